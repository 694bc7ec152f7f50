"""Byte <-> latent maps with static shapes (docs/design.md §2.5-§2.7), O(T) segment sums.

Latent slots: every document of a row owns a null slot followed by one slot per CLOSED group.
With ``concat`` packing (one document per row) this is upstream's [null, s_1, ..., s_K].
A byte of group k (k-th group of the row, counting from 0) whose document has ordinal o
(1, 2, ... within the row) pools into slot k + o; byte t reads slot u_t + o_t - 1 with
u_t = cumsum(b)_t, i.e. a byte inside a group reads the slot before its group, a closing byte
reads its own (now complete) group.

Capacity rule (static S slots): groups whose slot is >= S are not pooled (counted as
overflow); a byte whose read slot is >= S reads slot S-1 instead when that slot belongs to its
own document, else zeros. Slot S-1 then holds a group closed before the byte, so causality and
document isolation hold; only freshness is lost.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lca_jax.model import rows


class LatentPlan(NamedTuple):
  group_BT: jax.Array  # int32 group id g_t = cumsum(b) - b (row-global)
  slot_BT: jax.Array  # int32 slot a byte pools into (may be >= S)
  pool_BT: jax.Array  # bool: byte is pooled (closed group, real byte, slot < S)
  read_BT: jax.Array  # int32 slot a byte reads (already clipped into [0, S))
  read_ok_BT: jax.Array  # bool: the read slot is valid (else the byte reads zeros)
  null_BS: jax.Array  # bool: slot is a document's null slot
  slot_doc_BS: jax.Array  # int32 document id of each slot (0 = unused)
  slot_pos_BS: jax.Array  # int32 position of each slot inside its document's latent sequence
  n_closed_B: jax.Array  # int32 closed groups per row
  overflow_B: jax.Array  # int32 closed groups that did not fit in the capacity


def _scatter(n, idx_BT, val_BT, ok_BT, fill=0):
  """out[b, idx] = val where ok (indices past n dropped); other slots keep ``fill``."""
  idx = jnp.where(ok_BT, idx_BT, n)  # n is out of range: dropped
  # one scatter per row under vmap: its batch axis stays a batching dimension of the scatter,
  # which a batch-sharded step keeps on each device (row indices written out as
  # ``out.at[arange(b)[:, None], idx]`` made XLA gather the whole batch onto every device)
  row = lambda i_T, v_T: jnp.full((n,), fill, v_T.dtype).at[i_T].set(v_T, mode="drop")
  return jax.vmap(row)(idx, val_BT)


def plan_latents(b_hard_BT, doc_BT, n_slots: int) -> LatentPlan:
  """Static-shape slot assignment from hard boundaries (0/1) and doc ids (0 = padding)."""
  bh = (b_hard_BT > 0).astype(jnp.int32)
  real = doc_BT != 0
  bh = bh * real
  u = jnp.cumsum(bh, axis=1)
  g = u - bh
  start = jnp.concatenate([jnp.ones_like(doc_BT[:, :1], bool), doc_BT[:, 1:] != doc_BT[:, :-1]], 1)
  start = start & real
  o = jnp.maximum(jnp.cumsum(start.astype(jnp.int32), axis=1), 1)
  # null slot of each byte's document: (groups closed before the doc starts) + ordinal - 1
  null_at_start = jnp.where(start, g + o - 1, 0)
  null_slot = jax.lax.cummax(null_at_start, axis=1)
  n_closed = jnp.sum(bh, axis=1)
  closed = g < n_closed[:, None]
  slot = g + o
  pool = closed & real & (slot < n_slots)
  read = u + o - 1
  clipped = jnp.minimum(read, n_slots - 1)
  read_ok = real & (clipped >= null_slot)
  null_BS = _scatter(n_slots, null_slot, jnp.ones_like(start), start & (null_slot < n_slots), False)
  doc_slot = _scatter(n_slots, slot, doc_BT, pool)
  doc_null = _scatter(n_slots, null_slot, doc_BT, start & (null_slot < n_slots))
  slot_doc = jnp.where(null_BS, doc_null, doc_slot)
  pos_slot = _scatter(n_slots, slot, slot - null_slot, pool)
  slot_pos = jnp.where(null_BS, 0, pos_slot)
  overflow = jnp.sum(bh * (slot >= n_slots), axis=1)
  return LatentPlan(
    g,
    slot,
    pool,
    jnp.where(read_ok, clipped, 0),
    read_ok,
    null_BS,
    slot_doc,
    slot_pos,
    n_closed,
    overflow,
  )


def downsample(h_BTD, b_BT, plan: LatentPlan, null_D):
  """s[slot] = sum w_t h_t / (sum w_t + 1e-9) over the group's bytes; null slots = null_D.

  w_t = 1 + (c_t - stop_grad(c_t)), c_t = cumsum(b)_t - b_t: value 1, and the gradient that
  upstream's dense B x T x S pooling sends to the straight-through boundaries.
  """
  n_slots = plan.null_BS.shape[1]
  c = jnp.cumsum(b_BT, axis=1) - b_BT
  w = (1.0 + (c - jax.lax.stop_gradient(c))) * plan.pool_BT
  idx = jnp.where(plan.pool_BT, plan.slot_BT, n_slots)

  def per_row(hw, ww, ii):
    num = jax.ops.segment_sum(hw, ii, num_segments=n_slots + 1)[:n_slots]
    den = jax.ops.segment_sum(ww, ii, num_segments=n_slots + 1)[:n_slots]
    return num, den

  hw = (rows.merged(h_BTD.astype(jnp.float32)) * w.reshape(-1, 1)).reshape(h_BTD.shape)
  num_BSD, den_BS = jax.vmap(per_row)(hw, w, idx)
  s = group_mean(num_BSD, den_BS, jnp.float32)  # outside the vmap: its rows view is [B S, D]
  s = jnp.where(plan.null_BS[..., None], null_D.astype(jnp.float32), s)
  return s.astype(h_BTD.dtype)


def upsample(z_BSD, plan: LatentPlan):
  """Byte t reads z[read_t] (zeros where the plan says it has no valid slot)."""
  out = jnp.take_along_axis(z_BSD, plan.read_BT[..., None], axis=1)
  return out * plan.read_ok_BT[..., None].astype(z_BSD.dtype)


def open_group_sums(prev_close_BK, x_BKD, w_BK, carry_BD, carry_cnt_B):
  """Group sums inside a block of K bytes fed to a cache (decoding): segment s of the block
  starts after each close (``prev_close``: the byte before closed its group); segment 0
  continues the group left open before the block, whose sum and count are ``carry``. Returns
  the running group's total sum and count (of weights ``w``: 1 for real bytes) at each
  position ([B, K, D], [B, K]) and the segment ids [B, K]. O(K) segment sums; the mean
  ``sum / (count + 1e-9)`` is what ``downsample`` stores for a closed group.
  """
  k = prev_close_BK.shape[1]
  seg = jnp.cumsum(prev_close_BK.astype(jnp.int32), axis=1)
  tot = jax.vmap(lambda x, s: jax.ops.segment_sum(x, s, num_segments=k))(x_BKD, seg)
  cnt = jax.vmap(lambda w, s: jax.ops.segment_sum(w, s, num_segments=k))(w_BK, seg)
  tot = tot.at[:, 0].add(carry_BD)
  cnt = cnt.at[:, 0].add(carry_cnt_B)
  return jnp.take_along_axis(tot, seg[..., None], 1), jnp.take_along_axis(cnt, seg, 1), seg


def group_mean(sum_BKD, cnt_BK, dtype):
  """The pooled value of a group from its sum and count (``downsample``'s formula)."""
  mean = rows.merged(sum_BKD) / (cnt_BK.reshape(-1, 1) + 1e-9)  # model/rows.py
  return mean.reshape(sum_BKD.shape).astype(dtype)
