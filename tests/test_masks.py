"""Attention masks (lca_jax.model.masks) against their set definitions, by brute force.

causal: query i sees key j iff j <= i and both lie in the same non-padding document.
LCA:    query i sees key j iff (j == i or g_j == g_i - 1 or (g_j == g_i and j < i)) and same
        non-padding document. Equivalently one contiguous key range [k_start(i), i].
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lca_jax.model import masks

B, T = 4, 29


def _segmentation(seed):
  """Random doc ids (documents + trailing padding, row 0 a single document) and row-global
  group ids g = cumsum(b) - b with a forced close at each document's last byte (as the model)."""
  rng = np.random.default_rng(seed)
  doc = np.zeros((B, T), np.int32)
  for r in range(B):
    if r == 0:
      doc[r] = 1
      continue
    at, d = 0, 1
    end = T - rng.integers(0, 6)  # padding at the end
    while at < end:
      n = min(int(rng.integers(1, 12)), end - at)
      doc[r, at : at + n] = d
      at, d = at + n, d + 1
  b = (rng.uniform(size=(B, T)) < rng.uniform(0.1, 0.7, size=(B, 1))).astype(np.int32)
  nxt = np.concatenate([doc[:, 1:], np.zeros((B, 1), np.int32)], 1)
  b = np.where((nxt != doc) & (doc != 0), 1, b) * (doc != 0)
  g = np.cumsum(b, 1) - b
  return g.astype(np.int32), doc


def brute_causal(doc_q, doc_k, pos_q=None, pos_k=None):
  tq, tk = doc_q.shape[1], doc_k.shape[1]
  out = np.zeros((doc_q.shape[0], tq, tk), bool)
  for r in range(doc_q.shape[0]):
    for i in range(tq):
      for j in range(tk):
        before = (j <= i) if pos_q is None else (pos_k[r, j] <= pos_q[r, i])
        out[r, i, j] = before and doc_q[r, i] == doc_k[r, j] and doc_k[r, j] != 0
  return out


def brute_lca(g, doc, idx_q=None):
  idx_q = np.arange(g.shape[1]) if idx_q is None else idx_q
  out = np.zeros((g.shape[0], len(idx_q), g.shape[1]), bool)
  for r in range(g.shape[0]):
    for qi, i in enumerate(idx_q):
      for j in range(g.shape[1]):
        rule = j == i or g[r, j] == g[r, i] - 1 or (g[r, j] == g[r, i] and j < i)
        out[r, qi, j] = rule and doc[r, i] == doc[r, j] and doc[r, j] != 0
  return out


causal_jit = jax.jit(masks.causal_mask)
lca_jit = jax.jit(masks.lca_mask)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_causal_mask(seed):
  _, doc = _segmentation(seed)
  np.testing.assert_array_equal(np.asarray(causal_jit(doc)), brute_causal(doc, doc))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lca_mask(seed):
  g, doc = _segmentation(seed)
  got = np.asarray(lca_jit(g, doc))
  want = brute_lca(g, doc)
  np.testing.assert_array_equal(got, want)
  # padding queries see nothing; real queries always see themselves
  real = doc != 0
  assert not got[~real].any()
  assert np.all(got[:, np.arange(T), np.arange(T)] == real)
  # one contiguous key range [k_start(i), i] per query, k_start non-decreasing within a document
  for r in range(B):
    prev_start, prev_doc = -1, None
    for i in np.nonzero(real[r])[0]:
      keys = np.nonzero(got[r, i])[0]
      assert keys[-1] == i and np.all(np.diff(keys) == 1), (r, i, keys)
      if doc[r, i] == prev_doc:
        assert keys[0] >= prev_start
      prev_start, prev_doc = keys[0], doc[r, i]
  # the LCA mask is never wider than causal (so it can only remove information)
  assert not (got & ~brute_causal(doc, doc)).any()


def test_masks_for_caches():
  """Query subsets against all keys (cached decoding): positions / absolute byte indices."""
  g, doc = _segmentation(5)
  pos = np.zeros_like(doc)
  for r in range(B):  # positions restart per document
    for t in range(1, T):
      pos[r, t] = pos[r, t - 1] + 1 if doc[r, t] == doc[r, t - 1] else 0
  q_idx = np.array([0, 3, 11, 17, T - 1])
  got = np.asarray(
    masks.causal_mask(
      jnp.asarray(doc[:, q_idx]), jnp.asarray(doc), jnp.asarray(pos[:, q_idx]), jnp.asarray(pos)
    )
  )
  np.testing.assert_array_equal(got, brute_causal(doc[:, q_idx], doc, pos[:, q_idx], pos))
  # within a document, position order is index order: same as the full causal mask's rows
  np.testing.assert_array_equal(got, brute_causal(doc, doc)[:, q_idx])
  got = np.asarray(
    masks.lca_mask(
      jnp.asarray(g[:, q_idx]),
      jnp.asarray(doc[:, q_idx]),
      jnp.asarray(g),
      jnp.asarray(doc),
      idx_q=jnp.asarray(np.broadcast_to(q_idx, (B, len(q_idx)))),
      idx_k=jnp.asarray(np.broadcast_to(np.arange(T), (B, T))),
    )
  )
  np.testing.assert_array_equal(got, brute_lca(g, doc, q_idx))


@functools.lru_cache(maxsize=None)
def _kernel_reference():
  try:
    from lca_jax.kernels import reference  # pylint: disable=g-import-not-at-top
  except Exception as e:  # pylint: disable=broad-except
    return None, f"lca_jax.kernels.reference not importable: {e!r}"
  return reference, ""


@pytest.mark.parametrize("seed", [0, 3])
def test_kernel_masks_agree(seed):
  """The attention kernels' mask (used with attention_impl='pallas') is the model's mask."""
  reference, why = _kernel_reference()
  if reference is None:
    pytest.skip(why)
  g, doc = _segmentation(seed)
  want = brute_lca(g, doc)
  kernel_mask, key_start = jax.jit(reference.lca_mask), jax.jit(reference.lca_key_start)
  np.testing.assert_array_equal(np.asarray(kernel_mask(g, doc)), want)
  start = np.asarray(key_start(g, doc))
  for r in range(B):
    for i in range(T):
      keys = np.nonzero(want[r, i])[0]
      if keys.size:
        assert start[r, i] == keys[0], (r, i)
      else:
        assert start[r, i] > i, (r, i)  # empty range for padding queries
  # the causal stacks call the kernel with all-zero group ids: then it is the causal mask
  np.testing.assert_array_equal(
    np.asarray(kernel_mask(np.zeros_like(g), doc)), brute_causal(doc, doc)
  )
