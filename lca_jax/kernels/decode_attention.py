"""A decode step's attention over a KV cache in one Pallas (Triton) kernel.

``cache_attention`` is ``Attention`` over a cache (``layers._attend_cache``: RoPE of the
queries and new keys, ``cached_attention``, the window and the cache write) for the few query
rows of a decode step, taking the fused q/k/v projection as it comes out of
``decode_fused.norm_matvec``. XLA runs this as six to eight kernels per layer (RoPE of q and
of k, a copy of v, scores, softmax, values, the writes); here it is one, with one program per
(row, kv head, query row) reading the cache in blocks of ``block_s`` slots with an online
softmax. The new keys and values are stored into the caches in place (``write=True``) or
returned for the caller to write later (``defer_write``).

Numerics follow the XLA path: RoPE in float32 rounded to the compute dtype, scores and the
softmax in float32 (scaled by 1/sqrt(E), masked to ``NEG_INF``), probabilities cast to the
values' dtype before their product, products accumulated in float32, the output in the compute
dtype. The probabilities are those of the running maximum (rescaled as the maximum grows), not
the final ones, so bfloat16 outputs differ from the XLA path's at bfloat16 rounding.
``interpret=True`` runs it on the CPU (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from lca_jax.kernels.decode_fused import compiler_params, rows_product

NEG_INF = -1e30
BLOCK_S = 64  # cache slots per block
REGISTER_BUDGET = 8192  # query heads x slots x half the head dimension in one block's product


def supported(n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
  """Whether the kernel takes these heads: Triton blocks are powers of two, so the query heads
  of a kv head and the head dimension (at least 2: RoPE's halves) must be."""
  g = n_heads // n_kv_heads
  return g & (g - 1) == 0 and head_dim >= 2 and head_dim & (head_dim - 1) == 0


def block_slots(slots: int, g: int, e: int, want: int = BLOCK_S) -> int:
  """Cache slots per block: the largest power of two within ``want``, the cache and the
  register budget of a [G, slots, E / 2] product."""
  cap = max(1, min(want, slots, REGISTER_BUDGET // max(g * e // 2, 1)))
  return 1 << (cap.bit_length() - 1)


def _rotate(x1, x2, c1, s1, c2, s2, dtype):
  """Rotate-half RoPE of the halves (x1, x2), in float32, rounded to ``dtype``
  (``layers.rope``)."""
  x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
  return (x1 * c1 + (-x2) * s1).astype(dtype), (x2 * c2 + x1 * s2).astype(dtype)


def _kernel(
  qkv_ref,
  cs_ref,
  rows_ref,
  allow_ref,
  win_ref,
  start_ref,
  read_ref,
  kc_ref,
  vc_ref,
  *outs,
  h: int,
  kv: int,
  t: int,
  w: int,
  n_old: int,
  bs: int,
  nb: int,
  write: bool,
  causal: bool,
):
  o_ref = outs[0]
  b, kh, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  e = qkv_ref.shape[-1]
  half, g, dtype = e // 2, h // kv, o_ref.dtype
  slots = kc_ref.shape[2]
  lo, hi = pl.ds(0, half), pl.ds(half, half)
  inv = 1.0 / jnp.sqrt(jnp.float32(e))

  def trig(j):
    """cos / sin halves [1, E / 2] of new position j's RoPE row: cos lo, sin lo, cos hi, sin hi."""
    at = lambda col: cs_ref[b, pl.ds(j, 1), pl.ds(col, half)]
    return at(0), at(e), at(half), at(e + half)

  start = jnp.clip(start_ref[b], 0, slots - t)  # as ``layers.write_kv`` clamps it
  win = jnp.clip(win_ref[b], 0, slots - w)
  rel = start - win  # the new entries' first window column
  n_read = jnp.minimum(read_ref[0], n_old)  # the slots that can hold earlier keys

  def allowed_at(col, n):
    """Whether this query row may attend window columns col .. col + n - 1: up to its
    last slot (``causal``: ``allow_ref`` [B, R]), else as its mask says (``allow_ref``
    [B, R, W] padded by ``bs`` columns on the left)."""
    if causal:
      return win + col + jnp.arange(n) <= allow_ref[b, r]
    return allow_ref[b, r, pl.ds(col + bs, n)] != 0

  row = rows_ref[b, r]
  c1, s1, c2, s2 = trig(row)
  q1, q2 = _rotate(
    qkv_ref[b, row, pl.ds(kh * g, g), lo],
    qkv_ref[b, row, pl.ds(kh * g, g), hi],
    c1,
    s1,
    c2,
    s2,
    dtype,
  )  # [G, E / 2] each

  def update(carry, sc_GN, allowed_N, pv):
    """Online softmax over N more keys; ``pv(p)`` is p [G, N] (values' dtype) times them."""
    m, l, acc = carry
    sc = jnp.where(allowed_N[None, :], sc_GN * inv, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(allowed_N[None, :], jnp.exp(sc - m_new[:, None]), 0.0)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv(p)

  def old_block(i, carry):
    # slots win + i bs .. + bs, the last block moved back inside the cache: its slots before
    # win + i bs are the previous block's, masked out here; so are the slots past the first
    # n_old and those the new entries take (read from qkv instead)
    u0 = win + i * bs
    s0 = jnp.minimum(u0, slots - bs)
    col = s0 - win + jnp.arange(bs)
    fresh = (col >= rel) & (col < rel + t)
    allowed = allowed_at(s0 - win, bs) & (col >= i * bs) & (col < n_read) & ~fresh
    keys = pl.ds(s0, bs)
    sc = rows_product(q1, kc_ref[b, kh, keys, lo].astype(dtype), False)
    sc = sc + rows_product(q2, kc_ref[b, kh, keys, hi].astype(dtype), False)
    values = vc_ref[b, kh, :, keys]  # [E, bs]
    return update(carry, sc, allowed, lambda p: rows_product(p.astype(values.dtype), values, False))

  carry = (
    jnp.full((g,), NEG_INF, jnp.float32),
    jnp.zeros((g,), jnp.float32),
    jnp.zeros((g, e), jnp.float32),
  )
  if nb:
    carry = lax.fori_loop(0, jnp.minimum(nb, (n_read + bs - 1) // bs), old_block, carry)
  new = []  # the new entries: rotated key halves and value of each new position
  for j in range(t):
    k1, k2 = _rotate(
      qkv_ref[b, pl.ds(j, 1), h + kh, lo], qkv_ref[b, pl.ds(j, 1), h + kh, hi], *trig(j), dtype
    )  # [1, E / 2] each
    v = qkv_ref[b, j, h + kv + kh, :]  # [E]
    new.append((k1, k2, v))
    sc = jnp.sum(q1.astype(jnp.float32) * k1.astype(jnp.float32), axis=1)
    sc = sc + jnp.sum(q2.astype(jnp.float32) * k2.astype(jnp.float32), axis=1)
    allowed = allowed_at(jnp.minimum(rel + j, w - 1), 1)
    pv = lambda p, v=v: p.astype(v.dtype).astype(jnp.float32) * v.astype(jnp.float32)[None, :]
    carry = update(carry, sc[:, None], allowed, pv)
  _, l, acc = carry
  out = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
  o_ref[b, r, pl.ds(kh * g, g), :] = out.astype(dtype)
  k_out, v_out = outs[1], outs[2]  # the caches (in place) or the new entries

  @pl.when(r == 0)
  def _():
    s = start if write else 0
    for j, (k1, k2, v) in enumerate(new):
      k_out[b, kh, pl.ds(s + j, 1), lo] = k1.astype(k_out.dtype)
      k_out[b, kh, pl.ds(s + j, 1), hi] = k2.astype(k_out.dtype)
      v_out[b, kh, :, s + j] = v.astype(v_out.dtype)


@functools.partial(
  jax.jit, static_argnames=("n_heads", "old_slots", "write", "interpret", "block_s")
)
def cache_attention(
  qkv_BTCE,
  cos_sin_BT2E,
  cache_k_BKSE,
  cache_v_BKES,
  mask_BRW,
  start_B,
  window_B=None,
  rows_BR=None,
  last_slot_BR=None,
  read_slots=None,
  *,
  n_heads: int,
  old_slots=None,
  write=True,
  interpret=False,
  block_s=BLOCK_S,
):
  """R queries' attention over a cache as it will be once the step's T new entries are written.

  ``qkv_BTCE`` [B, T, H + 2 K, E]: the fused projection's queries, keys and values of the T
  new positions, before RoPE; ``cos_sin_BT2E`` their RoPE cos and sin, float32
  (``layers.rope_rows``); ``cache_k_BKSE`` /
  ``cache_v_BKES`` the caches (v transposed, as ``KVCache`` stores it); ``mask_BRW`` the slots
  each query may attend: ``window_B`` .. + W of its row (the whole cache, W = S, without a
  window); ``start_B`` where the new entries go (clamped so that T fit, as
  ``layers.write_kv``); ``rows_BR`` which positions query (default: all T, R = T);
  ``old_slots`` (static) as in ``cached_attention``; ``read_slots`` ([] int32, traced) the
  same bound known only at run time: the blocks past it are not read. ``last_slot_BR`` (no window, no mask):
  each query attends the slots up to its own (``masks.cache_causal_mask`` of its position),
  compared inside the kernel instead of read from a mask. The new entries' slots are read from
  ``qkv``, not the cache. Returns (out [B, R, H, E], caches with the new entries stored in
  place), or with ``write=False`` (out, (new keys [B, K, T, E], new values [B, K, E, T]))."""
  b, t, c, e = qkv_BTCE.shape
  h = n_heads
  kv = (c - h) // 2
  slots = cache_k_BKSE.shape[2]
  causal = last_slot_BR is not None
  if causal and (mask_BRW is not None or window_B is not None):
    raise ValueError("last_slot_BR replaces the mask and takes no window")
  w = slots if causal else mask_BRW.shape[-1]
  rows = jnp.broadcast_to(jnp.arange(t), (b, t)) if rows_BR is None else rows_BR
  r = rows.shape[1]
  n_old = w if old_slots is None else min(old_slots, w)
  start = start_B.astype(jnp.int32)
  read = jnp.full((1,), slots if read_slots is None else read_slots, jnp.int32)
  win = jnp.zeros_like(start) if window_B is None else window_B.astype(jnp.int32)
  bs = block_slots(slots, h // kv, e, block_s)
  nb = -(-n_old // bs)
  if causal:
    allow = last_slot_BR.astype(jnp.int32)
  else:
    # bs columns on the left (a block moved back inside the cache reads up to bs columns
    # before its own) and enough on the right for every block
    allow = jnp.pad(mask_BRW, ((0, 0), (0, 0), (bs, max(w, nb * bs) + bs - w))).astype(jnp.int32)
  if write:
    extra_shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (cache_k_BKSE, cache_v_BKES)]
  else:
    dt = cache_k_BKSE.dtype
    extra_shapes = [
      jax.ShapeDtypeStruct((b, kv, t, e), dt),
      jax.ShapeDtypeStruct((b, kv, e, t), dt),
    ]
  out = pl.pallas_call(
    functools.partial(
      _kernel, h=h, kv=kv, t=t, w=w, n_old=n_old, bs=bs, nb=nb, write=write, causal=causal
    ),
    grid=(b, kv, r),
    out_shape=[jax.ShapeDtypeStruct((b, r, h, e), qkv_BTCE.dtype)] + extra_shapes,
    input_output_aliases={7: 1, 8: 2} if write else {},
    compiler_params=compiler_params(num_warps=4, num_stages=1),
    interpret=interpret,
    name="decode_cache_attention",
  )(
    qkv_BTCE,
    cos_sin_BT2E.astype(jnp.float32),
    rows.astype(jnp.int32),
    allow,
    win,
    start,
    read,
    cache_k_BKSE,
    cache_v_BKES,
  )
  return out[0], (out[1], out[2])
