"""The paper's training step, one at a time: in this process (``UpstreamSide``) or in a child
process started with the environment this program was started with (``UpstreamProcess``), as
its users run it; either times its own steps."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import types
import warnings
from multiprocessing.connection import Connection

import numpy as np
import torch

from lca_jax import hostmem
from lca_jax.bench.args import BenchError
from lca_jax.bench.timing import timed
from lca_jax.bench.upstream import build_upstream, import_upstream, sync, upstream_script_id

LAMBDAS = (1.0, 1.0, 10.0)  # NTP, MBP (train.py scale_loss2), BP (train.py scale_bp)
# the package folder's parent: a child process imports lca_jax from where this one did
_PACKAGE_PARENT = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)


def upstream_step(model, opt, ids_BT: np.ndarray, device: str, script_id: int, clip: float):
  """One optimizer step as src/train/train.py takes it (task LM, no accumulation)."""
  x_BT = torch.from_numpy(np.asarray(ids_BT, np.int64)).to(device)
  batch = {"input_ids": x_BT, "attention_mask": torch.ones_like(x_BT)}
  loss, mtp_loss, stats, loss_boundaries, _ = model(batch, task="LM", script_id=script_id)
  total = LAMBDAS[0] * loss + LAMBDAS[1] * mtp_loss + LAMBDAS[2] * loss_boundaries[0]
  total.backward()
  if clip > 0:
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
  opt.step()
  opt.zero_grad(set_to_none=True)
  return total, stats


class UpstreamSide:
  """The paper's model and Adam, one optimizer step at a time (src/train/train.py's step)."""

  def __init__(self, cls, uc: dict, device: str, args):
    self.model = build_upstream(cls, uc, device, args.seed)
    self.opt = torch.optim.Adam(
      self.model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )
    self.sid, self.device, self.clip = upstream_script_id(uc), device, args.clip
    self.losses, self.s_len = [], []
    self.env = dict(glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""))  # what it runs under

  def step(self, host_batch) -> None:
    with warnings.catch_warnings():  # train.py ignores warnings too (var() of a 1-row batch)
      warnings.filterwarnings("ignore", message=".*degrees of freedom", category=UserWarning)
      total, stats = upstream_step(
        self.model, self.opt, host_batch["ids"], self.device, self.sid, self.clip
      )
    sync(self.device)
    self.losses.append(float(total.detach()))
    self.s_len.append(stats.get("shortened_length"))

  def timed_step(self, host_batch) -> float:
    return timed(self.step, host_batch)

  def close(self) -> None:
    pass

  def summary(self, step_s: float, n_timed: int, rows: int, t: int) -> dict:
    # shortened_length: null group + the most groups of any row in the batch
    groups = [float(x) - 1 for x in self.s_len[-n_timed:] if x is not None]
    return dict(
      bytes_per_s=rows * t / step_s,
      step_s=step_s,
      bytes_per_latent=(t * len(groups) / sum(groups)) if groups and sum(groups) > 0 else None,
      final_loss=self.losses[-1],
    )


class UpstreamProcess:
  """``UpstreamSide`` in a child process started with the environment this program was started
  with (``hostmem.original_environ``: without the allocator tunable lca_jax sets for itself),
  i.e. the paper's code as its users run it. Steps are timed in the child; the parent waits
  idle meanwhile (and the child while lca_jax steps)."""

  def __init__(self, src: str, uc: dict, device: str, args):
    ours, theirs = socket.socketpair()
    code = (
      f"import sys; sys.path.insert(0, {_PACKAGE_PARENT!r}); "
      f"from lca_jax.bench import upstream_side as b; b.upstream_child({theirs.fileno()})"
    )
    self.proc = subprocess.Popen(
      [sys.executable, "-c", code],
      pass_fds=(theirs.fileno(),),
      env=hostmem.original_environ(),
      stdin=subprocess.DEVNULL,
    )
    theirs.close()
    self.conn = Connection(ours.detach())
    hp = dict(seed=args.seed, lr=args.lr, clip=args.clip)
    try:
      self.env = self._call("init", src, uc, device, hp)
    except BenchError:
      self.close()
      raise

  def _call(self, *msg):
    try:
      self.conn.send(msg)
      status, value = self.conn.recv()
    except (EOFError, OSError) as e:
      raise BenchError(
        f"the paper's code's process ended (exit status {self.proc.poll()}): {e or 'no reply'}"
      ) from None
    if status != "ok":
      raise BenchError(value)
    return value

  def step(self, host_batch) -> None:
    self._call("step", host_batch)

  def timed_step(self, host_batch) -> float:
    return self._call("step", host_batch)

  def summary(self, step_s: float, n_timed: int, rows: int, t: int) -> dict:
    return self._call("summary", step_s, n_timed, rows, t)

  def close(self) -> None:
    try:
      self.conn.send(("close",))
    except OSError:
      pass
    self.conn.close()
    try:
      self.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()


def upstream_child(fd: int) -> None:
  """The child of ``UpstreamProcess``: builds the side on ``init``, then answers ``step``
  (its own wall time) and ``summary`` until ``close``; any failure goes back as one line."""
  conn = Connection(fd)
  torch.set_num_threads(os.cpu_count() or 1)
  side = None
  while True:
    try:
      msg = conn.recv()
    except EOFError:
      return
    try:
      if msg[0] == "close":
        return
      if msg[0] == "init":
        src, uc, device, hp = msg[1:]
        side = UpstreamSide(import_upstream(src), uc, device, types.SimpleNamespace(**hp))
        out = side.env
      elif msg[0] == "step":
        out = side.timed_step(msg[1])
      else:
        out = side.summary(*msg[1:])
      conn.send(("ok", out))
    except Exception as e:  # pylint: disable=broad-except  (reported by the parent, one line)
      conn.send(("error", str(e) if isinstance(e, BenchError) else f"{type(e).__name__}: {e}"))
