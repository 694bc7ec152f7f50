"""Checkpoints: restore onto another mesh, lca_jax.load(workdir), init_from, config checks."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from conftest import TRAIN_TINY  # noqa: E402

import lca_jax  # noqa: E402
from lca_jax import configs_io  # noqa: E402
from lca_jax.train import checkpoint as ckpt_lib  # noqa: E402
from lca_jax.train import (
  loop,  # noqa: E402
  run_config,  # noqa: E402
)
from lca_jax.train.errors import TrainError  # noqa: E402
from lca_jax.workdir import params as workdir_params  # noqa: E402

# Shared with tests/test_train.py (conftest.TRAIN_TINY): both files share one compiled step.
TINY = TRAIN_TINY


def tiny_config(*overrides):
  c = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_lca_mbp.py"))
  return configs_io.apply_overrides(c, TINY + list(overrides))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """2 steps on 8 devices (mesh data=8), checkpointed at step 2."""
  wd = str(tmp_path_factory.mktemp("saved"))
  res = loop.train_and_evaluate(tiny_config("train.steps=2", "mesh.data=8"), wd)
  return dict(
    workdir=wd,
    params=jax.device_get(res.state.params),
    opt_state=jax.device_get(res.state.opt_state),
  )


def test_restore_onto_smaller_mesh(saved):
  devs = jax.devices()[:4]
  setup = loop.prepare(tiny_config("train.steps=3", "mesh.data=2", "mesh.fsdp=2"), devs)
  ck = ckpt_lib.Checkpointer(saved["workdir"], read_only=True)
  try:
    state = ck.restore(2, setup.abstract)
  finally:
    ck.close()
  assert int(state.step) == 2
  leaf = state.params["encoder"]["layer_0"]["mlp"]["up_proj"]["kernel"]
  assert set(leaf.sharding.device_set) == set(devs)
  assert tuple(leaf.sharding.spec)[0] == "fsdp"
  for a, b in zip(
    jax.tree_util.tree_leaves(jax.device_get(state.params)),
    jax.tree_util.tree_leaves(saved["params"]),
  ):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(
    jax.tree_util.tree_leaves(jax.device_get(state.opt_state)),
    jax.tree_util.tree_leaves(saved["opt_state"]),
  ):
    np.testing.assert_array_equal(a, b)


def test_resume_on_other_mesh_continues(saved, tmp_path):
  """train_and_evaluate accepts the changed mesh and resumes onto 4 devices (no steps left,
  so nothing is compiled)."""
  import shutil

  wd = str(tmp_path / "copy")
  shutil.copytree(saved["workdir"], wd)
  devs = jax.devices()[:4]
  res = loop.train_and_evaluate(
    tiny_config("train.steps=2", "mesh.data=2", "mesh.fsdp=2"), wd, devices=devs
  )
  assert res.step == 2 and not res.stopped
  leaf = res.state.params["decoder"]["layer_0"]["attn"]["q_proj"]["kernel"]
  assert set(leaf.sharding.device_set) == set(devs)
  for a, b in zip(
    jax.tree_util.tree_leaves(jax.device_get(res.state.params)),
    jax.tree_util.tree_leaves(saved["params"]),
  ):
    np.testing.assert_array_equal(a, b)


def test_load_workdir_for_inference(saved):
  assert workdir_params.is_workdir(saved["workdir"])
  model = lca_jax.load(saved["workdir"])
  assert model.cfg.d_model == 32
  for a, b in zip(
    jax.tree_util.tree_leaves(model.params), jax.tree_util.tree_leaves(saved["params"])
  ):
    assert a.dtype == np.float32 and len(a.sharding.device_set) == 1
    np.testing.assert_array_equal(np.asarray(a), b)
  out = model.forward(np.arange(3, 40, dtype=np.int32))
  assert out["ntp_logits"].shape == (37, 261) and out["boundaries"].shape == (37,)
  with pytest.raises(lca_jax.LoadError, match="no checkpoint for step 7"):
    lca_jax.load(saved["workdir"], step=7)


def test_init_from_workdir(saved, tmp_path):
  res = loop.train_and_evaluate(
    tiny_config("train.steps=0", f"train.init_from={saved['workdir']}"), str(tmp_path)
  )
  assert res.step == 0
  for a, b in zip(
    jax.tree_util.tree_leaves(jax.device_get(res.state.params)),
    jax.tree_util.tree_leaves(saved["params"]),
  ):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(TrainError, match="does not match"):
    loop.train_and_evaluate(
      tiny_config("train.steps=0", "model.d_inner=96", f"train.init_from={saved['workdir']}"),
      str(tmp_path / "other"),
    )


def test_a_checkpoint_of_another_model_is_named_and_kept(saved, tmp_path):
  """A train_config.json edited to another model (or a checkpoint copied from another work
  directory): loading and resuming name the parameters that differ in one error, before any
  restore, and the step is not taken for a corrupt one (it stays where it is)."""
  wd = str(tmp_path / "wd")
  shutil.copytree(saved["workdir"], wd)
  path = os.path.join(wd, run_config.CONFIG_FILE)
  with open(path) as f:
    rc = json.load(f)
  rc["model"]["d_inner"] = rc["config"]["model"]["d_inner"] = 96
  with open(path, "w") as f:
    json.dump(rc, f)
  words = r"checkpoint step 2 in .* holds another model's parameters than .*train_config.json"
  detail = r" describes \(\['boundary_predictor'\]\['fc1'\]\['bias'\] stored \(64,\), the model"
  with pytest.raises(lca_jax.LoadError, match=words + detail + r" has \(96,\); .*\(\+12 more\)"):
    lca_jax.load(wd)
  with pytest.raises(workdir_params.CheckpointModelError, match=words):
    loop.train_and_evaluate(tiny_config("train.steps=3", "mesh.data=8", "model.d_inner=96"), wd)
  assert sorted(os.listdir(os.path.join(wd, workdir_params.CKPT_DIR))) == ["2"]
  assert not os.path.exists(os.path.join(wd, ckpt_lib.CORRUPT_DIR))


def test_config_diff_rules():
  a = {"model": {"d_model": 32}, "train": {"steps": 10, "seed": 0}, "mesh": {"data": 8}}
  b = {"model": {"d_model": 64}, "train": {"steps": 20, "seed": 1}, "mesh": {"data": 2}}
  assert [k for k, _, _ in run_config.config_diff(a, b)] == ["model.d_model", "train.seed"]


def test_init_from_upstream_layout(tmp_path):
  import ml_collections

  src = os.path.join(ROOT, "tests", "data", "reference", "lca_small")
  ref = lca_jax.load(src)
  cfg = tiny_config("train.steps=0", f"train.init_from={src}")
  cfg.model = ml_collections.ConfigDict(ref.cfg.to_dict())
  res = loop.train_and_evaluate(cfg, str(tmp_path))
  for a, b in zip(
    jax.tree_util.tree_leaves(jax.device_get(res.state.params)),
    jax.tree_util.tree_leaves(ref.params),
  ):
    np.testing.assert_array_equal(a, np.asarray(b))
