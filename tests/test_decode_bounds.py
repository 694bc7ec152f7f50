"""lca_jax.perf.bounds: bytes a decode step must read, the cache sizes it assumes (checked
against the engine), and the streaming-bandwidth measurement (tiny)."""

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from lca_jax.api import Model
from lca_jax.decode import engine
from lca_jax.model import incremental
from lca_jax.model.config import ModelConfig
from lca_jax.model.hierarchical import count_params, init_params
from lca_jax.perf import bounds

TINY = dict(d_model=32, d_inner=64, n_heads=4, n_kv_heads=2, n_enc=1, n_lm=2, n_dec=1)
LCA = ModelConfig(**TINY, n_mbp=2, max_seq_len=128)
FLAT = ModelConfig(**dict(TINY, n_lm=0, n_dec=0), kind="flat", n_mbp=0, max_seq_len=128)
MLP = ModelConfig(**TINY, n_mbp=0, n_mlp_mbp=2, max_seq_len=128)


def _model(cfg):
  return Model(cfg, jax.tree.map(np.asarray, init_params(cfg, jax.random.PRNGKey(0))))


@pytest.mark.parametrize(
  "mode,plens,max_bytes",
  [("ntp", [5], 20), ("verify", [33, 7], 20), ("threshold", [40], 500)],
)
def test_cache_len_is_the_engine_length(mode, plens, max_bytes):
  """The formula mirrors engine._request; if the engine changes its allocation, this fails."""
  model = _model(LCA)
  prompts = [np.arange(3, 3 + p, dtype=np.int32) % 200 + 3 for p in plens]
  req = engine._request(model, prompts, mode=mode, n=3, max_bytes=max_bytes)  # pylint: disable=protected-access
  width = 1 if mode == "ntp" else 3
  assert bounds.cache_len(plens, max_bytes, width, LCA.max_seq_len) == req.length


@pytest.mark.parametrize("cfg", [LCA, FLAT], ids=["lca", "flat"])
def test_min_cache_bytes_is_the_smallest_cache_buffer(cfg):
  params = nn.unbox(init_params(cfg, jax.random.PRNGKey(0)))
  b, length = 3, 50
  st = jax.eval_shape(lambda p: incremental.init_state(cfg, p, b, length, True), params)
  kv = [x for part in (st.enc, st.dec, st.mbp, st.lm) for x in jax.tree.leaves(part)]
  assert min(x.size * x.dtype.itemsize for x in kv) == bounds.min_cache_bytes(cfg, b, length)


def test_param_counts_cover_the_model():
  for cfg in (LCA, FLAT, MLP):
    groups = bounds.param_counts(cfg)
    assert sum(groups.values()) == count_params(init_params(cfg, jax.random.PRNGKey(0)))
  assert {"encoder", "lm", "decoder", "mbp", "head", "token_embedding"} <= set(
    bounds.param_counts(LCA)
  )


def test_param_bytes_are_those_decoding_reads():
  """float32: 4 bytes a parameter; bfloat16: the bytes of the tree decoding runs with (the
  model's own ``decode_params``): the matrices at 2 bytes, norms and the boundary predictor 4."""
  assert bounds.param_bytes(LCA) == {k: 4 * n for k, n in bounds.param_counts(LCA).items()}
  bf = dataclasses.replace(LCA, dtype="bfloat16")
  got, counts = bounds.param_bytes(bf), bounds.param_counts(bf)
  tree = _model(bf).decode_params()
  for k, n in got.items():
    leaves = jax.tree_util.tree_leaves_with_path(tree[k])
    fused = ("qkv_kernel", "gate_up_kernel")  # decoding reads these instead of their parts
    read = [x for p, x in leaves if not any(getattr(q, "key", None) in fused for q in p)]
    assert n == sum(x.size * x.dtype.itemsize for x in read), k
  assert got["boundary_predictor"] == 4 * counts["boundary_predictor"]
  assert got["token_embedding"] == 2 * counts["token_embedding"]
  assert 2 * counts["encoder"] < got["encoder"] < 2.1 * counts["encoder"]  # + norm scales


def test_stream_probe_is_the_model_size():
  """The bandwidth probe streams a matrix as large as the model's float32 parameters (so it reads
  from the memory level a step reads from), never less than MIN_STREAM_MB."""
  assert bounds.stream_mb_for(LCA) == bounds.MIN_STREAM_MB  # a tiny model
  big = ModelConfig(d_model=1024, d_inner=4096, n_heads=8, n_kv_heads=8, n_lm=16, n_mbp=2)
  n = sum(bounds.param_counts(big).values())
  assert n > 300e6 and bounds.stream_mb_for(big) == pytest.approx(n * 4 / 1e6)


def test_step_read_bytes_by_hand():
  g = bounds.param_counts(LCA)
  every = g["encoder"] + g["boundary_predictor"] + g["decoder"] + g["norm"] + g["head"]
  d, kv_slot = LCA.d_model, 2 * LCA.n_kv_heads * LCA.head_dim * 4
  length = 100
  # ntp, batch 1, no group closes: no LM
  r = bounds.step_read_bytes(LCA, "ntp", 1, 1, length, 0.0, 1.0)
  assert r["lm_fraction"] == 0.0 and "mbp" not in r["groups"]
  assert r["params"] == 4 * (every + d)
  assert r["kv"] == kv_slot * (LCA.n_enc + LCA.n_dec) * length
  # ntp, batch 1, a group every 4 bytes: the LM stack and its cache a quarter of the time
  r = bounds.step_read_bytes(LCA, "ntp", 1, 1, length, 0.25, 1.0)
  assert r["lm_fraction"] == pytest.approx(0.25)
  assert r["params"] == pytest.approx(4 * (every + d + 0.25 * g["lm"]))
  assert r["kv"] == pytest.approx(
    kv_slot * ((LCA.n_enc + LCA.n_dec) * length + 0.25 * LCA.n_lm * (length + 1))
  )
  # verify, batch 2, 3 bytes fed per row: MBP stack + its cache (whole: 100 slots are fewer
  # than MBP_WINDOW_FROM windows), 6 embedding rows
  f = 1 - (1 - 0.5) ** 2
  long = incremental.MBP_WINDOW_FROM * incremental.MBP_WINDOW
  for length, w in ((100, 100), (long, incremental.MBP_WINDOW)):
    r = bounds.step_read_bytes(LCA, "verify", 2, 3, length, 0.25, 2.0)
    assert r["lm_fraction"] == pytest.approx(f)
    assert r["params"] == pytest.approx(4 * (every + g["mbp"] + 6 * d + f * g["lm"]))
    assert r["kv"] == pytest.approx(
      2 * kv_slot * ((LCA.n_enc + LCA.n_dec) * length + f * LCA.n_lm * (length + 1) + 2 * w)
    )
    assert r["total"] == pytest.approx(r["params"] + r["kv"])
  length = 100
  # a flat model: encoder + head only, whatever the latents
  gf = bounds.param_counts(FLAT)
  r = bounds.step_read_bytes(FLAT, "ntp", 1, 1, length, 0.5, 1.0)
  assert r["lm_fraction"] == 0.0
  assert r["params"] == 4 * (gf["encoder"] + gf["norm"] + gf["head"] + d)
  assert r["kv"] == kv_slot * FLAT.n_enc * length
  # MLP-MBP heads count in the multi-byte modes only
  assert "mlp_mbp_0" in bounds.step_read_bytes(MLP, "threshold", 1, 3, length)["groups"]
  assert "mlp_mbp_0" not in bounds.step_read_bytes(MLP, "ntp", 1, 1, length)["groups"]


def test_lm_fraction():
  assert bounds.lm_fraction(0.3, 1.0, 1) == pytest.approx(0.3)
  assert bounds.lm_fraction(0.3, 2.0, 2) == pytest.approx(1 - 0.4**2)
  assert bounds.lm_fraction(0.5, 3.0, 1) == 1.0  # at most every step
  assert bounds.lm_fraction(0.0, 3.0, 32) == 0.0


def test_stream_bandwidth_tiny():
  s = bounds.stream_bandwidth(matrix_mb=1, repeats=2, chain=2)
  assert s["bytes_per_s"] > 0 and s["gb_s"] == pytest.approx(s["bytes_per_s"] / 1e9)
  d, f = s["shape"]
  assert s["matrix_bytes"] == d * f * 4 and abs(s["matrix_bytes"] - 1e6) < 0.01e6
  assert bounds.bound_ms(2e9, 1e12) == pytest.approx(2.0)
  with pytest.raises(ValueError):
    bounds.stream_bandwidth(matrix_mb=0)
