"""Agreement and barriers among the processes of a multi-process run (no-ops in one process).

``all_agree`` / ``processes_saying_no`` gather one flag per process (device collectives: every
process must call them, on the main thread); ``barrier`` waits for every process.
``AbortableBarriers`` are barriers in the coordination service's key-value store that any
process can abort, for orbax's background threads during a checkpoint save.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from lca_jax.train.distributed import DistributedError


def all_agree(flag: bool) -> bool:
  """True on every process iff ``flag`` is True on every process (False when one says False)."""
  return not processes_saying_no(flag)


def processes_saying_no(flag: bool) -> list:
  """The indices of the processes whose ``flag`` is False (the same list on every process; a
  collective: every process must call it)."""
  if jax.process_count() == 1:
    return [] if flag else [0]
  flags = np.asarray(multihost_utils.process_allgather(np.array([bool(flag)]))).reshape(-1)
  return [int(i) for i in np.flatnonzero(~flags)]


def barrier(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


class BarrierAborted(DistributedError):
  """A barrier that another process aborted (its part of the shared work failed)."""

  def __init__(self, processes: Sequence[int]):
    super().__init__(f"aborted by process {', '.join(str(p) for p in processes)}")
    self.processes = list(processes)


def _client():
  """jax's coordination-service client: the key-value store of the run's processes.

  The one place lca-jax reaches into jax's private modules. jax (0.10 and 0.11) has no public
  API for this store: ``jax.distributed`` exports only ``initialize``, ``shutdown`` and
  ``is_initialized``, and orbax, ``jax.experimental.multihost_utils`` and jax's own
  fault-tolerance guide read the client from ``jax._src.distributed.global_state`` as here.
  Collectives are no substitute: these barriers run on orbax's background threads while the
  main thread runs train steps. Imported here, not at the top, so that only the barriers of
  multi-process checkpoint saves depend on that private module."""
  if not jax.distributed.is_initialized():
    raise DistributedError("jax.distributed is not initialized")
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top

  return jax_distributed.global_state.client


def _processes_under(client, prefix: str) -> list:
  """The process indices keyed under ``prefix`` (keys ``prefix<index>``), sorted."""
  return sorted(int(k.rsplit("/", 1)[-1]) for k, _ in client.key_value_dir_get(prefix))


def _timed_out(exc: Exception) -> bool:
  return "DEADLINE_EXCEEDED" in str(exc)


class AbortableBarriers:
  """Barriers among all processes, kept in the coordination service's key-value store, that
  any process can abort: ``wait`` returns once every process has reached the same barrier,
  and raises :class:`BarrierAborted` as soon as a process calls ``abort`` for the same
  ``scope`` (a unit of shared work, e.g. one checkpoint step). A barrier of jax's service
  cannot be left early: a process whose part failed never arrives, and the others would wait
  out the whole timeout (orbax's: 20 minutes) before they learnt anything.

  Every process must pass the same barriers in the same order (the n-th ``wait`` on a key in
  a scope meets the n-th on every process). Keys of a finished scope are deleted by process
  0 once every process has passed a barrier of the next one."""

  def __init__(self, namespace: str, poll_s: float = 0.1):
    self._ns = namespace
    self._poll_ms = max(1, int(poll_s * 1000))
    self._uses: dict = {}
    self._lock = threading.Lock()
    self._last_scope: Optional[str] = None

  def abort(self, scope: str) -> None:
    if jax.process_count() > 1:
      _client().key_value_set(f"{self._ns}/abort/{scope}/{jax.process_index()}", "1", True)

  def aborted_by(self, scope: str) -> list:
    """The processes that aborted ``scope`` (sorted; empty when none did)."""
    return _processes_under(_client(), f"{self._ns}/abort/{scope}/")

  def wait(self, key: str, timeout_s: float, scope: str) -> None:
    n = jax.process_count()
    if n == 1:
      return
    client = _client()
    with self._lock:
      use = self._uses.get((scope, key), 0)
      self._uses[(scope, key)] = use + 1
    base = f"{self._ns}/barrier/{scope}/{key}#{use}"
    client.key_value_set(f"{base}/in/{jax.process_index()}", "1")
    if len(client.key_value_dir_get(f"{base}/in/")) >= n:  # the last one in opens it
      client.key_value_set(f"{base}/open", "1", True)
    deadline = time.monotonic() + timeout_s
    while True:
      failed = self.aborted_by(scope)
      if failed:
        raise BarrierAborted(failed)
      left_ms = int((deadline - time.monotonic()) * 1000)
      if left_ms <= 0:
        arrived = set(_processes_under(client, f"{base}/in/"))
        missing = ", ".join(str(i) for i in range(n) if i not in arrived)
        raise TimeoutError(f"waited {timeout_s:.0f}s at barrier {key} for process {missing}")
      try:
        client.blocking_key_value_get(f"{base}/open", min(self._poll_ms, left_ms))
        break
      except Exception as e:  # noqa: BLE001 - jax's runtime error; a timeout polls again
        if not _timed_out(e):
          raise
    self._forget_before(scope)

  def _forget_before(self, scope: str) -> None:
    """Process 0 deletes the keys of the previous scope: every process has passed a barrier
    of this one, hence every barrier of that one."""
    with self._lock:
      last, self._last_scope = self._last_scope, scope
      if last not in (None, scope):
        self._uses = {k: v for k, v in self._uses.items() if k[0] != last}
    if last not in (None, scope) and jax.process_index() == 0:
      _client().key_value_delete(f"{self._ns}/barrier/{last}")
