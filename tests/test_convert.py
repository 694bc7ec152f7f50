"""Checkpoint conversion (lca_jax/interop/convert.py, lca-convert): JAX <-> the paper's layout.

Round trips are exact, the compact PyTorch module reproduces our logits on exported weights,
imported reference directories reproduce their vectors through a work directory, exports of a
reference-shaped model have the reference's names/shapes/config, bf16 works, and bad inputs
give one-line errors (exit status 2).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from conftest import (  # noqa: E402
  REF_DIR,
  REF_NAMES,
  REL_IMPL,
  VARIANTS,
  assert_close_rel,
  random_ids,
  run_cli_process,
  tiny_config,
)

import lca_jax  # noqa: E402
from lca_jax.api import Model  # noqa: E402
from lca_jax.cli import convert as cli  # noqa: E402
from lca_jax.interop import convert, hf_export, safetensors_io, upstream  # noqa: E402

# TINY_DIMS: d 32, 2 heads / 1 kv head (GQA), vocab_size 384 padding n_tokens 261.
NAMES = list(VARIANTS)


def _cfg(variant):
  return tiny_config(variant, max_seq_len=64)


def random_params(cfg, seed=0, bp_gain=3.0):
  """numpy params with O(1) activations (as conftest.random_params), from the shapes the
  converter itself computes (one trace per config)."""
  rng = np.random.default_rng(seed)

  def make(path, shape):
    names = [k.key for k in path]
    if names[-1] == "kernel":
      x = rng.standard_normal(shape) / np.sqrt(shape[0])
      x = x * bp_gain if names[:2] == ["boundary_predictor", "fc2"] else x
    elif names[-1] == "scale":
      x = 1.0 + 0.1 * rng.standard_normal(shape)
    elif names[-1] == "bias":
      x = 0.1 * rng.standard_normal(shape)
    else:  # embedding, null_group
      x = rng.standard_normal(shape)
    return x.astype(np.float32)

  return jax.tree_util.tree_map_with_path(
    make, upstream.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)
  )


@functools.lru_cache(maxsize=None)
def _params(variant):
  return random_params(_cfg(variant), seed=3)


def _sharded(params):
  """``params`` spread over an 8-device mesh (dim 0 split where it divides, else replicated)."""
  devs = np.array(jax.devices()[:8])
  mesh = jax.sharding.Mesh(devs, ("x",))
  P = jax.sharding.PartitionSpec

  def put(a):
    spec = P("x") if a.shape[0] % len(devs) == 0 else P()
    return jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))

  return jax.tree_util.tree_map(put, params)


def _real_rows(cfg, params):
  """What the upstream layout can hold: the padding rows/columns of the embedding/head zeroed."""
  out = jax.tree_util.tree_map(lambda a: np.array(a, np.float32), params)
  out["token_embedding"]["embedding"][cfg.n_tokens :] = 0
  out["head"]["kernel"][:, cfg.n_tokens :] = 0
  return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """Every variant exported (float32) from params sharded over 8 devices."""
  root = tmp_path_factory.mktemp("exported")
  out = {}
  for v in NAMES:
    sharded = _sharded(_params(v))
    leaf = sharded["encoder"]["layer_0"]["mlp"]["up_proj"]["kernel"]
    assert len(leaf.sharding.device_set) == min(8, len(jax.devices()))
    out[v] = convert.export_params(sharded, _cfg(v), str(root / v))
  return out


def _leaves(tree):
  return {
    jax.tree_util.keystr(k): np.asarray(x) for k, x in jax.tree_util.tree_leaves_with_path(tree)
  }


@pytest.mark.parametrize("variant", NAMES)
def test_round_trip_identical(exported, variant):
  cfg = _cfg(variant)
  cfg2, params2, _ = convert.read_torch_dir(exported[variant])
  assert cfg2 == cfg
  want, got = _leaves(_real_rows(cfg, _params(variant))), _leaves(params2)
  assert sorted(want) == sorted(got)
  for k in want:
    assert got[k].dtype == np.float32
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  sd = safetensors_io.read_safetensors(os.path.join(exported[variant], "model.safetensors"))
  assert sd["token_embedding.weight"].shape == sd["head.weight"].shape == (261, 32)
  assert sd["blocks.0.0.attn.k_proj.weight"].shape == (16, 32)  # GQA: 1 kv head of 16


@pytest.mark.parametrize("variant", NAMES)
def test_torch_module_matches_jax(exported, variant):
  torch = pytest.importorskip("torch")
  from lca_jax.interop.torch_model import load_torch_model  # pylint: disable=g-import-not-at-top

  cfg = _cfg(variant)
  ids = random_ids(np.random.default_rng(5), (2, 24))
  ours = Model(cfg, _params(variant)).forward(ids)
  theirs = load_torch_model(exported[variant]).forward(torch.tensor(ids, dtype=torch.long))
  for key in ("ntp_logits", "mbp_logits", "mlp_mbp_logits"):
    a, b = ours[key], theirs.get(key)
    assert (a is None) == (b is None), key
    if a is not None:
      assert_close_rel(b.numpy(), a, REL_IMPL, err_msg=key)
  if cfg.hierarchical:
    np.testing.assert_array_equal(theirs["boundaries"].numpy(), ours["boundaries"])
    assert 0 < ours["boundaries"].sum() < ours["boundaries"].size
  else:
    assert theirs["boundaries"] is None and ours["boundaries"] is None


@pytest.mark.parametrize("name", REF_NAMES)
def test_reference_dir_through_workdir(tmp_path, name):
  wd = cli.from_torch(os.path.join(REF_DIR, name), str(tmp_path / "wd"))
  model = lca_jax.load(wd)
  assert model.cfg.vocab_size == 384 and model.cfg.n_tokens == 261
  v = dict(np.load(os.path.join(REF_DIR, name, "vectors.npz")))
  t = min(len(v["input_0"]), len(v["input_1"]))
  out = model.forward(np.stack([v["input_0"][:t], v["input_1"][:t]]))
  for i in (0, 1):
    np.testing.assert_array_equal(out["boundaries"][i], v[f"boundaries_{i}"][:t])
    assert_close_rel(out["ntp_logits"][i], v[f"ntp_logits_{i}"][:t], REL_IMPL)
    if f"mbp_logits_{i}" in v:
      assert_close_rel(out["mbp_logits"][i], v[f"mbp_logits_{i}"][:t], REL_IMPL)
    else:
      assert out["mbp_logits"] is None


@pytest.mark.parametrize("name", REF_NAMES)
def test_export_has_reference_layout(tmp_path, name):
  with open(os.path.join(REF_DIR, name, "config.json")) as f:
    ref_cfg = json.load(f)
  cfg = upstream.config_from_upstream(ref_cfg, vocab_size=384)
  out = convert.export_params(random_params(cfg, seed=1), cfg, str(tmp_path / "x"))
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  with open(os.path.join(out, "config.json")) as f:
    got_cfg = json.load(f)
  assert got_cfg == ref_cfg  # same keys and, the config being the same, the same values
  ref = safetensors_io.read_safetensors(os.path.join(REF_DIR, name, "model.safetensors"))
  got = safetensors_io.read_safetensors(os.path.join(out, "model.safetensors"))
  assert {k: a.shape for k, a in got.items()} == {k: a.shape for k, a in ref.items()}
  assert {a.dtype for a in got.values()} == {np.dtype(np.float32)}
  np.testing.assert_allclose(got["rotary_embd.inv_freq"], ref["rotary_embd.inv_freq"], rtol=1e-6)


def test_bf16_export_loads_back(tmp_path):
  torch = pytest.importorskip("torch")
  from safetensors.torch import load_file  # pylint: disable=g-import-not-at-top

  from lca_jax.interop.torch_model import load_torch_model  # pylint: disable=g-import-not-at-top

  cfg, params = _cfg("lca_mbp"), _params("lca_mbp")
  out = convert.export_params(_sharded(params), cfg, str(tmp_path / "bf16"), "bfloat16")
  tsd = load_file(os.path.join(out, "model.safetensors"))
  assert tsd["blocks.3.1.attn.q_proj.weight"].dtype == torch.bfloat16
  assert tsd["rotary_embd.inv_freq"].dtype == torch.float32
  rounded = jax.tree_util.tree_map(
    lambda a: np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32), params
  )
  cfg2, back, _ = convert.read_torch_dir(out)
  assert cfg2 == cfg
  want, got = _leaves(_real_rows(cfg, rounded)), _leaves(back)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  # the bf16 file is what torch itself would write: same bits as torch's own rounding
  q = np.asarray(params["mbp"]["layer_1"]["attn"]["q_proj"]["kernel"]).T
  np.testing.assert_array_equal(
    tsd["blocks.3.1.attn.q_proj.weight"].view(torch.int16).numpy(),
    torch.tensor(np.ascontiguousarray(q)).to(torch.bfloat16).view(torch.int16).numpy(),
  )
  m = load_torch_model(out)  # strict load_state_dict into a float32 module
  res = m.forward(torch.tensor(random_ids(np.random.default_rng(0), (1, 12)), dtype=torch.long))
  assert np.isfinite(res["mbp_logits"].numpy()).all()


def test_cli_round_trip_is_byte_identical(exported, tmp_path, capsys):
  src = exported["mlp_mbp"]
  wd, back = str(tmp_path / "wd"), str(tmp_path / "back")
  assert cli.main(["from-torch", "--torch-dir", src, "--out", wd]) == 0
  assert cli.main(["to-torch", "--checkpoint", wd, "--out", back]) == 0
  for f in ("config.json", "model.safetensors"):
    with open(os.path.join(src, f), "rb") as a, open(os.path.join(back, f), "rb") as b:
      assert a.read() == b.read(), f
  # non-empty output: refused without --force, overwritten with it
  capsys.readouterr()
  assert cli.main(["to-torch", "--checkpoint", wd, "--out", back]) == 2
  err = capsys.readouterr().err
  assert "not empty" in err and "--force" in err and len(err.strip().splitlines()) == 1
  assert (
    cli.main(["to-torch", "--checkpoint", wd, "--out", back, "--force", "--dtype", "bfloat16"]) == 0
  )
  assert cli.main(["from-torch", "--torch-dir", back, "--out", wd]) == 2
  assert cli.main(["from-torch", "--torch-dir", back, "--out", wd, "--force"]) == 0
  capsys.readouterr()
  assert cli.main(["from-torch", "--torch-dir", wd, "--out", back, "--force"]) == 2
  assert "holds an upstream checkpoint" in capsys.readouterr().err
  assert cli.main(["to-torch", "--checkpoint", back, "--out", wd, "--force"]) == 2
  assert "is an lca-train work directory" in capsys.readouterr().err
  assert lca_jax.load(wd).cfg == _cfg("mlp_mbp")


def test_hf_export_reads_back(exported, tmp_path):
  """A to-hf export is read back by lca_jax.load, lca-sample, from-hf and from-torch: the
  exported parameters bit for bit, the same greedy decode."""
  src, hf = exported["lca_mbp"], str(tmp_path / "hf")
  assert cli.main(["to-hf", "--checkpoint", src, "--out", hf]) == 0
  model, back = lca_jax.load(src), lca_jax.load(hf)
  assert back.cfg == model.cfg
  want, got = _leaves(model.params), _leaves(back.params)
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)

  prompt = "The quick brown"
  ref = model.generate(prompt, max_bytes=12, ignore_eos=True).ids[0].tolist()
  p = run_cli_process(
    "lca_jax.cli.sample", "--checkpoint", hf, "--prompt", prompt, "--max-bytes", "12"
  )
  assert p.returncode == 0, p.stderr
  p = run_cli_process(
    "lca_jax.cli.sample",
    "--checkpoint",
    hf,
    "--prompt",
    prompt,
    "--max-bytes",
    "12",
    "--ignore-eos",
    "--json",
  )
  assert p.returncode == 0, p.stderr
  assert json.loads(p.stdout)["ids"] == ref

  wd = str(tmp_path / "wd")
  p = run_cli_process("lca_jax.cli.convert", "from-hf", "--hf-dir", hf, "--out", wd)
  assert p.returncode == 0, p.stderr
  padded = _leaves(_real_rows(_cfg("lca_mbp"), _params("lca_mbp")))  # zero rows 261..383
  got = _leaves(lca_jax.load(wd).params)
  for k in padded:
    np.testing.assert_array_equal(got[k], padded[k], err_msg=k)
  assert cli.main(["from-torch", "--torch-dir", hf, "--out", str(tmp_path / "wd2")]) == 0


def test_hf_export_with_stray_tensor_names_is_one_line(exported, tmp_path, capsys):
  hf = str(tmp_path / "hf")
  hf_export.to_hf(lca_jax.load(exported["fxt"]), hf)
  sd = safetensors_io.read_safetensors(os.path.join(hf, "model.safetensors"))
  sd["stray"] = sd["model.norm.weight"]
  safetensors_io.write_safetensors(os.path.join(hf, "model.safetensors"), sd)
  assert cli.main(["from-hf", "--hf-dir", hf, "--out", str(tmp_path / "wd")]) == 2
  err = capsys.readouterr().err
  assert "'stray' lacks the 'model.' prefix" in err and err.count("\n") == 1


def test_conversion_doc_names_the_files_of_an_export():
  """docs/conversion.md names the files a to-hf export holds, by their names there."""
  with open(os.path.join(ROOT, "docs", "conversion.md"), encoding="utf-8") as f:
    doc = f.read()
  for name in hf_export.CODE_FILES:
    assert f"`{name}`" in doc, name


@pytest.mark.parametrize("command", ["to-torch", "to-hf"])
def test_exported_files_take_the_umask_mode(exported, tmp_path, command):
  """Every file of an export, model.safetensors included, has the mode the umask gives."""
  out = str(tmp_path / "out")
  old = os.umask(0o027)
  try:
    assert cli.main([command, "--checkpoint", exported["fxt"], "--out", out]) == 0
  finally:
    os.umask(old)
  modes = {f: oct(os.stat(os.path.join(out, f)).st_mode & 0o777) for f in os.listdir(out)}
  assert "model.safetensors" in modes
  assert set(modes.values()) == {oct(0o640)}, modes


def _edited_ref(tmp_path, drop=(), **changes):
  d = tmp_path / "edited"
  shutil.copytree(os.path.join(REF_DIR, "lca_small"), d)
  os.chmod(d / "config.json", 0o644)
  with open(d / "config.json") as f:
    c = json.load(f)
  c.update(changes)
  with open(d / "config.json", "w") as f:
    json.dump(c, f)
  for name in drop:
    os.remove(d / name)
  return str(d)


@pytest.mark.parametrize(
  "changes,drop,needles",
  [
    (dict(lm_inter_dim=96), (), ["blocks.0.0.mlp.gate_proj.weight", "(128, 64)", "(96, 64)"]),
    ({}, ("model.safetensors",), ["missing model.safetensors"]),
    (dict(boundaries_type="entropy"), (), ["unknown boundaries_type 'entropy'"]),
    (dict(model_config="[1, (2,), 1, 0]"), (), ["does not use", "blocks.3.0."]),
  ],
)
def test_cli_errors_one_line(tmp_path, capsys, changes, drop, needles):
  src = _edited_ref(tmp_path, drop, **changes)
  assert cli.main(["from-torch", "--torch-dir", src, "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
  for n in needles:
    assert n in err, (n, err)
  assert not os.path.exists(tmp_path / "o")


def test_cli_bad_arguments(tmp_path, capsys):
  assert (
    cli.main(["to-torch", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    == 2
  )
  assert "does not exist" in capsys.readouterr().err
  assert (
    cli.main(
      ["to-torch", "--checkpoint", REF_DIR, "--out", str(tmp_path / "o"), "--dtype", "float16"]
    )
    == 2
  )
  assert "float16" in capsys.readouterr().err
  assert cli.main(["sideways"]) == 2
  with pytest.raises(convert.ConvertError, match="is the source"):
    cli.to_torch(os.path.join(REF_DIR, "lca_small"), os.path.join(REF_DIR, "lca_small"), force=True)


# ---- lca-train: fine-tune (init_from) and resume from an imported directory ------------------
TRAIN = [
  "model.d_model=32",
  "model.d_inner=64",
  "model.n_heads=2",
  "model.n_kv_heads=1",
  "model.n_lm=1",
  "model.n_mbp=1",
  "data.seq_len=32",
  "train.micro_batch_size=8",
  "train.global_batch_bytes=256",
  "train.eval_every=0",
  "train.progress_bar=False",
  "train.tensorboard=False",
  "train.steps=0",
]


def _train_config(*overrides):
  from lca_jax import configs_io  # pylint: disable=g-import-not-at-top

  c = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_lca_mbp.py"))
  return configs_io.apply_overrides(c, TRAIN + list(overrides))


def test_lca_train_init_from_and_resume(tmp_path):
  from lca_jax.train import loop  # pylint: disable=g-import-not-at-top

  config = _train_config()
  cfg = loop.model_config_of(config)
  params = random_params(cfg, seed=4)
  src = convert.export_params(params, cfg, str(tmp_path / "torch"))
  want = _leaves(_real_rows(cfg, params))

  wd = cli.from_torch(src, str(tmp_path / "imported"))
  got = _leaves(jax.device_get(loop.load_init_params(loop.prepare(config), wd)))  # train.init_from
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)

  one = jax.devices()[:1]  # orbax saves of 8-way replicated states are slow on CPU
  wd2 = cli.from_torch(src, str(tmp_path / "resumable"), config=config, devices=one)
  res = loop.train_and_evaluate(config, wd2, devices=one)  # resumes step 0: params, opt, rng, data
  assert res.step == 0
  got = _leaves(jax.device_get(res.state.params))
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  with pytest.raises(convert.ConvertError, match="model.d_inner: checkpoint 64, config 96"):
    cli.from_torch(src, str(tmp_path / "other"), config=_train_config("model.d_inner=96"))
