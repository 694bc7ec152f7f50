"""LCA mask definitions and the dense XLA reference attention.

Terminology (shapes are carried in suffixes: B batch, T time, H query heads,
K key/value heads, G = H // K query heads per kv head, D head dim):

* ``segment_ids[b, t]`` is the group id ``g_t`` of byte ``t``: bytes are
  partitioned into contiguous groups and ``g`` is non-decreasing inside a
  document (ids may restart per document or increase globally).
* ``doc_ids[b, t]`` (optional) is the document id; ``0`` marks padding.

LCA mask (the set definition): query ``i`` may attend key ``j`` iff ``i`` and
``j`` are in the same (non-padding) document and

    j == i   or   g_j == g_i - 1   or   (g_j == g_i and j < i).

Because groups are contiguous and non-decreasing within a document, the
allowed keys of query ``i`` form the interval ``[k_start(i), i]`` where
``k_start(i)`` is the first position of group ``g_i - 1`` in ``i``'s document,
or the first position of group ``g_i`` when that group does not exist. For a
padding query (doc id 0) the interval is empty and ``k_start(i) = i + 1``;
``k_start`` is still non-decreasing in ``i``.

This module only depends on ``jax``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def _default_doc_ids(segment_ids_BT: jax.Array, doc_ids_BT: jax.Array | None) -> jax.Array:
  """Returns ``doc_ids`` or, when absent, a single document (id 1) per row."""
  if doc_ids_BT is None:
    return jnp.ones(segment_ids_BT.shape, jnp.int32)
  return doc_ids_BT.astype(jnp.int32)


def lca_allowed(g_i, g_j, i, j):
  """The LCA rule, elementwise with broadcasting: may query ``i`` (group ``g_i``) attend key
  ``j`` (group ``g_j``)? ``j == i``, or ``j < i`` with ``g_j`` in ``{g_i - 1, g_i}``.

  Within a sequence whose group ids are non-decreasing, ``g_j == g_i - 1`` already implies
  ``j < i`` (the set definition above); stating ``j < i`` makes the rule also hold over a KV
  cache whose slots past the query hold stale ids. The one definition every LCA mask uses
  (this module's dense mask, ``model.masks`` and the cached decode step).
  """
  return (j == i) | ((j < i) & ((g_j == g_i - 1) | (g_j == g_i)))


def lca_mask(segment_ids: jax.Array, doc_ids: jax.Array | None = None) -> jax.Array:
  """Dense LCA mask from the set definition.

  Args:
    segment_ids: int [B, T] group ids.
    doc_ids: optional int [B, T] document ids, 0 = padding.

  Returns:
    bool [B, T, T]; ``mask[b, i, j]`` is True iff query ``i`` may attend key ``j``.
  """
  seg_BT = segment_ids.astype(jnp.int32)
  T = seg_BT.shape[1]
  pos_T = jnp.arange(T)
  allowed_BTT = lca_allowed(seg_BT[:, :, None], seg_BT[:, None, :], pos_T[:, None], pos_T[None, :])
  if doc_ids is None:
    return allowed_BTT
  doc_BT = doc_ids.astype(jnp.int32)
  same_doc_BTT = doc_BT[:, :, None] == doc_BT[:, None, :]
  key_valid_B1T = (doc_BT != 0)[:, None, :]
  return allowed_BTT & same_doc_BTT & key_valid_B1T


def lca_key_start(segment_ids: jax.Array, doc_ids: jax.Array | None = None) -> jax.Array:
  """First allowed key position ``k_start(i)`` of every query (see module doc).

  Args:
    segment_ids: int [B, T] group ids (non-decreasing within a document).
    doc_ids: optional int [B, T] document ids, 0 = padding.

  Returns:
    int32 [B, T], non-decreasing in ``t``; ``i + 1`` for padding queries.
  """
  seg_BT = segment_ids.astype(jnp.int32)
  doc_BT = _default_doc_ids(seg_BT, doc_ids)
  B, T = seg_BT.shape
  pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

  continues_BT = jnp.concatenate(
    [
      jnp.zeros((B, 1), bool),
      (seg_BT[:, 1:] == seg_BT[:, :-1]) & (doc_BT[:, 1:] == doc_BT[:, :-1]),
    ],
    axis=1,
  )
  group_start_BT = lax.cummax(jnp.where(continues_BT, 0, pos_BT), axis=1)

  prev_BT = group_start_BT - 1  # last position of the preceding group
  prev_c_BT = jnp.maximum(prev_BT, 0)
  take = lambda x_BT: jnp.take_along_axis(x_BT, prev_c_BT, axis=1)
  has_prev_BT = (prev_BT >= 0) & (take(doc_BT) == doc_BT) & (take(seg_BT) == seg_BT - 1)
  k_start_BT = jnp.where(has_prev_BT, take(group_start_BT), group_start_BT)
  return jnp.where(doc_BT != 0, k_start_BT, pos_BT + 1)


def lca_attention_reference(
  q_BTHD: jax.Array,
  k_BTKD: jax.Array,
  v_BTKD: jax.Array,
  segment_ids: jax.Array,
  doc_ids: jax.Array | None = None,
  scale: float | None = None,
) -> jax.Array:
  """Dense-masked LCA attention in XLA (the oracle and the CPU path).

  Logits and softmax are computed in float32; fully masked query rows (padding)
  return zeros and have zero, finite gradients.

  Args:
    q_BTHD: queries [B, T, H, D].
    k_BTKD: keys [B, T, K, D] with ``H % K == 0`` (query head h uses kv head h // G).
    v_BTKD: values [B, T, K, D].
    segment_ids: int [B, T] group ids.
    doc_ids: optional int [B, T] document ids, 0 = padding.
    scale: logit scale, default ``1 / sqrt(D)``.

  Returns:
    [B, T, H, D] in ``q_BTHD.dtype``.
  """
  B, T, H, D = q_BTHD.shape
  K = k_BTKD.shape[2]
  G = H // K
  scale = 1.0 / math.sqrt(D) if scale is None else scale

  q_BTKGD = q_BTHD.reshape(B, T, K, G, D)
  logits_BKGTS = (
    jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BTKD, preferred_element_type=jnp.float32) * scale
  )
  mask_B11TS = lca_mask(segment_ids, doc_ids)[:, None, None]
  logits_BKGTS = jnp.where(mask_B11TS, logits_BKGTS, -jnp.inf)

  row_max_BKGT1 = jnp.max(logits_BKGTS, axis=-1, keepdims=True)
  row_max_BKGT1 = lax.stop_gradient(jnp.where(jnp.isfinite(row_max_BKGT1), row_max_BKGT1, 0.0))
  probs_BKGTS = jnp.exp(logits_BKGTS - row_max_BKGT1)  # exp(-inf) = 0 when masked
  denom_BKGT1 = jnp.sum(probs_BKGTS, axis=-1, keepdims=True)
  probs_BKGTS = probs_BKGTS / jnp.where(denom_BKGT1 == 0, 1.0, denom_BKGT1)

  out_BTKGD = jnp.einsum(
    "bkgts,bskd->btkgd", probs_BKGTS, v_BTKD.astype(jnp.float32), preferred_element_type=jnp.float32
  )
  return out_BTKGD.reshape(B, T, H, D).astype(q_BTHD.dtype)
