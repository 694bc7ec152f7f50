"""RoPE: the host tables a call gathers from (``rope_len`` > 0, the model's default) equal the
cos / sin computed inline; a position past the table is NaN, never a wrong rotation. A scanned
stack (``Stack.scan``) is its blocks applied in turn, dropout included. RoPE through a product
(TPUs) is RoPE through slices. Attention over a KV cache (``kv_cache.KVCache`` +
``CacheAccess``: ragged write slots, windows, deferred writes, old slots) equals self-attention
over the same tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_rel

from lca_jax import backend
from lca_jax.model import layers, masks
from lca_jax.model.kv_cache import CacheAccess, KVCache


def test_rope_table_gather_equals_inline_values():
  e, base, max_len = 64, 10000.0, 4096
  pos = np.random.default_rng(0).integers(0, max_len, size=(2, 300))
  table = layers.rope_cos_sin(jnp.asarray(pos), e, base, max_len)
  inline = layers.rope_cos_sin(jnp.asarray(pos), e, base, 0)
  # both round the angle pos * inv_freq to float32 (numpy on the host, XLA here): an ulp of
  # inv_freq apart, angles near pos differ by ~ulp(pos); a row off by one would differ by O(1)
  tol = 4 * float(pos.max()) * np.finfo(np.float32).eps
  for got, want in zip(table, inline):
    assert got.shape == want.shape == (2, 300, 1, e)
    assert_close_rel(got, want, tol, scale=1.0)


def test_rope_position_past_the_table_is_nan():
  pos = jnp.arange(8)[None].at[0, -1].set(10_000)  # table rows: max(16, 8) + 2
  cos, sin = layers.rope_cos_sin(pos, 8, 10000.0, 16)
  assert np.all(np.isfinite(np.asarray(cos[0, :-1]))) and np.all(np.isnan(np.asarray(cos[0, -1])))
  assert np.all(np.isnan(np.asarray(sin[0, -1])))


def test_scanned_stack_is_its_blocks_in_turn_each_with_its_own_dropout_key():
  """Training with dropout: the scanned stack equals its blocks applied one after the other
  with the per-layer parameters and keys split from the stack's, so every layer draws its own
  mask (one key reused by every layer would give other numbers), and the unrolled stack's
  parameter tree (``layer_{i}``) is what it reads."""
  rng = np.random.default_rng(0)
  b, t, d, n = 2, 8, 32, 3
  x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  kw = dict(n_layers=n, n_heads=2, n_kv_heads=1, d_inner=64, rope_base=1e4, dropout=0.5)
  scanned, unrolled = layers.Stack(**kw, scan=True), layers.Stack(**kw)
  params = unrolled.init(jax.random.PRNGKey(1), x, pos, mask)
  assert jax.tree.structure(scanned.init(jax.random.PRNGKey(1), x, pos, mask)) == (
    jax.tree.structure(params)
  )
  key = jax.random.PRNGKey(7)
  got, kv = scanned.apply(params, x, pos, mask, deterministic=False, rngs={"dropout": key})
  assert kv is None
  block = layers.Block(2, 1, 64, 1e4, dropout=0.5)

  def chain(keys):
    y = x
    for i in range(n):
      p = {"params": params["params"][f"layer_{i}"]}
      y, _ = block.apply(p, y, pos, mask, deterministic=False, rngs={"dropout": keys[i]})
    return y

  # the stack's own key (flax folds its path into the one given), split once per layer
  stack_key = scanned.apply(params, method=lambda m: m.make_rng("dropout"), rngs={"dropout": key})
  assert_close_rel(got, chain(jax.random.split(stack_key, n)))
  assert not np.allclose(got, chain([stack_key] * n))
  plain, _ = unrolled.apply(params, x, pos, mask)
  assert_close_rel(scanned.apply(params, x, pos, mask)[0], plain)  # no dropout: the same stack


# ---- attention over a KV cache --------------------------------------------------------------
B, T, D, H, KV, S = 3, 8, 32, 4, 2, 24
E = D // H
OFFSETS = np.array([0, 5, 16])  # ragged rows: the first slot (and position) of each row's tokens


def _attention_case(seed: int):
  """An attention layer, its parameters, inputs [B, T, D] at positions offset..offset+T-1 per
  row, the causal self-attention output, and a cache of garbage (slot j holds position j)."""
  rng = np.random.default_rng(seed)
  attn = layers.Attention(H, KV, E, 10000.0, rope_len=64)
  x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  pos = jnp.asarray(OFFSETS[:, None] + np.arange(T)[None], jnp.int32)
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
  params = attn.init(jax.random.PRNGKey(seed), x, pos, causal)
  params = jax.tree.map(lambda w: w + jnp.asarray(rng.normal(size=w.shape), w.dtype), params)
  full, _ = attn.apply(params, x, pos, causal)
  garbage = lambda *shape: jnp.asarray(100 * rng.normal(size=shape), jnp.float32)
  cache = KVCache(garbage(B, KV, S, E), garbage(B, KV, E, S))
  return attn, params, x, pos, full, cache


def _cache_mask(pos_BQ, n_slots: int, first_B, slot0_B=None):
  """Causal mask over cache slots (slot j holds position j) from each row's first position on;
  over a window of ``n_slots`` slots starting at ``slot0_B`` when given."""
  slot0 = jnp.zeros_like(first_B) if slot0_B is None else slot0_B
  slot = slot0[:, None, None] + jnp.arange(n_slots)[None, None]
  return (slot <= pos_BQ[:, :, None]) & (slot >= first_B[:, None, None])


@pytest.mark.parametrize("split", [1, 3, 7])
def test_attention_over_a_cache_equals_self_attention(split):
  """The first ``split`` tokens of each row written into a cache of garbage at ragged slots
  (``old_slots`` 0: nothing cached is read), then the rest: each call's outputs are the
  self-attention's at those positions, and the cache holds every token's keys and values."""
  attn, params, x, pos, full, cache = _attention_case(split)
  first = jnp.asarray(OFFSETS, jnp.int32)
  step = lambda x_, pos_, cache_, access: attn.apply(
    params, x_, pos_, _cache_mask(pos_, S, first), cache=cache_, access=access
  )
  out1, cache = step(x[:, :split], pos[:, :split], cache, CacheAccess(first, old_slots=0))
  assert isinstance(cache, KVCache)
  out2, cache = step(x[:, split:], pos[:, split:], cache, CacheAccess(first + split))
  assert_close_rel(jnp.concatenate([out1, out2], axis=1), full, 1e-5)
  _, kv = attn.apply(params, x, pos, jnp.ones((B, T, T), bool))  # keys and values [B, T, K, E]
  for b, o in enumerate(OFFSETS):
    assert_close_rel(cache.k[b, :, o : o + T], kv[0][b].transpose(1, 0, 2), 1e-5)
    assert_close_rel(cache.v[b, :, :, o : o + T], kv[1][b].transpose(1, 2, 0), 1e-5)


@pytest.mark.parametrize("defer", [False, True])
def test_windowed_attention_over_a_cache_equals_self_attention(defer):
  """Queries that attend only a window of W cache slots (ragged per row, one window start past
  the end and clamped) give the self-attention's outputs; a deferred write returns the new
  entries, which ``write_kv`` stores as the plain write does."""
  attn, params, x, pos, full, cache = _attention_case(11)
  split, w = 3, T
  first = jnp.asarray(OFFSETS, jnp.int32)
  whole = lambda pos_: _cache_mask(pos_, S, first)
  _, cache = attn.apply(
    params,
    x[:, :split],
    pos[:, :split],
    whole(pos[:, :split]),
    cache=cache,
    access=CacheAccess(first),
  )
  window = first.at[2].set(S)  # clamped to S - W, which still holds row 2's keys
  slot0 = jnp.clip(window, 0, S - w)
  mask = _cache_mask(pos[:, split:], w, first, slot0)
  access = CacheAccess(first + split, window, defer_write=defer)
  out, kv = attn.apply(params, x[:, split:], pos[:, split:], mask, cache=cache, access=access)
  assert_close_rel(out, full[:, split:], 1e-5)
  plain = attn.apply(
    params,
    x[:, split:],
    pos[:, split:],
    whole(pos[:, split:]),
    cache=cache,
    access=CacheAccess(first + split),
  )
  assert_close_rel(out, plain[0], 1e-5)
  if defer:
    assert kv.k.shape == (B, KV, T - split, E) and kv.v.shape == (B, KV, E, T - split)
    kv = layers.write_kv(cache, kv, first + split)
  for got, want in zip(kv, plain[1]):
    assert_close_rel(got, want, 1e-5)


def test_cache_rows_keep_those_queries():
  """Over a cache, ``rows_BR`` keeps only those queries' outputs; every key is still written."""
  attn, params, x, pos, full, cache = _attention_case(5)
  first = jnp.asarray(OFFSETS, jnp.int32)
  rows = jnp.asarray([[7], [0], [3]])
  access = CacheAccess(first, old_slots=0)
  mask = _cache_mask(pos, S, first)
  out, kv = attn.apply(params, x, pos, mask, cache=cache, access=access, rows_BR=rows)
  _, ref_kv = attn.apply(params, x, pos, mask, cache=cache, access=access)
  assert_close_rel(out, layers.take_rows(full, rows), 1e-5)
  for got, want in zip(kv, ref_kv):
    assert_close_rel(got, want, 1e-5)


def test_a_cache_needs_its_access():
  attn, params, x, pos, _, cache = _attention_case(0)
  mask = _cache_mask(pos, S, jnp.zeros((B,), jnp.int32))
  with pytest.raises(ValueError, match="CacheAccess"):
    attn.apply(params, x, pos, mask, cache=cache)
  with pytest.raises(ValueError, match="CacheAccess"):
    attn.apply(params, x, pos, mask, access=CacheAccess(jnp.zeros((B,), jnp.int32)))


def test_cache_access_is_a_pytree_with_static_options():
  """The write and window slots are traced; ``old_slots`` and ``defer_write`` are static (they
  pick the program), so a jitted function retraces when they change."""
  a = CacheAccess(jnp.arange(3), jnp.ones(3, jnp.int32), old_slots=4, defer_write=True)
  assert len(jax.tree.leaves(a)) == 2
  assert jax.tree.structure(a) != jax.tree.structure(a.replace(old_slots=5))
  traces = []

  @jax.jit
  def f(access):
    traces.append(access.old_slots)
    return access.write_B + 1

  f(a), f(a.replace(write_B=jnp.arange(3) + 2)), f(a.replace(defer_write=False))
  assert traces == [4, 4]


def test_block_write_b_is_a_plain_cache_access():
  """``Block`` and ``Stack`` read ``write_B`` as ``access=CacheAccess(write_B)``."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  pos = jnp.asarray(OFFSETS[:, None] + np.arange(T)[None], jnp.int32)
  mask = masks.cache_causal_mask(pos, S)
  caches = [KVCache(jnp.zeros((B, KV, S, E)), jnp.zeros((B, KV, E, S))) for _ in range(2)]
  stack = layers.Stack(n_layers=2, n_heads=H, n_kv_heads=KV, d_inner=64, rope_base=1e4)
  params = stack.init(jax.random.PRNGKey(0), x, pos, mask, caches=caches, write_B=pos[:, 0])
  short = stack.apply(params, x, pos, mask, caches=caches, write_B=pos[:, 0])
  long = stack.apply(params, x, pos, mask, caches=caches, access=CacheAccess(pos[:, 0]))
  for got, want in zip(jax.tree.leaves(short), jax.tree.leaves(long)):
    assert_close_rel(got, want, 0.0)
  with pytest.raises(ValueError, match="not both"):
    stack.apply(
      params, x, pos, mask, caches=caches, write_B=pos[:, 0], access=CacheAccess(pos[:, 0])
    )


def test_rope_by_product_gives_the_slices_values_and_gradients():
  """On TPUs (``backend.rope_by_product``) a bfloat16 x is rotated as x R: the same values and
  gradients, bit for bit, as the slices."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2, 7, 3, 16)), jnp.bfloat16)
  g = jnp.asarray(rng.standard_normal((2, 7, 3, 16)), jnp.bfloat16)
  cos_sin = layers.rope_cos_sin(jnp.broadcast_to(jnp.arange(7), (2, 7)), 16, 1e4, 32)
  plain, vjp = jax.vjp(lambda x: layers.rope(x, cos_sin), x)
  with backend.target("tpu"):
    assert backend.rope_by_product()
    by_product, vjp_product = jax.vjp(lambda x: layers.rope(x, cos_sin), x)
    (dx_product,) = vjp_product(g)
  assert by_product.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(by_product, np.float32), np.asarray(plain, np.float32))
  np.testing.assert_array_equal(
    np.asarray(dx_product, np.float32), np.asarray(vjp(g)[0], np.float32)
  )
  e = 16
  np.testing.assert_array_equal(
    np.arange(e) @ layers.rotate_half_EE(e),
    np.concatenate([-np.arange(e // 2, e), np.arange(e // 2)]),
  )


@pytest.mark.parametrize("axis", [0, 1])
def test_row_by_row_writes_equal_the_batched_write(axis):
  """On TPUs (``backend.row_by_row_writes``) each row's entries are one ``dynamic_update_slice``:
  the batched write's result, with ragged starts and a start past the end clamped."""
  rng = np.random.default_rng(5)
  cache = jnp.asarray(rng.standard_normal((4, 3, 9, 5)), jnp.float32)
  new_shape = (4, 3, 2, 5) if axis == 1 else (4, 2, 9, 5)
  new = jnp.asarray(rng.standard_normal(new_shape), jnp.float32)
  start = jnp.array([0, 7, 3, 8] if axis == 1 else [1, 0, 2, 1], jnp.int32)
  batched = jax.jit(lambda c, n, s: layers.write_rows(c, n, s, axis=axis))(cache, new, start)
  with backend.target("tpu"):
    assert backend.row_by_row_writes()
    by_row = jax.jit(lambda c, n, s: layers.write_rows(c, n, s, axis=axis))(cache, new, start)
  np.testing.assert_array_equal(np.asarray(by_row), np.asarray(batched))
  expect = np.asarray(cache).copy()
  for b, s in enumerate(np.asarray(start)):
    if axis == 1:
      s = min(s, 9 - 2)
      expect[b, :, s : s + 2] = np.asarray(new)[b]
    else:
      s = min(s, 3 - 2)
      expect[b, s : s + 2] = np.asarray(new)[b]
  np.testing.assert_array_equal(np.asarray(by_row), expect)
