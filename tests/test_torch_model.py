"""Tests for lca_jax/interop/torch_model.py against the upstream reference vectors."""

import json
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from conftest import REL_IMPL, assert_close_rel  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from lca_jax.interop.torch_model import (  # noqa: E402
  TorchHierarchicalLM,
  load_torch_model,
  spacebyte_boundaries,
)

REF = os.path.join(os.path.dirname(__file__), "data", "reference")
NAMES = ["lca_small", "lca_gqa", "fxt_small"]


@pytest.fixture(scope="module", params=NAMES)
def ref(request):
  path = os.path.join(REF, request.param)
  return request.param, load_torch_model(path), dict(np.load(os.path.join(path, "vectors.npz")))


def _run(model, *seqs):
  return model.forward(torch.tensor(np.stack(seqs), dtype=torch.long))


@pytest.mark.parametrize("i", [0, 1])
def test_reference_vectors(ref, i):
  name, model, v = ref
  out = _run(model, v[f"input_{i}"])
  np.testing.assert_array_equal(out["boundaries"][0].numpy(), v[f"boundaries_{i}"])
  assert_close_rel(out["ntp_logits"][0].numpy(), v[f"ntp_logits_{i}"], REL_IMPL)
  if name == "fxt_small":
    assert out["mbp_logits"] is None and f"mbp_logits_{i}" not in v
  else:
    assert_close_rel(out["mbp_logits"][0].numpy(), v[f"mbp_logits_{i}"], REL_IMPL)
  assert "mlp_mbp_logits" not in out


def test_batch_consistency(ref):
  name, model, v = ref
  x0, x1 = v["input_0"], v["input_1"]
  one = _run(model, x0)
  two = _run(model, x0, x0)
  for k in ("ntp_logits", "mbp_logits", "boundaries"):
    if one[k] is None:
      assert two[k] is None
      continue
    for r in range(2):
      assert_close_rel(two[k][r].numpy(), one[k][0].numpy())
  # Two different rows (different group counts per row). The model is causal, so a prefix's
  # outputs equal the first rows of the full sequence's reference vectors.
  T = min(len(x0), len(x1))
  out = _run(model, x0[:T], x1[:T])
  for r in range(2):
    np.testing.assert_array_equal(out["boundaries"][r].numpy(), v[f"boundaries_{r}"][:T])
    assert_close_rel(out["ntp_logits"][r].numpy(), v[f"ntp_logits_{r}"][:T], REL_IMPL)
    if out["mbp_logits"] is not None:
      assert_close_rel(out["mbp_logits"][r].numpy(), v[f"mbp_logits_{r}"][:T], REL_IMPL)


def test_greedy_full_forward(ref):
  """Greedy NT decoding by re-running the full forward reproduces greedy_ntp_i (first 12
  bytes of each: the JAX engine's tests check all 32)."""
  name, model, v = ref
  for i in (0, 1):
    seq = [int(t) for t in v[f"input_{i}"][:24]]
    out = []
    while len(out) < 12:
      out.append(int(_run(model, seq + out)["ntp_logits"][0, -1].argmax()))
    assert out == [int(t) for t in v[f"greedy_ntp_{i}"][:12]]


# ----------------------------------------------------------------------------- small models


def _cfg(model_config, boundaries_type="none", d=8, heads=2, kv=1, inter=16, V=261, **extra):
  c = {
    "lm_vocab_size": V,
    "lm_hidden_dim": d,
    "lm_inter_dim": inter,
    "lm_n_heads": heads,
    "lm_n_kv_heads": kv,
    "lm_rms_eps": 1e-6,
    "lm_re_base": 100000.0,
    "lm_max_position_embeddings": 4096,
    "lm_attn_scaling": 1.0,
    "lm_tie_weights": False,
    "model_config": model_config,
    "boundaries_type": boundaries_type,
    "all_script_ids_dict": {"<en>": [0.333, 0.023]},
    "num_predictors": 1,
    "activation_function": "gelu",
  }
  c.update(extra)
  return c


def _save_and_load(tmp_path, cfg, state):
  """Write the upstream layout and load it back through the public loader (strict names)."""
  with open(tmp_path / "config.json", "w") as f:
    json.dump(cfg, f)
  save_file({k: t.contiguous() for k, t in state.items()}, str(tmp_path / "model.safetensors"))
  return load_torch_model(str(tmp_path))


def _random_state(cfg, seed=0):
  torch.manual_seed(seed)
  m = TorchHierarchicalLM(cfg)
  return {
    k: torch.randn_like(t) * (0.5 if t.dim() > 1 else 1.0)
    + (1.0 if k.endswith("norm.weight") or ".norm1." in k or ".norm2." in k else 0.0)
    for k, t in m.state_dict().items()
    if k != "rotary_embd.inv_freq"
  } | {"rotary_embd.inv_freq": m.state_dict()["rotary_embd.inv_freq"]}


def _rms(x, w, eps=1e-6):
  return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_flat_model_by_hand(tmp_path):
  cfg = _cfg("[1, (0,), 0, 0]")
  st = _random_state(cfg)
  assert sorted(k for k in st if not k.startswith("blocks.")) == [
    "head.weight",
    "norm.weight",
    "rotary_embd.inv_freq",
    "token_embedding.weight",
  ]
  model = _save_and_load(tmp_path, cfg, st)
  W = lambda k: st[k]  # noqa: E731
  p = "blocks.0.0."
  ids = torch.tensor([[72]])
  out = model.forward(ids)
  assert out["boundaries"] is None and out["mbp_logits"] is None
  # One byte: RoPE at position 0 is the identity and softmax over one key is 1, so
  # attention = out_proj(v_proj(norm1(x))) with the single kv head shared by both query heads.
  x = W("token_embedding.weight")[72]
  v = W(p + "attn.v_proj.weight") @ _rms(x, W(p + "norm1.weight"))
  x = x + W(p + "attn.out_proj.weight") @ torch.cat([v, v])
  n2 = _rms(x, W(p + "norm2.weight"))
  gate = W(p + "mlp.gate_proj.weight") @ n2
  x = x + W(p + "mlp.down_proj.weight") @ (
    gate / (1 + torch.exp(-gate)) * (W(p + "mlp.up_proj.weight") @ n2)
  )
  want = W("head.weight") @ _rms(x, W("norm.weight"))
  assert_close_rel(out["ntp_logits"][0, 0].numpy(), want.numpy())
  # Causality: logits at t do not depend on bytes after t; identity blocks give head(norm(embed)).
  ids = torch.tensor([[10, 20, 30, 40], [10, 20, 31, 99]])
  out = model.forward(ids)["ntp_logits"]
  assert_close_rel(out[0, :2].numpy(), out[1, :2].numpy())
  assert (out[0, 2:] - out[1, 2:]).abs().max() > 1e-3
  st0 = dict(
    st,
    **{
      p + "attn.out_proj.weight": torch.zeros(8, 8),
      p + "mlp.down_proj.weight": torch.zeros(8, 16),
    },
  )
  ident = TorchHierarchicalLM(cfg)
  ident.load_state_dict(st0)
  want = _rms(st["token_embedding.weight"][ids], st["norm.weight"]) @ st["head.weight"].T
  assert_close_rel(ident.forward(ids)["ntp_logits"].numpy(), want.numpy())


def test_mlp_mbp_heads(tmp_path):
  cfg = _cfg("[1, (0,), 0, 0]", mlp_mbp_heads=2)
  st = _random_state(cfg, seed=1)
  for k in ("mlp_mbp.0.norm.weight", "mlp_mbp.1.fc1.weight", "mlp_mbp.1.fc2.weight"):
    assert k in st
  assert st["mlp_mbp.0.fc1.weight"].shape == (16, 8) and st["mlp_mbp.0.fc2.weight"].shape == (8, 16)
  # Identity trunk so the NT decoder's final hidden state is the embedding.
  st["blocks.0.0.attn.out_proj.weight"].zero_()
  st["blocks.0.0.mlp.down_proj.weight"].zero_()
  model = _save_and_load(tmp_path, cfg, st)
  ids = torch.tensor([[5, 6, 7, 8, 9]])
  out = model.forward(ids)
  assert out["mlp_mbp_logits"].shape == (1, 2, 5, 261)
  h = st["token_embedding.weight"][ids[0]]
  for i in range(2):
    f1 = _rms(h, st[f"mlp_mbp.{i}.norm.weight"]) @ st[f"mlp_mbp.{i}.fc1.weight"].T
    hi = h + (f1 * torch.sigmoid(f1)) @ st[f"mlp_mbp.{i}.fc2.weight"].T
    want = _rms(hi, st["norm.weight"]) @ st["head.weight"].T
    assert_close_rel(out["mlp_mbp_logits"][0, i].numpy(), want.numpy())


def _ids(data: bytes):
  return torch.tensor([[b + 3 for b in data]])


def test_spacebyte_rule():
  sb = lambda data, m=16: spacebyte_boundaries(_ids(data), m)[0].tolist()  # noqa: E731
  # space-like closes a group only after a non-space-like byte
  assert sb(b"ab cd  e") == [0, 0, 1, 0, 0, 1, 0, 0]
  # punctuation is space-like; digits are not
  assert sb(b"x1,y.") == [0, 0, 1, 0, 1]
  # byte 0 space-like: predecessor counts as not space-like
  assert sb(b" a") == [1, 0]
  # forced boundary every m bytes of a group; the count restarts after any boundary
  assert sb(b"abcdefg", 3) == [0, 0, 1, 0, 0, 1, 0]
  assert sb(b"ab cdefgh", 3) == [0, 0, 1, 0, 0, 1, 0, 0, 1]
  # UTF-8: lead byte 0xC3 is space-like, continuation 0xA9 is not; "é" = C3 A9
  assert sb("aé b".encode()) == [0, 1, 0, 1, 0]
  # specials (eos=1, <en>=259) are space-like
  ids = torch.tensor([[259, 68, 69, 1, 1]])
  assert spacebyte_boundaries(ids, 16)[0].tolist() == [1, 0, 0, 1, 0]
  # batch rows are independent
  both = spacebyte_boundaries(torch.cat([_ids(b"abcdef"), _ids(b"a b c ")]), 4)
  assert both.tolist() == [[0, 0, 0, 1, 0, 0], [0, 1, 0, 1, 0, 1]]


def test_spacebyte_model(tmp_path):
  """Hierarchical model with SpaceByte boundaries: no predictor weights, rule boundaries, causal."""
  src = os.path.join(REF, "lca_small")
  with open(os.path.join(src, "config.json")) as f:
    cfg = json.load(f)
  cfg.update(boundaries_type="spacebyte", spacebyte_max_group=5)
  from safetensors.torch import load_file

  st = {
    k: t
    for k, t in load_file(os.path.join(src, "model.safetensors")).items()
    if not k.startswith("script_to_bp_layers.")
  }
  model = _save_and_load(tmp_path, cfg, st)
  text = b"the quick brown fox, jumps!!"
  ids = _ids(text)
  out = model.forward(ids)
  np.testing.assert_array_equal(out["boundaries"].numpy(), spacebyte_boundaries(ids, 5).numpy())
  assert out["ntp_logits"].shape == out["mbp_logits"].shape == (1, len(text), 261)
  pre = model.forward(ids[:, :17])
  assert_close_rel(pre["ntp_logits"][0].numpy(), out["ntp_logits"][0, :17].numpy())
  assert_close_rel(pre["mbp_logits"][0].numpy(), out["mbp_logits"][0, :17].numpy())
  assert math.isfinite(float(out["ntp_logits"].abs().max()))
