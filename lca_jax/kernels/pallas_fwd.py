"""Pallas (Triton) forward kernel for LCA-masked attention.

The kernel is a FlashAttention-2 style online softmax over key blocks. Each
program owns one query block of one (batch, head) and visits only the key
blocks ``[kb_lo, kb_hi)`` that intersect the allowed key intervals
``[k_start(i), i]`` of its rows; those per-block bounds are computed outside
the kernel (see ``lca_attention.query_block_key_bounds``) and passed as small
int32 arrays, since scalar prefetch is not available on Triton.

Inputs are already padded: ``T`` is a multiple of both block sizes and ``D`` is
a power of two >= 16. Padding queries carry an empty interval and padding keys
are outside every interval, so no further masking is needed.

The log-sum-exp is kept in base 2 (``lse2 = log2(sum_j 2^(s_ij))`` with
``s = q.k * scale * log2(e)``); fully masked rows get ``lse2 = -1e30`` (finite),
output zero, and never produce NaN.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Initial running max: finite, so ``m_prev - m_next`` is never ``-inf - -inf``.
_M_INIT = -1e30


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static parameters shared by the forward and backward kernels."""

  block_q: int
  block_k: int
  scale: float
  interpret: bool = False
  num_warps_fwd: int = 4
  num_warps_bwd: int = 4
  num_stages: int = 2

  @property
  def scale_log2(self) -> float:
    """Logit scale that turns ``q.k`` into base-2 exponents."""
    return self.scale * math.log2(math.e)


def interval_mask(q_pos_Q: jax.Array, k_start_Q: jax.Array, k_pos_K: jax.Array) -> jax.Array:
  """bool [Q, K]: key ``k_pos`` lies in the query's interval ``[k_start, q_pos]``."""
  return (k_pos_K[None, :] >= k_start_Q[:, None]) & (k_pos_K[None, :] <= q_pos_Q[:, None])


def _fwd_kernel(
  kb_lo_ref,
  kb_hi_ref,
  k_start_ref,
  q_ref,
  k_ref,
  v_ref,  # inputs
  o_ref,
  lse2_ref,  # outputs
  *,
  block_k: int,
  scale_log2: float,
):
  """One query block: ``o_ref`` [bq, D], ``lse2_ref`` [bq]; k/v refs hold [T, D]."""
  block_q, head_dim = q_ref.shape
  q_pos_Q = pl.program_id(0) * block_q + jnp.arange(block_q, dtype=jnp.int32)
  k_start_Q = k_start_ref[...]
  q_QD = q_ref[...]

  def visit_key_block(kb, carry):
    acc_QD, m_Q, l_Q = carry
    k_first = kb * block_k
    keys = pl.ds(k_first, block_k)
    k_KD = k_ref[keys, :]
    v_KD = v_ref[keys, :]
    s_QK = plgpu.dot(q_QD, k_KD, trans_b=True) * scale_log2
    k_pos_K = k_first + jnp.arange(block_k, dtype=jnp.int32)
    s_QK = jnp.where(interval_mask(q_pos_Q, k_start_Q, k_pos_K), s_QK, -jnp.inf)
    m_next_Q = jnp.maximum(m_Q, jnp.max(s_QK, axis=1))
    alpha_Q = jnp.exp2(m_Q - m_next_Q)
    p_QK = jnp.exp2(s_QK - m_next_Q[:, None])
    l_next_Q = l_Q * alpha_Q + jnp.sum(p_QK, axis=1)
    acc_QD = acc_QD * alpha_Q[:, None] + plgpu.dot(p_QK.astype(v_KD.dtype), v_KD)
    return acc_QD, m_next_Q, l_next_Q

  init = (
    jnp.zeros((block_q, head_dim), jnp.float32),
    jnp.full((block_q,), _M_INIT, jnp.float32),
    jnp.zeros((block_q,), jnp.float32),
  )
  acc_QD, m_Q, l_Q = lax.fori_loop(kb_lo_ref[...], kb_hi_ref[...], visit_key_block, init)

  l_safe_Q = jnp.where(l_Q == 0.0, 1.0, l_Q)
  o_ref[...] = (acc_QD / l_safe_Q[:, None]).astype(o_ref.dtype)
  lse2_ref[...] = m_Q + jnp.log2(l_safe_Q)


def lca_forward(q_BTHD, k_BTKD, v_BTKD, k_start_BT, kb_lo_BN, kb_hi_BN, cfg: KernelConfig):
  """Runs the forward kernel on padded inputs.

  Args:
    q_BTHD: [B, T, H, D] queries; T % block_q == 0 and T % block_k == 0.
    k_BTKD, v_BTKD: [B, T, K, D] keys/values (GQA: head h uses kv head h // G).
    k_start_BT: int32 [B, T] interval starts (``i + 1`` for padding).
    kb_lo_BN, kb_hi_BN: int32 [B, T // block_q] key-block range per query block.
    cfg: kernel configuration.

  Returns:
    (o_BTHD in q dtype, lse2_BHT float32).
  """
  B, T, H, D = q_BTHD.shape
  G = H // k_BTKD.shape[2]
  bq = cfg.block_q
  kernel = functools.partial(_fwd_kernel, block_k=cfg.block_k, scale_log2=cfg.scale_log2)
  per_block = lambda i, b, h: (b, i)
  return pl.pallas_call(
    kernel,
    grid=(T // bq, B, H),
    in_specs=[
      pl.BlockSpec((None, None), per_block),  # kb_lo
      pl.BlockSpec((None, None), per_block),  # kb_hi
      pl.BlockSpec((None, bq), per_block),  # k_start
      pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),  # q
      pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h // G, 0)),  # k
      pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h // G, 0)),  # v
    ],
    out_specs=[
      pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),  # o
      pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),  # lse2
    ],
    out_shape=[
      jax.ShapeDtypeStruct(q_BTHD.shape, q_BTHD.dtype),
      jax.ShapeDtypeStruct((B, H, T), jnp.float32),
    ],
    compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps_fwd, num_stages=cfg.num_stages),
    interpret=cfg.interpret,
    name="lca_attention_fwd",
  )(kb_lo_BN, kb_hi_BN, k_start_BT, q_BTHD, k_BTKD, v_BTKD)
