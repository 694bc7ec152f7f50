"""A checkpoint save that fails for lack of space (or any OSError) ends lca-train in one line.

The failure is real, not mocked: the child process (this file with ``--child``) runs lca-train
and, once the first checkpoint is committed, sets RLIMIT_FSIZE (SIGXFSZ ignored), so every
later write past the limit fails with EFBIG inside orbax / tensorstore's real code, as ENOSPC
does on a full disk. stderr is a pipe (not subject to the limit). Checked: exit status 2, one
``lca-train: error:`` line naming the step, the problem and the intact step, no traceback, no
hang (each run has a timeout), the tmp directory gone, the earlier checkpoint verified and
resumable, metrics.jsonl whole. Asynchronous saves fail on orbax's background thread, either
mid-run (the run stops at the next step) or at the last save (raised by close); synchronous
saves fail in the call itself.
"""

import os
import sys

if __name__ != "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import errno  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
THIS = os.path.abspath(__file__)
LIMIT = 64 * 1024  # bytes: metrics.jsonl and the manifests stay below it, array files do not


# ---- the child driver ----------------------------------------------------------------------
def _limit_writes(limit: int) -> None:
  import resource  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top

  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
  resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _child_main(argv) -> int:
  """lca-train with $LCA_TEST_DISK_FULL = {"step": S, "after": C, "limit": B}: before step
  index S, wait until checkpoint C is committed (its directory exists), then limit file
  sizes to B bytes."""
  spec = json.loads(os.environ.get("LCA_TEST_DISK_FULL", "{}"))

  from lca_jax.cli import train as cli  # pylint: disable=g-import-not-at-top
  from lca_jax.train import loop  # pylint: disable=g-import-not-at-top

  real = loop.train_and_evaluate

  def train_and_evaluate(config, workdir, **kw):
    def on_step(step, batch):
      del batch
      if spec and step == spec["step"]:
        committed = os.path.join(workdir, "checkpoints", str(spec["after"]))
        deadline = time.time() + 120
        while not os.path.isdir(committed) and time.time() < deadline:
          time.sleep(0.01)
        _limit_writes(spec["limit"])

    return real(config, workdir, on_step=on_step, **kw)

  loop.train_and_evaluate = train_and_evaluate
  return cli.main(argv)


_PROBE_CHILD = """
import resource, signal, sys
from types import SimpleNamespace
import jax.numpy as jnp
from lca_jax.train import checkpoint as ckpt_lib
state = lambda s: SimpleNamespace(step=jnp.int32(s), params={"w": jnp.ones(64)},
                                  opt_state={"m": jnp.zeros(64)}, rng=jnp.zeros(2, jnp.uint32))
ck = ckpt_lib.Checkpointer(sys.argv[1], async_save=False)
ck.save(state(1))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
# below the probe's 4 KiB file: the step cannot be written at all
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
called = []
ck.manager.save = lambda *a, **k: called.append(1)
try:
  ck.save(state(2))
except ckpt_lib.CheckpointSaveError as e:
  print("ERROR", e, "manager.save called" if called else "")
ck.close()
"""

# the space goes between the probe and orbax: the step's directories cannot be created
_RACE_CHILD = """
import errno, os, sys
from types import SimpleNamespace
import jax.numpy as jnp
from lca_jax.train import checkpoint as ckpt_lib
state = lambda s: SimpleNamespace(step=jnp.int32(s), params={"w": jnp.ones(64)},
                                  opt_state={"m": jnp.zeros(64)}, rng=jnp.zeros(2, jnp.uint32))
ck = ckpt_lib.Checkpointer(sys.argv[1], async_save=True)
ck.save(state(1))
ck._finish_pending()
real = os.makedirs, os.mkdir
def step_2(p):
  name = os.path.basename(os.fspath(p).rstrip("/"))
  return name == "2" or name.startswith("2.")
def refuse(fn):
  def f(p, *a, **k):
    if step_2(p):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(p))
    return fn(p, *a, **k)
  return f
os.makedirs, os.mkdir = refuse(real[0]), refuse(real[1])
where = "save"
try:
  ck.save(state(2))
  where = "close"
  ck.close()
  print("no error")
except ckpt_lib.CheckpointSaveError as e:
  print("ERROR in", where + ":", e)
"""

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
  sys.exit(_child_main(sys.argv[2:]))


# ---- the tests -----------------------------------------------------------------------------
import pytest  # noqa: E402
from conftest import TRAIN_TINY  # noqa: E402

from lca_jax.train import checkpoint as ckpt_lib  # noqa: E402
from lca_jax.train import save_failures  # noqa: E402
from lca_jax.workdir import manifest  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "tiny_lca_mbp.py")


def _env(spec=None) -> dict:
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="--xla_force_host_platform_device_count=8",
    PYTHONPATH=ROOT,
    LCA_TEST_DISK_FULL=json.dumps(spec or {}),
  )
  cache = os.environ.get("LCA_JAX_TEST_XLA_CACHE", "0")  # opt-in, as in conftest.py
  if cache not in ("", "0"):
    env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
  return env


def _train(workdir, *overrides, spec=None, timeout=300):
  """(exit status, stderr) of lca-train in a child process; a hang fails the test."""
  argv = ["--config", CONFIG, "--workdir", str(workdir)]
  argv += [f"--config.{o}" for o in TRAIN_TINY + list(overrides)]
  res = subprocess.run(
    [sys.executable, THIS, "--child"] + argv,
    env=_env(spec),
    cwd=ROOT,
    stdin=subprocess.DEVNULL,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  return res.returncode, res.stderr


def _one_error_line(err: str) -> str:
  """The single ``lca-train: error:`` line; every other stderr line is lca-train's own."""
  lines = [line for line in err.splitlines() if line.strip()]
  errors = [line for line in lines if line.startswith("lca-train: error:")]
  assert len(errors) == 1 and "Traceback" not in err, err[-4000:]
  assert all(line.startswith("lca-train: ") for line in lines), err[-4000:]
  return errors[0]


def _checkpoint_entries(workdir) -> list:
  return sorted(os.listdir(os.path.join(workdir, "checkpoints")))


def _metrics_steps(workdir) -> list:
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line)["step"] for line in f]  # every line whole JSON


def _assert_intact(workdir, step):
  """Only committed step ``step`` is left, its manifest verifies, and it restores."""
  assert _checkpoint_entries(workdir) == [str(step)], _checkpoint_entries(workdir)
  step_dir = os.path.join(workdir, "checkpoints", str(step))
  assert os.path.isfile(os.path.join(step_dir, manifest.MANIFEST))
  assert manifest.verify_step(step_dir) is None


def test_background_save_failure_stops_the_run_and_it_resumes(tmp_path):
  """Asynchronous saves: the save of step 40 fails on orbax's background thread; the run stops
  at the end of the step that notices it (before the next scheduled save, 60), the tmp
  directory is removed, and once writes fit again the same command resumes from step 20 and
  finishes."""
  wd = tmp_path / "wd"
  run = ("train.steps=60", "train.checkpoint_every=20", "train.async_checkpointing=True")
  t0 = time.time()
  code, err = _train(wd, *run, spec={"step": 20, "after": 20, "limit": LIMIT})
  line = _one_error_line(err)
  assert code == 2, err[-4000:]
  assert "checkpoint save at step 40 failed: file too large" in line, line
  assert "the previous checkpoint at step 20 is intact" in line, line
  assert str(wd / "checkpoints") in line, line
  _assert_intact(wd, 20)
  steps = _metrics_steps(wd)
  assert steps == list(range(1, len(steps) + 1)) and 40 <= steps[-1] < 60, steps
  assert time.time() - t0 < 240

  code, err = _train(wd, *run)
  assert code == 0, err[-4000:]
  assert "resumed from step 20" in err and "done at step 60" in err, err[-4000:]
  assert _metrics_steps(wd) == list(range(1, 61))
  assert not [e for e in _checkpoint_entries(wd) if ckpt_lib.TMP_MARK in e]


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_last_save_failure_is_one_line(tmp_path, async_save):
  """The save of the last step (8) fails: asynchronously it is reported by ``close`` at the end
  of the run, synchronously by the save call itself. Either way exit status 2, one line, the
  tmp directory removed, step 4 intact."""
  wd = tmp_path / "wd"
  code, err = _train(
    wd,
    "train.steps=8",
    "train.checkpoint_every=4",
    f"train.async_checkpointing={async_save}",
    spec={"step": 4, "after": 4, "limit": LIMIT},
  )
  line = _one_error_line(err)
  assert code == 2, err[-4000:]
  assert "checkpoint save at step 8 failed: file too large" in line, line
  assert "the previous checkpoint at step 4 is intact" in line, line
  _assert_intact(wd, 4)
  assert _metrics_steps(wd) == list(range(1, 9))


def _run_script(script: str, tmp_path):
  """A child ``python -c script TMP`` (the Checkpointer scripts above), output captured."""
  return subprocess.run(
    [sys.executable, "-c", script, str(tmp_path)],
    env=_env(),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_unwritable_step_fails_before_orbax_starts(tmp_path):
  """A step that cannot be written at all (here: not even a 4 KiB file) is refused by the
  probe before orbax starts its writer threads (which would wait 300 s for a directory that
  is never created); step 1 stays."""
  res = _run_script(_PROBE_CHILD, tmp_path)
  assert res.returncode == 0, res.stderr[-4000:]
  out = res.stdout.strip()
  assert out.startswith("ERROR checkpoint save at step 2 failed: file too large"), out
  assert "manager.save called" not in out and "step 1 is intact" in out, out
  assert "Traceback" not in res.stderr, res.stderr[-4000:]
  assert _checkpoint_entries(tmp_path) == ["1"]


def test_step_directory_that_cannot_be_created_fails_in_save(tmp_path):
  """Space running out between the probe and orbax's directory creation: the save call
  itself raises the one-line error (the directories are created synchronously), not a later
  save or close after orbax's background threads gave up; step 1 stays."""
  res = _run_script(_RACE_CHILD, tmp_path)
  assert res.returncode == 0, res.stderr[-4000:]
  out = res.stdout.strip().splitlines()[-1]
  assert out.startswith("ERROR in save: checkpoint save at step 2 failed: no space left"), out
  assert "step 1 is intact" in out, out
  assert "Traceback" not in res.stderr, res.stderr[-4000:]
  assert _checkpoint_entries(tmp_path) == ["1"]


# ---- the pieces ----------------------------------------------------------------------------
def test_os_problem_names_the_os_error():
  assert save_failures.os_problem(OSError(errno.ENOSPC, "x")) == (
    errno.ENOSPC,
    "no space left on device",
  )
  ts = ValueError(
    'RESOURCE_EXHAUSTED: Error writing "w/0" ...: Failed to write 7 bytes to file 5: No space '
    "left on device [os_error_code='28']"
  )
  assert save_failures.os_problem(ts) == (errno.ENOSPC, "no space left on device")
  try:
    try:
      raise OSError(errno.EROFS, "ro")
    except OSError as e:
      raise RuntimeError("commit failed") from e
  except RuntimeError as e:
    assert save_failures.os_problem(e) == (errno.EROFS, "read-only file system")
  assert save_failures.os_problem(ValueError("shape mismatch")) is None
  assert save_failures.os_problem(TimeoutError("barrier"))[0] is None


def test_closed_loop_callback_is_recognised():
  import asyncio  # pylint: disable=g-import-not-at-top

  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(print)
  except RuntimeError as e:
    tb = e.__traceback__.tb_next  # as raised into native code: the callback's own frames only
    assert save_failures._closed_loop_callback(RuntimeError, e, tb)  # pylint: disable=protected-access
    assert not save_failures._closed_loop_callback(RuntimeError, e, e.__traceback__)  # pylint: disable=protected-access
  assert not save_failures._closed_loop_callback(RuntimeError, RuntimeError("other"), None)  # pylint: disable=protected-access
