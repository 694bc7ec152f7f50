"""Attention masks built inside jit from per-position ids (docs/design.md §3.1, §3.2).

Every dense mask is boolean ``[B, Tq, Tk]``: True = query may attend key. ``doc`` ids are 0
for padding (never attended, and a padded query attends nothing), otherwise a document id; two
positions interact only when their doc ids are equal. With ``concat`` packing every doc id is 1.

For self-attention over a packed row (documents are contiguous runs of equal non-zero ids)
each training mask is an interval per query: key ``j`` is allowed iff ``lo_i <= j <= i``.
``causal_key_start`` and ``lca_key_start`` give ``lo`` (``i + 1`` for a padded query, i.e. no
key); the blockwise attention (``model/attention.py``) and the Pallas kernels consume ``lo``,
the dense masks below are their reference (tests check both agree).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lca_jax.kernels.reference import lca_allowed, lca_key_start

__all__ = [
  "same_doc",
  "causal_mask",
  "cache_causal_mask",
  "lca_mask",
  "causal_key_start",
  "lca_key_start",
]


def same_doc(doc_q, doc_k):
  """[B,Tq],[B,Tk] -> [B,Tq,Tk]: same non-padding document."""
  return (doc_q[:, :, None] == doc_k[:, None, :]) & (doc_k[:, None, :] != 0)


def causal_mask(doc_q, doc_k=None, pos_q=None, pos_k=None):
  """Causal within a document: key index <= query index (or key position <= query position).

  Without positions, indices into the two sequences are compared (the usual self-attention).
  With positions (cached decoding: keys are a cache, queries the new bytes), positions are.
  """
  doc_k = doc_q if doc_k is None else doc_k
  if pos_q is None:
    tq, tk = doc_q.shape[1], doc_k.shape[1]
    order = jnp.arange(tk)[None, None, :] <= jnp.arange(tq)[None, :, None]
  else:
    order = pos_k[:, None, :] <= pos_q[:, :, None]
  return order & same_doc(doc_q, doc_k)


def lca_mask(group_q, doc_q=None, group_k=None, doc_k=None, idx_q=None, idx_k=None):
  """LCA mask (``kernels.reference.lca_allowed``): query i sees key j iff j == i, or j < i
  with g_j in {g_i - 1, g_i}; i.e. one contiguous key range [first byte of group g_i - 1, i].

  ``idx_*`` are absolute byte indices (default: 0..T-1) so the same rule applies to a KV cache
  (keys = cache slots). ``doc_q=None``: one document, no padding (a decode cache).
  """
  group_k = group_q if group_k is None else group_k
  if idx_q is None:
    idx_q = jnp.arange(group_q.shape[1])[None, :]
  if idx_k is None:
    idx_k = jnp.arange(group_k.shape[1])[None, :]
  allowed = lca_allowed(
    group_q[:, :, None], group_k[:, None, :], idx_q[:, :, None], idx_k[:, None, :]
  )
  if doc_q is None:
    return allowed
  return allowed & same_doc(doc_q, doc_q if doc_k is None else doc_k)


def cache_causal_mask(pos_BQ, n_slots: int):
  """[B, Q, S] causal mask of Q queries at positions ``pos`` over a cache of S slots (slot j
  holds position j)."""
  return jnp.arange(n_slots)[None, None, :] <= pos_BQ[:, :, None]


def causal_key_start(doc_BT):
  """lo_i for causal attention within documents: the first index of i's run of equal doc
  ids, or i + 1 for padding (doc id 0). int32 [B, T], non-decreasing."""
  b, t = doc_BT.shape
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  start = jnp.concatenate([jnp.ones((b, 1), bool), doc_BT[:, 1:] != doc_BT[:, :-1]], axis=1)
  run_start = jax.lax.cummax(jnp.where(start, pos, 0), axis=1)
  return jnp.where(doc_BT != 0, run_start, pos + 1)
