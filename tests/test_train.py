"""Training system: loss goes down, exact resume, SIGTERM, sharded step == 1 device, NaN stop,
CLI errors. Tiny model (d 32, T 32) on the bundled demo corpus, 8 fake CPU devices."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from conftest import TRAIN_TINY, assert_close_rel, assert_trees_equal, host_params  # noqa: E402

from lca_jax import configs_io  # noqa: E402
from lca_jax.cli import train as cli  # noqa: E402
from lca_jax.train import checkpoint as ckpt_lib  # noqa: E402
from lca_jax.train import (  # noqa: E402
  inputs,  # noqa: E402
  loop,  # noqa: E402
  optim,
  run_config,
)
from lca_jax.train import sharding as shd  # noqa: E402
from lca_jax.train.errors import NonFiniteLossError  # noqa: E402

TINY = TRAIN_TINY
N = 3  # exact-resume tests: 2N steps straight vs N + N


def tiny_config(*overrides):
  c = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_lca_mbp.py"))
  return configs_io.apply_overrides(c, TINY + list(overrides))


class Recorder:
  """on_step hook recording (step, ids) of every batch trained on."""

  def __init__(self, fire_at=None, action=None):
    self.batches, self.fire_at, self.action = [], fire_at, action

  def __call__(self, step, batch):
    self.batches.append((step, batch["ids"].copy()))
    if step == self.fire_at:
      self.action(batch)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """2N steps in one run (the reference for the resume tests)."""
  wd = str(tmp_path_factory.mktemp("straight"))
  rec = Recorder()
  res = loop.train_and_evaluate(tiny_config(f"train.steps={2 * N}"), wd, on_step=rec)
  return dict(workdir=wd, params=host_params(res.state), batches=rec.batches, result=res)


def test_loss_decreases(tmp_path):
  res = loop.train_and_evaluate(tiny_config("train.steps=40"), str(tmp_path))
  assert res.step == 40 and not res.stopped
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [l["step"] for l in lines] == list(range(1, 41))
  for key in (
    "loss",
    "bpb_ntp",
    "bpb_mbp",
    "bp_loss",
    "bytes_per_latent",
    "overflow",
    "lr",
    "grad_norm",
    "bytes_per_s",
    "step_time",
  ):
    assert key in lines[0]
  first = np.mean([l["loss"] for l in lines[:5]])
  last = np.mean([l["loss"] for l in lines[-5:]])
  assert last < first - 0.5, (first, last)
  assert lines[-1]["bpb_ntp"] < lines[0]["bpb_ntp"]
  assert ckpt_lib.Checkpointer(str(tmp_path), read_only=True).all_steps() == [40]


def test_exact_resume(tmp_path, straight):
  wd = str(tmp_path)
  rec = Recorder()
  first = loop.train_and_evaluate(tiny_config(f"train.steps={N}"), wd, on_step=rec)
  assert first.step == N
  # a work directory written before train.tensorboard / async_checkpointing / peak_tflops
  # existed: its train_config.json lacks them and still resumes
  path = os.path.join(wd, "train_config.json")
  with open(path) as f:
    saved = json.load(f)
  for key in ("tensorboard", "async_checkpointing", "peak_tflops"):
    del saved["config"]["train"][key]
  with open(path, "w") as f:
    json.dump(saved, f)
  second = loop.train_and_evaluate(tiny_config(f"train.steps={2 * N}"), wd, on_step=rec)
  assert second.step == 2 * N
  assert [s for s, _ in rec.batches] == list(range(2 * N))
  for (_, a), (_, b) in zip(rec.batches, straight["batches"]):
    np.testing.assert_array_equal(a, b)
  assert_trees_equal(host_params(second.state), straight["params"])
  steps = [json.loads(l)["step"] for l in open(os.path.join(wd, "metrics.jsonl"))]
  assert steps == list(range(1, 2 * N + 1))


def test_sigterm_checkpoints_and_resumes(tmp_path, straight):
  wd = str(tmp_path)
  cfg = tiny_config(f"train.steps={2 * N}")
  rec = Recorder(fire_at=N - 1, action=lambda _: os.kill(os.getpid(), signal.SIGTERM))
  before = signal.getsignal(signal.SIGTERM)
  res = loop.train_and_evaluate(cfg, wd, on_step=rec)
  assert res.stopped and res.step == N
  assert ckpt_lib.Checkpointer(wd, read_only=True).all_steps() == [N]
  assert signal.getsignal(signal.SIGTERM) is before  # our handler is removed again
  res2 = loop.train_and_evaluate(cfg, wd, on_step=rec)
  assert res2.step == 2 * N and not res2.stopped
  for (_, a), (_, b) in zip(rec.batches, straight["batches"]):
    np.testing.assert_array_equal(a, b)
  assert_trees_equal(host_params(res2.state), straight["params"])


@pytest.mark.parametrize("scan_min_layers", [8, 2])  # 2: the LM and LCA stacks run as scans
def test_sharded_step_matches_single_device(scan_min_layers):
  batches = [{k: np.asarray(v) for k, v in b.items()} for b in _batches(2)]
  results = []
  for mesh, devs in (
    (("mesh.data=1",), jax.devices()[:1]),
    (("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"), jax.devices()),
  ):
    scan = f"model.scan_min_layers={scan_min_layers}"
    setup = loop.prepare(tiny_config("train.steps=10", scan, *mesh), devs)
    state = setup.init_state()
    losses = []
    with shd.mesh_context(setup.mesh):
      for b in batches:
        state, m = setup.train_step(state, setup.device_batch(b))
        losses.append(float(m["loss"]))
    if len(devs) == 8:  # really sharded: embed over fsdp, heads over tensor
      spec = state.params["lm"]["layer_0"]["attn"]["q_proj"]["kernel"].sharding.spec
      assert tuple(spec) == ("fsdp", "tensor")
    results.append((losses, host_params(state)))
  assert_close_rel(results[0][0], results[1][0])
  for x, y in zip(
    jax.tree_util.tree_leaves(results[0][1]), jax.tree_util.tree_leaves(results[1][1])
  ):
    assert_close_rel(x, y)


def test_data_parallel_step_gathers_nothing():
  """Rows split over devices (data only, parameters replicated) need no all-gather: every
  stage is row-local, only gradients and the attention's batch-wide tile schedules are
  reduced. A scatter written with explicit row indices (``x.at[arange(b)[:, None], idx]``) made
  XLA gather the whole [B, T] batch onto every device, one sync point per step."""
  setup = loop.prepare(tiny_config("train.steps=10", "mesh.data=2"), jax.devices()[:2])
  state = setup.init_state()
  batch = setup.device_batch({k: np.asarray(v) for k, v in _batches(1)[0].items()})
  with shd.mesh_context(setup.mesh):
    text = setup.train_step.lower(state, batch).compile().as_text()
  assert "all-reduce" in text  # really split (the gradients are reduced)
  gathers = [line.strip()[:160] for line in text.splitlines() if " all-gather(" in line]
  assert not gathers, gathers


def _batches(n):
  cfg = tiny_config()
  setup_plan = inputs.plan_batches(cfg, shd.make_mesh(cfg.mesh, jax.devices()[:1]))
  pipe = inputs.make_train_pipeline(cfg, setup_plan)
  try:
    return [next(pipe) for _ in range(n)]
  finally:
    pipe.close()


def test_nonfinite_loss_stops_without_checkpoint(tmp_path):
  def poison(batch):
    batch["ids"][:] = 10**6  # out-of-range ids: NaN embeddings

  cfg = tiny_config("train.steps=6", "train.checkpoint_every=2")
  with pytest.raises(NonFiniteLossError, match="non-finite loss at step 4"):
    loop.train_and_evaluate(cfg, str(tmp_path), on_step=Recorder(fire_at=3, action=poison))
  assert ckpt_lib.Checkpointer(str(tmp_path), read_only=True).all_steps() == [2]


# ---- CLI errors: one line, no traceback ---------------------------------------------------
def run_cli(capsys, workdir, *overrides):
  code = cli.main(
    ["--config", os.path.join(ROOT, "configs", "tiny_lca_mbp.py"), "--workdir", str(workdir)]
    + [f"--config.{o}" for o in TINY + list(overrides)]
  )
  err = capsys.readouterr().err.strip()
  return code, err


def test_cli_full_disk_for_metrics_stops_in_one_line(tmp_path, capsys):
  """metrics.jsonl on a full device (/dev/full: every write fails with ENOSPC): exit 2, one
  line naming the file and the problem, no traceback."""
  if not os.path.exists("/dev/full"):
    pytest.skip("no /dev/full")
  wd = tmp_path / "w"
  wd.mkdir()
  os.symlink("/dev/full", wd / "metrics.jsonl")
  code, err = run_cli(capsys, wd, "train.steps=2")
  last = err.splitlines()[-1]
  assert code == 2, err
  assert last.startswith("lca-train: error: cannot append step 1 to "), err
  assert "metrics.jsonl" in last and "No space left on device" in last, err
  assert "Traceback" not in err, err


def test_cli_header_names_the_attention_and_an_old_xla_workdir_resumes(tmp_path, capsys):
  """The first line says which attention runs: an explicit choice as it is, the default "auto"
  resolved for this host ("xla (auto)" on the CPU). A work directory saved with
  attention_impl "xla" (the default before "auto") resumes under the default, and its saved
  config then records the config's own value, "auto"."""
  wd = tmp_path / "w"
  code, err = run_cli(capsys, wd, "train.steps=1", "model.attention_impl=xla")
  assert code == 0, err
  first = err.splitlines()[0]
  assert first.startswith("lca-train: ") and first.endswith(", attention xla"), err
  code, err = run_cli(capsys, wd, "train.steps=2")
  assert code == 0, err
  first = err.splitlines()[0]
  assert "steps 1->2" in first and first.endswith(", attention xla (auto)"), err
  with open(wd / run_config.CONFIG_FILE) as f:
    saved = json.load(f)
  assert saved["model"]["attention_impl"] == saved["config"]["model"]["attention_impl"] == "auto"


def _logged_lrs(workdir) -> dict:
  """step -> the learning rate metrics.jsonl logged for it (the schedule at step - 1)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {line["step"]: line["lr"] for line in map(json.loads, f)}


def _resume_warning(capsys, workdir, *overrides) -> str:
  """The one ScheduleWarning of an lca-train run that must succeed, as one line."""
  with pytest.warns(run_config.ScheduleWarning) as caught:
    code, err = run_cli(capsys, workdir, *overrides)
  assert code == 0, err
  (warning,) = [str(w.message) for w in caught if w.category is run_config.ScheduleWarning]
  assert "\n" not in warning
  return warning


@pytest.mark.slow
def test_a_longer_resume_keeps_its_learning_rate_schedule(tmp_path, capsys):
  """lca-train resumed with a larger train.steps, optim.decay_steps 0 (the horizon follows
  train.steps): one warning line, and the learning rate of the resumed steps is the original
  schedule's; an explicit optim.decay_steps moves the horizon, with a warning."""
  wd = tmp_path / "wd"
  code, err = run_cli(capsys, wd, "train.steps=4", "optim.decay_steps=0")
  assert code == 0, err
  warning = _resume_warning(capsys, wd, "train.steps=6", "optim.decay_steps=0")
  assert "keeps the learning-rate schedule" in warning and "horizon 4 steps" in warning
  assert "optim.decay_steps=6" in warning
  base = tiny_config("optim.decay_steps=0").optim
  kept, stretched = optim.make_schedule(base, 4), optim.make_schedule(base, 6)
  lrs = _logged_lrs(wd)
  assert sorted(lrs) == list(range(1, 7))
  for step in (5, 6):
    assert lrs[step] == pytest.approx(float(kept(step - 1)), rel=1e-6)
    assert lrs[step] != pytest.approx(float(stretched(step - 1)), rel=1e-3)

  warning = _resume_warning(capsys, wd, "train.steps=8", "optim.decay_steps=8")
  assert "optim.decay_steps=8 moves the learning-rate schedule" in warning
  assert "from 4 to 8 steps" in warning
  lrs = _logged_lrs(wd)
  for step in (7, 8):
    assert lrs[step] == pytest.approx(float(optim.make_schedule(base, 8)(step - 1)), rel=1e-6)


def test_cli_unknown_config_key(tmp_path, capsys):
  code, err = run_cli(capsys, tmp_path, "train.no_such_key=3")
  assert code == 2 and "unknown config key: train.no_such_key" in err
  assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
  "overrides,needle",
  [
    (("data.train_files=/nonexistent/dir/*.parquet", "data.format=parquet"), "no files match"),
    (("train.global_batch_bytes=1000",), "not a multiple of train.micro_batch_size * data.seq_len"),
    (("train.micro_batch_size=4", "train.global_batch_bytes=256"), "cannot be divided over the 8"),
    (("mesh.data=3",), "mesh"),
  ],
)
def test_cli_clear_errors(tmp_path, capsys, overrides, needle):
  wd = tmp_path / "wd"
  code, err = run_cli(capsys, wd, *overrides)
  assert code == 2 and needle in err, err
  assert "Traceback" not in err and len(err.splitlines()) == 1
  if needle == "no files match":  # found before the work directory is created
    assert not wd.exists()


def test_cli_unwritable_workdir(tmp_path, capsys):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  code, err = run_cli(capsys, blocker / "sub")
  assert code == 2 and "cannot write to workdir" in err and len(err.splitlines()) == 1


def test_cli_config_mismatch_names_fields(straight, capsys):
  code, err = run_cli(
    capsys, straight["workdir"], f"train.steps={2 * N}", "model.d_inner=128", "optim.lr=1e-3"
  )
  assert code == 2 and "does not match the checkpoint" in err
  assert "model.d_inner: checkpoint 64, now 128" in err and "optim.lr" in err
  assert len(err.splitlines()) == 1


def test_cli_no_usable_record_stops_in_one_line(tmp_path, capsys):
  """A jsonl whose every line is invalid: exit 2 with one line naming the file (no endless
  loop over new epochs)."""
  bad = tmp_path / "bad.jsonl"
  bad.write_bytes(b"not json\n" * 30 + b'{"body": "no text key"}\n' * 5)
  code, err = run_cli(
    capsys, tmp_path / "wd", f"data.train_files={bad}", "data.format=jsonl", "train.steps=3"
  )
  last = err.splitlines()[-1]
  assert code == 2 and last.startswith(f"lca-train: error: no usable document in {bad}: "), err
  assert "a whole epoch of its 35 records was skipped (bad_json " in last, last
  assert "not_string" in last and "Traceback" not in err


def test_cli_trains_on_non_utf8_text_and_counts_skipped_records(tmp_path, capsys):
  """Latin-1 text and random bytes are bytes to train on (exit 0); a jsonl's bad lines are
  skipped, and their count is in metrics.jsonl (an integer, cumulative) and the summary line."""
  latin = tmp_path / "latin1.txt"
  latin.write_bytes(
    ("Voil\u00e0 un texte en fran\u00e7ais, cod\u00e9 en Latin-1.\n\n" * 20).encode("latin-1")
  )
  noise = tmp_path / "noise.txt"
  noise.write_bytes(np.random.default_rng(0).bytes(4000))
  code, err = run_cli(
    capsys,
    tmp_path / "wd1",
    f"data.train_files={latin},{noise}",
    "data.format=text",
    "train.steps=2",
  )
  assert code == 0 and "lca-train: done at step 2" in err and "skipped" not in err, err
  mixed = tmp_path / "mixed.jsonl"
  with open(mixed, "wb") as f:  # ~600 bytes of documents per epoch: 3 steps read every line
    for i in range(6):
      f.write(json.dumps({"text": f"document {i} " + "words " * 15}).encode() + b"\n")
      f.write(b"{broken json\n")
  code, err = run_cli(
    capsys, tmp_path / "wd2", f"data.train_files={mixed}", "data.format=jsonl", "train.steps=3"
  )
  assert code == 0, err
  lines = [json.loads(l) for l in open(tmp_path / "wd2" / "metrics.jsonl")]
  counts = [l["skipped_records"] for l in lines]
  assert all(isinstance(c, int) for c in counts) and counts == sorted(counts) and counts[-1] >= 6
  assert f"{counts[-1]} bad records skipped (bad_json {counts[-1]})" in err.splitlines()[-1], err


def test_metrics_lines_after_resume_point_are_dropped(tmp_path):
  from lca_jax.train import metrics

  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 25, 50, 75)))
  metrics.MetricsWriter(str(tmp_path), tensorboard=False, start_step=50).close()
  assert [json.loads(l)["step"] for l in open(path)] == [1, 25, 50]


def test_prepare_reuses_compiled_steps_only_for_an_equal_compile_spec():
  """Runs that differ only outside the compiled functions (length with a fixed decay horizon,
  cadences, batch layout) share them; any input of the compiled functions makes new ones."""
  one = jax.devices()[:1]
  ref = loop.prepare(tiny_config("train.steps=10"), one)
  same = loop.prepare(
    tiny_config("train.steps=20", "train.log_every=7", "train.global_batch_bytes=256"), one
  )
  assert same.train_step is ref.train_step and same.eval_step is ref.eval_step
  assert same.plan.rows == 8 and ref.plan.rows == 16  # the plan follows each config
  for override in ("train.lambda_bp=2.0", "optim.clip_norm=1.0", "optim.decay_steps=0"):
    other = loop.prepare(tiny_config("train.steps=10", override), one)
    assert other.train_step is not ref.train_step, override
  other = loop.prepare(tiny_config("train.steps=10"), jax.devices()[1:2])
  assert other.train_step is not ref.train_step and other.mesh != ref.mesh
