"""One run per work directory: ``acquire(workdir)`` locks ``WORKDIR/lca_train.lock``.

Two runs on one work directory would interleave their checkpoints, ``train_config.json`` and
``metrics.jsonl``. Process 0 of a run (the one that writes the config and the metrics) holds
an exclusive ``flock`` on the lock file from before anything in the work directory is read or
written until the run ends, with its pid, host and start time written in the file. A second
run is refused with a ``WorkdirLockedError`` naming them. The kernel drops a flock when its
holder dies however it dies (SIGKILL, OOM, a lost node), so the file a dead run left behind
is taken over (a note names the old owner); a run that ends removes the file.

Where the filesystem cannot lock (flock fails with ENOLCK, ENOSYS, ...) the file's content
decides instead: a live pid on this host refuses the run, a dead one is taken over, and an
owner on another host (whose pid cannot be checked from here) refuses the run, naming the file
to remove if that run is dead.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time

from lca_jax.train.errors import TrainError

LOCK_FILE = "lca_train.lock"
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


class WorkdirLockedError(TrainError):
  """The work directory belongs to another run that is alive."""


def pid_alive(pid: int) -> bool:
  """Whether process ``pid`` exists on this host."""
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def _read_owner(path: str, fd=None) -> dict:
  """The owner recorded in the lock file ({} when empty or being written)."""
  for _ in range(20):  # the owner writes its record right after locking: wait for it a little
    try:
      if fd is not None:
        raw = os.pread(fd, 4096, 0)
      else:
        with open(path, "rb") as f:
          raw = f.read(4096)
      owner = json.loads(raw.decode("utf-8")) if raw.strip() else {}
      if isinstance(owner, dict) and owner:
        return owner
    except (OSError, ValueError):
      pass
    if fd is not None:
      return {}
    time.sleep(0.05)
  return {}


def _describe(owner: dict) -> str:
  since = owner.get("started")
  when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
  return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}{when}"


class WorkdirLock:
  """The lock of one run; ``release()`` (idempotent) ends it and removes the file."""

  def __init__(self, path: str = "", fd=None):
    self.path, self._fd = path, fd

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      if self.path:
        os.unlink(self.path)  # while still holding the lock: see acquire's inode check
    except OSError:
      pass
    finally:
      os.close(self._fd)  # drops the flock
      self._fd = None


def _record() -> bytes:
  return json.dumps(
    {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "argv": sys.argv[:8]}
  ).encode()


def _refuse(workdir: str, owner: dict, extra: str = "") -> WorkdirLockedError:
  return WorkdirLockedError(
    f"workdir {workdir} is in use by another lca-train run ({_describe(owner)}){extra}; "
    "wait for it to end, stop it (SIGTERM or Ctrl-C checkpoint it), or use another --workdir"
  )


def _note_takeover(old: dict) -> None:
  if old:
    print(
      f"lca-train: note: taking over the lock of a run that is no longer running "
      f"({_describe(old)})",
      file=sys.stderr,
      flush=True,
    )


def acquire(workdir: str, process_index: int = 0) -> WorkdirLock:
  """Lock ``workdir`` for this run (a no-op lock on processes other than 0)."""
  if process_index != 0:
    return WorkdirLock()
  path = os.path.join(workdir, LOCK_FILE)
  for _ in range(10):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno in _BUSY:
        os.close(fd)
        raise _refuse(workdir, _read_owner(path)) from None
      os.close(fd)
      return _acquire_without_flock(workdir, path)
    try:  # a run that ended may have unlinked the file between our open and our flock
      same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
      same = False
    if not same:
      os.close(fd)
      continue
    old = _read_owner(path, fd)
    _note_takeover(old)
    os.ftruncate(fd, 0)
    os.pwrite(fd, _record(), 0)
    return WorkdirLock(path, fd)
  raise TrainError(f"cannot lock workdir {workdir}: {path} keeps changing")


def _acquire_without_flock(workdir: str, path: str) -> WorkdirLock:
  """Fallback where flock is not supported: the recorded owner decides (module docstring)."""
  old = _read_owner(path)
  if old and old.get("pid") != os.getpid():
    if old.get("host") != socket.gethostname():
      raise _refuse(
        workdir,
        old,
        f" (this filesystem cannot lock, so whether it is still "
        f"running cannot be checked from here: remove {path} if it is not)",
      )
    if pid_alive(int(old.get("pid", 0) or 0)):
      raise _refuse(workdir, old)
    _note_takeover(old)
  tmp = f"{path}.{socket.gethostname()}.{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(_record())
  os.replace(tmp, path)  # atomic: readers see the old record or ours, never a mix
  fd = os.open(path, os.O_RDONLY)
  return WorkdirLock(path, fd)
