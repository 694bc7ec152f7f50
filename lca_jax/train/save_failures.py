"""Checkpoint saves that fail because of the storage: telling them from bugs, and reporting
each once.

A save that fails because of the storage (no space left, quota, read-only file system, any
OSError, also inside tensorstore or orbax's background threads) is reported as one
``CheckpointSaveError`` (``failure_error``) naming the step, the problem and the last intact
step; anything else is raised as it is. ``settle`` waits for the failed save's writer threads
before its tmp directory is removed. orbax's and tensorstore's own reports of the same failure
(logged tracebacks, "Event loop is closed" from write callbacks that arrive after orbax closed
its event loop) are kept off stderr once ``quiet_storage_noise`` has run.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import re
import sys
import threading
import time
import warnings
from typing import Optional

from lca_jax.errors import LcaError
from lca_jax.train.errors import TrainError
from lca_jax.workdir.manifest import short_reason


class PeerSaveError(LcaError, OSError):
  """Another process could not write its part of a checkpoint (its own error says why)."""

  def __init__(self, processes):
    who = ", ".join(str(i) for i in processes)
    super().__init__(f"process {who} could not write it (its own error says why)")


class CheckpointSaveError(TrainError):
  """A checkpoint could not be written (no space left, quota, read-only file system, ...).
  The partial step was removed; the earlier steps are intact and a rerun resumes from the
  latest of them."""


# tensorstore reports a failed write as ValueError("... [os_error_code='28']"), a refusal of
# the storage service (quota, permissions; no OS error behind it) by its status code
_OS_CODE = re.compile(r"os_error_code='?(\d+)")
_REFUSED = re.compile(r"^(RESOURCE_EXHAUSTED|PERMISSION_DENIED): ")


def os_problem(exc: BaseException) -> Optional[tuple]:
  """(errno or None, what the OS said) when ``exc``, or an exception it was raised from, is a
  failed file operation: an OSError, or a tensorstore error carrying an OS error code. None
  for anything else (a bug, not the storage)."""
  todo, seen = [exc], set()
  while todo:
    e = todo.pop(0)
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    code = e.errno if isinstance(e, OSError) else None
    if code is None and not isinstance(e, OSError):
      m = _OS_CODE.search(str(e))
      code = int(m.group(1)) if m else None
    if code is not None:
      what = os.strerror(code)
      return code, what[:1].lower() + what[1:]
    if isinstance(e, OSError) or _REFUSED.match(str(e)):  # e.g. a barrier's TimeoutError
      return None, short_reason(e)
    todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
  return None


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
# orbax's threads of one save (waited for after a failure, before its tmp directory is removed)
_SAVE_THREADS = (
  "array_type_handler",
  "write_metadata_after_commits",
  "async_save",
  "asyncio_",
  "(_target_setting_result)",
)
SETTLE_S = 10.0  # at most this long waiting for them
_LOGGED: list = []  # (time, errno, what) of the storage errors _StorageNoise kept off stderr
_ORBAX = os.sep + "orbax" + os.sep


def _orbax_frames(tb) -> bool:
  while tb is not None:
    if _ORBAX in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


class _StorageNoise(logging.Filter):
  """Drops orbax's error records of a failed file write (logged by its threads, or by asyncio
  for its tasks and futures): the failure reaches the caller as one ``CheckpointSaveError``
  instead of a traceback per thread and task. Records of other code pass."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    if record.levelno < logging.ERROR or exc is None:
      return True
    try:
      ours = (
        _ORBAX in record.pathname
        or _orbax_frames(exc.__traceback__)
        # a tensorstore write error (lca-jax writes tensorstore only through orbax), e.g. on a
        # future nobody awaited any more: asyncio logs it, without a traceback
        or (not isinstance(exc, OSError) and _OS_CODE.search(str(exc)) is not None)
      )
      if not ours:
        return True
      problem = os_problem(exc)
      if problem is not None and problem[0] is not None and len(_LOGGED) < 100:
        _LOGGED.append((time.monotonic(), *problem))
      return problem is None
    except Exception:  # noqa: BLE001 - never break logging (e.g. at interpreter shutdown)
      return True


def _closed_loop_callback(exc_type, exc, tb) -> bool:
  """True for the RuntimeError("Event loop is closed") that tensorstore prints when a write
  finishes after orbax gave up on its batch (the first failed write ends orbax's event loop;
  the others' completion callbacks then find it closed): raised at the top of
  ``loop.call_soon_threadsafe`` called from native code, so never a program's own error."""
  if exc_type is not RuntimeError or str(exc) != "Event loop is closed" or tb is None:
    return False
  code = tb.tb_frame.f_code
  return code.co_name == "call_soon_threadsafe" and "asyncio" in code.co_filename


_quiet_installed = False


def quiet_storage_noise() -> None:
  """Install (once) the filters that keep a failed save's duplicate reports off stderr."""
  global _quiet_installed
  if _quiet_installed:
    return
  _quiet_installed = True
  noise = _StorageNoise()
  for name in ("absl", "asyncio"):
    logging.getLogger(name).addFilter(noise)
  prev = sys.unraisablehook  # tensorstore reports a failing callback as "unraisable"

  def unraisablehook(args):
    if not _closed_loop_callback(args.exc_type, args.exc_value, args.exc_traceback):
      prev(args)

  sys.unraisablehook = unraisablehook


def settle(before: set) -> None:
  """Wait (bounded) for the threads orbax started for a failed save (those alive now and not in
  ``before``): they may still be writing into its tmp directory (only the first failure ends
  orbax's wait). Then let the failed batch's coroutines go without warnings."""
  deadline = time.monotonic() + SETTLE_S
  me = threading.current_thread()
  for t in threading.enumerate():
    if t in before or t is me or not any(n in t.name for n in _SAVE_THREADS):
      continue
    try:
      t.join(max(0.0, deadline - time.monotonic()))
    except Exception:  # noqa: BLE001 - orbax's threads re-raise their error on join
      pass
  gc.collect()  # ends the failed batch's coroutines now, not noisily at interpreter exit
  # one still held by a writer thread may only be finalized at exit ("coroutine
  # 'write_fragment' was never awaited"): after a failed save that is expected, not news
  warnings.filterwarnings(
    "ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning
  )


def failure_error(
  exc: BaseException, step: int, directory: str, committed: list, since: float
) -> BaseException:
  """What a failed save of ``step`` into ``directory`` raises: for a storage problem a
  ``CheckpointSaveError`` naming it and the last intact step (``committed``: the steps
  there), else ``exc`` itself (a bug keeps its traceback). ``since``: when the save began (a
  timeout is named by the storage error orbax's threads logged after it)."""
  problem = os_problem(exc)
  if problem is None:
    return exc
  code, what = problem
  if code is None:  # e.g. a timeout waiting for a thread that failed: use what it said
    code, what = next(((c, w) for t, c, w in _LOGGED if t >= since), problem)
  fix = (
    "once space is freed"
    if code in _NO_SPACE
    else "once it is writable"
    if code in _NOT_WRITABLE
    else "once that is fixed"
  )
  if committed:
    tail = (
      f"the previous checkpoint at step {max(committed)} is intact (rerun the same command "
      f"{fix} to resume from it)"
    )
  else:
    tail = f"there is no earlier checkpoint (rerun the same command {fix})"
  return CheckpointSaveError(f"checkpoint save at step {step} failed: {what} ({directory}); {tail}")
