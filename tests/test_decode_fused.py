"""The fused decode kernels (lca_jax/kernels/decode_fused.py) against the XLA path they
replace: each kernel on random inputs (rows 1..20, float32 and bfloat16, both weight layouts;
the cache writes at clamped starts), and whole greedy decodes of a tiny model with the kernels
(Pallas interpret mode on the CPU) against without."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_params, tiny_config

from lca_jax import backend
from lca_jax.api import Model
from lca_jax.decode import engine
from lca_jax.decode.executables import ExecutableCache
from lca_jax.kernels import decode_fused as df
from lca_jax.model import incremental, layers
from lca_jax.model.activations import swiglu

TOL = {jnp.float32: 2e-6, jnp.bfloat16: 1e-2}  # of the largest output


def _norm(x, scale, eps):
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)
  return (y * scale).astype(x.dtype)


def _dot_oi(x, w, dtype):
  return layers.dot_rows_oi(x, w, dtype)


def _close(got, want, dtype):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * np.max(np.abs(want)))


@pytest.mark.parametrize("in_out", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 20])
def test_each_kernel_matches_the_xla_path(m, dtype, in_out):
  """Weights stored [out, in] (decoding's plain kernels on GPUs) or [in, out] (its fused
  q/k/v and gate/up kernels)."""
  rng = np.random.default_rng(m)
  d, n, f = 256, 96, 128
  draw = lambda *s, scale=1.0: jnp.asarray(scale * rng.standard_normal(s), dtype)
  x, scale = draw(m, d), jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32)
  w, w_gu, w_down = draw(n, d, scale=0.05), draw(2 * f, d, scale=0.05), draw(n, f, scale=0.05)
  kw = dict(dtype=dtype, interpret=True, in_out=in_out)
  stored = lambda w: w.T if in_out else w
  want = _dot_oi(_norm(x, scale, 1e-6), w, dtype)
  _close(df.norm_matvec(x, scale, stored(w), eps=1e-6, **kw), want, dtype)
  gu = _dot_oi(_norm(x, scale, 1e-6), w_gu, dtype)
  glu = df.norm_matvec_glu(x, scale, stored(w_gu), eps=1e-6, **kw)
  _close(glu, swiglu(gu[:, :f], gu[:, f:]), dtype)
  res = draw(m, n)
  got = df.matvec_residual(glu, stored(w_down), res, **kw)
  _close(got, res + _dot_oi(glu, w_down, dtype), dtype)


def test_a_chunked_input_and_a_ragged_output_block_still_cover_every_column():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 384)), jnp.float32)  # 384 = 3 chunks of 128
  w = jnp.asarray(rng.standard_normal((48, 384)), jnp.float32)  # 48: blocks of 16
  got = df.norm_matvec(x, jnp.ones(384), w, eps=1e-6, dtype=jnp.float32, interpret=True)
  _close(got, _dot_oi(_norm(x, jnp.ones(384), 1e-6), w, jnp.float32), jnp.float32)


@pytest.fixture(scope="module")
def transposed_model():
  cfg = tiny_config("lca_mbp", max_seq_len=96)
  params = layers.decode_weights(random_params(cfg, seed=3), cfg.dtype, True, transpose=True)
  return Model(cfg, params)


@pytest.mark.parametrize("mode,lm_reads", [("ntp", "whole"), ("verify", "whole"), ("ntp", "parts")])
def test_greedy_decoding_with_the_fused_kernels_equals_the_xla_path(
  transposed_model, mode, lm_reads, monkeypatch, request
):
  """The fused path's latent LM writes its caches in place and reads the slots it needs, known
  at run time (``CacheAccess.read_slots``); the XLA path reads the whole LM cache, or with
  ``parts`` the smallest of its static parts that holds them (``incremental.lm_reads``)."""
  if lm_reads == "parts":  # traced anew (no cached programs) with the patched reads
    jax.clear_caches()
    request.addfinalizer(jax.clear_caches)
    monkeypatch.setattr(engine, "_EXECUTABLES", ExecutableCache(capacity=4))
    monkeypatch.setattr(incremental, "LM_READS_FROM", 1)
    monkeypatch.setattr(incremental, "LM_READS_SHARE", 0.0)
  prompts = ["The hacker ", "ab"]  # a batch of two, ragged
  kw = dict(mode=mode, n=3, max_bytes=24) if mode == "verify" else dict(mode=mode, max_bytes=24)
  traced = []
  kernel = df.norm_matvec
  monkeypatch.setattr(df, "norm_matvec", lambda *a, **k: traced.append(1) or kernel(*a, **k))
  with backend.fused_decode(False):
    ref = transposed_model.generate(prompts, **kw)
  assert not traced
  with backend.fused_decode(True):
    got = transposed_model.generate(prompts, **kw)
  layers_per_step = sum(getattr(transposed_model.cfg, f"n_{s}") for s in ("enc", "lm", "dec"))
  assert len(traced) >= layers_per_step  # every block of the step took the fused path
  assert got.texts == ref.texts
  if mode == "verify":  # verify's greedy text is ntp's, with the kernels too
    with backend.fused_decode(True):
      assert transposed_model.generate(prompts, mode="ntp", max_bytes=24).texts == got.texts
