"""Blockwise (flash-style) self-attention in plain JAX for interval masks.

Every training mask of the model family is an *interval mask*: query ``i`` may attend key
``j`` iff ``lo_i <= j <= i``, where ``lo`` comes from :mod:`lca_jax.model.masks`
(``causal_key_start``: the first byte of ``i``'s document; ``lca_key_start``: the first byte
of the group before ``i``'s, see docs/design.md §3.2). A query with no key (padding) has
``lo_i = i + 1``.

``blockwise_attention`` never builds a [T, T] array: queries are cut into blocks of
``block_q`` rows; block ``n`` visits only the key tiles of ``block_k`` keys that cover
``[min lo, max i]`` of its non-empty rows (taken over the batch, so one loop serves every row;
under a multi-device mesh over each device's own rows),
starting at that minimum (tiles need not be aligned to ``block_k``), with an online softmax in
float32. The number of tiles is computed inside the jitted step from ``lo`` (a
``lax.fori_loop`` with a traced trip count), so masked-out work (the upper triangle, earlier
documents, groups older than the previous one) is skipped, and a group longer than a block
only means more tiles: the result stays exact. The backward pass (``jax.custom_vjp``)
recomputes the probabilities tile by tile from the saved log-sum-exp (FlashAttention-2): one
loop nest gives dq per query block and accumulates dk/dv into the visited key ranges.

Shapes: B batch, T length, H query heads, K kv heads (GQA: query head h uses kv head
h // (H // K)), G = H // K, E head dim; Q = block_q, S = block_k, N = number of query blocks.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from lca_jax.kernels.sharded import shard_over_mesh
from lca_jax.model import rows

NEG_INF = -1e30


def _pad_lo(lo_BT, length):
  """Key starts padded to ``length`` queries; padded queries have no key (lo = int32 max)."""
  return jnp.pad(
    lo_BT.astype(jnp.int32),
    ((0, 0), (0, length - lo_BT.shape[1])),
    constant_values=jnp.iinfo(jnp.int32).max,
  )


class Schedule(NamedTuple):
  """Per query block: first key of its first tile, the number of tiles it visits, and the
  range [full_lo, full_hi) of those tiles that no row of the block masks (every key of the
  tile is allowed for every query: the block has no empty row, the tile starts at or after
  every row's ``lo`` and ends at or before the block's first query). Those tiles skip the
  mask; the others apply it. The order of tiles, hence the result, is the same."""

  start_N: jax.Array  # int32 [N]
  n_tiles_N: jax.Array  # int32 [N]
  full_lo_N: jax.Array  # int32 [N]
  full_hi_N: jax.Array  # int32 [N]


def schedule(lo_BT: jax.Array, block_q: int, block_k: int) -> Schedule:
  """Tiles visited by each query block (union over the batch), from the key starts ``lo``."""
  b, t = lo_BT.shape
  n = -(-t // block_q)
  pos_T = jnp.arange(n * block_q, dtype=jnp.int32)
  lo = _pad_lo(lo_BT, n * block_q)
  nonempty_BT = lo <= pos_T
  first_N = jnp.min(jnp.where(nonempty_BT, lo, t).reshape(b, n, block_q), axis=(0, 2))
  end_N = jnp.max(jnp.where(nonempty_BT, pos_T + 1, 0).reshape(b, n, block_q), axis=(0, 2))
  tiles_N = jnp.where(end_N > first_N, -(-(end_N - first_N) // block_k), 0)
  start_N = jnp.minimum(first_N, t)
  # unmasked tiles: keys in [max lo, first query of the block], all rows non-empty
  full_N = jnp.all(nonempty_BT.reshape(b, n, block_q), axis=(0, 2))
  max_lo_N = jnp.max(jnp.where(nonempty_BT, lo, 0).reshape(b, n, block_q), axis=(0, 2))
  q0_N = jnp.arange(n, dtype=jnp.int32) * block_q
  hi_N = jnp.clip((q0_N + 1 - start_N) // block_k, 0, tiles_N)
  lo_N = jnp.clip(-(-(max_lo_N - start_N) // block_k), 0, hi_N)
  hi_N = jnp.where(full_N, hi_N, 0)
  lo_N = jnp.where(full_N, lo_N, 0)
  i32 = lambda x: x.astype(jnp.int32)
  return Schedule(i32(start_N), i32(tiles_N), i32(lo_N), i32(hi_N))


# Tile loops per query block (masked, unmasked, masked): XLA's cost analysis counts each loop
# body once, whatever its trip count (perf/costs.py corrects for the tiles really run).
LOOPS_PER_BLOCK = 3


def _tile_loops(sched: Schedule, n, masked_body, full_body, init):
  """Run block ``n``'s tiles in order: masked ones before and after [full_lo, full_hi), the
  unmasked ones between."""
  a, z, e = sched.full_lo_N[n], sched.full_hi_N[n], sched.n_tiles_N[n]
  c = lax.fori_loop(0, a, masked_body, init)
  c = lax.fori_loop(a, z, full_body, c)
  return lax.fori_loop(z, e, masked_body, c)


def tiles_visited(lo_BT: jax.Array, block_q: int, block_k: int) -> jax.Array:
  """Total number of (query block, key tile) pairs one call executes (for FLOP accounting)."""
  return jnp.sum(schedule(lo_BT, block_q, block_k).n_tiles_N)


class _Blocks(NamedTuple):
  """Inputs laid out head-major for the loops: queries by block, keys (transposed, [B,K,E,S])
  and values padded by one tile so no tile is clamped at the end. These are the residuals the
  backward pass keeps; it lays the keys out untransposed again itself (one transpose per call),
  so the transposed keys cost no memory between the passes.

  Every tile product is then a plain [M, C] x [C, N] product of row-major operands, the only
  form XLA:CPU's matmul library (YNNPACK) takes without a transposing copy: the forward's
  scores are q [G Q, E] x kT [E, S]; the backward works on key-major tiles [S, G Q] (see
  ``_backward``). With query-major tiles and untransposed keys the step copied a transposed
  [S, E] or [S, G Q] operand before each of three products of every tile."""

  q_NBKGQE: jax.Array
  lo_NBQ: jax.Array
  kT_BKES: jax.Array
  v_BKSE: jax.Array
  sched: Schedule


def _to_blocks(x_BTHE, kv, block_q):
  """[B,T,H,E] -> [N,B,K,G,Q,E] (T padded to N * Q)."""
  b, t, h, e = x_BTHE.shape
  n = -(-t // block_q)
  x = jnp.pad(x_BTHE, ((0, 0), (0, n * block_q - t), (0, 0), (0, 0)))
  return x.reshape(b, n, block_q, kv, h // kv, e).transpose(1, 0, 3, 4, 2, 5)


def _from_blocks(x_NBKGQE, t):
  n, b, kv, g, q, e = x_NBKGQE.shape
  return x_NBKGQE.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * q, kv * g, e)[:, :t]


def _layout(q_BTHE, k_BTKE, v_BTKE, lo_BT, block_q, block_k) -> _Blocks:
  b, t = lo_BT.shape
  kv = k_BTKE.shape[2]
  n = -(-t // block_q)
  lo = _pad_lo(lo_BT, n * block_q)
  kpad = lambda x: jnp.pad(x, ((0, 0), (0, block_k), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  return _Blocks(
    _to_blocks(q_BTHE, kv, block_q),
    lo.reshape(b, n, block_q).transpose(1, 0, 2),
    jnp.swapaxes(kpad(k_BTKE), 2, 3),
    kpad(v_BTKE),
    schedule(lo_BT, block_q, block_k),
  )


def _tile_mask_BSQ(s0, n, lo_BQ, block_q, block_k):
  """[B,S,Q]: which keys of the tile starting at ``s0`` each query of block ``n`` sees."""
  kpos_S = s0 + jnp.arange(block_k, dtype=jnp.int32)
  qpos_Q = n * block_q + jnp.arange(block_q, dtype=jnp.int32)
  return (kpos_S[None, :, None] >= lo_BQ[:, None, :]) & (kpos_S[None, :, None] <= qpos_Q)


def _tile_start(blocks: _Blocks, n, tile, block_k):
  return blocks.sched.start_N[n] + tile * block_k


def _forward(blocks: _Blocks, t, block_q, block_k, scale):
  """(out [B,T,H,E], lse [N,B,K,G,Q] float32; +inf marks rows with no key)."""
  e = blocks.q_NBKGQE.shape[-1]

  def per_block(n):
    q_n, lo_n = blocks.q_NBKGQE[n], blocks.lo_NBQ[n]

    def body(tile, carry, masked=True):
      m, l, acc = carry
      s0 = _tile_start(blocks, n, tile, block_k)
      kT_t = lax.dynamic_slice_in_dim(blocks.kT_BKES, s0, block_k, axis=3)
      v_t = lax.dynamic_slice_in_dim(blocks.v_BKSE, s0, block_k, axis=2)
      s = jnp.einsum("bkgqe,bkes->bkgqs", q_n, kT_t, preferred_element_type=jnp.float32)
      s = s * scale
      if masked:
        mask_BQS = jnp.swapaxes(_tile_mask_BSQ(s0, n, lo_n, block_q, block_k), 1, 2)
        s = jnp.where(mask_BQS[:, None, None], s, NEG_INF)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      # A row with no key so far keeps m = NEG_INF; subtracting 0 there makes its masked
      # scores exp(NEG_INF) = 0 without a second select over the tile.
      m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      l = alpha * l + jnp.sum(p, axis=-1)
      pv = jnp.einsum(
        "bkgqs,bkse->bkgqe", p.astype(v_t.dtype), v_t, preferred_element_type=jnp.float32
      )
      return m_new, l, alpha[..., None] * acc + pv

    shape = q_n.shape[:-1]
    init = (
      jnp.full(shape, NEG_INF, jnp.float32),
      jnp.zeros(shape, jnp.float32),
      jnp.zeros(shape + (e,), jnp.float32),
    )
    full = functools.partial(body, masked=False)
    m, l, acc = _tile_loops(blocks.sched, n, body, full, init)
    empty = l == 0.0
    out = acc / jnp.where(empty, 1.0, l)[..., None]
    lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
    return out.astype(q_n.dtype), lse

  out_NBKGQE, lse = lax.map(per_block, jnp.arange(blocks.q_NBKGQE.shape[0]))
  return _from_blocks(out_NBKGQE, t), lse


def _backward(blocks: _Blocks, out_BTHE, lse, do_BTHE, block_q, block_k, scale):
  """(dq, dk, dv) from the forward's layout (saved, not rebuilt), output and log-sum-exp.

  Tiles are key-major, [B,K,S,G,Q] (S keys by the block's G Q query rows): scores
  k [S,E] x qT [E,G Q], dv = p [S,G Q] x do [G Q,E], dk = ds x q, and dq is accumulated
  transposed, dqT [E,G Q] += kT [E,S] x ds [S,G Q], and transposed back once per block. A
  block's transposed queries and output gradients are laid out once per block (for all blocks
  at once up front, the step's temp memory grew by another ~3%); the untransposed keys once
  per call."""
  t = out_BTHE.shape[1]
  kv = blocks.kT_BKES.shape[1]
  k_BKSE = jnp.swapaxes(blocks.kT_BKES, 2, 3)
  dtype = blocks.q_NBKGQE.dtype
  do_NBKGQE = _to_blocks(do_BTHE.astype(dtype), kv, block_q)
  to_t = lambda x: x.transpose(0, 1, 4, 2, 3)  # [B,K,G,Q,E] -> [B,K,E,G,Q]
  od_NHE = rows.merged(out_BTHE.astype(jnp.float32) * do_BTHE.astype(jnp.float32), 2)
  delta = jnp.sum(od_NHE, axis=-1).reshape(out_BTHE.shape[:-1])  # model/rows.py
  delta_NBKGQ = _to_blocks(delta[..., None], kv, block_q)[..., 0]

  def per_block(carry, n):
    q_n, lo_n, do_n = blocks.q_NBKGQE[n], blocks.lo_NBQ[n], do_NBKGQE[n]
    qT_n, doT_n = to_t(q_n), to_t(do_n)  # once per block, outside its tile loops
    lse_n, delta_n = lse[n][:, :, None], delta_NBKGQ[n][:, :, None]  # [B,K,1,G,Q]

    def body(tile, c, masked=True):
      dqT, dk, dv = c
      s0 = _tile_start(blocks, n, tile, block_k)
      k_t = lax.dynamic_slice_in_dim(k_BKSE, s0, block_k, axis=2)
      kT_t = lax.dynamic_slice_in_dim(blocks.kT_BKES, s0, block_k, axis=3)
      v_t = lax.dynamic_slice_in_dim(blocks.v_BKSE, s0, block_k, axis=2)
      s = jnp.einsum("bkse,bkegq->bksgq", k_t, qT_n, preferred_element_type=jnp.float32)
      p = jnp.exp(s * scale - lse_n)
      if masked:
        p = jnp.where(_tile_mask_BSQ(s0, n, lo_n, block_q, block_k)[:, None, :, None], p, 0.0)
      dv_t = jnp.einsum(
        "bksgq,bkgqe->bkse", p.astype(do_n.dtype), do_n, preferred_element_type=jnp.float32
      )
      dp = jnp.einsum("bkse,bkegq->bksgq", v_t, doT_n, preferred_element_type=jnp.float32)
      ds = (p * (dp - delta_n) * scale).astype(q_n.dtype)
      dqT = dqT + jnp.einsum("bkes,bksgq->bkegq", kT_t, ds, preferred_element_type=jnp.float32)
      dk_t = jnp.einsum("bksgq,bkgqe->bkse", ds, q_n, preferred_element_type=jnp.float32)
      add = lambda acc, x: lax.dynamic_update_slice_in_dim(
        acc, lax.dynamic_slice_in_dim(acc, s0, block_k, axis=2) + x, s0, axis=2
      )
      return dqT, add(dk, dk_t), add(dv, dv_t)

    dk, dv = carry
    dqT0 = jnp.zeros(qT_n.shape, jnp.float32)
    full = functools.partial(body, masked=False)
    dqT, dk, dv = _tile_loops(blocks.sched, n, body, full, (dqT0, dk, dv))
    return (dk, dv), dqT.transpose(0, 1, 3, 4, 2)  # [B,K,G,Q,E]

  zeros = jnp.zeros(k_BKSE.shape, jnp.float32)
  (dk, dv), dq_NBKGQE = lax.scan(per_block, (zeros, zeros), jnp.arange(blocks.q_NBKGQE.shape[0]))
  back = lambda x: x.transpose(0, 2, 1, 3)[:, :t].astype(k_BKSE.dtype)
  return _from_blocks(dq_NBKGQE, t).astype(dtype), back(dk), back(dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, lo, block_q, block_k, scale):
  return _attention_fwd(q, k, v, lo, block_q, block_k, scale)[0]


def _attention_fwd(q, k, v, lo, block_q, block_k, scale):
  blocks = _layout(q, k, v, lo, block_q, block_k)
  out, lse = _forward(blocks, q.shape[1], block_q, block_k, scale)
  return out, (blocks, out, lse)


def _attention_bwd(block_q, block_k, scale, res, do):
  blocks, out, lse = res
  dq, dk, dv = _backward(blocks, out, lse, do, block_q, block_k, scale)
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _split_axis(b: int, kv: int, parallel: int):
  """(axis, parts) to cut the call into ``parts`` independent calls: kv heads (axis 2) when
  they divide, else batch rows (axis 0), else no cut (axis None)."""
  for parts in range(min(parallel, max(b, kv)), 1, -1):
    if kv % parts == 0:
      return 2, parts
    if b % parts == 0:
      return 0, parts
  return None, 1


def blockwise_attention(
  q_BTHE,
  k_BTKE,
  v_BTKE,
  lo_BT,
  *,
  block_q: int = 64,
  block_k: int = 64,
  scale: float | None = None,
  parallel: int = 1,
  shard: bool = True,
):
  """Self-attention where query i sees keys [lo_i, i]; rows with no key give zeros.

  q [B,T,H,E], k/v [B,T,K,E], lo int [B,T]. Scores and softmax in float32; the
  probabilities are cast to the value dtype for the value product (as flash kernels do).
  Block sizes are clamped to the sequence (no work on a block larger than T).

  ``parallel`` > 1 cuts the call into that many independent loop nests over groups of kv heads
  (or batch rows): a tile's operations depend on each other, so one loop nest keeps one core
  of XLA:CPU busy, while independent nests run side by side (the model passes the host's core
  count on CPU, 1 on accelerators). The result is the same: heads and rows never interact.

  ``shard``: under a multi-device mesh (``jax.set_mesh``) the call runs per device in a
  ``jax.shard_map`` (``lca_jax.kernels.sharded.shard_over_mesh``: rows over 'data' / 'fsdp',
  heads over 'tensor' where they divide), so each device schedules the tiles of its own rows
  and the program has no collective. Left to XLA's partitioner (``False``), the schedule's
  minimum over the batch is an all-reduce in the forward, which makes every device wait for
  the others and visit the union of all rows' tiles.
  """
  if shard:  # per device under a multi-device mesh: each schedules its own rows' tiles
    call = lambda q, k, v, lo, _: blockwise_attention(
      q, k, v, lo, block_q=block_q, block_k=block_k, scale=scale, parallel=parallel, shard=False
    )
    return shard_over_mesh(call, q_BTHE, k_BTKE, v_BTKE, lo_BT, None)
  b, t, h, _ = q_BTHE.shape
  kv = k_BTKE.shape[2]
  block_q = max(1, min(block_q, t))
  block_k = max(1, min(block_k, t))
  scale = 1.0 / math.sqrt(q_BTHE.shape[-1]) if scale is None else float(scale)
  axis, parts = _split_axis(b, kv, parallel)
  if axis is None:
    return _attention(q_BTHE, k_BTKE, v_BTKE, lo_BT, block_q, block_k, scale)
  cut = lambda x: jnp.split(x, parts, axis=axis)
  los = cut(lo_BT) if axis == 0 else [lo_BT] * parts
  outs = [
    _attention(q, k, v, lo, block_q, block_k, scale)
    for q, k, v, lo in zip(cut(q_BTHE), cut(k_BTKE), cut(v_BTKE), los)
  ]
  return jnp.concatenate(outs, axis=axis)
