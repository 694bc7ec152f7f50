"""The decode attention kernel (lca_jax/kernels/decode_attention.py, Pallas interpret mode on the
CPU) against the XLA path it replaces (``layers._attend_cache``: ``cached_attention`` and the
cache write), on random inputs: one and several query rows, new keys at ragged and clamped
starts (a cache at capacity), a window, ``old_slots``, fully masked rows, float32 and bfloat16.

    .venv/bin/python -m pytest -q tests/test_decode_attention.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lca_jax.kernels import decode_attention as da
from lca_jax.model import layers, masks
from lca_jax.model.kv_cache import CacheAccess, KVCache

TOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-2}  # of the largest output
BASE = 10000.0


def _inputs(seed, *, b=2, t=3, h=4, kv=2, e=16, slots=64, dtype=jnp.float32):
  """Random q/k/v of the fused projection (before RoPE), caches, RoPE at ragged positions."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  n = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(dtype)
  qkv = n(ks[0], (b, t, h + 2 * kv, e))
  cache = KVCache(n(ks[1], (b, kv, slots, e)), n(ks[2], (b, kv, e, slots)))
  pos = jax.random.randint(ks[3], (b, 1), 0, 200) + jnp.arange(t)[None, :]
  return qkv, pos, cache, ks[5]


def _xla(qkv, pos, cache, mask, access, rows, h, rope_len):
  """The XLA path (``Attention`` over a cache without the kernel)."""
  cos_sin = layers.rope_cos_sin(pos, qkv.shape[-1], BASE, rope_len)
  kv = (qkv.shape[2] - h) // 2
  q, k, v = qkv[:, :, :h], qkv[:, :, h : h + kv], qkv[:, :, h + kv :]
  q, k = layers.rope(q, cos_sin), layers.rope(k, cos_sin)
  if rows is not None:
    q, mask = layers.take_rows(q, rows), layers.take_rows(mask, rows)
  return layers._attend_cache(q, k, v, cache, mask, access)  # pylint: disable=protected-access


def _check(
  qkv,
  pos,
  cache,
  mask,
  access,
  dtype,
  rows=None,
  h=4,
  block_s=8,
  rope_len=512,
  causal=False,
  read_slots=None,
):
  """The kernel against the XLA path; with ``causal`` the kernel compares slots with the
  queries' positions (``last_slot_BR``) where the XLA path reads ``mask`` (the causal one);
  ``read_slots`` (traced) passed to the kernel in place of ``access.old_slots``."""
  want_out, want_kv = _xla(qkv, pos, cache, mask, access, rows, h, rope_len)
  take = lambda x: x if rows is None else layers.take_rows(x, rows)
  got_out, got_kv = da.cache_attention(
    qkv,
    layers.rope_rows(pos, qkv.shape[-1], BASE, rope_len),
    cache.k,
    cache.v,
    None if causal else take(mask),
    access.write_B,
    access.window_B,
    rows,
    take(pos) if causal else None,
    read_slots,
    n_heads=h,
    old_slots=None if read_slots is not None else access.old_slots,
    write=not access.defer_write,
    interpret=True,
    block_s=block_s,
  )
  want, got = np.asarray(want_out, np.float64), np.asarray(got_out, np.float64)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * np.max(np.abs(want)))
  for g, w in zip(got_kv, want_kv):  # the written caches, or the new entries: exact
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 4])
def test_matches_the_xla_path_over_the_whole_cache(t, dtype):
  qkv, pos, cache, key = _inputs(t, t=t, dtype=dtype)
  slots = cache.k.shape[2]
  mask = jax.random.bernoulli(key, 0.4, (2, t, slots))
  mask = mask.at[1, 0].set(False)  # a row with no allowed key: zeros
  # a ragged start, and one past the end (clamped: the cache at capacity)
  access = CacheAccess(jnp.array([5, slots + 3], jnp.int32))
  _check(qkv, pos, cache, mask, access, dtype)


@pytest.mark.parametrize("defer_write", [False, True])
@pytest.mark.parametrize("old_slots", [0, 20])
def test_old_slots_read_only_the_first_slots(old_slots, defer_write):
  """``old_slots``; with ``defer_write`` the new entries come back instead of the caches."""
  qkv, pos, cache, key = _inputs(7)
  mask = jax.random.bernoulli(key, 0.6, (2, 3, cache.k.shape[2]))
  access = CacheAccess(jnp.array([20, 17], jnp.int32), old_slots=old_slots, defer_write=defer_write)
  _check(qkv, pos, cache, mask, access, jnp.float32)


@pytest.mark.parametrize("n", [0, 20, 64])
def test_read_slots_known_at_run_time_bound_the_blocks_read(n):
  """``read_slots``: ``old_slots`` as a traced value (the blocks past it are not read)."""
  qkv, pos, cache, key = _inputs(9)
  mask = jax.random.bernoulli(key, 0.6, (2, 3, cache.k.shape[2]))
  access = CacheAccess(jnp.array([20, 33], jnp.int32), old_slots=n)
  _check(qkv, pos, cache, mask, access, jnp.float32, read_slots=jnp.int32(n))


@pytest.mark.parametrize("rope_len", [512, 0])
def test_rope_from_the_table_or_computed(rope_len):
  """RoPE rows from the model's table, or computed for this call (rope_len 0)."""
  qkv, pos, cache, key = _inputs(5, t=2)
  mask = jax.random.bernoulli(key, 0.5, (2, 2, cache.k.shape[2]))
  access = CacheAccess(jnp.array([9, 33], jnp.int32))
  _check(qkv, pos, cache, mask, access, jnp.float32, rope_len=rope_len)


@pytest.mark.parametrize("block_s", [8, 64])
def test_a_window_of_the_cache(block_s):
  qkv, pos, cache, key = _inputs(11, t=2)
  w = 24
  mask = jax.random.bernoulli(key, 0.7, (2, 2, w))
  # windows at unaligned starts, one clamped to the cache's end; writes inside each window
  access = CacheAccess(jnp.array([13, 60], jnp.int32), window_B=jnp.array([3, 50], jnp.int32))
  _check(qkv, pos, cache, mask, access, jnp.float32, block_s=block_s)


def test_fewer_query_rows_than_new_keys_and_grouped_heads():
  """R < T (a caller that reads only some positions) with 4 query heads per kv head."""
  qkv, pos, cache, key = _inputs(3, t=4, h=8, kv=2)
  rows = jnp.array([[3], [1]])
  mask = jax.random.bernoulli(key, 0.5, (2, 4, cache.k.shape[2]))
  access = CacheAccess(jnp.array([0, 40], jnp.int32))
  _check(qkv, pos, cache, mask, access, jnp.float32, rows=rows, h=8)


@pytest.mark.parametrize("old_slots", [None, 20])
@pytest.mark.parametrize("t,rows", [(1, None), (3, None), (3, [[2], [0]])])
def test_causal_queries_compare_slots_with_their_positions(t, rows, old_slots):
  """``last_slot_BR``: the causal mask of the queries' positions computed in the kernel, as
  decoding's byte and latent stacks attend (new keys at their positions, ragged rows, one
  start past the end clamped)."""
  qkv, _, cache, _ = _inputs(13, t=t)
  slots = cache.k.shape[2]
  start = jnp.array([17, slots + 2], jnp.int32)
  pos = jnp.minimum(start, slots - t)[:, None] + jnp.arange(t)[None, :]
  mask = masks.cache_causal_mask(pos, slots)
  rows = None if rows is None else jnp.array(rows)
  access = CacheAccess(start, old_slots=old_slots)
  _check(qkv, pos, cache, mask, access, jnp.float32, rows=rows, causal=True)


def test_supported_heads_and_block_sizes():
  assert da.supported(8, 8, 128) and da.supported(4, 2, 16)
  assert not da.supported(12, 4, 64) and not da.supported(8, 8, 96)
  assert da.block_slots(515, 1, 128) == 64 and da.block_slots(40, 1, 128) == 32
  assert da.block_slots(4096, 8, 128) == 16  # the register budget of [8, slots, 64]
