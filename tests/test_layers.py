"""RoPE: the host tables a call gathers from (``rope_len`` > 0, the model's default) equal the
cos / sin computed inline; a position past the table is NaN, never a wrong rotation. A scanned
stack (``Stack.scan``) is its blocks applied in turn, dropout included."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_close_rel

from lca_jax.model import layers


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
