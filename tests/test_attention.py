"""Blockwise attention (model/attention.py) against the dense masked reference.

Random segmentations (group lengths from 1 to 3x the block size), packed documents with
padding, a row that is all padding, GQA and MQA, T not a multiple of the block: values and
gradients agree within 1e-5 relative to the magnitude of what is compared (f32 accumulation
error grows with that magnitude, not with the CPU). Then the whole model with
``attention_impl="xla"`` (blockwise) equals ``"dense"`` on every variant, forward and
gradients; the schedule skips what the masks exclude; and no compiled train step holds a
[T, T] array.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  VARIANTS,
  random_ids,
  random_params,
  segmented_layout,
  tiny_config,
  train_forward,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lca_jax.model import masks
from lca_jax.model.attention import blockwise_attention, schedule, tiles_visited
from lca_jax.model.hierarchical import ByteLM
from lca_jax.model.layers import masked_attention
from lca_jax.model.loss import compute_loss
from lca_jax.perf import costs
from lca_jax.train import sharding as shd

REL = 1e-5


def assert_rel_close(actual, ref, rel=REL, what=""):
  """max |actual - ref| <= rel * max |ref| (scale-relative: holds on any x86-64 CPU)."""
  actual, ref = np.asarray(actual, np.float64), np.asarray(ref, np.float64)
  scale = max(float(np.max(np.abs(ref))), 1e-30)
  err = float(np.max(np.abs(actual - ref)))
  assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel} x scale {scale:.3g}"


def _groups(rng, t, max_len):
  """Group ids (cumsum(b) - b) of contiguous groups with lengths uniform in [1, max_len]."""
  b = np.zeros(t, np.int32)
  at = -1
  while True:
    at += int(rng.integers(1, max_len + 1))
    if at >= t:
      break
    b[at] = 1
  return np.cumsum(b) - b


def _case(seed, t, block, h, kv, docs):
  rng = np.random.default_rng(seed)
  e = 8
  q, k, v = (jnp.asarray(rng.standard_normal((3, t, n, e)), jnp.float32) for n in (h, kv, kv))
  doc = np.ones((3, t), np.int32)
  if docs:
    doc[1], _ = segmented_layout((t // 3, t // 4, t // 5), t)  # three documents + padding
    doc[2] = 0  # a row that is all padding
  grp = np.stack([_groups(rng, t, 3 * block) for _ in range(3)])
  return q, k, v, jnp.asarray(doc), jnp.asarray(grp)


CASES = {  # name: (T, block, H, KV, documents)
  "gqa_docs": (45, 8, 4, 2, True),
  "mqa_one_doc": (64, 16, 2, 1, False),
  "mha_ragged_t": (37, 8, 2, 2, True),
}


@pytest.mark.parametrize("kind", ["causal", "lca"])
@pytest.mark.parametrize("case", list(CASES))
def test_blockwise_equals_dense(kind, case):
  t, block, h, kv, docs = CASES[case]
  q, k, v, doc, grp = _case(len(case), t, block, h, kv, docs)
  if kind == "causal":
    lo, mask = masks.causal_key_start(doc), masks.causal_mask(doc)
  else:
    lo, mask = masks.lca_key_start(grp, doc), masks.lca_mask(grp, doc)
  w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
  for bq, bk in ((block, block), (block // 2, block + 3)):  # aligned and unaligned tiles
    fast = lambda q, k, v: blockwise_attention(q, k, v, lo, block_q=bq, block_k=bk)
    dense = lambda q, k, v: masked_attention(q, k, v, mask)
    out_f, out_d = jax.jit(fast)(q, k, v), jax.jit(dense)(q, k, v)
    assert_rel_close(out_f, out_d, what=f"out bq={bq} bk={bk}")
    if docs:
      assert np.all(np.asarray(out_f)[2] == 0.0)  # the all-padding row attends nothing
    grads = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))(q, k, v)
    for name, gf, gd in zip("qkv", grads(fast), grads(dense)):
      assert_rel_close(gf, gd, what=f"d{name} bq={bq} bk={bk}")


def test_bfloat16_matches_float32_reference():
  q, k, v, doc, grp = _case(3, 40, 8, 4, 2, True)
  lo, mask = masks.lca_key_start(grp, doc), masks.lca_mask(grp, doc)
  bf = lambda x: x.astype(jnp.bfloat16)
  out = blockwise_attention(bf(q), bf(k), bf(v), lo, block_q=8, block_k=8)
  assert out.dtype == jnp.bfloat16
  ref = masked_attention(
    bf(q).astype(jnp.float32), bf(k).astype(jnp.float32), bf(v).astype(jnp.float32), mask
  )
  assert_rel_close(out.astype(jnp.float32), ref, rel=2e-2, what="bf16")


def test_schedule_skips_masked_tiles():
  """Causal, one document: the lower triangle only; two documents: not the cross blocks;
  LCA with short groups: one tile per query block; a group longer than the lookback: more."""
  t, bq = 64, 16
  n = t // bq
  one = jnp.ones((1, t), jnp.int32)
  assert int(tiles_visited(masks.causal_key_start(one), bq, bq)) == n * (n + 1) // 2
  two = jnp.asarray(np.repeat([1, 2], t // 2)[None], jnp.int32)
  assert int(tiles_visited(masks.causal_key_start(two), bq, bq)) == 2 * 3  # 2 x (2 * 3 / 2)
  short = jnp.asarray((np.arange(t) // 3)[None], jnp.int32)
  lo = masks.lca_key_start(short, one)
  assert np.asarray(schedule(lo, bq, bq + 8).n_tiles_N).tolist() == [1] * n
  long = jnp.asarray((np.arange(t) // 40)[None], jnp.int32)  # groups of 40 > lookback 8
  lo = masks.lca_key_start(long, one)
  assert int(tiles_visited(lo, bq, bq + 8)) > n


@pytest.mark.parametrize("kind", ["causal_one", "causal_packed", "lca", "padded"])
def test_unmasked_tile_range_is_exactly_unmasked(kind):
  """Every tile of [full_lo, full_hi) is allowed for every query of its block (so skipping the
  mask there is exact), and on one causal document only the diagonal tile is masked."""
  t, bq, bk = 100, 16, 16
  rng = np.random.default_rng(3)
  one = jnp.ones((2, t), jnp.int32)
  if kind == "causal_one":
    doc, lo = one, masks.causal_key_start(one)
  elif kind == "causal_packed":
    doc = jnp.asarray(np.r_[np.ones(60), np.full(40, 2)][None].repeat(2, 0), jnp.int32)
    lo = masks.causal_key_start(doc)
  elif kind == "lca":
    doc, bk = one, 24
    grp = jnp.asarray(np.cumsum(rng.random((2, t)) < 0.1, axis=1), jnp.int32)
    lo = masks.lca_key_start(grp, doc)
  else:
    doc = jnp.asarray(np.r_[np.ones(70), np.zeros(30)][None].repeat(2, 0), jnp.int32)
    lo = masks.causal_key_start(doc)
  sch = schedule(lo, bq, bk)
  lo_np = np.asarray(lo)
  n_full = 0
  for n in range(len(sch.start_N)):
    a, z = int(sch.full_lo_N[n]), int(sch.full_hi_N[n])
    assert 0 <= a <= z <= int(sch.n_tiles_N[n])
    for j in range(a, z):
      k0 = int(sch.start_N[n]) + j * bk
      q = np.arange(n * bq, min((n + 1) * bq, t))
      assert len(q) == bq  # a block with padded queries has no unmasked tile
      keys = np.arange(k0, k0 + bk)
      ok = (keys[None, None] >= lo_np[:, q, None]) & (keys[None, None] <= q[None, :, None])
      assert ok.all(), (kind, n, j)
      n_full += 1
  if kind == "causal_one":
    assert np.asarray(sch.full_hi_N).tolist() == list(range(len(sch.start_N) - 1)) + [0]
  if kind == "padded":  # queries past the last document have no key: their blocks are masked
    assert int(sch.full_hi_N[-1]) == 0
  assert n_full > 0 or kind == "lca"


def _model_batch(t):
  rng = np.random.default_rng(5)
  doc, pos = segmented_layout((t // 2, t // 4, t // 8), t)
  return {
    "ids": jnp.asarray(random_ids(rng, (2, t))),
    "segment_ids": jnp.asarray(np.stack([np.ones(t, np.int32), doc])),
    "positions": jnp.asarray(np.stack([np.arange(t, dtype=np.int32), pos])),
  }


def _loss_fn(cfg, t):
  """params -> (training loss, model outputs) on the two-row batch of length t."""
  model = ByteLM(cfg)
  batch = _model_batch(t)
  key = jax.random.PRNGKey(3)

  def loss_fn(params):
    out = train_forward(model, params, batch, key)
    return compute_loss(cfg, out, batch, (1.0, 1.0, 10.0))[0], out

  return loss_fn


@functools.lru_cache(maxsize=None)
def _loss_and_grads(cfg, t):
  grad_fn = jax.value_and_grad(_loss_fn(cfg, t), has_aux=True)
  (loss, out), grads = jax.jit(grad_fn)(random_params(cfg))
  return loss, out, grads


# Small blocks so that T = 48 spans several query blocks and learned groups exceed the LCA
# lookback (several tiles per block, unaligned starts).
SMALL_BLOCKS = dict(attn_block_q=8, attn_block_k=16, lca_block_q=8, lca_lookback=2)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_blockwise_equals_dense(variant):
  t = 48
  fast = _loss_and_grads(tiny_config(variant, attention_impl="xla", **SMALL_BLOCKS), t)
  dense = _loss_and_grads(tiny_config(variant, attention_impl="dense"), t)
  assert_rel_close(fast[0], dense[0], what="loss")
  for key in ("ntp_logits", "mbp_logits", "mlp_mbp_logits"):
    if dense[1].get(key) is not None:
      assert_rel_close(fast[1][key], dense[1][key], what=key)
  flat = lambda tree: dict(jax.tree_util.tree_flatten_with_path(tree)[0])
  gf, gd = flat(fast[2]), flat(dense[2])
  for path, g in gd.items():
    assert_rel_close(gf[path], g, rel=1e-4, what=jax.tree_util.keystr(path))


@pytest.mark.parametrize("variant,impl", [(v, "xla") for v in VARIANTS] + [("lca_mbp", "dense")])
def test_no_t_by_t_buffer_in_train_step(variant, impl):
  """The compiled loss + gradient of every variant holds no [T, T] array with the blockwise
  path; the dense path does (so the check can fail)."""
  t = 400  # more than the vocabulary (384) and the latent capacity, so only T x T matches
  cfg = tiny_config(
    variant, attention_impl=impl, attn_block_q=32, attn_block_k=32, lca_block_q=16, lca_lookback=16
  )
  grad_fn = jax.grad(lambda p: _loss_fn(cfg, t)(p)[0])
  params = random_params(cfg)
  text = jax.jit(grad_fn).lower(params).compile().as_text()
  square = costs.buffers(text, t)["t_by_t_buffers"]
  if impl == "xla":
    assert not square, f"[T, T] arrays in the blockwise step: {sorted(square)[:5]}"
  else:
    assert square


@pytest.mark.parametrize("case,parallel", [("gqa_docs", 2), ("mqa_one_doc", 3)])
def test_parallel_loop_nests_same_result(case, parallel):
  """Cutting a call over kv heads (GQA: 2 kv heads, 2 nests) or batch rows (MQA: 3 rows,
  3 nests) gives the single call's values and gradients."""
  t, block, h, kv, docs = CASES[case]
  q, k, v, doc, grp = _case(len(case), t, block, h, kv, docs)
  lo = masks.lca_key_start(grp, doc)
  call = lambda p: (
    lambda q, k, v: blockwise_attention(q, k, v, lo, block_q=block, block_k=block, parallel=p)
  )
  w = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)
  run = lambda f: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))(
    q, k, v
  )
  (l1, g1), (lp, gp) = run(call(1)), run(call(parallel))
  assert_rel_close(lp, l1, what="loss")
  for name, a, b in zip("qkv", gp, g1):
    assert_rel_close(a, b, what=f"d{name}")


@pytest.mark.parametrize("kind", ["causal", "lca"])
def test_sharded_call_schedules_each_device_alone(kind):
  """Under a mesh whose 'data' axis splits the rows, each device runs its own rows' schedule
  (``shard_over_mesh``): the same values and gradients as one unsharded call, and a compiled
  program with no collective at all. Left to XLA's partitioner (``shard=False``, the control),
  the schedule's minimum over the batch is an all-reduce that makes every device visit the
  union of all rows' tiles."""
  t, block, h, kv, _ = CASES["gqa_docs"]
  parts = [_case(seed, t, block, h, kv, docs=True) for seed in (5, 6)]
  q, k, v, doc, grp = (jnp.concatenate(x) for x in zip(*parts))  # 6 rows
  lo = (masks.lca_key_start if kind == "lca" else lambda g, d: masks.causal_key_start(d))(grp, doc)
  w = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape), jnp.float32)

  def out_and_grads(q, k, v, lo, shard):  # cotangent w, so that no loss sums over the rows
    f = lambda q, k, v: blockwise_attention(q, k, v, lo, block_q=block, block_k=block, shard=shard)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(w)

  fn = lambda shard: jax.jit(functools.partial(out_and_grads, shard=shard))
  o1, g1 = fn(True)(q, k, v, lo)  # no mesh: one call
  mesh = shd.make_mesh({"data": 2, "fsdp": 1, "tensor": 1}, jax.devices()[:2])
  rows = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
  args = [rows(x) for x in (q, k, v, lo)]
  with jax.set_mesh(mesh):
    (os_, gs), hlo = fn(True)(*args), fn(True).lower(*args).compile().as_text()
    control = fn(False).lower(*args).compile().as_text()
  for name, a, b in zip(("out", "dq", "dk", "dv"), (os_, *gs), (o1, *g1)):
    assert_rel_close(a, b, what=name)
  collectives = re.findall(r" (all-reduce|all-gather|all-to-all|collective-permute)\(", hlo)
  assert not collectives, collectives
  assert " all-reduce(" in control, "the control shows no all-reduce: the check proves nothing"
