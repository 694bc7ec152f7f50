"""Transformer building blocks shared by every stack: RMSNorm, RoPE, GQA attention, SwiGLU, block.

Shapes: B batch, T query length, S key length, D model width, H query heads, K kv heads,
E head dim, F inner width. Parameters are float32; compute runs in ``dtype``; norms and
softmax in float32. Parameter axes carry logical names for sharding ('embed', 'heads',
'kv', 'mlp', 'vocab'); the model knows nothing else about meshes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

NEG_INF = -1e30
Dtype = Any


class Dense(nn.Module):
  """y = x W (+ b) over the last axis; parameters ``kernel`` [in, out] (and ``bias``) as in
  ``nn.Dense``, compute in ``dtype``.

  The product runs on x flattened to [tokens, in]: with a [B, T, in] input, autodiff's weight
  gradient would contract over two axes (B and T), for which XLA:CPU lays the activation
  gradient out transposed through a slow strided fusion (measured: 1.7x the whole MLP's
  forward + backward at [4, 1024, 256] x [256, 1024]); one contracting axis needs no copy.
  """

  features: int
  axes: tuple
  dtype: Dtype = jnp.float32
  use_bias: bool = False

  @nn.compact
  def __call__(self, x):
    kernel = self.param(
      "kernel",
      nn.with_logical_partitioning(nn.initializers.normal(0.02), self.axes),
      (x.shape[-1], self.features),
    )
    y = jnp.dot(x.reshape(-1, x.shape[-1]).astype(self.dtype), kernel.astype(self.dtype))
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,)).astype(self.dtype)
    return y.reshape(x.shape[:-1] + (self.features,))


def dense(features, name, axes, dtype):
  return Dense(features, tuple(axes), dtype, name=name)


class RMSNorm(nn.Module):
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param(
      "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (x.shape[-1],)
    )
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * scale).astype(x.dtype)


def rope(x_BTHE, positions_BT, base: float):
  """Rotate-half RoPE with cos/sin over cat(freqs, freqs) (upstream layout)."""
  e = x_BTHE.shape[-1]
  inv_freq = 1.0 / (base ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))
  freqs = positions_BT.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  xf = x_BTHE.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (xf * cos + rotated * sin).astype(x_BTHE.dtype)


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
  batches)."""

  def one(c, n, s):
    return jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), s, axis=axis)

  return jax.vmap(one)(cache_BS, new_BT, start_B)


class Attention(nn.Module):
  n_heads: int
  n_kv_heads: int
  head_dim: int
  rope_base: float
  dtype: Dtype = jnp.float32
  dropout: float = 0.0

  @nn.compact
  def __call__(
    self,
    x_BTD,
    positions_BT,
    mask_BTS=None,
    *,
    kernel: Optional[Callable] = None,
    cache=None,
    write_B=None,
    deterministic=True,
    window_B=None,
  ):
    """Self-attention, or attention over a KV cache.

    Without ``cache``: keys are this call's tokens; pass either ``mask_BTS`` or ``kernel``
    (a function (q, k, v) -> out that applies its own mask, e.g. the Pallas LCA kernel).
    With ``cache`` = (k [B,K,S,E], v) (head-major): the new keys are written at ``write_B`` and queries attend
    the whole cache under ``mask_BTS`` [B,T,S], or, with ``window_B``, only the W = mask width
    slots starting there (the caller guarantees no allowed key lies outside). Returns (out, (k, v)) — the new keys/values
    (no cache) or the updated cache.
    """
    b, t, d = x_BTD.shape
    h, kv, e = self.n_heads, self.n_kv_heads, self.head_dim
    q = dense(h * e, "q_proj", ("embed", "heads"), self.dtype)(x_BTD).reshape(b, t, h, e)
    k = dense(kv * e, "k_proj", ("embed", "kv"), self.dtype)(x_BTD).reshape(b, t, kv, e)
    v = dense(kv * e, "v_proj", ("embed", "kv"), self.dtype)(x_BTD).reshape(b, t, kv, e)
    q = rope(q, positions_BT, self.rope_base)
    k = rope(k, positions_BT, self.rope_base)
    if cache is not None:
      k_all = write_rows(cache[0], k.transpose(0, 2, 1, 3), write_B, axis=1)
      v_all = write_rows(cache[1], v.transpose(0, 2, 1, 3), write_B, axis=1)
      k_att, v_att = k_all, v_all
      if window_B is not None:
        w = mask_BTS.shape[-1]
        win = jax.vmap(lambda c, s: jax.lax.dynamic_slice_in_dim(c, s, w, axis=1))
        k_att, v_att = win(k_all, window_B), win(v_all, window_B)
      out = masked_attention(q, k_att, v_att, mask_BTS, head_major=True)
      new_kv = (k_all, v_all)
    else:
      out = kernel(q, k, v) if kernel is not None else masked_attention(q, k, v, mask_BTS)
      new_kv = (k, v)
    out = dense(d, "out_proj", ("heads", "embed"), self.dtype)(out.reshape(b, t, h * e))
    out = nn.Dropout(self.dropout)(out, deterministic=deterministic)
    return out, new_kv


class SwiGLU(nn.Module):
  d_inner: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    gate = dense(self.d_inner, "gate_proj", ("embed", "mlp"), self.dtype)(x)
    up = dense(self.d_inner, "up_proj", ("embed", "mlp"), self.dtype)(x)
    return dense(d, "down_proj", ("mlp", "embed"), self.dtype)(nn.silu(gate) * up)


class Block(nn.Module):
  """Pre-norm block: x + attn(norm1(x)); x + mlp(norm2(x))."""

  n_heads: int
  n_kv_heads: int
  d_inner: int
  rope_base: float
  eps: float = 1e-6
  dtype: Dtype = jnp.float32
  dropout: float = 0.0

  @nn.compact
  # Not keyword-only: Stack's remat path passes every argument positionally (static_argnums
  # there count self as 0: kernel is 4, deterministic 7).
  def __call__(
    self,
    x,
    positions,
    mask=None,
    kernel=None,
    cache=None,
    write_B=None,
    deterministic=True,
    window_B=None,
  ):
    attn = Attention(
      self.n_heads,
      self.n_kv_heads,
      x.shape[-1] // self.n_heads,
      self.rope_base,
      self.dtype,
      self.dropout,
      name="attn",
    )
    y, kv = attn(
      RMSNorm(self.eps, name="norm1")(x),
      positions,
      mask,
      kernel=kernel,
      cache=cache,
      write_B=write_B,
      deterministic=deterministic,
      window_B=window_B,
    )
    x = x + y
    y = SwiGLU(self.d_inner, self.dtype, name="mlp")(RMSNorm(self.eps, name="norm2")(x))
    y = nn.Dropout(self.dropout)(y, deterministic=deterministic)
    x = x + y
    return nn.with_logical_constraint(x, ("batch", "length", "embed")), kv


class Stack(nn.Module):
  """``n_layers`` blocks. ``caches`` is a list of per-layer (k, v) or None."""

  n_layers: int
  n_heads: int
  n_kv_heads: int
  d_inner: int
  rope_base: float
  eps: float = 1e-6
  dtype: Dtype = jnp.float32
  dropout: float = 0.0
  remat: bool = False

  @nn.compact
  def __call__(
    self,
    x,
    positions,
    mask=None,
    *,
    kernel=None,
    caches=None,
    write_B=None,
    deterministic=True,
    window_B=None,
  ):
    block_cls = nn.remat(Block, static_argnums=(4, 7)) if self.remat else Block
    new_caches = []
    for i in range(self.n_layers):
      blk = block_cls(
        self.n_heads,
        self.n_kv_heads,
        self.d_inner,
        self.rope_base,
        self.eps,
        self.dtype,
        self.dropout,
        name=f"layer_{i}",
      )
      cache = None if caches is None else caches[i]
      if self.remat:
        x, kv = blk(x, positions, mask, kernel, cache, write_B, deterministic, window_B)
      else:
        x, kv = blk(
          x,
          positions,
          mask,
          kernel=kernel,
          cache=cache,
          write_B=write_B,
          deterministic=deterministic,
          window_B=window_B,
        )
      new_caches.append(kv)
    return x, new_caches
