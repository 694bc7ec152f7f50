"""Pallas (Triton) backward kernels for LCA-masked attention.

Two kernels, as in FlashAttention-2:

* ``dq``: one program per (query block, batch, query head); visits the same
  key-block range ``[kb_lo, kb_hi)`` as the forward kernel.
* ``dk/dv``: one program per (key block, batch, kv head); loops over the
  ``G = H // K`` query heads sharing that kv head (GQA reduction happens in
  registers) and over the query blocks ``[qb_lo, qb_hi)`` whose intervals
  intersect the key block (see ``lca_attention.key_block_query_bounds``).

Both recompute probabilities from the base-2 log-sum-exp saved by the forward
pass: ``p = 2^(s - lse2)`` with ``s = q.k * scale * log2(e)``, and use
``delta_i = sum_d o_id * do_id`` (computed in XLA). Masked entries are set to
``-inf`` before the exponent, so they contribute exact zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .pallas_fwd import KernelConfig, interval_mask


def interval_mask_t(k_pos_K: jax.Array, k_start_Q: jax.Array, q_pos_Q: jax.Array) -> jax.Array:
  """bool [K, Q]: transpose of ``interval_mask`` built directly (no transpose op)."""
  return (k_pos_K[:, None] >= k_start_Q[None, :]) & (k_pos_K[:, None] <= q_pos_Q[None, :])


def _dq_kernel(
  kb_lo_ref,
  kb_hi_ref,
  k_start_ref,
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse2_ref,
  delta_ref,  # inputs
  dq_ref,  # output
  *,
  block_k: int,
  scale_log2: float,
  scale: float,
):
  """One query block: ``dq_ref`` [bq, D]; k/v refs hold the whole [T, D]."""
  block_q, head_dim = q_ref.shape
  q_pos_Q = pl.program_id(0) * block_q + jnp.arange(block_q, dtype=jnp.int32)
  k_start_Q = k_start_ref[...]
  q_QD = q_ref[...]
  do_QD = do_ref[...]
  lse2_Q = lse2_ref[...]
  delta_Q = delta_ref[...]

  def visit_key_block(kb, dq_QD):
    k_first = kb * block_k
    keys = pl.ds(k_first, block_k)
    k_KD = k_ref[keys, :]
    v_KD = v_ref[keys, :]
    s_QK = plgpu.dot(q_QD, k_KD, trans_b=True) * scale_log2
    k_pos_K = k_first + jnp.arange(block_k, dtype=jnp.int32)
    s_QK = jnp.where(interval_mask(q_pos_Q, k_start_Q, k_pos_K), s_QK, -jnp.inf)
    p_QK = jnp.exp2(s_QK - lse2_Q[:, None])
    dp_QK = plgpu.dot(do_QD, v_KD, trans_b=True)
    ds_QK = p_QK * (dp_QK - delta_Q[:, None])
    return dq_QD + plgpu.dot(ds_QK.astype(k_KD.dtype), k_KD)

  dq_QD = lax.fori_loop(
    kb_lo_ref[...], kb_hi_ref[...], visit_key_block, jnp.zeros((block_q, head_dim), jnp.float32)
  )
  dq_ref[...] = (dq_QD * scale).astype(dq_ref.dtype)


def _dkdv_kernel(
  qb_lo_ref,
  qb_hi_ref,
  k_start_ref,
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse2_ref,
  delta_ref,  # inputs
  dk_ref,
  dv_ref,  # outputs
  *,
  block_q: int,
  group: int,
  scale_log2: float,
  scale: float,
):
  """One key block of one kv head: ``dk_ref``/``dv_ref`` [bk, D].

  ``q_ref``/``do_ref`` hold [T, G, D] (the G query heads of this kv head),
  ``lse2_ref``/``delta_ref`` hold [G, T], ``k_start_ref`` holds [T].
  Works on transposed scores ``s^T`` [bk, bq] so no transposes are needed.
  """
  block_k, head_dim = k_ref.shape
  k_pos_K = pl.program_id(0) * block_k + jnp.arange(block_k, dtype=jnp.int32)
  k_KD = k_ref[...]
  v_KD = v_ref[...]
  qb_lo = qb_lo_ref[...]
  qb_hi = qb_hi_ref[...]

  def visit_query_block(qb, carry, g):
    dk_KD, dv_KD = carry
    q_first = qb * block_q
    rows = pl.ds(q_first, block_q)
    q_QD = q_ref[rows, g, :]
    do_QD = do_ref[rows, g, :]
    lse2_Q = lse2_ref[g, rows]
    delta_Q = delta_ref[g, rows]
    q_pos_Q = q_first + jnp.arange(block_q, dtype=jnp.int32)
    mask_KQ = interval_mask_t(k_pos_K, k_start_ref[rows], q_pos_Q)
    s_KQ = plgpu.dot(k_KD, q_QD, trans_b=True) * scale_log2
    s_KQ = jnp.where(mask_KQ, s_KQ, -jnp.inf)
    p_KQ = jnp.exp2(s_KQ - lse2_Q[None, :])
    dv_KD = dv_KD + plgpu.dot(p_KQ.astype(do_QD.dtype), do_QD)
    dp_KQ = plgpu.dot(v_KD, do_QD, trans_b=True)
    ds_KQ = p_KQ * (dp_KQ - delta_Q[None, :])
    dk_KD = dk_KD + plgpu.dot(ds_KQ.astype(q_QD.dtype), q_QD)
    return dk_KD, dv_KD

  def visit_head(g, carry):
    return lax.fori_loop(qb_lo, qb_hi, functools.partial(visit_query_block, g=g), carry)

  zeros_KD = jnp.zeros((block_k, head_dim), jnp.float32)
  dk_KD, dv_KD = lax.fori_loop(0, group, visit_head, (zeros_KD, zeros_KD))
  dk_ref[...] = (dk_KD * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_KD.astype(dv_ref.dtype)


def lca_backward_dq(
  q_BTHD,
  k_BTKD,
  v_BTKD,
  do_BTHD,
  lse2_BHT,
  delta_BHT,
  k_start_BT,
  kb_lo_BN,
  kb_hi_BN,
  cfg: KernelConfig,
):
  """dq [B, T, H, D] (q dtype) on padded inputs; bounds as in ``lca_forward``."""
  B, T, H, D = q_BTHD.shape
  G = H // k_BTKD.shape[2]
  bq = cfg.block_q
  kernel = functools.partial(
    _dq_kernel, block_k=cfg.block_k, scale_log2=cfg.scale_log2, scale=cfg.scale
  )
  per_block = lambda i, b, h: (b, i)
  q_block = pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0))
  kv_full = pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h // G, 0))
  row_block = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
  return pl.pallas_call(
    kernel,
    grid=(T // bq, B, H),
    in_specs=[
      pl.BlockSpec((None, None), per_block),  # kb_lo
      pl.BlockSpec((None, None), per_block),  # kb_hi
      pl.BlockSpec((None, bq), per_block),  # k_start
      q_block,
      kv_full,
      kv_full,
      q_block,  # q, k, v, do
      row_block,
      row_block,  # lse2, delta
    ],
    out_specs=q_block,
    out_shape=jax.ShapeDtypeStruct(q_BTHD.shape, q_BTHD.dtype),
    compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages),
    interpret=cfg.interpret,
    name="lca_attention_bwd_dq",
  )(kb_lo_BN, kb_hi_BN, k_start_BT, q_BTHD, k_BTKD, v_BTKD, do_BTHD, lse2_BHT, delta_BHT)


def lca_backward_dkdv(
  q_BTHD,
  k_BTKD,
  v_BTKD,
  do_BTHD,
  lse2_BHT,
  delta_BHT,
  k_start_BT,
  qb_lo_BN,
  qb_hi_BN,
  cfg: KernelConfig,
):
  """(dk, dv), each [B, T, K, D] in k/v dtype, on padded inputs.

  Args:
    qb_lo_BN, qb_hi_BN: int32 [B, T // block_k] query-block range per key block.
    Other arguments as in ``lca_backward_dq``.
  """
  B, T, H, D = q_BTHD.shape
  K = k_BTKD.shape[2]
  G = H // K
  bk = cfg.block_k
  kernel = functools.partial(
    _dkdv_kernel, block_q=cfg.block_q, group=G, scale_log2=cfg.scale_log2, scale=cfg.scale
  )
  per_block = lambda j, b, h: (b, j)
  kv_block = pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0))
  q_group = pl.BlockSpec((None, T, G, D), lambda j, b, h: (b, 0, h, 0))
  rows_group = pl.BlockSpec((None, G, T), lambda j, b, h: (b, h, 0))
  return pl.pallas_call(
    kernel,
    grid=(T // bk, B, K),
    in_specs=[
      pl.BlockSpec((None, None), per_block),  # qb_lo
      pl.BlockSpec((None, None), per_block),  # qb_hi
      pl.BlockSpec((None, T), lambda j, b, h: (b, 0)),  # k_start (all queries)
      q_group,
      kv_block,
      kv_block,
      q_group,  # q, k, v, do
      rows_group,
      rows_group,  # lse2, delta
    ],
    out_specs=[kv_block, kv_block],
    out_shape=[
      jax.ShapeDtypeStruct(k_BTKD.shape, k_BTKD.dtype),
      jax.ShapeDtypeStruct(v_BTKD.shape, v_BTKD.dtype),
    ],
    compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages),
    interpret=cfg.interpret,
    name="lca_attention_bwd_dkdv",
  )(qb_lo_BN, qb_hi_BN, k_start_BT, q_BTHD, k_BTKD, v_BTKD, do_BTHD, lse2_BHT, delta_BHT)
