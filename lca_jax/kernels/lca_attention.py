"""Public LCA attention entry point: dispatch, padding, block bounds, custom VJP.

``lca_attention(q, k, v, segment_ids, doc_ids=..., impl="xla" | "pallas")``

* ``impl="xla"``: dense-masked reference (``reference.lca_attention_reference``).
* ``impl="pallas"``: block-sparse Triton kernels (``pallas_fwd``/``pallas_bwd``)
  under ``jax.custom_vjp``; ``interpret=True`` runs them on CPU. Under a multi-device
  mesh (``jax.set_mesh``) the call runs per device in a ``jax.shard_map`` (``sharded``).

The Pallas path pads ``T`` up to a multiple of the block sizes (padded
positions behave like doc id 0) and ``D`` up to a power of two >= 16, computes
per-block visiting bounds from ``k_start`` in XLA, runs the kernels and slices
the result back.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .pallas_bwd import lca_backward_dkdv, lca_backward_dq
from .pallas_fwd import KernelConfig, lca_forward
from .reference import lca_attention_reference, lca_key_start
from .sharded import shard_over_mesh

_MIN_BLOCK = 16  # Triton dot products need every dim >= 16.


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


# ----------------------------------------------------------------------------
# Per-block visiting bounds (computed in XLA, outside the kernels).
# ----------------------------------------------------------------------------


def query_block_key_bounds(k_start_BT: jax.Array, block_q: int, block_k: int):
  """Key-block range ``[kb_lo, kb_hi)`` visited by each query block.

  Covers the union of the intervals ``[k_start(i), i]`` of the block's rows;
  a block whose rows are all empty (padding) gets ``kb_lo == kb_hi == 0``.

  Returns:
    (kb_lo_BN, kb_hi_BN), int32 [B, T // block_q].
  """
  B, T = k_start_BT.shape
  n_q = T // block_q
  k_start_BNQ = k_start_BT.reshape(B, n_q, block_q)
  pos_NQ = jnp.arange(T, dtype=jnp.int32).reshape(n_q, block_q)
  nonempty_BNQ = k_start_BNQ <= pos_NQ
  first_key_BN = jnp.min(jnp.where(nonempty_BNQ, k_start_BNQ, T), axis=-1)
  last_key_BN = jnp.max(jnp.where(nonempty_BNQ, pos_NQ, -1), axis=-1)
  any_BN = last_key_BN >= 0
  kb_lo_BN = jnp.where(any_BN, first_key_BN // block_k, 0)
  kb_hi_BN = jnp.where(any_BN, last_key_BN // block_k + 1, 0)
  return kb_lo_BN.astype(jnp.int32), kb_hi_BN.astype(jnp.int32)


def key_block_query_bounds(k_start_BT: jax.Array, block_q: int, block_k: int):
  """Query-block range ``[qb_lo, qb_hi)`` visited by each key block.

  Query ``i`` reaches key block ``[j0, j1]`` iff its interval is non-empty,
  ``i >= j0`` and ``k_start(i) <= j1``. The last such query is found with
  ``searchsorted`` on the suffix minimum of ``k_start`` (exact even if
  ``k_start`` were not monotone); the first is the first non-empty query at
  or after ``j0`` (it attends itself, which lies in the block).

  Returns:
    (qb_lo_BN, qb_hi_BN), int32 [B, T // block_k].
  """
  B, T = k_start_BT.shape
  pos_T = jnp.arange(T, dtype=jnp.int32)
  nonempty_BT = k_start_BT <= pos_T
  key_first_N = jnp.arange(0, T, block_k, dtype=jnp.int32)
  key_last_N = key_first_N + block_k - 1

  start_eff_BT = jnp.where(nonempty_BT, k_start_BT, T)
  suffix_min_BT = lax.cummin(start_eff_BT, axis=1, reverse=True)
  search = jax.vmap(lambda a_T: jnp.searchsorted(a_T, key_last_N, side="right"))
  q_last_BN = search(suffix_min_BT).astype(jnp.int32) - 1

  next_nonempty_BT = lax.cummin(jnp.where(nonempty_BT, pos_T, T), axis=1, reverse=True)
  q_first_BN = next_nonempty_BT[:, key_first_N]

  any_BN = q_first_BN <= q_last_BN
  qb_lo_BN = jnp.where(any_BN, q_first_BN // block_q, 0)
  qb_hi_BN = jnp.where(any_BN, q_last_BN // block_q + 1, 0)
  return qb_lo_BN.astype(jnp.int32), qb_hi_BN.astype(jnp.int32)


# ----------------------------------------------------------------------------
# custom_vjp over the padded problem.
# ----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lca_flash(cfg: KernelConfig, q_BTHD, k_BTKD, v_BTKD, k_start_BT, bounds):
  """Pallas LCA attention on padded inputs; ``bounds`` = (kb_lo, kb_hi, qb_lo, qb_hi)."""
  kb_lo_BN, kb_hi_BN, _, _ = bounds
  o_BTHD, _ = lca_forward(q_BTHD, k_BTKD, v_BTKD, k_start_BT, kb_lo_BN, kb_hi_BN, cfg)
  return o_BTHD


def _lca_flash_fwd(cfg, q_BTHD, k_BTKD, v_BTKD, k_start_BT, bounds):
  kb_lo_BN, kb_hi_BN, _, _ = bounds
  o_BTHD, lse2_BHT = lca_forward(q_BTHD, k_BTKD, v_BTKD, k_start_BT, kb_lo_BN, kb_hi_BN, cfg)
  residuals = (q_BTHD, k_BTKD, v_BTKD, k_start_BT, bounds, o_BTHD, lse2_BHT)
  return o_BTHD, residuals


def _lca_flash_bwd(cfg, residuals, do_BTHD):
  q_BTHD, k_BTKD, v_BTKD, k_start_BT, bounds, o_BTHD, lse2_BHT = residuals
  kb_lo_BN, kb_hi_BN, qb_lo_BN, qb_hi_BN = bounds
  do_BTHD = do_BTHD.astype(q_BTHD.dtype)
  delta_BHT = jnp.einsum("bthd,bthd->bht", o_BTHD.astype(jnp.float32), do_BTHD.astype(jnp.float32))
  common = (q_BTHD, k_BTKD, v_BTKD, do_BTHD, lse2_BHT, delta_BHT, k_start_BT)
  dq_BTHD = lca_backward_dq(*common, kb_lo_BN, kb_hi_BN, cfg)
  dk_BTKD, dv_BTKD = lca_backward_dkdv(*common, qb_lo_BN, qb_hi_BN, cfg)
  return dq_BTHD, dk_BTKD, dv_BTKD, None, None


_lca_flash.defvjp(_lca_flash_fwd, _lca_flash_bwd)


def _pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
  """Pads ``x`` at the end of ``axis`` up to ``size``."""
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _pick_block(requested: int, seq_len: int) -> int:
  """Power-of-two block >= 16, no larger than needed for ``seq_len``."""
  if requested < _MIN_BLOCK or requested & (requested - 1):
    raise ValueError(f"block sizes must be powers of two >= {_MIN_BLOCK}, got {requested}")
  return max(_MIN_BLOCK, min(requested, _next_pow2(seq_len)))


@functools.partial(
  jax.jit, static_argnames=("block_q", "block_k", "scale", "interpret", "num_warps", "num_stages")
)
def _lca_attention_pallas(
  q_BTHD,
  k_BTKD,
  v_BTKD,
  segment_ids,
  doc_ids,
  *,
  block_q: int,
  block_k: int,
  scale: float,
  interpret: bool,
  num_warps: int | None,
  num_stages: int,
):
  """Pads, computes bounds, runs ``_lca_flash`` and unpads."""
  B, T, H, D = q_BTHD.shape
  bq, bk = _pick_block(block_q, T), _pick_block(block_k, T)
  T_pad = _round_up(T, max(bq, bk))
  D_pad = max(_MIN_BLOCK, _next_pow2(D))

  doc_BT = jnp.ones((B, T), jnp.int32) if doc_ids is None else doc_ids.astype(jnp.int32)
  doc_BT = _pad_axis(doc_BT, 1, T_pad, 0)
  seg_BT = _pad_axis(segment_ids.astype(jnp.int32), 1, T_pad, 0)
  k_start_BT = lca_key_start(seg_BT, doc_BT)
  bounds = (
    *query_block_key_bounds(k_start_BT, bq, bk),
    *key_block_query_bounds(k_start_BT, bq, bk),
  )

  pad = lambda x: _pad_axis(_pad_axis(x, 1, T_pad), 3, D_pad)
  if num_warps is None:
    num_warps_fwd = 8 if bq >= 128 and D_pad >= 128 else 4
    num_warps_bwd = 4 if bq * bk <= 64 * 64 else 8
  else:
    num_warps_fwd = num_warps_bwd = num_warps
  cfg = KernelConfig(
    block_q=bq,
    block_k=bk,
    scale=scale,
    interpret=interpret,
    num_warps_fwd=num_warps_fwd,
    num_warps_bwd=num_warps_bwd,
    num_stages=num_stages,
  )
  o_BTHD = _lca_flash(cfg, pad(q_BTHD), pad(k_BTKD), pad(v_BTKD), k_start_BT, bounds)
  return o_BTHD[:, :T, :, :D]


def _check_shapes(q, k, v, segment_ids, doc_ids):
  B, T, H, D = q.shape
  if k.shape != v.shape or k.ndim != 4 or k.shape[:2] != (B, T) or k.shape[3] != D:
    raise ValueError(f"expected k, v [B, T, KV, D] matching q {q.shape}; got {k.shape}, {v.shape}")
  if H % k.shape[2]:
    raise ValueError(f"query heads {H} must be a multiple of kv heads {k.shape[2]}")
  if segment_ids.shape != (B, T):
    raise ValueError(f"segment_ids must be [B, T] = {(B, T)}, got {segment_ids.shape}")
  if doc_ids is not None and doc_ids.shape != (B, T):
    raise ValueError(f"doc_ids must be [B, T] = {(B, T)}, got {doc_ids.shape}")


def lca_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array,
  *,
  doc_ids: jax.Array | None = None,
  impl: str = "xla",
  interpret: bool = False,
  block_q: int = 64,
  block_k: int = 64,
  scale: float | None = None,
  num_warps: int | None = None,
  num_stages: int = 2,
  shard: bool = True,
) -> jax.Array:
  """LCA-masked multi-head attention (see ``reference`` for the mask).

  Args:
    q: [B, T, H, D] queries.
    k, v: [B, T, KV, D] keys/values; query head h uses kv head ``h // (H // KV)``.
    segment_ids: int [B, T] group ids (non-decreasing within a document).
    doc_ids: optional int [B, T] document ids; 0 = padding (such query rows
      output zeros, such keys are never attended).
    impl: ``"xla"`` (dense reference) or ``"pallas"`` (Triton kernels).
    interpret: run the Pallas kernels in interpret mode (CPU testing).
    block_q, block_k: Pallas tile sizes (powers of two >= 16; clamped for short T).
    scale: logit scale, default ``1 / sqrt(D)``.
    num_warps, num_stages: Triton launch parameters (``None`` = heuristic).
    shard: ``impl="pallas"`` only: under a multi-device mesh set with ``jax.set_mesh``, run
      the kernel per device in a ``jax.shard_map`` (batch over the mesh axes 'data'/'fsdp',
      heads over 'tensor' when they divide; see ``sharded``). ``False`` leaves the call to
      XLA, which then gathers the inputs onto every device.

  Returns:
    [B, T, H, D] in ``q.dtype``.
  """
  _check_shapes(q, k, v, segment_ids, doc_ids)
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  if impl == "xla":
    return lca_attention_reference(q, k, v, segment_ids, doc_ids, scale=scale)
  if impl == "pallas":
    kernel = functools.partial(
      _lca_attention_pallas,
      block_q=block_q,
      block_k=block_k,
      scale=scale,
      interpret=interpret,
      num_warps=num_warps,
      num_stages=num_stages,
    )
    if not shard:
      return kernel(q, k, v, segment_ids, doc_ids)
    return shard_over_mesh(kernel, q, k, v, segment_ids, doc_ids)
  raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
