"""Tests for lca_jax.kernels: mask semantics, XLA reference, Pallas kernels.

Pallas kernels run in interpret mode on CPU and are compiled by Triton on a GPU (the same
tests; `tools/gpu_check.sh`); a separate test lowers them for CUDA (no GPU needed) so
Triton's shape rules are checked. On a GPU float32 inputs are multiplied at TF32, the
precision both the kernels' ``tl.dot`` and XLA's reference dots use there by default, so
float32 cases are compared at ``REL_TF32`` of the scale (``REL_REORDER`` on CPU).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import REL_REORDER, REL_TF32, assert_close_rel  # noqa: E402

from lca_jax.kernels import (  # noqa: E402
  lca_attention,
  lca_attention_reference,
  lca_key_start,
  lca_mask,
)
from lca_jax.kernels.lca_attention import (  # noqa: E402
  key_block_query_bounds,
  query_block_key_bounds,
)

INTERPRET = jax.default_backend() == "cpu"  # on a GPU the kernels are compiled for real

# ----------------------------------------------------------------------------
# Input builders.
# ----------------------------------------------------------------------------


def random_groups(rng, n, first_id=0, max_len=40):
  """Group ids for ``n`` bytes with segment lengths in [1, max_len]."""
  ids, g = [], first_id
  while len(ids) < n:
    ids += [g] * int(rng.integers(1, max_len + 1))
    g += 1
  return ids[:n]


def packed_row(rng, doc_lens, restart_groups):
  """(segment_ids, doc_ids) for a row of documents; a length < 0 means padding.

  Padding repeats the last group id, so with ``restart_groups=False`` the row's
  group ids are non-decreasing overall (valid without ``doc_ids`` too).
  """
  seg, doc, next_doc, next_group = [], [], 1, 0
  for n in doc_lens:
    if n < 0:
      seg += [max(next_group - 1, 0)] * -n
      doc += [0] * -n
      continue
    groups = random_groups(rng, n, 0 if restart_groups else next_group)
    next_group = groups[-1] + 1
    seg += groups
    doc += [next_doc] * n
    next_doc += 1
  return seg, doc


def scenario_rows(rng, T, restart_groups=True):
  """Four rows: random groups, one single segment, packed docs with trailing
  padding (group ids restart per doc unless ``restart_groups=False``), packed
  docs with leading/middle padding and globally increasing group ids.

  Use ``restart_groups=False`` when the rows are used without ``doc_ids``
  (group ids must then be non-decreasing along the whole row).
  """
  rows = [
    (random_groups(rng, T), [1] * T),
    ([0] * T, [1] * T),
    packed_row(rng, [T // 3, T // 3, -(T - 2 * (T // 3))], restart_groups),
    packed_row(rng, [-3, T // 3, -2, T - T // 3 - 7, 2], restart_groups=False),
  ]
  seg = np.array([r[0] for r in rows], np.int32)
  doc = np.array([r[1] for r in rows], np.int32)
  assert seg.shape == (4, T) and doc.shape == (4, T)
  return seg, doc


def random_qkv(rng, B, T, H, KV, D, dtype):
  draw = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype)
  return draw(B, T, H, D), draw(B, T, KV, D), draw(B, T, KV, D)


def set_definition_mask(seg, doc=None):
  """numpy bool [B, T, T] straight from the set definition (python loops)."""
  B, T = seg.shape
  mask = np.zeros((B, T, T), bool)
  for b in range(B):
    for i in range(T):
      for j in range(T):
        if doc is not None and (doc[b, i] != doc[b, j] or doc[b, j] == 0):
          continue
        gi, gj = seg[b, i], seg[b, j]
        mask[b, i, j] = j == i or gj == gi - 1 or (gj == gi and j < i)
  return mask


# ----------------------------------------------------------------------------
# Mask semantics.
# ----------------------------------------------------------------------------


def test_lca_mask_matches_set_definition():
  rng = np.random.default_rng(0)
  seg, doc = scenario_rows(rng, 48)
  np.testing.assert_array_equal(np.asarray(lca_mask(seg, doc)), set_definition_mask(seg, doc))
  np.testing.assert_array_equal(np.asarray(lca_mask(seg)), set_definition_mask(seg))


@pytest.mark.parametrize("use_docs", [True, False])
def test_key_start_is_interval_of_mask(use_docs):
  rng = np.random.default_rng(1)
  seg, doc = scenario_rows(rng, 80, restart_groups=use_docs)
  doc = doc if use_docs else None
  k_start = np.asarray(jax.jit(lca_key_start)(seg, doc))
  mask = np.asarray(jax.jit(lca_mask)(seg, doc))
  T = seg.shape[1]
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  interval = (j >= k_start[:, :, None]) & (j <= i)
  np.testing.assert_array_equal(interval, mask)
  assert (np.diff(k_start, axis=1) >= 0).all(), "k_start must be non-decreasing"


@pytest.mark.parametrize("block_q,block_k", [(16, 16), (16, 32), (32, 16)])
def test_block_bounds_cover_mask(block_q, block_k):
  rng = np.random.default_rng(2)
  seg, doc = scenario_rows(rng, 96)
  k_start = jax.jit(lca_key_start)(seg, doc)
  mask = np.asarray(jax.jit(lca_mask)(seg, doc))
  bounds = jax.jit(
    lambda ks: (
      query_block_key_bounds(ks, block_q, block_k),
      key_block_query_bounds(ks, block_q, block_k),
    )
  )
  (kb_lo, kb_hi), (qb_lo, qb_hi) = jax.tree.map(np.asarray, bounds(k_start))
  b, i, j = np.nonzero(mask)
  qb, kb = i // block_q, j // block_k
  assert ((kb_lo[b, qb] <= kb) & (kb < kb_hi[b, qb])).all(), "fwd/dq bounds miss a pair"
  assert ((qb_lo[b, kb] <= qb) & (qb < qb_hi[b, kb])).all(), "dk/dv bounds miss a pair"
  # Padding-only rows of row 2 (last third) visit nothing.
  assert kb_lo[2, -1] == kb_hi[2, -1] == 0


# ----------------------------------------------------------------------------
# XLA reference vs brute force.
# ----------------------------------------------------------------------------


def brute_force_attention(q, k, v, seg, doc, scale):
  """float64 per-query loop over the set definition; empty rows give zeros."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, H, _ = q.shape
  G = H // k.shape[2]
  out = np.zeros_like(q)
  for b in range(B):
    for i in range(T):
      keys = [
        j
        for j in range(T)
        if (doc is None or (doc[b, i] == doc[b, j] and doc[b, j] != 0))
        and (j == i or seg[b, j] == seg[b, i] - 1 or (seg[b, j] == seg[b, i] and j < i))
      ]
      if not keys:
        continue
      for h in range(H):
        logits = k[b, keys, h // G] @ q[b, i, h] * scale
        w = np.exp(logits - logits.max())
        out[b, i, h] = (w / w.sum()) @ v[b, keys, h // G]
  return out


@pytest.mark.parametrize("use_docs", [True, False])
def test_reference_matches_brute_force(use_docs):
  rng = np.random.default_rng(3)
  seg, doc = scenario_rows(rng, 40, restart_groups=use_docs)
  doc = doc if use_docs else None
  q, k, v = random_qkv(rng, 4, 40, 4, 2, 16, jnp.float32)
  out = jax.jit(lca_attention_reference)(q, k, v, seg, doc)
  expected = brute_force_attention(q, k, v, seg, doc, 1 / np.sqrt(16))
  assert_close_rel(out, expected)


# ----------------------------------------------------------------------------
# Pallas (interpret mode) vs XLA reference: forward and gradients.
# ----------------------------------------------------------------------------


def f32_tolerance(tol: float, dtype) -> float:
  """A float32 case's tolerance: at least ``REL_TF32`` where the kernels are compiled (a GPU's
  float32 dots run at TF32)."""
  return tol if INTERPRET or jnp.dtype(dtype) != jnp.float32 else max(tol, REL_TF32)


def out_and_grads(q, k, v, w, seg, doc, impl, block_q, block_k):
  """Output and (dq, dk, dv) of the linear functional ``sum(w * out)``."""

  def loss(q, k, v):
    out = lca_attention(
      q, k, v, seg, doc_ids=doc, impl=impl, interpret=INTERPRET, block_q=block_q, block_k=block_k
    )
    return jnp.sum(w * out.astype(jnp.float32)), out

  grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, grads


CASES = {
  # name: (T, H, KV, D, dtype, block_q, block_k, use_docs, tolerance relative to the scale)
  "f32_gqa2_docs_T80": (80, 4, 2, 32, jnp.float32, 16, 32, True, REL_REORDER),
  "f32_mqa_nodocs_T50": (50, 4, 1, 16, jnp.float32, 32, 16, False, REL_REORDER),
  "f32_mha_d64_T40": (40, 2, 2, 64, jnp.float32, 16, 16, True, REL_REORDER),
  "bf16_gqa2_docs_T72": (72, 4, 2, 32, jnp.bfloat16, 32, 32, True, 2e-2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pallas_matches_reference(name):
  T, H, KV, D, dtype, block_q, block_k, use_docs, tol = CASES[name]
  tol = f32_tolerance(tol, dtype)
  rng = np.random.default_rng(sorted(CASES).index(name))
  seg, doc = scenario_rows(rng, T, restart_groups=use_docs)
  doc = jnp.asarray(doc) if use_docs else None
  seg = jnp.asarray(seg)
  q, k, v = random_qkv(rng, 4, T, H, KV, D, dtype)
  w = jnp.asarray(rng.standard_normal((4, T, H, D)), jnp.float32)

  run = lambda impl: jax.jit(
    functools.partial(out_and_grads, impl=impl, block_q=block_q, block_k=block_k)
  )(
    q,
    k,
    v,
    w,
    seg,
    doc,
  )
  ref_out, ref_grads = run("xla")
  out, grads = run("pallas")

  assert out.dtype == dtype and out.shape == q.shape
  for got, want, what in zip((out, *grads), (ref_out, *ref_grads), ("out", "dq", "dk", "dv")):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all() and np.isfinite(want).all(), what
    assert_close_rel(got, want, tol, err_msg=what)
  if use_docs:  # padded query rows are exactly zero
    assert not np.asarray(out, np.float32)[np.asarray(doc) == 0].any()


def test_pallas_pads_head_dim():
  """D = 24 (not a power of two) is zero-padded to 32 inside the wrapper."""
  rng = np.random.default_rng(4)
  seg, doc = scenario_rows(rng, 32)
  q, k, v = random_qkv(rng, 4, 32, 2, 1, 24, jnp.float32)
  ref = jax.jit(lca_attention_reference)(q, k, v, seg, doc)
  pallas = functools.partial(
    lca_attention, impl="pallas", interpret=INTERPRET, block_q=16, block_k=16
  )
  out = jax.jit(lambda q, k, v, seg, doc: pallas(q, k, v, seg, doc_ids=doc))(q, k, v, seg, doc)
  assert_close_rel(out, ref, f32_tolerance(REL_REORDER, q.dtype))


def test_invalid_arguments():
  q = jnp.zeros((1, 16, 2, 16))
  seg = jnp.zeros((1, 16), jnp.int32)
  with pytest.raises(ValueError, match="impl"):
    lca_attention(q, q, q, seg, impl="cuda")
  with pytest.raises(ValueError, match="power"):
    lca_attention(q, q, q, seg, impl="pallas", interpret=True, block_q=24)
  with pytest.raises(ValueError, match="multiple"):
    lca_attention(q, q[:, :, :1].repeat(3, axis=2), q[:, :, :1].repeat(3, axis=2), seg)


# ----------------------------------------------------------------------------
# Lowering for CUDA on a CPU-only machine (checks Triton shape rules).
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128])
def test_pallas_lowers_for_cuda(head_dim):
  B, T, H, KV = 1, 200, 4, 2
  q = jax.ShapeDtypeStruct((B, T, H, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, T, KV, head_dim), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((B, T), jnp.int32)

  def fwd(q, k, v, seg, doc):
    return lca_attention(q, k, v, seg, doc_ids=doc, impl="pallas")

  def fwd_bwd(q, k, v, seg, doc):
    loss = lambda q, k, v: jnp.sum(fwd(q, k, v, seg, doc).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  for f, n_kernels in ((fwd, 1), (fwd_bwd, 3)):
    # jax >= 0.11 lowers for the GPU kind of the abstract mesh (it no longer falls back to sm_90
    # without a GPU); jax 0.10 ignores the mesh here.
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)
    with jax.sharding.use_abstract_mesh(mesh):
      lowered = jax.jit(f).trace(q, kv, kv, ids, ids).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == n_kernels, f.__name__
