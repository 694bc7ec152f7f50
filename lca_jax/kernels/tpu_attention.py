"""LCA-masked attention as Pallas kernels for TPUs (Mosaic): forward, dq and dk/dv.

``lca_attention_tpu(q, k, v, segment_ids, doc_ids=...)`` computes what
``reference.lca_attention_reference`` does, block-sparse: each query block visits only the key
blocks ``[kb_lo, kb_hi)`` that meet the allowed key intervals ``[k_start(i), i]`` of its rows,
and each key block only the query blocks ``[qb_lo, qb_hi)`` that reach it (the bounds of
``lca_attention.query_block_key_bounds`` / ``key_block_query_bounds``, computed in XLA and passed
to the kernels as scalar-prefetch operands in SMEM). The masked blocks are neither loaded into
the MXU nor computed; the rule inside a visited block is the interval test.

Layout: the kernels work on [B, heads, T, D] (q, k, v transposed once in XLA), so a block is a
[rows, D] tile in VMEM. Each program of the forward and dq kernels owns one query block of one
(batch row, query head) and holds that row's keys and values of its kv head whole in VMEM
(2 x T x D elements, fetched once per kv head: T 4096, D 128 in bf16 is 2 MB), looping over its
key blocks; each program of the dk/dv kernel owns one key block of one kv head and holds the
G = H / KV query heads' queries and output gradients (2 x G x T x D), looping over those heads
and the query blocks that reach the key block (the GQA sum stays in the kernel).

The softmax is online (FlashAttention-2) with the natural-log ``lse`` saved for the backward
pass, [B, H, 1, T] (a lane-dense row per head); fully masked rows (padding) get ``lse`` -1e30,
output zeros and zero gradients. ``T`` is padded to a multiple of the block (padded positions
behave like doc id 0). ``interpret=True`` runs the kernels in Pallas' interpreter (CPU tests).
Under a multi-device mesh the call runs per device in a ``jax.shard_map`` over every mesh axis
(batch and heads split as for the GPU kernels, ``sharded.kernel_partition``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from . import sharded
from .lca_attention import key_block_query_bounds, query_block_key_bounds
from .reference import lca_key_start

BLOCK = 128  # rows per block: a multiple of the TPU's 128 lanes (lse rows, score tiles)
_M_INIT = -1e30  # finite: ``m_prev - m_next`` never gives inf - inf
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class Config:
  block_q: int
  block_k: int
  scale: float
  interpret: bool = False


def _params():
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))


def _iota(shape, dim):
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def _fwd_kernel(kb_lo_ref, kb_hi_ref, k_start_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg):
  b, i = pl.program_id(0), pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  q_QD = q_ref[...]
  k_start_Q1 = k_start_ref[...].T
  q_pos_QK = i * bq + _iota((bq, bk), 0)

  def visit(kb, carry):
    acc_QD, m_Q1, l_Q1 = carry
    first = pl.multiple_of(kb * bk, bk)
    k_KD = k_ref[pl.ds(first, bk), :]
    v_KD = v_ref[pl.ds(first, bk), :]
    s_QK = lax.dot_general(q_QD, k_KD, _NT, preferred_element_type=jnp.float32) * cfg.scale
    k_pos_QK = first + _iota((bq, bk), 1)
    allowed_QK = (k_pos_QK >= k_start_Q1) & (k_pos_QK <= q_pos_QK)
    s_QK = jnp.where(allowed_QK, s_QK, -jnp.inf)
    m_next_Q1 = jnp.maximum(m_Q1, jnp.max(s_QK, axis=1, keepdims=True))
    alpha_Q1 = jnp.exp(m_Q1 - m_next_Q1)
    p_QK = jnp.exp(s_QK - m_next_Q1)
    l_Q1 = l_Q1 * alpha_Q1 + jnp.sum(p_QK, axis=1, keepdims=True)
    pv_QD = lax.dot_general(p_QK.astype(v_KD.dtype), v_KD, _NN, preferred_element_type=jnp.float32)
    return acc_QD * alpha_Q1 + pv_QD, m_next_Q1, l_Q1

  init = (
    jnp.zeros(q_QD.shape, jnp.float32),
    jnp.full((bq, 1), _M_INIT, jnp.float32),
    jnp.zeros((bq, 1), jnp.float32),
  )
  acc_QD, m_Q1, l_Q1 = lax.fori_loop(kb_lo_ref[b, i], kb_hi_ref[b, i], visit, init)
  l_safe_Q1 = jnp.where(l_Q1 == 0.0, 1.0, l_Q1)
  o_ref[...] = (acc_QD / l_safe_Q1).astype(o_ref.dtype)
  lse_ref[...] = (m_Q1 + jnp.log(l_safe_Q1)).T


def _dq_kernel(
  kb_lo_ref, kb_hi_ref, k_start_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, cfg
):
  b, i = pl.program_id(0), pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  q_QD, do_QD = q_ref[...], do_ref[...]
  k_start_Q1 = k_start_ref[...].T
  lse_Q1, delta_Q1 = lse_ref[...].T, delta_ref[...].T
  q_pos_QK = i * bq + _iota((bq, bk), 0)

  def visit(kb, dq_QD):
    first = pl.multiple_of(kb * bk, bk)
    k_KD = k_ref[pl.ds(first, bk), :]
    v_KD = v_ref[pl.ds(first, bk), :]
    s_QK = lax.dot_general(q_QD, k_KD, _NT, preferred_element_type=jnp.float32) * cfg.scale
    k_pos_QK = first + _iota((bq, bk), 1)
    allowed_QK = (k_pos_QK >= k_start_Q1) & (k_pos_QK <= q_pos_QK)
    p_QK = jnp.exp(jnp.where(allowed_QK, s_QK, -jnp.inf) - lse_Q1)
    dp_QK = lax.dot_general(do_QD, v_KD, _NT, preferred_element_type=jnp.float32)
    ds_QK = p_QK * (dp_QK - delta_Q1)
    return dq_QD + lax.dot_general(
      ds_QK.astype(k_KD.dtype), k_KD, _NN, preferred_element_type=jnp.float32
    )

  dq_QD = lax.fori_loop(kb_lo_ref[b, i], kb_hi_ref[b, i], visit, jnp.zeros(q_QD.shape, jnp.float32))
  dq_ref[...] = (dq_QD * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(
  qb_lo_ref,
  qb_hi_ref,
  k_start_ref,
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  dk_ref,
  dv_ref,
  *,
  cfg,
  group: int,
):
  """One key block of one kv head; ``q_ref`` / ``do_ref`` hold its G query heads [G, T, D],
  ``lse_ref`` / ``delta_ref`` [G, 1, T], ``k_start_ref`` [1, T]. Scores are kept transposed,
  [keys, queries], so the per-query rows (lse, delta, k_start) broadcast as rows."""
  b, j = pl.program_id(0), pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  k_KD, v_KD = k_ref[...], v_ref[...]
  k_pos_KQ = j * bk + _iota((bk, bq), 0)
  lo, hi = qb_lo_ref[b, j], qb_hi_ref[b, j]

  def visit(qb, carry, g):
    dk_KD, dv_KD = carry
    first = pl.multiple_of(qb * bq, bq)
    rows = pl.ds(first, bq)
    q_QD, do_QD = q_ref[g, rows, :], do_ref[g, rows, :]
    lse_1Q, delta_1Q = lse_ref[g, :, rows], delta_ref[g, :, rows]
    q_pos_KQ = first + _iota((bk, bq), 1)
    allowed_KQ = (k_pos_KQ >= k_start_ref[:, rows]) & (k_pos_KQ <= q_pos_KQ)
    s_KQ = lax.dot_general(k_KD, q_QD, _NT, preferred_element_type=jnp.float32) * cfg.scale
    p_KQ = jnp.exp(jnp.where(allowed_KQ, s_KQ, -jnp.inf) - lse_1Q)
    dv_KD = dv_KD + lax.dot_general(
      p_KQ.astype(do_QD.dtype), do_QD, _NN, preferred_element_type=jnp.float32
    )
    dp_KQ = lax.dot_general(v_KD, do_QD, _NT, preferred_element_type=jnp.float32)
    ds_KQ = p_KQ * (dp_KQ - delta_1Q)
    dk_KD = dk_KD + lax.dot_general(
      ds_KQ.astype(q_QD.dtype), q_QD, _NN, preferred_element_type=jnp.float32
    )
    return dk_KD, dv_KD

  def head(g, carry):
    return lax.fori_loop(lo, hi, functools.partial(visit, g=g), carry)

  zeros_KD = jnp.zeros(k_KD.shape, jnp.float32)
  dk_KD, dv_KD = lax.fori_loop(0, group, head, (zeros_KD, zeros_KD))
  dk_ref[...] = (dk_KD * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_KD.astype(dv_ref.dtype)


def _query_block_specs(cfg: Config, q_shape, n_kv_heads: int):
  """The blocks of a grid over (row, query head, query block): k_start's block of the query
  block, the query block, its kv head whole, and its [1, block_q] row (lse, delta)."""
  _, H, T, D = q_shape
  G, bq = H // n_kv_heads, cfg.block_q
  return (
    pl.BlockSpec((None, 1, bq), lambda b, h, i, *_: (b, 0, i)),
    pl.BlockSpec((None, None, bq, D), lambda b, h, i, *_: (b, h, i, 0)),
    pl.BlockSpec((None, None, T, D), lambda b, h, i, *_: (b, h // G, 0, 0)),
    pl.BlockSpec((None, None, 1, bq), lambda b, h, i, *_: (b, h, 0, i)),
  )


def _forward(cfg: Config, q_BHTD, k_BKTD, v_BKTD, k_start_B1T, kb_lo_BN, kb_hi_BN):
  B, H, T, _ = q_BHTD.shape
  k_start, q_block, kv_whole, row_block = _query_block_specs(cfg, q_BHTD.shape, k_BKTD.shape[1])
  return pl.pallas_call(
    functools.partial(_fwd_kernel, cfg=cfg),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(B, H, T // cfg.block_q),
      in_specs=[
        k_start,
        q_block,
        kv_whole,
        kv_whole,
      ],
      out_specs=[q_block, row_block],
    ),
    out_shape=[
      jax.ShapeDtypeStruct(q_BHTD.shape, q_BHTD.dtype),
      jax.ShapeDtypeStruct((B, H, 1, T), jnp.float32),
    ],
    compiler_params=_params(),
    interpret=cfg.interpret,
    name="lca_attention_fwd",
  )(kb_lo_BN, kb_hi_BN, k_start_B1T, q_BHTD, k_BKTD, v_BKTD)


def _backward_dq(cfg: Config, q, k, v, do, lse, delta, k_start_B1T, kb_lo_BN, kb_hi_BN):
  B, H, T, _ = q.shape
  k_start, q_block, kv_whole, row_block = _query_block_specs(cfg, q.shape, k.shape[1])
  return pl.pallas_call(
    functools.partial(_dq_kernel, cfg=cfg),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(B, H, T // cfg.block_q),
      in_specs=[
        k_start,
        q_block,
        kv_whole,
        kv_whole,
        q_block,  # do
        row_block,  # lse
        row_block,  # delta
      ],
      out_specs=q_block,
    ),
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    compiler_params=_params(),
    interpret=cfg.interpret,
    name="lca_attention_bwd_dq",
  )(kb_lo_BN, kb_hi_BN, k_start_B1T, q, k, v, do, lse, delta)


def _backward_dkdv(cfg: Config, q, k, v, do, lse, delta, k_start_B1T, qb_lo_BN, qb_hi_BN):
  B, H, T, D = q.shape
  K = k.shape[1]
  G = H // K
  bk = cfg.block_k
  kv_block = pl.BlockSpec((None, None, bk, D), lambda b, h, j, *_: (b, h, j, 0))
  q_group = pl.BlockSpec((None, G, T, D), lambda b, h, j, *_: (b, h, 0, 0))
  rows_group = pl.BlockSpec((None, G, 1, T), lambda b, h, j, *_: (b, h, 0, 0))
  return pl.pallas_call(
    functools.partial(_dkdv_kernel, cfg=cfg, group=G),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(B, K, T // bk),
      in_specs=[
        pl.BlockSpec((None, 1, T), lambda b, h, j, *_: (b, 0, 0)),  # k_start, every query
        q_group,
        kv_block,
        kv_block,
        q_group,  # do
        rows_group,  # lse
        rows_group,  # delta
      ],
      out_specs=[kv_block, kv_block],
    ),
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    compiler_params=_params(),
    interpret=cfg.interpret,
    name="lca_attention_bwd_dkdv",
  )(qb_lo_BN, qb_hi_BN, k_start_B1T, q, k, v, do, lse, delta)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: Config, q_BHTD, k_BKTD, v_BKTD, k_start_B1T, bounds):
  o_BHTD, _ = _forward(cfg, q_BHTD, k_BKTD, v_BKTD, k_start_B1T, *bounds[:2])
  return o_BHTD


def _flash_fwd(cfg, q_BHTD, k_BKTD, v_BKTD, k_start_B1T, bounds):
  o_BHTD, lse_BH1T = _forward(cfg, q_BHTD, k_BKTD, v_BKTD, k_start_B1T, *bounds[:2])
  return o_BHTD, (q_BHTD, k_BKTD, v_BKTD, k_start_B1T, bounds, o_BHTD, lse_BH1T)


def _flash_bwd(cfg, residuals, do_BHTD):
  q, k, v, k_start_B1T, bounds, o, lse = residuals
  do_BHTD = do_BHTD.astype(q.dtype)
  delta_BH1T = jnp.einsum("bhtd,bhtd->bht", o.astype(jnp.float32), do_BHTD.astype(jnp.float32))[
    :, :, None, :
  ]
  common = (q, k, v, do_BHTD, lse, delta_BH1T, k_start_B1T)
  dq = _backward_dq(cfg, *common, *bounds[:2])
  dk, dv = _backward_dkdv(cfg, *common, *bounds[2:])
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_time(x, size: int, value=0):
  return jnp.pad(
    x, [(0, 0), (0, size - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=value
  )


@functools.partial(jax.jit, static_argnames=("block", "scale", "interpret"))
def _attention(q_BTHD, k_BTKD, v_BTKD, segment_ids, doc_ids, *, block, scale, interpret):
  B, T, H, D = q_BTHD.shape
  T_pad = -(-T // block) * block
  doc_BT = jnp.ones((B, T), jnp.int32) if doc_ids is None else doc_ids.astype(jnp.int32)
  doc_BT = _pad_time(doc_BT, T_pad)
  seg_BT = _pad_time(segment_ids.astype(jnp.int32), T_pad)
  k_start_BT = lca_key_start(seg_BT, doc_BT)
  bounds = (
    *query_block_key_bounds(k_start_BT, block, block),
    *key_block_query_bounds(k_start_BT, block, block),
  )
  heads_first = lambda x: jnp.swapaxes(_pad_time(x, T_pad), 1, 2)
  cfg = Config(block, block, scale, interpret)
  o_BHTD = _flash(
    cfg,
    heads_first(q_BTHD),
    heads_first(k_BTKD),
    heads_first(v_BTKD),
    k_start_BT[:, None, :],
    bounds,
  )
  return jnp.swapaxes(o_BHTD, 1, 2)[:, :T]


def lca_attention_tpu(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array,
  *,
  doc_ids: jax.Array | None = None,
  block: int = BLOCK,
  scale: float | None = None,
  interpret: bool = False,
  shard: bool = True,
) -> jax.Array:
  """LCA-masked attention through the TPU kernels (arguments as ``lca_attention.lca_attention``:
  q [B, T, H, D], k and v [B, T, KV, D], int segment_ids [B, T], optional doc_ids with 0 for
  padding); ``block`` rows per query and key block (a multiple of 128). Under a multi-device
  mesh the call runs per device (``_per_device``) unless ``shard`` is False."""
  if block < BLOCK or block % BLOCK:
    raise ValueError(f"block must be a multiple of {BLOCK}, got {block}")
  B, T, H, D = q.shape
  if k.shape != v.shape or k.ndim != 4 or k.shape[:2] != (B, T) or k.shape[3] != D:
    raise ValueError(f"expected k, v [B, T, KV, D] matching q {q.shape}; got {k.shape}, {v.shape}")
  if H % k.shape[2]:
    raise ValueError(f"query heads {H} must be a multiple of kv heads {k.shape[2]}")
  if segment_ids.shape != (B, T) or (doc_ids is not None and doc_ids.shape != (B, T)):
    raise ValueError(f"segment_ids and doc_ids must be [B, T] = {(B, T)}")
  scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
  kernel = functools.partial(_attention, block=block, scale=scale, interpret=interpret)
  mesh = sharded.active_mesh() if shard else None
  if mesh is None:
    return kernel(q, k, v, segment_ids, doc_ids)
  return _per_device(mesh, kernel, q, k, v, segment_ids, doc_ids)


def _per_device(mesh, kernel, q, k, v, segment_ids, doc_ids):
  """``kernel`` per device under ``mesh``: batch and heads split as ``sharded.kernel_partition``
  says, in a ``jax.shard_map`` whose every axis is manual (Mosaic kernels take no automatic
  partitioning, unlike ``sharded.shard_over_mesh``'s partly manual one); an axis of size > 1
  that splits neither would hold copies of the call, which is refused."""
  b_axes, h_axes = sharded.kernel_partition(mesh, q.shape[0], q.shape[2], k.shape[2])
  idle = [a for a, n in dict(mesh.shape).items() if n > 1 and a not in b_axes + h_axes]
  if idle:
    raise ValueError(
      f"the TPU attention kernel splits the batch or heads over every mesh axis; {idle} split "
      f"neither (batch {q.shape[0]}, heads {q.shape[2]} / {k.shape[2]})"
    )
  entry = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes
  qkv, ids = P(entry(b_axes), None, entry(h_axes), None), P(entry(b_axes), None)
  if doc_ids is None:
    body = lambda q, k, v, seg: kernel(q, k, v, seg, None)
    args, in_specs = (q, k, v, segment_ids), (qkv, qkv, qkv, ids)
  else:
    body, args, in_specs = kernel, (q, k, v, segment_ids, doc_ids), (qkv, qkv, qkv, ids, ids)
  if mesh.explicit_axes:
    q_spec = jax.typeof(q).sharding.spec
    args = tuple(jax.sharding.reshard(x, spec) for x, spec in zip(args, in_specs))
  out = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=qkv, check_vma=False)(*args)
  return jax.sharding.reshard(out, q_spec) if mesh.explicit_axes else out
