"""Transformer building blocks shared by every stack: RMSNorm, RoPE, GQA attention, SwiGLU, block.

Shapes: B batch, T query length, S key length, D model width, H query heads, K kv heads,
E head dim, F inner width. Parameters are float32; compute runs in ``dtype``; norms and
softmax in float32. Parameter axes carry logical names for sharding ('embed', 'heads',
'kv', 'mlp', 'vocab'); the model knows nothing else about meshes.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lca_jax import backend
from lca_jax.kernels import decode_attention, decode_fused
from lca_jax.model import rows
from lca_jax.model.activations import swiglu
from lca_jax.model.kv_cache import CacheAccess, KVCache

NEG_INF = -1e30
Dtype = Any


class Dense(nn.Module):
  """y = x W (+ b) over the last axis; parameters ``kernel`` [in, out] (and ``bias``) as in
  ``nn.Dense``, compute in ``dtype``.

  The product runs on x flattened to [tokens, in] (``dot_rows``): with a [B, T, in] input,
  autodiff's weight gradient would contract over two axes (B and T), for which XLA:CPU lays the
  activation gradient out transposed through a slow strided fusion; one contracting axis needs
  no copy. On TPUs, over a row count that is not a multiple of the tile's, it runs on x as it
  is (``backend.merged_rows``).
  """

  features: int
  axes: tuple
  dtype: Dtype = jnp.float32
  use_bias: bool = False

  @nn.compact
  def __call__(self, x):
    if self.has_variable("params", out_in("kernel")):  # decode weights, ``transpose_kernels``
      y = dot_rows_oi(x, self.get_variable("params", out_in("kernel")), self.dtype)
    else:
      kernel = self.param(
        "kernel",
        nn.with_logical_partitioning(nn.initializers.normal(0.02), self.axes),
        (x.shape[-1], self.features),
      )
      y = dot_rows(x, kernel, self.dtype)
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,)).astype(self.dtype)
    return y.reshape(x.shape[:-1] + (self.features,))


def dot_rows(x, kernel_IO, dtype):
  """x [..., in] times kernel [in, out] in ``dtype``: a [tokens, in] x [in, out] product (one
  contracting axis: see ``Dense``) returning [tokens, out] where ``backend.merged_rows`` says,
  else the product over x's own axes, [..., out]."""
  x = x.reshape(-1, x.shape[-1]) if _merge(x) else x
  return jnp.dot(x.astype(dtype), kernel_IO.astype(dtype))


def _merge(x) -> bool:
  """Whether x [..., rows, features] runs as a [tokens, features] view (``backend.merged_rows``)."""
  return x.ndim < 3 or backend.merged_rows(x.shape[-2])


def dot_rows_oi(x, kernel_OI, dtype):
  """``dot_rows`` with the kernel stored [out, in] (``transpose_kernels``)."""
  x_TI = x.reshape(-1, x.shape[-1]).astype(dtype)
  return jax.lax.dot_general(x_TI, kernel_OI.astype(dtype), (((1,), (1,)), ((), ())))


def out_in(name: str) -> str:
  """The name a kernel [in, out] has when ``transpose_kernels`` stores it [out, in]."""
  return name + "_oi"


def decode_kernel(module, name: str):
  """(kernel, stored [out, in]) of a decode-only fused kernel of ``module``'s scope, or None."""
  for key, oi in ((out_in(name), True), (name, False)):
    if module.has_variable("params", key):
      return module.get_variable("params", key), oi
  return None


def stored_weight(scope, name: str):
  """(kernel, stored [in, out]) of kernel ``name`` in a parameter scope, stored [out, in]
  (``transpose_kernels``) or [in, out]; None when absent. The fused decode kernels take either."""
  for key, in_out in ((out_in(name), False), (name, True)):
    if key in scope:
      return scope[key], in_out
  return None


def dense(features, name, axes, dtype):
  return Dense(features, tuple(axes), dtype, name=name)


# Decode-only fused kernels (``fuse_decode_params``): the concatenation of an attention's
# q/k/v kernels and of an MLP's gate/up kernels along the output axis, stored next to them.
QKV_KERNEL = "qkv_kernel"
GATE_UP_KERNEL = "gate_up_kernel"
_FUSED = ((QKV_KERNEL, ("q_proj", "k_proj", "v_proj")), (GATE_UP_KERNEL, ("gate_proj", "up_proj")))


def fuse_decode_params(params):
  """``params`` plus, in every attention (MLP) scope, ``QKV_KERNEL`` ([D, (H + 2K) E], the
  q, k, v kernels concatenated along the output axis) and ``GATE_UP_KERNEL`` ([D, 2F]).

  Decoding a few rows is bound by per-dot overhead, not by bandwidth: one dot against the
  fused kernel replaces three (two). ``api.Model.decode_params`` builds it once per model; the
  decode engine calls this (a no-op on a tree that has them) once per generate call, outside
  its ``while_loop``: a concatenate written inside the step would be hoisted out of the loop
  body by XLA, but not out of the ``lax.cond`` branches that run the latent LM and the
  windowed LCA-MBP head, so it would copy those weights every step. The original parameters are kept (same tree, names and
  layout: checkpoints, converter and sharding never see the fused ones); the cache path of
  ``Attention`` and ``SwiGLU`` uses a fused kernel when its scope has one. Boxed (partitioned)
  kernels are unboxed; the fused kernels are plain arrays.
  """
  if not isinstance(params, Mapping):
    return params
  out = {k: fuse_decode_params(v) for k, v in params.items()}
  for fused_name, parts in _FUSED:
    if fused_name in params:  # already fused (``api.Model.decode_params``)
      continue
    if all(isinstance(params.get(p), Mapping) and "kernel" in params[p] for p in parts):
      kernels = [nn.unbox(params[p]["kernel"]) for p in parts]
      out[fused_name] = jnp.concatenate([jnp.asarray(k) for k in kernels], axis=1)
  return out


# Weights every use casts to the compute dtype first (``Dense`` kernels, ``nn.Embed``'s table
# and the fused kernels made of them), except under the scopes that compute in float32 whatever
# the model's dtype (the boundary predictor's MLP).
_COMPUTE_WEIGHTS = frozenset({"kernel", "embedding", QKV_KERNEL, GATE_UP_KERNEL})
_FLOAT32_SCOPES = frozenset({"boundary_predictor"})


def compute_dtype_weights(params, dtype):
  """``params`` with the weights that every use casts to the compute ``dtype`` (dense and fused
  kernels, the embedding table; not norms, biases, the null group or the boundary predictor)
  stored in ``dtype``. Exact: each use would make the same cast. For decoding, where a
  bfloat16 model's step then reads 2 bytes per weight instead of 4: XLA leaves a cast of a
  loop-invariant weight inside the decode loop's body (on XLA:CPU: a weight-size float32 ->
  bfloat16 convert per weight per step). A float32 ``dtype`` returns ``params`` itself."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return params

  def walk(tree):
    out = {}
    for k, v in tree.items():
      if isinstance(v, Mapping):
        out[k] = v if k in _FLOAT32_SCOPES else walk(v)
      elif k in _COMPUTE_WEIGHTS:
        out[k] = jnp.asarray(nn.unbox(v)).astype(dtype)
      else:
        out[k] = v
    return out

  return walk(params) if isinstance(params, Mapping) else params


def transpose_kernels(params):
  """``params`` with every ``Dense`` kernel [in, out] stored as its transpose [out, in] under
  ``out_in("kernel")`` instead (``Dense`` reads it there); the fused q/k/v and gate/up kernels
  stay [in, out].

  A product of one row (a batch-1 decode step) against a kernel [in, out] is a reduction over
  its first axis, which XLA:GPU splits into two kernels when it does not fuse the row's
  broadcast into the reduction: a product of the kernel's size written to memory and read back
  by a column reduction (the attention output and MLP down projections of the paper-scale
  model). Against [out, in] it is a row reduction over contiguous weights, one kernel. The fused
  kernels' products are single reductions as they are, and XLA copies them back to [in, out]
  before the loop when they are given [out, in]. A tree that has no [in, out] ``Dense`` kernel
  left is returned as it is."""
  if not isinstance(params, Mapping):
    return params
  out = {}
  for k, v in params.items():
    if isinstance(v, Mapping):
      out[k] = transpose_kernels(v)
    elif k == "kernel" and getattr(v, "ndim", 0) == 2:
      out[out_in(k)] = jnp.asarray(nn.unbox(v)).T
    else:
      out[k] = v
  return out


def decode_weights(params, dtype, fuse: bool = True, transpose: Optional[bool] = None):
  """The parameter tree decoding runs with: with ``fuse``, the fused kernels of
  ``fuse_decode_params``; the weights every use casts to ``dtype`` stored in it
  (``compute_dtype_weights``); with ``transpose`` (default: ``backend.row_major_kernels()``,
  on GPUs) every kernel stored [out, in] (``transpose_kernels``). Applied to its own result, it
  returns it unchanged."""
  tree = compute_dtype_weights(fuse_decode_params(params) if fuse else params, dtype)
  if transpose is None:
    transpose = backend.row_major_kernels()
  return transpose_kernels(tree) if transpose else tree


def split_dense(x, kernel, sizes: Sequence[int], dtype, out_in_layout: bool = False):
  """``Dense`` with a fused kernel [in, sum(sizes)] ([sum(sizes), in] with ``out_in_layout``):
  one dot, split into one output per part (each [..., size]), as ``Dense`` computes it
  (flattened rows, compute in ``dtype``)."""
  y = (dot_rows_oi if out_in_layout else dot_rows)(x, kernel, dtype)
  cuts = np.cumsum(sizes)[:-1].tolist()
  return [part.reshape(x.shape[:-1] + (part.shape[-1],)) for part in jnp.split(y, cuts, axis=-1)]


class RMSNorm(nn.Module):
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param(
      "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (x.shape[-1],)
    )
    xf = x.astype(jnp.float32)
    xf = rows.merged(xf) if _merge(xf) else xf  # [N, D]: see model/rows.py
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * scale).reshape(x.shape).astype(x.dtype)


def rope_tables(length: int, head_dim: int, base: float):
  """cos / sin of RoPE for positions 0 .. length-1, float32 [length, E] (cat(freqs, freqs)),
  computed on the host when the model is traced: a jitted step then gathers rows instead of
  evaluating cos and sin, which XLA otherwise recomputes inside every fusion that reads them
  (per head, forward and backward)."""
  e = head_dim
  inv_freq = (1.0 / (np.float32(base) ** (np.arange(0, e, 2, dtype=np.float32) / e))).astype(
    np.float32
  )
  freqs = np.arange(length, dtype=np.float32)[:, None] * inv_freq
  emb = np.concatenate([freqs, freqs], axis=-1)
  return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def rope_cos_sin(positions_BT, head_dim: int, base: float, max_len: int = 0):
  """cos / sin [B, T, 1, E] of RoPE at ``positions`` (cat(freqs, freqs), upstream layout), for
  ``rope`` to apply to the queries and the keys of one call.

  ``max_len`` > 0: gathered from ``rope_tables`` for positions below max(max_len, T) + 2 (the
  model's context, or this call's length, plus the latent stack's null slot); a position past
  the table gives NaN, never a wrong rotation. 0: computed here."""
  e = head_dim
  if max_len > 0:
    n = max(max_len, positions_BT.shape[1]) + 2
    take = lambda tab: jnp.take(
      jnp.asarray(tab), positions_BT, axis=0, mode="fill", fill_value=jnp.nan
    )[:, :, None, :]
    cos, sin = rope_tables(n, e, base)
    return take(cos), take(sin)
  inv_freq = 1.0 / (base ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))
  freqs = positions_BT.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  return jnp.cos(emb), jnp.sin(emb)


def rope_rows(positions_BT, head_dim: int, base: float, max_len: int = 0):
  """``rope_cos_sin``'s values as one array [B, T, 2 E] float32 (cos, then sin), for a kernel
  that applies RoPE itself (``kernels.decode_attention``); XLA shares it between the layers of
  a step."""
  cos, sin = rope_cos_sin(positions_BT, head_dim, base, max_len)
  return jnp.concatenate([cos[:, :, 0], sin[:, :, 0]], axis=-1)


def rope(x_BTHE, cos_sin):
  """Rotate-half RoPE of x [B, T, H, E] with ``rope_cos_sin``'s (cos, sin); a bfloat16 x
  where ``backend.rope_by_product()`` says through ``_rope_product`` (the same values)."""
  cos, sin = cos_sin
  if x_BTHE.dtype == jnp.bfloat16 and backend.rope_by_product():
    return _rope_product(x_BTHE, cos, sin)
  xf = x_BTHE.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (xf * cos + rotated * sin).astype(x_BTHE.dtype)


def rotate_half_EE(e: int) -> np.ndarray:
  """The signed permutation R [E, E] with x R = cat(-x2, x1) for x = cat(x1, x2)."""
  r = np.zeros((e, e), np.float32)
  half = np.arange(e // 2)
  r[half + e // 2, half] = -1.0
  r[half, half + e // 2] = 1.0
  return r


@jax.custom_vjp
def _rope_product(x_BTHE, cos, sin):
  """``rope`` of a bfloat16 x with its rotated halves computed as x R (``rotate_half_EE``) in
  float32: each output sums one signed element of x and zeros, the values of the slices.
  XLA:TPU then keeps the projections' outputs in bfloat16 and runs RoPE as one fusion over
  them; with the slices it writes x out in float32 and its halves apart. The gradient is the
  plain ``rope``'s (the product's would round g sin to bfloat16)."""
  r = jnp.asarray(rotate_half_EE(x_BTHE.shape[-1]), x_BTHE.dtype)
  rotated = jnp.dot(x_BTHE, r, preferred_element_type=jnp.float32)
  return (x_BTHE.astype(jnp.float32) * cos + rotated * sin).astype(x_BTHE.dtype)


def _rope_product_fwd(x_BTHE, cos, sin):
  return _rope_product(x_BTHE, cos, sin), (cos, sin)


def _rope_product_bwd(residuals, g_BTHE):
  cos, sin = residuals
  g = g_BTHE.astype(jnp.float32)
  g1, g2 = jnp.split(g * sin, 2, axis=-1)
  dx = g * cos + jnp.concatenate([g2, -g1], axis=-1)  # the transpose of the rotation
  return dx.astype(g_BTHE.dtype), jnp.zeros_like(cos), jnp.zeros_like(sin)


_rope_product.defvjp(_rope_product_fwd, _rope_product_bwd)


def masked_attention(q_BTHE, k, v, mask_BTS, *, head_major: bool = False):
  """Reference attention with a dense boolean mask; rows with no allowed key give zeros.

  k, v are [B, S, K, E], or [B, K, S, E] with ``head_major`` (decode caches: both products
  then contract without moving the cache; [B, S, K, E] would cost a full transpose per step).
  """
  kv_spec = "bkse" if head_major else "bske"
  h, kv = q_BTHE.shape[2], k.shape[1 if head_major else 2]
  b, t, _, e = q_BTHE.shape
  q = q_BTHE.reshape(b, t, kv, h // kv, e)
  scores = jnp.einsum(f"btkge,{kv_spec}->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = scores / jnp.sqrt(jnp.float32(e))
  m = mask_BTS[:, None, None, :, :]
  scores = jnp.where(m, scores, NEG_INF)
  probs = jnp.where(m, jax.nn.softmax(scores, axis=-1), 0.0)
  out = jnp.einsum(
    f"bkgts,{kv_spec}->btkge", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
  )
  return out.reshape(b, t, h, e).astype(q_BTHE.dtype)


def write_rows(cache_BS, new_BT, start_B, axis: int = 0):
  """Write ``new`` into ``cache`` at a per-row start index along ``axis`` of each row (ragged
  batches). Like ``dynamic_update_slice``, a start that would run past the end is clamped.

  One row is one ``dynamic_update_slice`` (XLA writes it in place, fused with what computes
  ``new``); several rows are the per-row write's batching (a scatter, which XLA:GPU lowers for a
  single row as a read of the old slice, a select and the write: two kernels), or one
  ``dynamic_update_slice`` per row where ``backend.row_by_row_writes`` says so."""
  new_BT = new_BT.astype(cache_BS.dtype)
  rows = cache_BS.shape[0]
  if rows == 1 or backend.row_by_row_writes():
    for b in range(rows):
      at = [0] * cache_BS.ndim
      at[0], at[axis + 1] = b, start_B[b]
      cache_BS = jax.lax.dynamic_update_slice(cache_BS, new_BT[b : b + 1], at)
    return cache_BS

  def one(c, n, s):
    return jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=axis)

  return jax.vmap(one)(cache_BS, new_BT, start_B)


def write_kv(cache, entries, write_B) -> KVCache:
  """Store new cache entries (k [B, K, T, E], v [B, K, E, T]) at slots ``write_B`` (clamped so
  that they fit, as ``Attention`` assumes when it reads them)."""
  k_c, v_c = cache
  start = jnp.clip(write_B, 0, k_c.shape[2] - entries[0].shape[2])
  return KVCache(
    write_rows(k_c, entries[0], start, axis=1), write_rows(v_c, entries[1], start, axis=2)
  )


def take_rows(x_BT, rows_BR):
  """x[b, rows[b, r]] along axis 1 of a [B, T, ...] array: [B, R, ...]."""
  idx = rows_BR.reshape(rows_BR.shape + (1,) * (x_BT.ndim - 2))
  return jnp.take_along_axis(x_BT, idx, axis=1)


# The most query columns (query heads per kv head x queries) per (row, kv head) for which a
# product over a decode cache may run as one matrix-vector product per column
# (``backend.matvec_cache_products``: on the CPU; docs/design.md §6.5).
MATVEC_CACHE_COLUMNS = 8


def _matvec_cache_products(g: int, t: int) -> bool:
  return backend.matvec_cache_products(g * t, MATVEC_CACHE_COLUMNS)


def _column_matvecs(cache_BKMN, vecs_BKGTN):
  """``cache[b, k] @ vecs[b, k, g, t]`` as one dot per column (g, t), batched over rows and kv
  heads (a matrix-vector product per (b, k) over the cache as stored): [B, K, G, T, M] float32."""
  b, kv, g, t, _ = vecs_BKGTN.shape
  dims = (((3,), (2,)), ((0, 1), (0, 1)))
  cols = [
    jax.lax.dot_general(
      cache_BKMN, vecs_BKGTN[:, :, i, j], dims, preferred_element_type=jnp.float32
    )
    for i in range(g)
    for j in range(t)
  ]
  return jnp.stack(cols, axis=2).reshape(b, kv, g, t, cache_BKMN.shape[2])


def cache_scores(q_BTKGE, k_BKSE):
  """q.K over a cache: [B, K, G, T, S] float32 (matrix-vector products where
  ``_matvec_cache_products``)."""
  _, t, _, g, _ = q_BTKGE.shape
  if not _matvec_cache_products(g, t):
    return jnp.einsum("btkge,bkse->bkgts", q_BTKGE, k_BKSE, preferred_element_type=jnp.float32)
  return _column_matvecs(k_BKSE, q_BTKGE.transpose(0, 2, 3, 1, 4))


def cache_values(p_BKGTS, v_BKES):
  """P.V over a cache: [B, T, K, G, E] float32 (matrix-vector products where
  ``_matvec_cache_products``)."""
  _, _, g, t, _ = p_BKGTS.shape
  if not _matvec_cache_products(g, t):
    return jnp.einsum("bkgts,bkes->btkge", p_BKGTS, v_BKES, preferred_element_type=jnp.float32)
  return _column_matvecs(v_BKES, p_BKGTS).transpose(0, 3, 1, 2, 4)


def cached_attention(q_BTHE, k_BKTE, v_BKET, cache, mask_BTS, start_B, old_slots=None):
  """Attention of T queries over a KV cache (k [B, K, S, E], v transposed [B, K, E, S]) as it
  will be once the N new keys (``k_BKTE``) and values (``v_BKET``) are written at slots
  ``start_B`` (already clamped so that they fit): the S cache slots under ``mask_BTS``
  [B, T, S], except the N slots being written, which are taken from the new keys instead.
  Usually the queries are the N new positions (T = N); a caller that reads only some of
  them passes those rows' queries and mask rows (T < N). ``old_slots`` (static): only the
  first that many slots can hold keys from earlier calls (0: none, the first block of an empty
  cache; None: any), so only those are read.

  Layouts chosen so that no step moves a cache: both products are matrix-vector products over
  the cache in its stored order (q.K over [S, E] rows, P.V over [E, S] rows; with v stored
  [S, E] XLA:CPU transposed the whole v cache every step), and the cache is read before the
  write rather than after it, which leaves the write one consumer that XLA performs in place.
  """
  b, t, h, e = q_BTHE.shape
  kv, s = cache[0].shape[1], cache[0].shape[2]
  n_new = k_BKTE.shape[2]  # new keys: T, or more when only some rows query (``Attention``)
  n_old = s if old_slots is None else min(old_slots, s)
  q = q_BTHE.reshape(b, t, kv, h // kv, e)
  inv = 1.0 / jnp.sqrt(jnp.float32(e))
  # mask columns of the written slots, i.e. the mask of each query against each new key
  cols_BT = start_B[:, None] + jnp.arange(n_new)[None, :]
  new_mask_BTT = jnp.take_along_axis(mask_BTS, jnp.minimum(cols_BT, s - 1)[:, None, :], axis=2)
  sc = jnp.einsum("btkge,bkne->bkgtn", q, k_BKTE, preferred_element_type=jnp.float32)
  m_all = new_mask_BTT
  if n_old:
    k_old, v_old = (cache[0][:, :, :n_old], cache[1][..., :n_old]) if n_old < s else cache
    rel_BS = jnp.arange(n_old)[None, :] - start_B[:, None]  # slot - first written slot
    fresh_BS = (rel_BS >= 0) & (rel_BS < n_new)
    old_mask_BTS = mask_BTS[..., :n_old] & ~fresh_BS[:, None, :]
    sc = jnp.concatenate([cache_scores(q, k_old), sc], axis=-1)
    m_all = jnp.concatenate([old_mask_BTS, new_mask_BTT], axis=-1)
  m_all = m_all[:, None, None]
  sc = jnp.where(m_all, sc * inv, NEG_INF)
  probs = jnp.where(m_all, jax.nn.softmax(sc, axis=-1), 0.0)
  p_new = probs[..., n_old:].astype(v_BKET.dtype)
  out = jnp.einsum("bkgtn,bken->btkge", p_new, v_BKET, preferred_element_type=jnp.float32)
  if n_old:
    out = cache_values(probs[..., :n_old].astype(v_old.dtype), v_old) + out
  return out.reshape(b, t, h, e).astype(q_BTHE.dtype)


class Attention(nn.Module):
  n_heads: int
  n_kv_heads: int
  head_dim: int
  rope_base: float
  dtype: Dtype = jnp.float32
  dropout: float = 0.0
  rope_len: int = 0  # RoPE table rows (the model's context, see ``rope``); 0 = computed inline

  @nn.compact
  def __call__(
    self,
    x_BTD,
    positions_BT,
    mask_BTS=None,
    *,
    kernel: Optional[Callable] = None,
    cache: Optional[KVCache] = None,
    access: Optional[CacheAccess] = None,
    rows_BR=None,
    deterministic: bool = True,
    qkv=None,
  ):
    """Self-attention, or attention over a KV cache.

    Without ``cache``: keys are this call's tokens; pass either ``mask_BTS`` or ``kernel``
    (a function (q, k, v) -> out that applies its own mask, e.g. the Pallas LCA kernel).
    With ``cache`` (a ``KVCache`` or a (k, v) pair) and ``access`` (a ``CacheAccess``: where
    the T new keys go, which slots are read, whether the write is deferred): the queries attend
    the cache under ``mask_BTS`` [B, T, S] ([B, T, W] with a window).
    Returns (out, kv): the new keys and values [B, T, K, E] (no cache), the updated
    ``KVCache``, or with ``access.defer_write`` the new entries (k [B, K, T, E], v [B, K, E, T])
    for ``write_kv`` to store later. ``rows_BR`` [B, R] (indices into T) keeps only those rows'
    outputs, [B, R, D] (a caller that reads only some positions after this layer): all T keys
    and values are still computed (and written); over a cache only those rows query.
    ``qkv`` (decoding with ``fused_decode_kernels``: the caller's fused q/k/v projection
    [B, T, (H + 2 K) E]) skips the input projection and returns the heads' outputs [B, R, H E]
    before the output projection, which the caller fuses with its residual; with heads the
    decode attention kernel takes (``decode_attention.supported``), RoPE, the attention and
    the cache write run in that one kernel.
    """
    if (cache is None) != (access is None):
      raise ValueError("a KV cache needs its CacheAccess and a CacheAccess its cache")
    b, t = (x_BTD if qkv is None else qkv).shape[:2]
    h, kv, e = self.n_heads, self.n_kv_heads, self.head_dim
    fused = decode_kernel(self, QKV_KERNEL) if cache is not None and qkv is None else None
    if qkv is not None and decode_attention.supported(h, kv, e):
      out, new_kv = _attend_cache_kernel(
        qkv.reshape(b, t, h + 2 * kv, e),
        positions_BT,
        rope_rows(positions_BT, e, self.rope_base, self.rope_len),
        KVCache(*cache),
        mask_BTS,
        access,
        rows_BR,
        h,
      )
      return out.reshape(b, -1, h * e), new_kv
    if qkv is not None:
      q, k, v = jnp.split(qkv, [h * e, (h + kv) * e], axis=-1)
    elif fused is not None:
      # decoding with ``fuse_decode_params``: one dot (training keeps three, faster there)
      q, k, v = split_dense(x_BTD, fused[0], (h * e, kv * e, kv * e), self.dtype, fused[1])
    else:
      q = dense(h * e, "q_proj", ("embed", "heads"), self.dtype)(x_BTD)
      k = dense(kv * e, "k_proj", ("embed", "kv"), self.dtype)(x_BTD)
      v = dense(kv * e, "v_proj", ("embed", "kv"), self.dtype)(x_BTD)
    q, k, v = q.reshape(b, t, h, e), k.reshape(b, t, kv, e), v.reshape(b, t, kv, e)
    cos_sin = rope_cos_sin(positions_BT, e, self.rope_base, self.rope_len)  # once for q and k
    q = rope(q, cos_sin)
    k = rope(k, cos_sin)
    if cache is not None:
      if rows_BR is not None:
        q, mask_BTS = take_rows(q, rows_BR), take_rows(mask_BTS, rows_BR)
      out, new_kv = _attend_cache(q, k, v, KVCache(*cache), mask_BTS, access)
    else:
      out = kernel(q, k, v) if kernel is not None else masked_attention(q, k, v, mask_BTS)
      out = out if rows_BR is None else take_rows(out, rows_BR)
      new_kv = (k, v)
    if qkv is not None:
      return out.reshape(b, -1, h * e), new_kv
    out = dense(x_BTD.shape[-1], "out_proj", ("heads", "embed"), self.dtype)(
      out.reshape(b, -1, h * e)
    )
    out = nn.Dropout(self.dropout)(out, deterministic=deterministic)
    return out, new_kv


def _attend_cache(q_BRHE, k_BTKE, v_BTKE, cache: KVCache, mask_BRS, access: CacheAccess):
  """``Attention`` over a KV cache: the R queries' outputs [B, R, H, E] and the updated cache
  (or with ``access.defer_write`` the new entries)."""
  t = k_BTKE.shape[1]
  k_h, v_h = k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 3, 1)  # [B,K,T,E], [B,K,E,T]
  s_len = cache.k.shape[2]
  start = jnp.clip(access.write_B, 0, s_len - t)  # where write_rows puts them (clamped)
  att, att_start = cache, start
  if access.window_B is not None:
    w = mask_BRS.shape[-1]
    window = jnp.clip(access.window_B, 0, s_len - w)
    win = lambda c, ax: jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, w, ax))(c, window)
    att, att_start = KVCache(win(cache.k, 1), win(cache.v, 2)), start - window
  out = cached_attention(q_BRHE, k_h, v_h, att, mask_BRS, att_start, access.old_slots)
  # The writes must come after the reads, or XLA:CPU copies each cache to write it (twice
  # per step): a zero that depends on the attention output orders them (an optimization
  # barrier does not survive XLA:CPU's pipeline). Exact unless the output is not finite.
  tie = (out[:, :1, :1, :1] * 0).astype(k_h.dtype).transpose(0, 2, 1, 3)
  new_kv = KVCache(k_h + tie, v_h + tie)
  if not access.defer_write:
    new_kv = write_kv(cache, new_kv, access.write_B)
  return out, new_kv


def _attend_cache_kernel(
  qkv_BTCE, positions_BT, cos_sin_BT2E, cache: KVCache, mask_BTS, access, rows_BR, n_heads
):
  """``_attend_cache`` of the fused projection's q, k, v (before RoPE: ``rope_rows``'s values
  ``cos_sin_BT2E``) in one Pallas kernel (``kernels.decode_attention``); a causal mask
  (``access.causal``) is compared with the queries' positions there instead of read."""
  take = lambda x: x if rows_BR is None else take_rows(x, rows_BR)
  causal = access.causal and access.window_B is None
  out, new_kv = decode_attention.cache_attention(
    qkv_BTCE,
    cos_sin_BT2E,
    cache.k,
    cache.v,
    None if causal else take(mask_BTS),
    access.write_B,
    access.window_B,
    rows_BR,
    take(positions_BT) if causal else None,
    access.read_slots,
    n_heads=n_heads,
    old_slots=access.old_slots,
    write=not access.defer_write,
    interpret=backend.pallas_interpret(),
  )
  return out, KVCache(*new_kv)


class SwiGLU(nn.Module):
  d_inner: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, decoding: bool = False):
    """``decoding`` (a block run over a KV cache): gate and up in one dot against
    ``GATE_UP_KERNEL`` when ``fuse_decode_params`` added it (training keeps two dots: the fused
    one is slower there on XLA:CPU)."""
    d, f = x.shape[-1], self.d_inner
    fused = decode_kernel(self, GATE_UP_KERNEL) if decoding else None
    if fused is not None:
      gate, up = split_dense(x, fused[0], (f, f), self.dtype, fused[1])
    else:
      gate = dense(f, "gate_proj", ("embed", "mlp"), self.dtype)(x)
      up = dense(f, "up_proj", ("embed", "mlp"), self.dtype)(x)
    return dense(d, "down_proj", ("mlp", "embed"), self.dtype)(swiglu(gate, up))


class Block(nn.Module):
  """Pre-norm block: x + attn(norm1(x)); x + mlp(norm2(x))."""

  n_heads: int
  n_kv_heads: int
  d_inner: int
  rope_base: float
  eps: float = 1e-6
  dtype: Dtype = jnp.float32
  dropout: float = 0.0
  rope_len: int = 0

  @nn.compact
  def __call__(
    self,
    x,
    positions,
    mask=None,
    kernel=None,
    deterministic: bool = True,
    *,
    cache=None,
    access: Optional[CacheAccess] = None,
    write_B=None,
    rows_BR=None,
  ):
    """The block over ``Attention``'s arguments. ``kernel`` and ``deterministic`` come
    positionally from ``Stack``'s remat path (static arguments there); ``write_B`` stands for
    ``access=CacheAccess(write_B)``."""
    access = _cache_access(access, write_B)
    attn = Attention(
      self.n_heads,
      self.n_kv_heads,
      x.shape[-1] // self.n_heads,
      self.rope_base,
      self.dtype,
      self.dropout,
      self.rope_len,
      name="attn",
    )
    small = cache is not None and x.shape[0] * x.shape[1] <= decode_fused.MAX_ROWS
    weights = self._fused_weights() if small else None
    if weights is not None:
      return self._fused_step(attn, weights, x, positions, mask, cache, access, rows_BR)
    y, kv = attn(
      RMSNorm(self.eps, name="norm1")(x),
      positions,
      mask,
      kernel=kernel,
      cache=cache,
      access=access,
      rows_BR=rows_BR,
      deterministic=deterministic,
    )
    x = (x if rows_BR is None else take_rows(x, rows_BR)) + y
    y = SwiGLU(self.d_inner, self.dtype, name="mlp")(
      RMSNorm(self.eps, name="norm2")(x), decoding=cache is not None
    )
    y = nn.Dropout(self.dropout)(y, deterministic=deterministic)
    x = x + y
    return nn.with_logical_constraint(x, ("batch", "length", "embed")), kv

  def _fused_weights(self):
    """(norm1 scale, qkv, out_proj, norm2 scale, gate_up, down), each weight an (array, stored
    [in, out]) pair, when this step runs the fused decode kernels (``backend.fused_decode_kernels``
    and decode weights with the fused projections, ``fuse_decode_params``), else None."""
    p = self.variables.get("params", {})
    if not backend.fused_decode_kernels() or "attn" not in p or "mlp" not in p:
      return None
    p = nn.unbox(p)
    attn, mlp = p["attn"], p["mlp"]
    found = (
      p.get("norm1", {}).get("scale"),
      stored_weight(attn, QKV_KERNEL),
      stored_weight(attn.get("out_proj", {}), "kernel"),
      p.get("norm2", {}).get("scale"),
      stored_weight(mlp, GATE_UP_KERNEL),
      stored_weight(mlp.get("down_proj", {}), "kernel"),
    )
    return None if any(w is None for w in found) else found

  def _fused_step(self, attn, weights, x, positions, mask, cache, access, rows_BR):
    """The block over a KV cache for a step of at most ``decode_fused.MAX_ROWS`` rows (a
    prefill's block keeps XLA's GEMMs) with ``kernels.decode_fused``: norm1 + q/k/v projection, the
    attention (``Attention`` from the projection; ``kernels.decode_attention``: one more
    kernel), output projection + residual, norm2 + gate/up + SwiGLU, down projection +
    residual: five kernels a layer."""
    s1, qkv, w_out, s2, w_gate_up, w_down = weights
    b, t, d = x.shape
    h, e = self.n_heads, d // self.n_heads
    kw = dict(dtype=self.dtype, interpret=backend.pallas_interpret())
    y = decode_fused.norm_matvec(x.reshape(b * t, d), s1, qkv[0], eps=self.eps, in_out=qkv[1], **kw)
    heads, kv = attn(
      None, positions, mask, cache=cache, access=access, rows_BR=rows_BR, qkv=y.reshape(b, t, -1)
    )
    x = x if rows_BR is None else take_rows(x, rows_BR)
    r = x.shape[1]
    heads = heads.reshape(b * r, h * e)
    x2 = decode_fused.matvec_residual(heads, w_out[0], x.reshape(b * r, d), in_out=w_out[1], **kw)
    g = decode_fused.norm_matvec_glu(x2, s2, w_gate_up[0], eps=self.eps, in_out=w_gate_up[1], **kw)
    x2 = decode_fused.matvec_residual(g, w_down[0], x2, in_out=w_down[1], **kw)
    return x2.reshape(b, r, d), kv


def _cache_access(access: Optional[CacheAccess], write_B) -> Optional[CacheAccess]:
  """``access``, or a plain write at slots ``write_B`` (``Block``'s and ``Stack``'s shorthand)."""
  if write_B is None:
    return access
  if access is not None:
    raise ValueError("pass either access or write_B, not both")
  return CacheAccess(write_B)


class Stack(nn.Module):
  """``n_layers`` blocks, returning (x, per-layer keys and values: see ``Attention`` for what
  comes back with and without caches)."""

  n_layers: int
  n_heads: int
  n_kv_heads: int
  d_inner: int
  rope_base: float
  eps: float = 1e-6
  dtype: Dtype = jnp.float32
  dropout: float = 0.0
  remat: bool = False
  rope_len: int = 0
  scan: bool = False  # without caches, run the blocks as one lax.scan (see ``_scanned``)

  def _block(self, cls, **kw):
    return cls(
      self.n_heads,
      self.n_kv_heads,
      self.d_inner,
      self.rope_base,
      self.eps,
      self.dtype,
      self.dropout,
      self.rope_len,
      **kw,
    )

  def _scanned(self, x, positions, mask, kernel, deterministic):
    """The blocks as one ``lax.scan`` over their parameters stacked on a new leading axis: the
    program holds one block instead of ``n_layers`` (compile time; the paper-scale LM has 16),
    and the parameters keep their per-layer layout (``layer_{i}``: checkpoints, converter and
    sharding rules are those of the unrolled stack). The stacked copy and, in the backward
    pass, the unstacking of its gradient are one read and write of the stack's weights per
    step. Each layer's dropout draws from its own key, split from this module's."""
    n = self.n_layers
    params = nn.unbox(self.variables["params"])
    stacked = jax.tree.map(lambda *p: jnp.stack(p), *[params[f"layer_{i}"] for i in range(n)])
    drop = not deterministic and self.dropout > 0
    keys = jax.random.split(self.make_rng("dropout"), n) if drop else jnp.zeros((n,))
    block = self._block(Block, parent=None)  # unbound: applied to each layer's slice of ``stacked``

    def body(x, layer):
      p, key = layer
      y, _ = block.apply(
        {"params": p},
        x,
        positions,
        mask,
        kernel=kernel,
        deterministic=deterministic,
        rngs={"dropout": key} if drop else None,
      )
      return y, None

    if self.remat:
      body = jax.checkpoint(body, prevent_cse=False)
    return jax.lax.scan(body, x, (stacked, keys))[0]

  @nn.compact
  def __call__(
    self,
    x,
    positions,
    mask=None,
    *,
    kernel=None,
    caches=None,
    access: Optional[CacheAccess] = None,
    write_B=None,
    rows_BR=None,
    deterministic: bool = True,
  ):
    """The blocks in order; over ``caches`` (one ``KVCache`` per layer) each reads and writes
    its own as ``access`` says (``write_B``: see ``Block``). ``rows_BR`` [B, R] keeps only those
    positions after the last layer (the output is [B, R, D]; every layer still computes, and
    over caches writes, all T positions' keys and values). With ``scan`` (a full forward of
    more than one layer, all positions kept, parameters already made) the blocks run as one
    scan and the per-layer keys and values are not returned (None)."""
    access = _cache_access(access, write_B)
    full = caches is None and rows_BR is None
    if self.scan and full and self.n_layers > 1 and not self.is_initializing():
      return self._scanned(x, positions, mask, kernel, deterministic), None
    # remat only saves activation memory for a backward pass: decoding (caches) runs plain
    # blocks, whose cache writes may be deferred (``CacheAccess.defer_write``) out of a
    # ``lax.cond``
    remat = self.remat and caches is None
    # static_argnums count self as 0: kernel is 4, deterministic 5
    block_cls = nn.remat(Block, static_argnums=(4, 5)) if remat else Block
    new_caches = []
    for i in range(self.n_layers):
      rows = rows_BR if i == self.n_layers - 1 else None
      blk = self._block(block_cls, name=f"layer_{i}")
      if remat:
        x, kv = blk(x, positions, mask, kernel, deterministic, rows_BR=rows)
      else:
        cache = None if caches is None else caches[i]
        x, kv = blk(
          x, positions, mask, kernel, deterministic, cache=cache, access=access, rows_BR=rows
        )
      new_caches.append(kv)
    return x, new_caches
