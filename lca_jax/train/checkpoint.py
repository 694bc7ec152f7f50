"""Saving and restoring the train states of an lca-train work directory (orbax).

The directory's layout is described in ``lca_jax.workdir``; restoring only the params (for
inference and ``train.init_from``) is ``lca_jax.workdir.params``.

``step`` is the number of optimizer steps completed. Saving is asynchronous (the arrays are
copied to host before ``save`` returns, so the next, donating train step is safe; with
``async_save=False`` ``save`` waits for the commit); the data iterator state is captured at
save time (``data_state``). Restores take their target shardings from the abstract state
of the *current* mesh, so a run can resume on a different device layout.

Fault tolerance:
  * orbax writes each step into ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>``
    only once every process has written its shards (commit). A save interrupted by a crash
    leaves only the tmp directory, which is never listed as a step (so never restored) and is
    deleted when the next run opens the directory.
  * Once a step is committed, process 0 writes ``<step>/lca_manifest.json`` (every file of
    the step and its size; see lca_jax/workdir/manifest.py). ``restore_latest`` checks it
    before restoring: a step with a missing or truncated file, or one that fails to restore, is
    skipped and the previous step restored; the skipped steps are then moved to
    ``WORKDIR/corrupt_checkpoints/`` with a ``CorruptCheckpointWarning`` naming them (nothing
    is moved when no step restores).
    (In a multi-process run the manifest check is agreed by all processes; a failure inside
    orbax's restore on only some processes cannot be recovered from safely, so it is an error
    naming the step to move away.)
  * A save that fails because of the storage (no space left, quota, read-only file system, any
    OSError, also inside tensorstore or orbax's background threads) raises
    ``CheckpointSaveError`` (a ``TrainError``: lca-train prints it in one line and exits 2)
    naming the step, the problem and the last intact step. Before it is raised, the save's
    writer threads are waited for and its tmp directory is removed; older steps are never
    touched (orbax deletes steps beyond ``keep`` only after a successful commit). An
    asynchronous save that fails in the background also stops the run at the end of the
    current step (``stop.request_stop``), whose checkpoint call then raises the error; a
    failure of the last save is raised by ``close``. orbax's and tensorstore's own reports of
    the same failure (logged tracebacks, "Event loop is closed" from write callbacks that
    arrive after orbax closed their event loop) are kept off stderr (all in
    ``save_failures``).
  * In a multi-process run the processes agree on the probe before orbax starts, and orbax's
    barriers of a save can be aborted (``_barrier``, ``collectives.AbortableBarriers``): a process whose write fails midway
    makes the others leave them at once (``PeerSaveError``) instead of after orbax's
    20-minute timeout.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import warnings
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from lca_jax.train import collectives, save_failures
from lca_jax.train import data_state as data_lib
from lca_jax.train import stop as stop_lib
from lca_jax.train.save_failures import CheckpointSaveError, PeerSaveError
from lca_jax.workdir.manifest import (
  MANIFEST,
  CorruptCheckpointError,
  CorruptCheckpointWarning,
  short_reason,
  verify_step,
  write_manifest,
)
from lca_jax.workdir.params import check_step_model, checkpoint_dir

CORRUPT_DIR = "corrupt_checkpoints"
TMP_MARK = ".orbax-checkpoint-tmp"  # orbax writes step N into N.orbax-checkpoint-tmp[-*]
PROBE_MARK = ".lca-probe-"  # Checkpointer._probe's directories


# ---- the manager --------------------------------------------------------------------------
def _handlers(with_data: bool):
  h = {name: ocp.StandardCheckpointHandler() for name in ("params", "opt_state", "step", "rng")}
  h["meta"] = ocp.JsonCheckpointHandler()
  if with_data:
    h["data"] = data_lib.grain_handler()
  return h


class Checkpointer:
  """Saves and restores train states (+ data iterator state) of one work directory."""

  def __init__(self, workdir: str, keep: int = 3, async_save: bool = True, read_only: bool = False):
    # read_only: open an existing directory for restoring (no directory is created; orbax's
    # own read_only flag is not used because it logs warnings on every open).
    # cleanup_tmp_directories: saves interrupted by a crash leave <step>.orbax-checkpoint-tmp-*
    # directories (never restored); they are removed when a run opens the directory again.
    opts = ocp.CheckpointManagerOptions(
      max_to_keep=max(1, int(keep)) if keep else None,
      create=not read_only,
      # orbax always saves in the background; a synchronous Checkpointer waits for the commit
      # inside ``save``. One path for both, and synchronous multi-process saves also get the
      # abortable barriers (orbax's synchronous save meets the others in a gloo collective,
      # which fails with a traceback when a process whose write failed has left)
      enable_async_checkpointing=not read_only,
      cleanup_tmp_directories=not read_only,
      # the step's directories are created inside ``save`` (orbax's default creates them on
      # a background thread): a step that cannot be created (space gone since ``_probe``)
      # then fails in ``save`` itself, before any writer thread starts, instead of at the
      # next ``save`` / ``close`` after orbax's threads gave up waiting for it
      # barriers of asynchronous saves among processes (multi-process runs): see _barrier
      async_options=ocp.AsyncOptions(
        create_directories_asynchronously=False,
        barrier_sync_fn=self._barrier if jax.process_count() > 1 else None,
      ),
    )
    self.workdir = os.path.abspath(workdir)
    self.directory = checkpoint_dir(workdir)
    self.read_only = read_only
    self.async_save = bool(async_save and not read_only)
    self._unsealed: list = []  # steps saved whose manifest is not written yet
    self._watcher: Optional[threading.Thread] = None  # waits for the asynchronous save
    self._failure: Optional[BaseException] = None  # a failed save: raised by save / close
    self._failure_raised = False
    self._cleanup_lock = threading.Lock()
    self._barriers = collectives.AbortableBarriers("lca_checkpoint")
    self._saving: Optional[int] = None  # the step of the save in flight (the barriers' scope)
    if not read_only:
      save_failures.quiet_storage_noise()
      if jax.process_index() == 0 and os.path.isdir(self.directory):
        for name in os.listdir(self.directory):
          if name.startswith(PROBE_MARK):  # left by a crash during a probe
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    self.manager = ocp.CheckpointManager(
      self.directory, options=opts, item_handlers=_handlers(with_data=True)
    )

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def all_steps(self):
    return list(self.manager.all_steps())

  def save(self, state, data_state: Any = None, meta: Optional[dict] = None) -> None:
    step = int(jax.device_get(state.step))
    items = dict(
      params=ocp.args.StandardSave(state.params),
      opt_state=ocp.args.StandardSave(state.opt_state),
      step=ocp.args.StandardSave({"step": state.step}),
      rng=ocp.args.StandardSave({"key": state.rng}),
      meta=ocp.args.JsonSave(dict(meta or {}, step=step)),
    )
    if data_state is not None:
      items["data"] = data_lib.grain_save(data_state)
    self._finish_pending()  # the previous (asynchronous) save
    self._raise_failure()
    started = (set(threading.enumerate()), time.monotonic())
    self._saving = step
    try:
      self._probe_everywhere(step)
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    except Exception as e:  # noqa: BLE001 - classified in _failed
      self._failed(step, e, started)
      self._raise_failure()
    self._unsealed.append(step)
    self._watch(step, started)
    if not self.async_save:
      self.wait()

  # ---- failed saves ----
  def _watch(self, step: int, started: tuple) -> None:
    """Wait for orbax's background save of ``step`` on a daemon thread: when it fails, its
    partial directory is removed at once and, for an asynchronous Checkpointer, the run asked
    to stop at the end of the current step (as SIGTERM does), whose save call then raises the
    failure (a synchronous ``save`` waits for this thread and raises it itself)."""

    def run():
      try:
        self.manager.wait_until_finished()
      except Exception as e:  # noqa: BLE001 - classified in _failed
        try:
          self._failed(step, e, started)
        except Exception as e2:  # noqa: BLE001 - never lose the failure
          self._failure = self._failure or e2
        if self.async_save:  # a synchronous save raises it in the call itself
          stop_lib.request_stop(f"checkpoint save at step {step} failed")

    self._watcher = threading.Thread(target=run, name=f"lca_checkpoint_{step}", daemon=True)
    self._watcher.start()

  def _finish_pending(self) -> None:
    """Wait for the save in flight and seal the committed steps."""
    if self._watcher is not None:
      self._watcher.join()
      self._watcher = None
    self._seal()

  def _raise_failure(self) -> None:
    """Raise the failed save's error: the original the first time (a ``CheckpointSaveError``
    or, for a bug, the exception itself), a ``CheckpointSaveError`` repeating it after that
    (the Checkpointer saves nothing more once a save has failed)."""
    if self._failure is None:
      return
    if self._failure_raised:
      raise CheckpointSaveError(f"an earlier save failed: {short_reason(self._failure)}") from None
    self._failure_raised = True
    raise self._failure

  def _probe_everywhere(self, step: int) -> None:
    """``_probe`` on every process, with one outcome: when any process cannot write the step,
    every process raises before orbax starts (the others would wait in orbax's barriers for
    the one that stopped); a process whose own probe passed names those that failed."""
    try:
      self._probe(step)
    except Exception:
      collectives.processes_saying_no(False)  # a collective: the others are waiting for it
      raise
    failed = collectives.processes_saying_no(True)
    if failed:
      raise PeerSaveError(failed)

  def _barrier(self, *, key: str, timeout_ms: int) -> None:
    """orbax's barriers of an asynchronous save, among processes (``AsyncOptions``). A
    process whose part of the save fails on orbax's threads (a write error midway: its disk
    filled up) skips the barrier it waits at when its commit fails, and the others would
    wait out orbax's 20-minute timeout in theirs: here such a process, which reaches its
    next barrier on orbax's finalize thread with the error propagating, aborts the save's
    barriers instead, and every other process leaves its barrier at once with a
    ``PeerSaveError`` naming it. (Barriers on the main thread are never aborted: an exception
    being handled there is the caller's, not the save's.)"""
    scope = str(self._saving)
    failing = sys.exc_info()[1]
    if failing is not None and threading.current_thread() is not threading.main_thread():
      if not isinstance(failing, PeerSaveError):  # this process's own write failed
        self._barriers.abort(scope)
      return
    try:
      self._barriers.wait(key, timeout_ms / 1000, scope)
    except collectives.BarrierAborted as e:
      raise PeerSaveError(e.processes) from None

  def _probe(self, step: int) -> None:
    """Fail before orbax starts when the step cannot be written at all (read-only, no space
    left, no permission): a step directory orbax cannot create leaves its writer threads
    waiting 300 s for a signal that never comes, the caller blocked meanwhile. Creates a
    directory with a 4 KiB file where the step goes, then removes it (one left by a crash is
    removed when the directory is opened again)."""
    path = os.path.join(self.directory, f"{PROBE_MARK}{step}-{jax.process_index()}")
    try:
      os.makedirs(os.path.join(path, "d"), exist_ok=True)
      with open(os.path.join(path, "d", "probe"), "wb") as f:
        f.write(bytes(4096))
    finally:
      shutil.rmtree(path, ignore_errors=True)

  def _failed(self, step: int, exc: BaseException, started: tuple) -> None:
    """Record why the save of ``step`` failed, after waiting for its writer threads and
    removing its partial directory; ``_raise_failure`` raises it (a ``CheckpointSaveError``
    for a storage problem, else ``exc`` itself: a bug keeps its traceback). ``started``: the
    threads alive and the time when the save began."""
    before, t0 = started
    with self._cleanup_lock:
      save_failures.settle(before)
      self._remove_partial(step)
      self._unsealed = [s for s in self._unsealed if s != step]
      self._failure = save_failures.failure_error(
        exc, step, self.directory, self._committed_steps(exclude=step), since=t0
      )

  def _remove_partial(self, step: int) -> None:
    """Remove the tmp directory of ``step`` (process 0; the directory is shared)."""
    if jax.process_index() != 0:
      return
    prefix = f"{step}{TMP_MARK}"
    for attempt in range(5):
      try:
        left = [n for n in os.listdir(self.directory) if n.startswith(prefix)]
      except OSError:
        return
      if not left and attempt:
        return
      for name in left:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      time.sleep(0.05 * (attempt + 1))  # a write still in flight may recreate it: check again

  def _committed_steps(self, exclude: int) -> list:
    try:
      names = os.listdir(self.directory)
    except OSError:
      return []
    return [
      int(n)
      for n in names
      if n.isdigit() and int(n) != exclude and os.path.isdir(os.path.join(self.directory, n))
    ]

  def _seal(self, last: bool = False) -> None:
    """Write the manifests of the committed steps. One that cannot be written (the disk may
    be full right now) is tried again at the next save; at ``close`` (``last``) it is left
    unverified with a warning, none when a failed save already reported the problem."""
    left = []
    for step in self._unsealed:
      try:
        write_manifest(os.path.join(self.directory, str(step)), step)
      except OSError as e:  # the checkpoint itself is complete; it just stays unverified
        if not last:
          left.append(step)
        elif self._failure is None:
          warnings.warn(f"could not write {MANIFEST} of checkpoint step {step}: {e}")
    self._unsealed = left

  def restore(self, step: int, abstract_state, data_iterator=None):
    """The TrainState at ``step``, laid out as ``abstract_state``'s shardings; restores the data
    pipeline (or grain iterator) in place when given."""
    items = dict(
      params=ocp.args.StandardRestore(abstract_state.params),
      opt_state=ocp.args.StandardRestore(abstract_state.opt_state),
      step=ocp.args.StandardRestore({"step": abstract_state.step}),
      rng=ocp.args.StandardRestore({"key": abstract_state.rng}),
    )
    if data_iterator is not None:
      items["data"] = data_lib.grain_restore(data_iterator)
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    return abstract_state.replace(
      params=out["params"],
      opt_state=out["opt_state"],
      step=out["step"]["step"],
      rng=out["rng"]["key"],
    )

  def wait(self):
    """Wait for the save in flight and seal the committed steps; its failure raises."""
    self._finish_pending()
    self._raise_failure()

  def close(self):
    """Wait for the save in flight and close the manager. A failed save not reported yet (the
    last one of a run) raises its error after that; one already raised is not raised again
    (close runs in ``finally`` blocks while that error propagates)."""
    try:
      self._finish_pending()
      self._seal(last=True)
    finally:
      self._close_manager()
    if self._failure is not None and not self._failure_raised:
      self._raise_failure()

  def _close_manager(self) -> None:
    if self._failure is None:
      self.manager.close()
      return
    # orbax re-raises the failed save's error once per calling thread: let it, then close
    for _ in range(2):
      try:
        self.manager.close()
        return
      except Exception:  # noqa: BLE001 - the failure is reported as CheckpointSaveError
        continue

  # ---- fault tolerance ----
  def set_aside(self, step: int) -> Optional[str]:
    """Move step ``step`` out of the checkpoint directory (into WORKDIR/corrupt_checkpoints/)
    on process 0, then reload the step list on every process. Returns the new path."""
    dest = None
    if jax.process_index() == 0:
      dest = set_aside(self.workdir, step)
    collectives.barrier(f"lca_set_aside_{step}")
    self.manager.reload()
    return dest

  def restore_latest(self, abstract_state, data_iterator=None):
    """(state, step) from the newest checkpoint that verifies and restores; (None, None) when
    there is none. Steps newer than the one restored that failed are then set aside (into
    WORKDIR/corrupt_checkpoints/) with a ``CorruptCheckpointWarning`` naming them; nothing is
    moved when no step restores (``CorruptCheckpointError`` listing why), so a systematic
    problem never empties the directory."""
    steps = sorted(self.all_steps(), reverse=True)
    if not steps:
      return None, None
    data_lib.check_process_count(os.path.join(self.directory, str(steps[0])), jax.process_count())
    multi = jax.process_count() > 1
    bad = []
    for i, step in enumerate(steps):
      nxt = steps[i + 1] if i + 1 < len(steps) else None
      reason = verify_step(os.path.join(self.directory, str(step)))
      if not collectives.all_agree(reason is None):
        reason = reason or "unreadable on another process"
      if reason is None:
        check_step_model(self.workdir, step, abstract_state.params)  # not corrupt: named
        try:
          state = self.restore(step, abstract_state, data_iterator)
        except Exception as e:  # noqa: BLE001 - any read failure means a damaged checkpoint
          reason = short_reason(e)
          if multi:  # other processes may be inside orbax's restore barrier: no way back
            raise CorruptCheckpointError(
              f"checkpoint step {step} in {self.directory} cannot be restored on process "
              f"{jax.process_index()} ({reason}). Move it out of the way (e.g. into "
              f"{os.path.join(self.workdir, CORRUPT_DIR)}/) and rerun to resume from "
              f"{'step ' + str(nxt) if nxt is not None else 'scratch'}."
            ) from None
        else:
          for s_bad, r_bad in bad:
            warnings.warn(
              f"checkpoint step {s_bad} in {self.directory} is corrupt ({r_bad}); "
              f"falling back to step {step}",
              CorruptCheckpointWarning,
              stacklevel=2,
            )
            self.set_aside(s_bad)
          return state, step
      bad.append((step, reason))
    raise CorruptCheckpointError(
      f"no readable checkpoint in {self.directory}: "
      + "; ".join(f"step {s}: {r}" for s, r in bad)
      + " (nothing was moved; move the damaged steps away, or use a new --workdir)"
    )


def set_aside(workdir: str, step: int) -> Optional[str]:
  """Move ``checkpoints/<step>`` to ``corrupt_checkpoints/<step>[.N]``; the new path."""
  src = os.path.join(checkpoint_dir(workdir), str(step))
  if not os.path.isdir(src):
    return None
  root = os.path.join(os.path.abspath(workdir), CORRUPT_DIR)
  os.makedirs(root, exist_ok=True)
  dest, n = os.path.join(root, str(step)), 0
  while os.path.exists(dest):
    n += 1
    dest = os.path.join(root, f"{step}.{n}")
  try:
    os.replace(src, dest)
  except OSError:
    shutil.move(src, dest)
  return dest
