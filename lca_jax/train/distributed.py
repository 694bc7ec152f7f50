"""Joining and leaving a multi-process run: ``jax.distributed.initialize`` from flags / the
environment, and ``exit_now``.

Where the parameters come from (first match wins, per field):

  1. explicit values (``lca-train --coordinator HOST:PORT --num-processes N --process-id I
     --local-device-ids 0,1``), as the launchers in ``launch/`` pass them;
  2. ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``,
     ``JAX_LOCAL_DEVICE_IDS``;
  3. SLURM (``SLURM_NTASKS`` > 1): the coordinator is the first host of
     ``SLURM_JOB_NODELIST`` (``scontrol show hostnames``; a built-in parser when scontrol is
     absent) on port ``LCA_COORDINATOR_PORT`` (default: derived from ``SLURM_JOB_ID`` like jax
     does), process count / id from ``SLURM_NTASKS`` / ``SLURM_PROCID``, local devices from
     ``CUDA_VISIBLE_DEVICES`` / ``SLURM_LOCALID`` (:func:`slurm_local_device_ids`).

Failure detection (the bound documented in README "Multi-host"): every process sends heartbeats
to the coordination service (hosted by process 0). A process that dies (SIGKILL, OOM, node
loss) stops sending them; after ``heartbeat_timeout`` seconds the service declares it dead and
every surviving process terminates with the message "Terminating process because the JAX
distributed service detected fatal errors ... another task died" (SIGABRT, exit status 134)
instead of hanging in its next collective. If process 0 itself dies, the others notice at
once (the service's socket closes) and terminate the same way. A process that is alive but
stuck (deadlock, hung filesystem) keeps sending heartbeats; the optional
:class:`lca_jax.train.watchdog.Watchdog` (``lca-train --watchdog SECONDS``) ends it (exit
status 3), and the heartbeat then ends the others. Collectives among the processes
(agreement, barriers) are in :mod:`lca_jax.train.collectives`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Mapping, Optional, Sequence

import jax

from lca_jax.errors import LcaError

DEFAULT_HEARTBEAT_TIMEOUT = 60  # seconds; jax's own default is 100
DEFAULT_INIT_TIMEOUT = 300  # seconds to wait for all processes to connect
# How long a failing process waits for the others in jax.distributed's shutdown before it
# leaves without them. A grace shorter than a peer's own cleanup of the same failure ends
# that peer mid-cleanup: the coordination service (process 0) closing, or a process missing
# from the shutdown barrier, makes jax abort the others (status 134) before they print their
# line. A failed checkpoint save alone waits up to 10 s for orbax's writer threads
# (save_failures.SETTLE_S), longer on a loaded machine; a 10 s grace lost that race in CI.
# Processes that fail together leave together at once; the grace only delays an error that
# one process saw alone, while the others wait for it in a collective.
EXIT_GRACE_S = 60.0


class DistributedError(LcaError, RuntimeError):
  """A multi-process launch that cannot work (missing / inconsistent parameters, no peers)."""


@dataclasses.dataclass(frozen=True)
class DistConfig:
  coordinator: Optional[str]  # HOST:PORT of process 0's coordination service
  num_processes: Optional[int]
  process_id: Optional[int]
  local_device_ids: Optional[tuple]  # None: all devices this process sees
  heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT
  init_timeout: int = DEFAULT_INIT_TIMEOUT
  source: str = ""  # where the values came from (for messages)

  def describe(self) -> str:
    ids = ",".join(map(str, self.local_device_ids)) if self.local_device_ids else "all"
    return (
      f"process {self.process_id}/{self.num_processes}, coordinator {self.coordinator}, "
      f"local devices {ids}, heartbeat timeout {self.heartbeat_timeout}s ({self.source})"
    )


# ---- SLURM ---------------------------------------------------------------------------------
def _expand_range(body: str) -> list:
  out = []
  for part in body.split(","):
    if "-" in part:
      lo, hi = part.split("-", 1)
      width = len(lo)
      out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
      out.append(part)
  return out


def parse_nodelist(nodelist: str) -> list:
  """'gpu[003-005,010],login1' -> ['gpu003', 'gpu004', 'gpu005', 'gpu010', 'login1'] (the
  forms SLURM prints; nested brackets like 'a[1-2]b[3-4]' expand left to right)."""
  hosts, depth, cur = [], 0, ""
  for ch in nodelist.strip():
    if ch == "," and depth == 0:
      hosts.append(cur)
      cur = ""
      continue
    depth += ch == "["
    depth -= ch == "]"
    cur += ch
  if cur:
    hosts.append(cur)
  out = []
  for h in hosts:
    names = [""]
    for m in re.finditer(r"([^\[]+)|\[([^\]]*)\]", h):
      if m.group(1):
        names = [n + m.group(1) for n in names]
      else:
        names = [n + s for n in names for s in _expand_range(m.group(2))]
    out += names
  return out


def first_slurm_host(nodelist: str) -> str:
  """The first host of a SLURM node list: ``scontrol show hostnames`` when available."""
  try:
    res = subprocess.run(
      ["scontrol", "show", "hostnames", nodelist],
      capture_output=True,
      text=True,
      timeout=30,
      check=True,
    )
    lines = res.stdout.split()
    if lines:
      return lines[0]
  except (OSError, subprocess.SubprocessError):
    pass
  hosts = parse_nodelist(nodelist)
  if not hosts:
    raise DistributedError(f"empty SLURM node list {nodelist!r}")
  return hosts[0]


def _tasks_on_this_node(env: Mapping[str, str]) -> Optional[int]:
  if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
    return int(env["SLURM_NTASKS_PER_NODE"])
  tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
  node_id = int(env.get("SLURM_NODEID", "0") or 0)
  if not tpn:
    return None
  counts = []  # '8(x2),4' -> [8, 8, 4]
  for part in tpn.split(","):
    m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
    if not m:
      return None
    counts += [int(m.group(1))] * int(m.group(2) or 1)
  return counts[node_id] if node_id < len(counts) else counts[-1]


def slurm_local_device_ids(env: Mapping[str, str]) -> Optional[tuple]:
  """Which of the GPUs this task sees it should use.

  One task per node: all (None). Several tasks per node: when SLURM already bound GPUs to
  each task (``CUDA_VISIBLE_DEVICES`` lists fewer GPUs than there are tasks on the node, e.g.
  ``--gpus-per-task=1`` / ``--gpu-bind``), all of the visible ones (None); when every task sees
  all the node's GPUs, task ``SLURM_LOCALID`` takes its equal share of them; without
  ``CUDA_VISIBLE_DEVICES``, device ``SLURM_LOCALID`` (one GPU per task, jax's own rule).
  """
  ntasks = _tasks_on_this_node(env)
  local = env.get("SLURM_LOCALID")
  if ntasks is None or ntasks <= 1 or local is None or not local.isdigit():
    return None
  local = int(local)
  visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
  if not visible:
    return (local,)
  if len(visible) < ntasks:
    return None  # already bound per task
  per = len(visible) // ntasks
  return tuple(range(local * per, (local + 1) * per))


def _slurm_port(env: Mapping[str, str]) -> int:
  if env.get("LCA_COORDINATOR_PORT"):
    return int(env["LCA_COORDINATOR_PORT"])
  job = int(env.get("SLURM_JOB_ID", "0") or 0)
  return job % 4096 + 61440  # jax's SLURM rule: one port per job in [61440, 65535]


# ---- resolution ----------------------------------------------------------------------------
def _int(value, name: str) -> Optional[int]:
  if value is None or value == "":
    return None
  try:
    return int(value)
  except (TypeError, ValueError):
    raise DistributedError(f"{name} must be an integer, got {value!r}") from None


def _ids(value) -> Optional[tuple]:
  if value is None or value == "":
    return None
  if isinstance(value, str):
    try:
      return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
      raise DistributedError(f"local device ids must look like 0,1,2: got {value!r}") from None
  return tuple(int(v) for v in value)


def wanted(
  env: Optional[Mapping[str, str]] = None, *, flag: bool = False, coordinator: Optional[str] = None
) -> bool:
  """Whether this process is part of a multi-process run."""
  env = os.environ if env is None else env
  if flag or coordinator or env.get("JAX_COORDINATOR_ADDRESS"):
    return True
  for key in ("JAX_NUM_PROCESSES", "SLURM_NTASKS"):
    try:
      if int(env.get(key, "1") or 1) > 1:
        return True
    except ValueError:
      pass
  return False


def resolve(
  coordinator: Optional[str] = None,
  num_processes: Optional[int] = None,
  process_id: Optional[int] = None,
  local_device_ids=None,
  heartbeat_timeout: Optional[int] = None,
  init_timeout: Optional[int] = None,
  env: Optional[Mapping[str, str]] = None,
) -> DistConfig:
  """The initialize() parameters for this process (see the module docstring for the order)."""
  env = os.environ if env is None else env
  sources = []
  coord = coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None
  n = _int(num_processes, "--num-processes")
  if n is None:
    n = _int(env.get("JAX_NUM_PROCESSES"), "JAX_NUM_PROCESSES")
  pid = _int(process_id, "--process-id")
  if pid is None:
    pid = _int(env.get("JAX_PROCESS_ID"), "JAX_PROCESS_ID")
  ids = _ids(local_device_ids)
  if ids is None:
    ids = _ids(env.get("JAX_LOCAL_DEVICE_IDS"))
  if coord or n is not None or pid is not None:
    sources.append("flags/JAX_* environment")
  slurm_n = _int(env.get("SLURM_NTASKS"), "SLURM_NTASKS")
  if slurm_n is not None and slurm_n > 1 and (coord is None or n is None or pid is None):
    sources.append("SLURM")
    if n is None:
      n = slurm_n
    if pid is None:
      pid = _int(env.get("SLURM_PROCID"), "SLURM_PROCID")
    if coord is None:
      nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
      if not nodelist:
        raise DistributedError("SLURM_NTASKS > 1 but SLURM_JOB_NODELIST is not set")
      coord = f"{first_slurm_host(nodelist)}:{_slurm_port(env)}"
    if ids is None:
      ids = slurm_local_device_ids(env)
  hb = _int(heartbeat_timeout, "--heartbeat-timeout")
  if hb is None:
    hb = (
      _int(env.get("LCA_HEARTBEAT_TIMEOUT"), "LCA_HEARTBEAT_TIMEOUT") or DEFAULT_HEARTBEAT_TIMEOUT
    )
  it = _int(init_timeout, "--init-timeout")
  if it is None:
    it = _int(env.get("LCA_INIT_TIMEOUT"), "LCA_INIT_TIMEOUT") or DEFAULT_INIT_TIMEOUT
  if coord is not None and ":" not in coord:
    raise DistributedError(f"coordinator address must be HOST:PORT, got {coord!r}")
  if n is not None and n < 1:
    raise DistributedError(f"the number of processes must be >= 1, got {n}")
  if n is not None and pid is not None and not 0 <= pid < n:
    raise DistributedError(f"process id {pid} is not in [0, {n})")
  if hb < 2 or it < 1:
    raise DistributedError(f"timeouts too small (heartbeat {hb}s, init {it}s)")
  return DistConfig(coord, n, pid, ids, hb, it, " + ".join(sources) or "jax auto-detection")


def wait_for_coordinator(address: str, timeout: float) -> None:
  """Until ``timeout`` s have passed, try to open a TCP connection to ``address`` (process 0's
  coordination service); a ``DistributedError`` when it never accepts. (jax's own connect
  aborts the process when it times out, which cannot be caught.)"""
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  deadline = time.monotonic() + float(timeout)
  last = None
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=5):
        return
    except OSError as e:
      last = e
    if time.monotonic() >= deadline:
      raise DistributedError(
        f"could not reach the coordinator {address} (process 0 of the run) within "
        f"{timeout:g}s: {getattr(last, 'strerror', None) or last}. Start process 0 with the "
        "same --coordinator / --num-processes, and check the host name and that the port is "
        "open between the hosts"
      )
    time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def initialize(cfg: DistConfig) -> None:
  """``jax.distributed.initialize`` with ``cfg``. Processes other than 0 first wait (up to
  ``cfg.init_timeout`` s) for the coordinator's port to accept connections, so that a wrong
  address or a process 0 that never started is a ``DistributedError``. A process 0 whose peers
  never connect is ended by jax itself after ``cfg.init_timeout`` s ("DEADLINE_EXCEEDED ...
  RegisterTask", status 134)."""
  if cfg.process_id not in (None, 0) and cfg.coordinator:
    wait_for_coordinator(cfg.coordinator, cfg.init_timeout)
  kw = dict(
    initialization_timeout=int(cfg.init_timeout),
    heartbeat_timeout_seconds=int(cfg.heartbeat_timeout),
    # the barrier every process passes at exit: bounded like a dead peer, and no shorter
    # than exit_now's wait for the peers of a failed run
    shutdown_timeout_seconds=max(int(EXIT_GRACE_S), int(cfg.heartbeat_timeout)),
  )
  if cfg.local_device_ids is not None:
    kw["local_device_ids"] = list(cfg.local_device_ids)
  print(
    f"lca-train: joining a {cfg.num_processes or '?'}-process run: {cfg.describe()}; "
    f"waiting up to {cfg.init_timeout}s for every process",
    file=sys.stderr,
    flush=True,
  )
  try:
    jax.distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, **kw)
  except (ValueError, TypeError) as e:
    raise DistributedError(f"jax.distributed.initialize: {e}") from None
  except Exception as e:  # noqa: BLE001 - XlaRuntimeError and friends: connection problems
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise DistributedError(
      f"could not join the {cfg.num_processes}-process run at {cfg.coordinator} within "
      f"{cfg.init_timeout}s ({first}); check that every process was started with the same "
      "coordinator address and process count, and that the port is reachable"
    ) from None


def _shutdown_quietly() -> None:
  """jax.distributed.shutdown; its failure (a peer gone from the barrier) is not news to a
  process that is leaving with its own error line printed."""
  try:
    jax.distributed.shutdown()
  except Exception:  # noqa: BLE001 - the process exits next either way
    pass


def exit_now(code: int, grace: float = EXIT_GRACE_S) -> None:
  """Leave a multi-process run with status ``code``: shut jax.distributed down together with
  the other processes if they do so within ``grace`` seconds (they failed the same way), else
  exit without it (the others then see this process as dead within their heartbeat timeout
  instead of waiting for it in a collective)."""
  sys.stdout.flush()
  sys.stderr.flush()
  t = threading.Thread(target=_shutdown_quietly, name="lca-shutdown", daemon=True)
  t.start()
  t.join(grace)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(int(code))  # pylint: disable=protected-access


def local_process_info() -> str:
  return (
    f"process {jax.process_index()}/{jax.process_count()}, "
    f"{jax.local_device_count()} local of {jax.device_count()} devices"
  )


__all__: Sequence[str] = (
  "DistConfig",
  "DistributedError",
  "resolve",
  "initialize",
  "wanted",
  "parse_nodelist",
  "first_slurm_host",
  "slurm_local_device_ids",
  "exit_now",
  "EXIT_GRACE_S",
)
