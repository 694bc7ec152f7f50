"""model/rows.py: the per-row products and reductions of a batch of one row run over merged rows.

XLA:CPU's YNNPACK fusions reduce a product over the last axis of [1, T, D] 10-20x slower than
over [T, D] (model/rows.py). The RMSNorm, the pooling weights and the attention backward
compute those products on a rows view; these tests check that the view changes no value or
gradient (nor does running on [B, T, D] as it is, as on TPUs at some T), and that the backward of the
whole model at batch 1 is left with no reduction whose result is [1, T, ...] (the form the slow
path takes; the test fails on the code before the rows views: the RMSNorm's input gradient,
the pooling weights' gradient and the attention backward's row sums).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  REL_REORDER,
  assert_close_rel,
  random_ids,
  random_params,
  tiny_config,
  train_forward,
)

from lca_jax import backend
from lca_jax.model import rows
from lca_jax.model.hierarchical import ByteLM
from lca_jax.model.layers import RMSNorm, Stack
from lca_jax.model.loss import compute_loss
from lca_jax.perf import hlo_stats

T = 48


def test_merged_keeps_the_last_axes():
  x = jnp.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
  assert rows.merged(x).shape == (24, 5)
  assert rows.merged(x, 2).shape == (6, 4, 5)
  np.testing.assert_array_equal(rows.merged(x, 2)[4], x[1, 1])


@pytest.mark.parametrize("batch", [1, 3])
def test_rmsnorm_values_and_gradients_are_the_plain_formula(batch):
  rng = np.random.default_rng(batch)
  x = jnp.asarray(rng.standard_normal((batch, T, 16)), jnp.float32)
  scale = jnp.asarray(1 + 0.1 * rng.standard_normal(16), jnp.float32)
  g = jnp.asarray(rng.standard_normal((batch, T, 16)), jnp.float32)

  def ours(x, scale):
    return RMSNorm(1e-6).apply({"params": {"scale": scale}}, x)

  def plain(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale

  y, vjp = jax.vjp(ours, x, scale)
  y_ref, vjp_ref = jax.vjp(plain, x, scale)
  assert y.shape == x.shape
  assert_close_rel(y, y_ref, REL_REORDER)
  for got, ref in zip(vjp(g), vjp_ref(g)):
    assert_close_rel(got, ref, REL_REORDER)


def test_unmerged_rows_give_the_stacks_values_and_gradients():
  """On TPUs, with T not a multiple of 8 (``backend.merged_rows`` False), ``Dense`` and
  ``RMSNorm`` run on [B, T, D] as it is: a scanned, rematerialized stack over T = 13 (not a multiple of 8) gives the values and
  gradients of the merged rows."""
  rng = np.random.default_rng(0)
  b, t, d = 2, 13, 32
  x = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  stack = Stack(3, n_heads=4, n_kv_heads=2, d_inner=64, rope_base=1e4, remat=True, scan=True)
  params = stack.init(jax.random.PRNGKey(1), x, pos, mask)

  def loss(params, x):
    return jnp.sum(jnp.sin(stack.apply(params, x, pos, mask)[0]))

  merged = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
  with backend.target("tpu"):
    assert not backend.merged_rows(t)
    unmerged = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
  for got, ref in zip(jax.tree.leaves(unmerged), jax.tree.leaves(merged)):
    assert got.shape == ref.shape
    assert_close_rel(got, ref, REL_REORDER)


@functools.lru_cache(maxsize=None)
def _grad_hlo(variant):
  cfg = tiny_config(variant, max_seq_len=T)
  model = ByteLM(cfg)
  batch = {
    "ids": jnp.asarray(random_ids(np.random.default_rng(0), (1, T))),
    "segment_ids": jnp.ones((1, T), jnp.int32),
    "positions": jnp.arange(T, dtype=jnp.int32)[None],
  }

  def loss_fn(params):
    out = train_forward(model, params, batch, jax.random.PRNGKey(1))
    return compute_loss(cfg, out, batch, jnp.asarray((1.0, 1.0, 10.0), jnp.float32))[0]

  params = random_params(cfg, seed=1)
  return jax.jit(jax.grad(loss_fn)).lower(params).compile().as_text()


def _row_reductions(hlo_text, t):
  """The backward pass's reductions whose result is [1, t, ...]: one row's per-position sums
  over its last axis, as autodiff writes them for a [1, T, D] product."""
  found = []
  for key, instrs in hlo_stats.computations(hlo_text).items():
    if key == "ENTRY":  # the entry computation is also under its own name
      continue
    for ins in instrs:
      if hlo_stats.op_name(ins) != "reduce" or "transpose(" not in ins:
        continue
      dims = hlo_stats.result_dims(ins)
      if len(dims) >= 2 and dims[0] == 1 and dims[1] == t:
        found.append(ins[:200])
  return found


@pytest.mark.parametrize("variant", ["lca_mbp", "llamabyte"])
def test_a_one_row_backward_reduces_over_merged_rows(variant):
  if jax.default_backend() != "cpu":
    pytest.skip("the YNNPACK slow path is XLA:CPU's")
  assert not _row_reductions(_grad_hlo(variant), T)


def test_the_row_reduction_check_sees_a_one_row_product():
  x = jnp.ones((1, T, 16))

  def f(x, y):
    return jnp.sum(nn.tanh(x) * y[..., None])

  text = jax.jit(jax.grad(f, argnums=1)).lower(x, jnp.ones((1, T))).compile().as_text()
  assert _row_reductions(text, T)
