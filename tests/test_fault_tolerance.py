"""Fault tolerance with real processes: a save killed before its commit is never restored, a
corrupt latest checkpoint falls back to the previous one with a warning naming it, Ctrl-C
checkpoints the completed steps, a work directory in use is refused and a dead run's lock taken
over, a killed peer makes the survivor exit within the heartbeat bound, errors of multi-process
runs are one line, the hang watchdog. The child driver and helpers live in
tests/test_multihost.py."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import errno  # noqa: E402
import glob  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

_spec = importlib.util.spec_from_file_location(
  "_lca_multihost_helpers", os.path.join(ROOT, "tests", "test_multihost.py")
)
mh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mh)

from conftest import assert_trees_equal, host_params  # noqa: E402

import lca_jax  # noqa: E402
from lca_jax import configs_io  # noqa: E402
from lca_jax.cli import train as cli  # noqa: E402
from lca_jax.train import checkpoint as ckpt_lib  # noqa: E402
from lca_jax.train import (
  loop,  # noqa: E402
  workdir_lock,  # noqa: E402
)
from lca_jax.workdir import manifest  # noqa: E402

STEPS = 6  # checkpoints at 2, 4, 6 (train.checkpoint_every=2, keep 3)
MULTI = os.path.join(ROOT, "launch", "multiprocess.sh")


def tiny_config(*overrides):
  c = configs_io.load_config(mh.CONFIG)
  return configs_io.apply_overrides(c, mh.TINY + list(overrides))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """STEPS steps in one run, checkpoints 2, 4, 6 (8 devices, this process)."""
  wd = str(tmp_path_factory.mktemp("straight"))
  res = loop.train_and_evaluate(tiny_config(f"train.steps={STEPS}"), wd)
  assert ckpt_lib.Checkpointer(wd, read_only=True).all_steps() == [2, 4, 6]
  return dict(workdir=wd, params=host_params(res.state))


def _copy(straight, tmp_path):
  wd = str(tmp_path / "wd")
  shutil.copytree(straight["workdir"], wd)
  return wd


def _resume_and_compare(wd, straight, warn_match=None):
  """Resume ``wd`` to STEPS in this process; the result must equal the straight run."""
  cfg = tiny_config(f"train.steps={STEPS}")
  if warn_match:
    with pytest.warns(manifest.CorruptCheckpointWarning, match=warn_match):
      res = loop.train_and_evaluate(cfg, wd)
  else:
    res = loop.train_and_evaluate(cfg, wd)
  assert res.step == STEPS and not res.stopped
  assert_trees_equal(host_params(res.state), straight["params"])
  assert [m["step"] for m in mh.metrics(wd)] == list(range(1, STEPS + 1))
  return res


# ---- a save interrupted before its commit -------------------------------------------------
def test_killed_mid_save_is_never_restored(tmp_path, straight):
  """A real process is SIGKILLed while checkpoint 4 is written (all its files are in the tmp
  directory, commit_success.txt included, only the rename is missing): step 2 is restored and
  the resumed run equals the uninterrupted one; the tmp directory is cleaned up."""
  wd = tmp_path / "wd"
  marker = tmp_path / "saving_4"
  env = mh.child_env(8, {"hang_rename_step": 4, "hang_marker": str(marker)})
  p = mh.Proc(
    ["bash", os.path.join(ROOT, "launch", "single_host.sh")]
    + mh.train_args(wd, f"train.steps={STEPS}"),
    env,
    tmp_path / "child.log",
  )
  deadline = time.time() + 400
  while not marker.exists():
    if p.p.poll() is not None or time.time() > deadline:
      p.kill()
      pytest.fail(f"the child never reached the commit of step 4:\n{p.output()[-3000:]}")
    time.sleep(0.2)
  p.kill()  # SIGKILL mid-save
  assert p.p.returncode == -9
  ckdir = wd / "checkpoints"
  tmp_dirs = glob.glob(str(ckdir / "4.orbax-checkpoint-tmp*"))
  assert len(tmp_dirs) == 1 and os.path.isfile(os.path.join(tmp_dirs[0], "commit_success.txt"))
  assert os.path.isdir(os.path.join(tmp_dirs[0], "params"))
  assert ckpt_lib.Checkpointer(str(wd), read_only=True).all_steps() == [2]
  assert manifest.verify_step(str(ckdir / "2")) is None
  assert os.path.isfile(ckdir / "2" / manifest.MANIFEST)  # sealed when step 4 was saved
  _resume_and_compare(str(wd), straight)
  assert not glob.glob(str(ckdir / "*orbax-checkpoint-tmp*"))  # cleaned up
  assert ckpt_lib.Checkpointer(str(wd), read_only=True).all_steps() == [2, 4, 6]


# ---- corrupt checkpoints ------------------------------------------------------------------
def _params_files(step_dir):
  return sorted(
    f
    for f in glob.glob(os.path.join(step_dir, "params", "**", "*"), recursive=True)
    if os.path.isfile(f) and f"{os.sep}d{os.sep}" in f
  )


def test_corrupt_latest_falls_back_with_warning(tmp_path, straight):
  """A deleted and a truncated array file of step 6 (found by the manifest): step 6 is set
  aside with a warning naming it, step 4 restored, and the resumed run equals the straight one."""
  wd = _copy(straight, tmp_path)
  six = os.path.join(wd, "checkpoints", "6")
  files = _params_files(six)
  assert len(files) >= 2
  os.remove(files[0])
  with open(files[1], "r+b") as f:
    f.truncate(os.path.getsize(files[1]) // 2)
  assert "missing" in manifest.verify_step(six)
  # Inference skips it too (and leaves it in place).
  with pytest.warns(manifest.CorruptCheckpointWarning, match="step 6 .* corrupt .*using step 4"):
    model = lca_jax.load(wd)
  assert model.cfg.d_model == 32
  _resume_and_compare(
    wd,
    straight,
    warn_match=r"checkpoint step 6 in .* is corrupt \(params/.* missing; "
    r"params/.* has \d+ of \d+ bytes\); falling back to step 4",
  )
  assert os.path.isdir(os.path.join(wd, ckpt_lib.CORRUPT_DIR, "6"))
  assert ckpt_lib.Checkpointer(wd, read_only=True).all_steps() == [2, 4, 6]


# orbax leaves an asyncio callback behind when a restore fails ("Event loop is closed").
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_latest_without_manifest_falls_back(tmp_path, straight):
  """No manifest (a run killed before sealing it, or an older checkpoint): the failing restore
  itself sends the run back to step 4."""
  wd = _copy(straight, tmp_path)
  six = os.path.join(wd, "checkpoints", "6")
  os.remove(os.path.join(six, manifest.MANIFEST))
  os.remove(os.path.join(six, "params", "manifest.ocdbt"))
  _resume_and_compare(
    wd, straight, warn_match="checkpoint step 6 in .* is corrupt .*; falling back to step 4"
  )


def test_no_readable_checkpoint_is_one_line_error(tmp_path, straight, capsys):
  wd = _copy(straight, tmp_path)
  for step in (2, 4, 6):
    os.remove(_params_files(os.path.join(wd, "checkpoints", str(step)))[0])
  code = cli.main(
    ["--config", mh.CONFIG, "--workdir", wd]
    + [f"--config.{o}" for o in mh.TINY + [f"train.steps={STEPS}"]]
  )
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and "no readable checkpoint" in err[-1] and "step 6:" in err[-1], err
  assert "nothing was moved" in err[-1] and "Traceback" not in "\n".join(err)
  # A problem common to every step (here: all damaged) never empties the directory.
  assert ckpt_lib.Checkpointer(wd, read_only=True).all_steps() == [2, 4, 6]
  assert not os.path.exists(os.path.join(wd, ckpt_lib.CORRUPT_DIR))


def test_unwritable_checkpoint_folder(tmp_path, capsys):
  (tmp_path / "checkpoints").write_text("not a folder")
  code = cli.main(
    ["--config", mh.CONFIG, "--workdir", str(tmp_path)] + [f"--config.{o}" for o in mh.TINY]
  )
  err = capsys.readouterr().err.strip()
  assert code == 2 and "cannot write to checkpoint folder" in err and len(err.splitlines()) == 1


# ---- Ctrl-C and the work directory lock ---------------------------------------------------
# The child gets SIGINT at its default: pytest run from a script in the background may have it
# ignored, and lca-train leaves an ignored SIGINT ignored. (exec keeps the pid.)
_SIGINT_DFL = (
  "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
  "os.execv(sys.executable, [sys.executable] + sys.argv[1:])"
)


def _start_training(tmp_path, wd, *overrides):
  """lca-train (the child driver, 8 devices) training ``wd`` in the background, far from done
  and without periodic checkpoints."""
  return mh.Proc(
    [sys.executable, "-c", _SIGINT_DFL, mh.THIS, "--child"]
    + mh.train_args(wd, "train.steps=100000", "train.checkpoint_every=100000", *overrides),
    mh.child_env(8),
    tmp_path / "child.log",
  )


def _wait_for_steps(p, wd, n, timeout=400):
  """Until ``wd``'s metrics.jsonl has ``n`` lines (steps done)."""
  path = os.path.join(wd, "metrics.jsonl")
  deadline = time.time() + timeout
  while not (os.path.exists(path) and len(open(path).readlines()) >= n):
    if p.p.poll() is not None or time.time() > deadline:
      p.kill()
      pytest.fail(f"the child did not train {n} steps:\n{p.output()[-3000:]}")
    time.sleep(0.1)


def _dead_pid() -> int:
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  return child.pid


def test_ctrl_c_checkpoints_the_completed_steps_and_resumes(tmp_path):
  """Ctrl-C (SIGINT to the process group, as a terminal sends it: the data worker process gets
  it too) a few steps into a run: it checkpoints the last completed step (the only checkpoint:
  no periodic ones), says so, exits 130 and releases the workdir; resuming it gives exactly an
  uninterrupted run's params."""
  wd = str(tmp_path / "wd")
  workers = "data.worker_count=1"
  p = _start_training(tmp_path, wd, workers)
  _wait_for_steps(p, wd, 3)
  os.killpg(p.p.pid, signal.SIGINT)
  rc = p.wait(timeout=200)
  out = p.output()
  n = len(mh.metrics(wd))
  assert rc == 130, out[-3000:]
  assert f"lca-train: interrupted at step {n} (checkpoint saved; rerun to resume)" in out, out[
    -3000:
  ]
  assert "Traceback" not in out and "Ctrl-C again quits at once" in out
  assert ckpt_lib.Checkpointer(wd, read_only=True).all_steps() == [n]
  assert not os.path.exists(os.path.join(wd, workdir_lock.LOCK_FILE))
  res = loop.train_and_evaluate(tiny_config(f"train.steps={n + 2}", workers), wd)
  assert res.step == n + 2 and [m["step"] for m in mh.metrics(wd)] == list(range(1, n + 3))
  ref = loop.train_and_evaluate(tiny_config(f"train.steps={n + 2}", workers), str(tmp_path / "ref"))
  assert_trees_equal(host_params(res.state), host_params(ref.state))


def test_second_run_on_a_live_workdir_is_refused(tmp_path, capsys):
  """While a run trains, a second lca-train on its workdir exits 2 in one line naming the
  owner's pid and host, and touches nothing there; the first run goes on undisturbed."""
  wd = str(tmp_path / "wd")
  p = _start_training(tmp_path, wd)
  try:
    _wait_for_steps(p, wd, 2)
    with open(os.path.join(wd, "train_config.json")) as f:
      config_before = f.read()
    code = cli.main(
      ["--config", mh.CONFIG, "--workdir", wd]
      + [f"--config.{o}" for o in mh.TINY + ["train.steps=4", "train.seed=7"]]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(
      f"lca-train: error: workdir {wd} is in use by another lca-train run "
      f"(pid {p.p.pid} on host {socket.gethostname()} since "
    ), err
    with open(os.path.join(wd, "train_config.json")) as f:
      assert f.read() == config_before
  finally:
    p.p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=200)
  assert rc == 0, p.output()[-3000:]
  steps = [m["step"] for m in mh.metrics(wd)]
  assert steps == list(range(1, len(steps) + 1))  # one run's lines, each step once
  assert ckpt_lib.Checkpointer(wd, read_only=True).all_steps() == [steps[-1]]


def test_dead_runs_lock_is_taken_over(tmp_path, capsys):
  """A lock file left by a run that died (this host, pid gone: SIGKILL never cleans up) does
  not block the next run, which notes whose lock it takes over and removes it when done."""
  wd = tmp_path / "wd"
  wd.mkdir()
  dead = _dead_pid()
  (wd / workdir_lock.LOCK_FILE).write_text(
    json.dumps({"pid": dead, "host": socket.gethostname(), "started": time.time() - 60})
  )
  code = cli.main(
    ["--config", mh.CONFIG, "--workdir", str(wd)]
    + [f"--config.{o}" for o in mh.TINY + ["train.steps=2"]]
  )
  err = capsys.readouterr().err
  assert code == 0, err
  assert (
    f"lca-train: note: taking over the lock of a run that is no longer running (pid {dead} "
    f"on host {socket.gethostname()}"
  ) in err
  assert not (wd / workdir_lock.LOCK_FILE).exists()


def test_lock_in_process_and_without_flock(tmp_path, monkeypatch):
  """flock: a second lock on a locked workdir is refused (even in the same process), a released
  one can be taken again. A filesystem without locks: the pid decides on this host, an owner
  on another host is refused with the file to remove."""
  path = tmp_path / workdir_lock.LOCK_FILE
  host = socket.gethostname()
  first = workdir_lock.acquire(str(tmp_path))
  with pytest.raises(workdir_lock.WorkdirLockedError, match=f"pid {os.getpid()} on host {host}"):
    workdir_lock.acquire(str(tmp_path))
  first.release()
  assert not path.exists()
  workdir_lock.acquire(str(tmp_path)).release()
  assert workdir_lock.acquire(str(tmp_path), process_index=1).path == ""  # only process 0 locks

  def no_flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")

  monkeypatch.setattr(workdir_lock.fcntl, "flock", no_flock)
  path.write_text(json.dumps({"pid": os.getppid(), "host": host}))  # alive: pytest's parent
  with pytest.raises(workdir_lock.WorkdirLockedError, match=f"pid {os.getppid()} on host {host}"):
    workdir_lock.acquire(str(tmp_path))
  path.write_text(json.dumps({"pid": 12345, "host": "elsewhere"}))
  with pytest.raises(
    workdir_lock.WorkdirLockedError,
    match=f"host elsewhere.*remove {re.escape(str(path))} if it is not",
  ):
    workdir_lock.acquire(str(tmp_path))
  path.write_text(json.dumps({"pid": _dead_pid(), "host": host}))
  lock = workdir_lock.acquire(str(tmp_path))
  assert json.loads(path.read_text())["pid"] == os.getpid()
  lock.release()
  assert not path.exists()


# ---- multi-process failures ---------------------------------------------------------------
# The heartbeat timeout of these runs: a dead peer must be noticed within it, and live peers
# must not miss it while both compile on a loaded machine (CI on 2 cores, with a second test
# worker, once saw both processes miss a 5 s window before the first step).
HEARTBEAT = 15


def _two_processes(tmp_path, port, env, heartbeat, args) -> list:
  """Processes 0 and 1 of one run, started by launch/multiprocess.sh (logs TMP/p<i>.log)."""
  return [
    mh.Proc(
      ["bash", MULTI, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
      + ["--process-id", str(i), "--heartbeat-timeout", str(heartbeat), "--"]
      + args,
      env,
      tmp_path / f"p{i}.log",
    )
    for i in (0, 1)
  ]


@pytest.mark.parametrize("victim", [1, 0], ids=["worker_dies", "coordinator_dies"])
def test_killed_peer_makes_survivor_exit(tmp_path, victim):
  """One process is SIGKILLed during step index 1; the other, waiting for it in the step's
  collectives, must exit non-zero within the heartbeat timeout (+ slack), not hang. (When the
  dead one is process 0, which hosts the coordination service, the survivor notices at once.)"""
  wd = tmp_path / "wd"
  stamp = tmp_path / "killed_at"
  port = mh.free_port()
  survivor = 1 - victim
  env = mh.child_env(
    2, {"actions": [{"step": 1, "process": victim, "do": "sigkill_self", "stamp": str(stamp)}]}
  )
  procs = _two_processes(
    tmp_path, port, env, HEARTBEAT, mh.train_args(wd, "train.steps=4", *mh.MESH4)
  )
  rc_victim = procs[victim].wait()
  rc = procs[survivor].wait(timeout=HEARTBEAT + 120)
  ended = time.time()
  out = mh.clean_log(procs[survivor].output())
  assert rc_victim == -9, procs[victim].output()[-2000:]
  assert stamp.exists(), out[-3000:]
  elapsed = ended - float(stamp.read_text())
  print(
    f"process {survivor} exited {elapsed:.1f}s after process {victim} was killed "
    f"(heartbeat {HEARTBEAT}s), status {rc}"
  )
  assert rc != 0, out[-3000:]
  assert "JAX distributed service detected fatal errors" in out, out[-3000:]
  assert elapsed < HEARTBEAT + 25, (elapsed, out[-3000:])
  # Nothing was committed past the last complete checkpoint (none yet): nothing to restore.
  assert ckpt_lib.Checkpointer(str(wd), read_only=True).all_steps() == []


# how process 1's storage fails at the checkpoint of step 4, what its own line says, and
# whether saves are asynchronous
ONE_PROCESS_FAILS = {
  # its disk is full: the probe before orbax starts fails there only
  "before_orbax": ({"do": "no_space"}, "no space left on device", True),
  # its array files fail midway on orbax's writer threads (the probe's 4 KiB still fits)
  "midway": ({"do": "limit_writes", "bytes": 8192}, "file too large", True),
  "midway_sync": ({"do": "limit_writes", "bytes": 8192}, "file too large", False),
}


@pytest.mark.parametrize("how", list(ONE_PROCESS_FAILS))
def test_storage_failure_on_one_process_stops_every_process(tmp_path, how):
  """Only process 1 cannot write the checkpoint of step 4: both processes exit 2 at that save,
  each with one line (process 1 naming its error, process 0 naming process 1), instead of
  process 0 waiting in orbax's barriers for a peer that left (before_orbax) or whose commit
  failed (midway: orbax's barrier timeout is 20 minutes; synchronous saves died in a gloo
  collective with a traceback); the checkpoint of step 2 is intact and is the only one, no
  tmp directory is left."""
  wd = tmp_path / "wd"
  port = mh.free_port()
  action, own_error, async_save = ONE_PROCESS_FAILS[how]
  env = mh.child_env(2, {"actions": [dict(action, step=3, process=1)]})
  run = ("train.steps=6", f"train.async_checkpointing={async_save}", *mh.MESH4)
  procs = _two_processes(tmp_path, port, env, 10, mh.train_args(wd, *run))
  lines = []
  for p in procs:
    rc = p.wait(timeout=300)
    out = mh.clean_log(p.output())
    errs = [l for l in out.splitlines() if l.startswith("lca-train: error:")]
    assert rc == 2, out[-3000:]
    assert len(errs) == 1 and "checkpoint save at step 4 failed" in errs[0], out[-3000:]
    assert "the previous checkpoint at step 2 is intact" in errs[0], errs
    assert "Traceback" not in out, out[-3000:]
    lines.append(errs[0])
  assert "process 1 could not write it" in lines[0], lines
  assert own_error in lines[1], lines
  assert sorted(os.listdir(wd / "checkpoints")) == ["2"]


def test_multiprocess_config_error_is_one_line(tmp_path):
  """Every process sees the bad batch layout, says so in one line and exits 2 (together)."""
  port = mh.free_port()
  env = mh.child_env(2, LCA_TRAIN=f"{sys.executable} -m lca_jax.cli.train")
  procs = _two_processes(
    tmp_path,
    port,
    env,
    10,
    mh.train_args(tmp_path / "wd", "train.micro_batch_size=2", "train.global_batch_bytes=64"),
  )
  for i, p in enumerate(procs):
    rc = p.wait(timeout=200)
    errs = [l for l in p.output().splitlines() if l.startswith("lca-train: error:")]
    assert rc == 2, p.output()[-2000:]
    assert len(errs) == 1 and "cannot be divided over the 4 batch shards" in errs[0], errs
    assert "Traceback" not in p.output()


def test_unreachable_coordinator_is_one_line_error(tmp_path):
  env = mh.child_env(2)
  t0 = time.time()
  res = subprocess.run(
    [
      sys.executable,
      "-m",
      "lca_jax.cli.train",
      "--coordinator",
      f"127.0.0.1:{mh.free_port()}",
      "--num-processes",
      "2",
      "--process-id",
      "1",
      "--init-timeout",
      "3",
    ]
    + mh.train_args(tmp_path / "wd"),
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=200,
  )
  errs = [l for l in res.stderr.splitlines() if l.startswith("lca-train: error:")]
  assert res.returncode == 2, res.stderr[-2000:]
  assert len(errs) == 1 and "could not reach the coordinator 127.0.0.1:" in errs[0], errs
  assert "within 3s" in errs[0] and "Traceback" not in res.stderr
  assert time.time() - t0 < 120


def test_watchdog_ends_a_stuck_training_process(tmp_path):
  """lca-train --watchdog: a process stuck after its first step (here: in Python, before step
  index 2; the first checkpoint, at 2, is not timed) exits with status 3 and says where it
  was."""
  env = mh.child_env(
    8, {"actions": [{"step": 2, "do": "hang", "stamp": str(tmp_path / "t")}]}, LCA_WATCHDOG="5"
  )
  p = mh.Proc(
    ["bash", os.path.join(ROOT, "launch", "single_host.sh")]
    + mh.train_args(tmp_path / "wd", "train.steps=6"),
    env,
    tmp_path / "child.log",
  )
  rc = p.wait(timeout=400)
  elapsed = time.time() - float((tmp_path / "t").read_text())
  assert rc == 3, p.output()[-3000:]
  assert "lca-train: error: no progress for" in p.output() and "last: step 2" in p.output()
  assert elapsed < 5 + 15, elapsed


def test_watchdog_ends_a_stuck_process():
  code = (
    "import time\nfrom lca_jax.train.watchdog import Watchdog\n"
    "w = Watchdog(1.0)\nw.arm('step 7')\ntime.sleep(60)\n"
  )
  t0 = time.time()
  res = subprocess.run(
    [sys.executable, "-c", code],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  assert res.returncode == 3, res.stderr
  assert "no progress for" in res.stderr and "last: step 7" in res.stderr
  assert time.time() - t0 < 20


_EXIT_CHILD = """
import sys, time
from lca_jax.train import distributed
pid, port, delay = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
distributed.initialize(distributed.DistConfig(
  coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid, local_device_ids=None,
  heartbeat_timeout=10, init_timeout=60))
print(f"lca-train: error: process {pid} failed", file=sys.stderr, flush=True)
time.sleep(delay)
distributed.exit_now(2)
"""


@pytest.mark.parametrize("late", [False, True], ids=["together", "one_late"])
def test_exit_now_waits_for_a_peer_still_cleaning_up(tmp_path, late):
  """Both processes of a run fail; process 1 reaches ``exit_now`` 15 s after process 0 (a
  failed checkpoint save waits up to 10 s for orbax's threads, more on a loaded machine).
  Both exit 2: process 0 must not close the coordination service under process 1 (which jax
  then aborts, status 134: this failed CI with the earlier 10 s grace)."""
  port = mh.free_port()
  env = mh.child_env(1)
  delays = (0, 15 if late else 0)
  procs = [
    mh.Proc(
      [sys.executable, "-c", _EXIT_CHILD, str(i), str(port), str(delays[i])],
      env,
      tmp_path / f"p{i}.log",
    )
    for i in (0, 1)
  ]
  for p in procs:
    rc = p.wait(timeout=120)
    assert rc == 2, p.output()[-3000:]
    assert "Traceback" not in p.output(), p.output()[-3000:]
