"""Multi-host training with real processes on localhost (jax.distributed + gloo CPU collectives).

Two lca-train processes with 2 fake CPU devices each (a 4-device mesh, params sharded over
fsdp=4 across both processes) train the tiny config. The run is started by launch/slurm.sbatch
under a stand-in ``srun`` / ``scontrol`` (2 tasks), stopped by a real SIGTERM that only process
1 receives (both must stop at the same step, checkpoint and exit 0), and resumed by
``launch/multiprocess.sh --local 2``. Its losses (metrics.jsonl) must equal those of one process
with 4 devices fed the same global batches, and its checkpoint must load in one process
(``lca_jax.load``) with the params the two processes ended with.

This file is also the child driver of these tests and of tests/test_fault_tolerance.py:
``python tests/test_multihost.py --child <lca-train args>`` runs lca-train with the actions
of the JSON in $LCA_TEST_CHILD (signals at given steps, a save that hangs, a params dump).
"""

import os
import sys

if __name__ != "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
THIS = os.path.abspath(__file__)
PY = sys.executable

# Same tiny model as tests/test_train.py; mesh fsdp=4 so that params are split across processes.
TINY = [
  "model.d_model=32",
  "model.d_inner=64",
  "model.n_heads=2",
  "model.n_kv_heads=2",
  "model.n_lm=1",
  "model.n_mbp=1",
  "data.seq_len=32",
  "train.micro_batch_size=8",
  "train.global_batch_bytes=512",
  "train.log_every=1",
  "train.eval_every=0",
  "train.checkpoint_every=2",
  "train.progress_bar=False",
  "train.tensorboard=False",
  "optim.warmup_steps=2",
  "optim.lr=3e-3",
  "optim.decay_steps=40",
]
MESH4 = ["mesh.data=1", "mesh.fsdp=4"]
CONFIG = os.path.join(ROOT, "configs", "tiny_lca_mbp.py")


# ---- the child driver --------------------------------------------------------------------
def _child_main(argv):
  """lca-train (lca_jax.cli.train.main) with test actions from $LCA_TEST_CHILD:

  actions: [{"step": S, "process": P (default: every), "do": "sigterm_self" | "sigterm_parent"
             | "sigkill_self" | "hang" | "no_space" | "limit_writes", "stamp": FILE
             (time.time() written before acting), "bytes": B (limit_writes)}]
    no_space: from then on this process cannot create a directory in the checkpoint folder
              (ENOSPC, as a full local disk): the next save's probe fails there only.
    limit_writes: from then on a write of this process past B bytes in one file fails
                  (RLIMIT_FSIZE, EFBIG; SIGXFSZ ignored): the next save's probe (4 KiB)
                  passes and its array files fail midway on orbax's writer threads.
  hang_rename_step: S -> the commit (tmp dir -> final rename) of checkpoint S blocks forever,
                     after writing FILE hang_marker.
  dump_params: FILE -> process 0 saves the final params (all processes gathered) to FILE.npz.
  """
  spec = json.loads(os.environ.get("LCA_TEST_CHILD", "{}"))
  import jax  # pylint: disable=g-import-not-at-top

  from lca_jax.cli import train as cli  # pylint: disable=g-import-not-at-top
  from lca_jax.train import loop  # pylint: disable=g-import-not-at-top

  if spec.get("hang_rename_step") is not None:
    from orbax.checkpoint._src.path import async_path  # pylint: disable=g-import-not-at-top

    real_rename = async_path.rename
    target = str(spec["hang_rename_step"])

    async def rename(src, dst):
      if os.path.basename(str(dst)) == target:
        with open(spec["hang_marker"], "w") as f:
          f.write(str(src))
        time.sleep(3600)
      return await real_rename(src, dst)

    async_path.rename = rename

  def no_space(workdir):
    import errno  # pylint: disable=g-import-not-at-top

    folder = os.path.join(os.path.abspath(workdir), "checkpoints")

    def refuse(fn):
      def f(p, *args, **kw):
        if os.path.dirname(os.path.abspath(os.fspath(p))).startswith(folder):
          raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(p))
        return fn(p, *args, **kw)

      return f

    os.makedirs, os.mkdir = refuse(os.makedirs), refuse(os.mkdir)

  def act(a, workdir):
    if a.get("stamp"):
      with open(a["stamp"], "w") as f:
        f.write(repr(time.time()))
    what = a["do"]
    if what == "sigterm_self":
      os.kill(os.getpid(), signal.SIGTERM)
    elif what == "sigterm_parent":
      os.kill(os.getppid(), signal.SIGTERM)
    elif what == "sigkill_self":
      sys.stderr.flush()
      os.kill(os.getpid(), signal.SIGKILL)
    elif what == "hang":
      time.sleep(3600)
    elif what == "no_space":
      no_space(workdir)
    elif what == "limit_writes":
      import resource  # pylint: disable=g-import-not-at-top

      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
      hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
      resource.setrlimit(resource.RLIMIT_FSIZE, (a["bytes"], hard))

  real = loop.train_and_evaluate

  def train_and_evaluate(config, workdir, **kw):
    pid = jax.process_index()

    def on_step(step, batch):
      del batch
      for a in spec.get("actions", []):
        if a["step"] == step and a.get("process", pid) == pid:
          act(a, workdir)

    res = real(config, workdir, on_step=on_step, **kw)
    if spec.get("dump_params"):
      import numpy as np  # pylint: disable=g-import-not-at-top
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

      flat = jax.tree_util.tree_leaves_with_path(res.state.params)
      arrays = {
        jax.tree_util.keystr(k): np.asarray(multihost_utils.process_allgather(v, tiled=True))
        for k, v in flat
      }
      if pid == 0:
        np.savez(spec["dump_params"], **arrays)
    return res

  loop.train_and_evaluate = train_and_evaluate
  return cli.main(argv)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
  sys.exit(_child_main(sys.argv[2:]))


# ---- helpers shared with tests/test_fault_tolerance.py -----------------------------------
def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(devices: int, spec=None, **extra) -> dict:
  """Environment of a child process: CPU with ``devices`` fake devices, the test XLA cache,
  most optimizations off (JAX_DISABLE_MOST_OPTIMIZATIONS, inherited from conftest.py),
  LCA_TRAIN = this file's child driver."""
  env = dict(os.environ)
  for k in (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "JAX_LOCAL_DEVICE_IDS",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_JOB_NODELIST",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "CUDA_VISIBLE_DEVICES",
  ):
    env.pop(k, None)
  env.update(
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
    PYTHONPATH=ROOT,
    PYTHON=PY,
    PYTHONUNBUFFERED="1",
    LCA_TRAIN=f"{PY} {THIS} --child",
    LCA_TEST_CHILD=json.dumps(spec or {}),
  )
  cache = os.environ.get("LCA_JAX_TEST_XLA_CACHE", "0")  # opt-in, as in conftest.py
  if cache not in ("", "0"):
    env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
  env.update({k: str(v) for k, v in extra.items()})
  return env


def train_args(workdir, *overrides) -> list:
  return ["--config", CONFIG, "--workdir", str(workdir)] + [
    f"--config.{o}" for o in TINY + list(overrides)
  ]


class Proc:
  """A child process in its own session, output to a log file."""

  def __init__(self, cmd, env, log, cwd=ROOT):
    self.log = str(log)
    self._f = open(self.log, "wb")
    self.p = subprocess.Popen(
      cmd, env=env, cwd=cwd, stdout=self._f, stderr=subprocess.STDOUT, start_new_session=True
    )
    self.t0 = time.time()

  def wait(self, timeout=400):
    try:
      rc = self.p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.kill()
      raise AssertionError(f"{self.p.args} did not finish in {timeout}s:\n{self.output()[-3000:]}")
    finally:
      self._f.close()
    return rc

  def kill(self):
    try:
      os.killpg(self.p.pid, signal.SIGKILL)  # the group of the process this test started
    except ProcessLookupError:
      pass
    self.p.wait()

  def output(self) -> str:
    with open(self.log, "rb") as f:
      return f.read().decode(errors="replace")


def clean_log(text: str) -> str:
  """Drop gloo / absl chatter."""
  return "\n".join(
    l
    for l in text.splitlines()
    if "[Gloo]" not in l and not l.lstrip("[]0123456789 ").startswith(("I0", "W0"))
  )


def metrics(workdir) -> list:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(l) for l in f]


# ---- tests --------------------------------------------------------------------------------
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from lca_jax.train import distributed as dist  # noqa: E402

STEPS = 4


def test_resolve_explicit_and_env():
  env = {
    "JAX_COORDINATOR_ADDRESS": "h0:1234",
    "JAX_NUM_PROCESSES": "4",
    "JAX_PROCESS_ID": "3",
    "JAX_LOCAL_DEVICE_IDS": "2,3",
  }
  c = dist.resolve(env=env)
  assert (c.coordinator, c.num_processes, c.process_id, c.local_device_ids) == (
    "h0:1234",
    4,
    3,
    (2, 3),
  )
  c = dist.resolve("h1:9", 2, 1, "0", heartbeat_timeout=7, env=env)  # flags win
  assert (
    c.coordinator,
    c.num_processes,
    c.process_id,
    c.local_device_ids,
    c.heartbeat_timeout,
  ) == ("h1:9", 2, 1, (0,), 7)
  assert dist.wanted({"JAX_NUM_PROCESSES": "2"}) and not dist.wanted({"SLURM_NTASKS": "1"})
  with pytest.raises(dist.DistributedError, match=r"process id 5 is not in \[0, 2\)"):
    dist.resolve("h:1", 2, 5, env={})
  with pytest.raises(dist.DistributedError, match="HOST:PORT"):
    dist.resolve("h", 2, 0, env={})


def test_resolve_slurm():
  assert dist.parse_nodelist("gpu[003-005,010],login1") == [
    "gpu003",
    "gpu004",
    "gpu005",
    "gpu010",
    "login1",
  ]
  assert dist.parse_nodelist("a[1-2]b[3-4]") == ["a1b3", "a1b4", "a2b3", "a2b4"]
  base = {
    "SLURM_NTASKS": "32",
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_ID": "77",
    "SLURM_JOB_NODELIST": "node[07-10]",
    "SLURM_NTASKS_PER_NODE": "8",
    "PATH": "",
  }
  c = dist.resolve(env=dict(base, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"))
  assert (c.coordinator, c.num_processes, c.process_id) == ("node07:61517", 32, 9)
  assert c.local_device_ids == (1,)  # all 8 GPUs visible to each of 8 tasks: its own one
  c = dist.resolve(env=dict(base, CUDA_VISIBLE_DEVICES="5"))  # SLURM bound one GPU per task
  assert c.local_device_ids is None
  c = dist.resolve(
    env=dict(
      base,
      SLURM_NTASKS_PER_NODE="4",
      LCA_COORDINATOR_PORT="4000",
      CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7",
    )
  )
  assert c.coordinator == "node07:4000" and c.local_device_ids == (2, 3)
  one_per_node = {k: v for k, v in base.items() if k != "SLURM_NTASKS_PER_NODE"}
  c = dist.resolve(
    env=dict(one_per_node, SLURM_NTASKS="4", SLURM_PROCID="3", SLURM_TASKS_PER_NODE="1(x4)")
  )
  assert c.num_processes == 4 and c.local_device_ids is None


def _fake_slurm_bin(tmp_path) -> str:
  """Stand-ins for srun (SLURM_NTASKS local tasks with SLURM_PROCID / SLURM_LOCALID) and
  scontrol (show hostnames -> localhost)."""
  b = tmp_path / "bin"
  b.mkdir()
  (b / "scontrol").write_text('#!/bin/sh\necho localhost\n')
  (b / "srun").write_text(
    '#!/usr/bin/env bash\n'
    'while [[ "$1" == -* ]]; do shift; done\n'
    'pids=(); for ((i = 0; i < SLURM_NTASKS; i++)); do\n'
    '  SLURM_PROCID=$i SLURM_LOCALID=$i "$@" & pids+=($!); done\n'
    'rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc\n'
  )
  for f in b.iterdir():
    f.chmod(0o755)
  return str(b)


def test_launchers_dry_run(tmp_path):
  env = child_env(
    2,
    PATH=_fake_slurm_bin(tmp_path) + os.pathsep + os.environ["PATH"],
    SLURM_JOB_NODELIST="gpu[1-4]",
    SLURM_NTASKS="16",
    SLURM_PROCID="5",
    SLURM_LOCALID="1",
    SLURM_NTASKS_PER_NODE="4",
    SLURM_JOB_ID="100",
    CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7",
    LCA_TRAIN="lca-train",
  )
  run = lambda *a: (
    subprocess.run(
      ["bash", os.path.join(ROOT, "launch", "multiprocess.sh"), *a],
      env=env,
      capture_output=True,
      text=True,
      check=True,
    ).stdout
  )
  out = run("--slurm", "--dry-run", "--", "--config", "c")
  assert (
    "lca-train --coordinator localhost:61540 --num-processes 16 --process-id 5 "
    "--local-device-ids 2\\,3 --config c" in out
  )
  out = run(
    "--local",
    "2",
    "--devices-per-process",
    "2",
    "--port",
    "999",
    "--dry-run",
    "--",
    "--workdir",
    "w",
  )
  assert (
    "--coordinator 127.0.0.1:999 --num-processes 2 --process-id 1 --local-device-ids 2\\,3" in out
  )
  out = run(
    "--coordinator",
    "h:5",
    "--num-processes",
    "3",
    "--process-id",
    "2",
    "--heartbeat-timeout",
    "9",
    "--dry-run",
    "--",
    "--workdir",
    "w",
  )
  assert (
    "--coordinator h:5 --num-processes 3 --process-id 2 --heartbeat-timeout 9 --workdir w" in out
  )


_FAKE_TRAIN = """
import os, signal, sys, time
pid, d = os.environ["JAX_PROCESS_ID"], sys.argv[-1]
def term(*_):
  open(os.path.join(d, "term" + pid), "w").close()
  sys.exit(0)
signal.signal(signal.SIGTERM, term)
open(os.path.join(d, "ready" + pid), "w").close()
if os.environ.get("FAIL_ID") == pid:
  sys.exit(7)
time.sleep(60)
"""


@pytest.mark.parametrize("case", ["sigterm", "failure"])
def test_local_launcher_signals_and_failures(tmp_path, case):
  """multiprocess.sh --local: SIGTERM reaches every process (exit 0); a failing process makes
  the launcher exit with its status and kill the others after LCA_FAIL_GRACE seconds."""
  script = tmp_path / "fake_train.py"
  script.write_text(_FAKE_TRAIN)
  env = child_env(
    1,
    LCA_TRAIN=f"{PY} {script}",
    LCA_FAIL_GRACE="1",
    **({"FAIL_ID": "1"} if case == "failure" else {}),
  )
  p = Proc(
    ["bash", os.path.join(ROOT, "launch", "multiprocess.sh"), "--local", "3", "--", str(tmp_path)],
    env,
    tmp_path / "launcher.log",
  )
  deadline = time.time() + 30
  while not all((tmp_path / f"ready{i}").exists() for i in range(3)):
    assert time.time() < deadline and p.p.poll() in (None, 7), p.output()
    time.sleep(0.1)
  if case == "sigterm":
    time.sleep(0.3)
    p.p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 0, p.output()
    assert all((tmp_path / f"term{i}").exists() for i in range(3)), p.output()
  else:
    t0 = time.time()
    assert p.wait(timeout=30) == 7, p.output()
    assert time.time() - t0 < 15
    assert "process 1 exited with status 7" in p.output()
    assert "still running 1s after a failure: killing it" in p.output()


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
  """launch/slurm.sbatch (2 tasks) trains; process 1 gets SIGTERM before step index 1 -> both
  stop after step 2 with a checkpoint; launch/multiprocess.sh --local 2 resumes to STEPS."""
  tmp = tmp_path_factory.mktemp("mh")
  wd = tmp / "wd"
  env = child_env(
    2,
    {"actions": [{"step": 1, "process": 1, "do": "sigterm_self"}]},
    PATH=_fake_slurm_bin(tmp) + os.pathsep + os.environ["PATH"],
    SLURM_JOB_NODELIST="localhost",
    SLURM_NTASKS="2",
    SLURM_NTASKS_PER_NODE="2",
    SLURM_JOB_ID="1",
    SLURM_SUBMIT_DIR=ROOT,
    LCA_COORDINATOR_PORT=free_port(),
    LCA_HEARTBEAT_TIMEOUT="20",
  )
  t0 = time.time()
  first = Proc(
    ["bash", os.path.join(ROOT, "launch", "slurm.sbatch")]
    + train_args(wd, f"train.steps={STEPS}", *MESH4),
    env,
    tmp / "first.log",
  )
  rc1 = first.wait()
  out1 = clean_log(first.output())
  ckpt_after_stop = sorted(os.listdir(wd / "checkpoints")) if (wd / "checkpoints").exists() else []
  metrics_after_stop = metrics(wd) if (wd / "metrics.jsonl").exists() else []
  t1 = time.time()
  dump = tmp / "params.npz"
  env2 = child_env(2, {"dump_params": str(dump)})
  second = Proc(
    [
      "bash",
      os.path.join(ROOT, "launch", "multiprocess.sh"),
      "--local",
      "2",
      "--heartbeat-timeout",
      "20",
      "--",
    ]
    + train_args(wd, f"train.steps={STEPS}", *MESH4),
    env2,
    tmp / "second.log",
  )
  rc2 = second.wait()
  out2 = clean_log(second.output())
  print(f"two-process runs: {t1 - t0:.0f}s (SIGTERM), {time.time() - t1:.0f}s (resume)")
  return dict(
    workdir=str(wd),
    rc1=rc1,
    out1=out1,
    rc2=rc2,
    out2=out2,
    dump=str(dump),
    ckpt_after_stop=ckpt_after_stop,
    metrics_after_stop=metrics_after_stop,
  )


def test_sigterm_stops_all_processes_at_one_step(two_process_run):
  r = two_process_run
  assert r["rc1"] == 0, r["out1"][-3000:]
  # Only process 1 was signalled; both stopped after step 2 with one checkpoint.
  assert r["out1"].count("lca-train: stopped at step 2 (checkpoint saved; rerun to resume)") == 2, (
    r["out1"][-3000:]
  )
  assert "coordinator localhost:" in r["out1"]  # from the SLURM node list
  assert r["ckpt_after_stop"] == ["2"]
  assert [m["step"] for m in r["metrics_after_stop"]] == [1, 2]


def test_resume_two_processes(two_process_run):
  r = two_process_run
  assert r["rc2"] == 0, r["out2"][-3000:]
  assert "resumed from step 2" in r["out2"]
  assert r["out2"].count(f"done at step {STEPS}") == 2
  assert [m["step"] for m in metrics(r["workdir"])] == list(range(1, STEPS + 1))


def _reference(steps):
  """One process, 4 devices, same mesh, fed the global batches of the 2-process run (rows of
  process 0's shard of the data, then process 1's, per micro-batch)."""
  import jax  # pylint: disable=g-import-not-at-top

  from lca_jax import configs_io  # pylint: disable=g-import-not-at-top
  from lca_jax.data import pipeline as dp  # pylint: disable=g-import-not-at-top
  from lca_jax.train import inputs, loop  # pylint: disable=g-import-not-at-top
  from lca_jax.train import sharding as shd  # pylint: disable=g-import-not-at-top

  cfg = configs_io.apply_overrides(
    configs_io.load_config(CONFIG), TINY + MESH4 + [f"train.steps={steps}"]
  )
  setup = loop.prepare(cfg, jax.devices()[:4])
  p = setup.plan
  src = inputs.data_sources(cfg)["train"]
  pipes = [
    dp.make_pipeline(
      src["files"],
      batch_size=p.rows // 2,
      seed=int(cfg.train.seed),
      shuffle=True,
      shard_index=i,
      shard_count=2,
      **inputs._pipeline_kwargs(cfg, src),
    )
    for i in range(2)
  ]  # pylint: disable=protected-access
  state = setup.init_state()
  losses = []
  try:
    with shd.mesh_context(setup.mesh):
      for _ in range(steps):
        hosts = [next(q) for q in pipes]
        merged = {
          k: np.concatenate(
            [h[k].reshape(p.accum, p.micro // 2, p.seq_len) for h in hosts], axis=1
          ).reshape(p.rows, p.seq_len)
          for k in hosts[0]
        }
        state, m = setup.train_step(state, setup.device_batch(merged))
        losses.append(float(m["loss"]))
  finally:
    for q in pipes:
      q.close()
  return losses, jax.device_get(state.params)


def test_two_processes_match_one_process_and_load(two_process_run):
  import jax  # pylint: disable=g-import-not-at-top
  from conftest import assert_close_rel  # pylint: disable=g-import-not-at-top

  import lca_jax  # pylint: disable=g-import-not-at-top

  r = two_process_run
  assert r["rc1"] == 0 and r["rc2"] == 0, (r["out1"][-2000:], r["out2"][-2000:])
  losses, ref_params = _reference(STEPS)
  got = [m["loss"] for m in metrics(r["workdir"])]
  # Cross-process all-reduces (gloo) sum in another order than one process: ~1e-7 apart.
  assert_close_rel(got, losses)
  model = lca_jax.load(r["workdir"])  # one process, one device
  loaded = {
    jax.tree_util.keystr(k): np.asarray(v)
    for k, v in jax.tree_util.tree_leaves_with_path(model.params)
  }
  dumped = dict(np.load(r["dump"]))
  assert sorted(loaded) == sorted(dumped)
  for k in loaded:  # the checkpoint holds exactly what the two processes ended with
    np.testing.assert_array_equal(loaded[k], dumped[k], err_msg=k)
  for a, b in zip(jax.tree_util.tree_leaves(model.params), jax.tree_util.tree_leaves(ref_params)):
    assert_close_rel(a, b)


def test_resume_with_other_process_count_is_a_clear_error(two_process_run, tmp_path):
  """The data position is per process: resuming the 2-process run in 1 process is refused in
  one message (and no checkpoint is touched)."""
  import jax  # pylint: disable=g-import-not-at-top

  from lca_jax import configs_io  # pylint: disable=g-import-not-at-top
  from lca_jax.train import loop  # pylint: disable=g-import-not-at-top
  from lca_jax.train.run_config import ConfigMismatchError  # pylint: disable=g-import-not-at-top

  wd = str(tmp_path / "copy")
  shutil.copytree(two_process_run["workdir"], wd)
  before = sorted(os.listdir(os.path.join(wd, "checkpoints")))
  cfg = configs_io.apply_overrides(
    configs_io.load_config(CONFIG), TINY + MESH4 + [f"train.steps={STEPS + 2}"]
  )
  with pytest.raises(ConfigMismatchError, match="written by 2 processes, this run has 1"):
    loop.train_and_evaluate(cfg, wd, devices=jax.devices()[:4])
  assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == before
