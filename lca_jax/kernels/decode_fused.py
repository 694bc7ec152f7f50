"""Fused Pallas (Triton) kernels for the dense parts of a decode step: a few rows times a weight.

A decode step multiplies M rows (the bytes of a step times the batch, 1..32) by every weight
of a layer. XLA runs each of norm, product, activation and residual add as a kernel of its own;
these kernels do one weight's whole job in one launch, reading the weight once:

* ``norm_matvec(x, scale, w)``: RMSNorm(x) * scale, then times ``w`` ([N, D], [out, in] as
  decoding stores a plain kernel on GPUs; ``in_out=True``: [D, N], as it stores the fused
  ones) -> [M, N] (an attention's fused q/k/v projection);
* ``norm_matvec_glu(x, scale, w)``: the same against a fused gate/up weight [2F, D], returning
  silu(gate) * up [M, F] (a SwiGLU MLP's first half);
* ``matvec_residual(x, w, res)``: res + x w^T (an output or down projection and its residual).

Numerics follow the XLA path they replace (``layers.RMSNorm``, ``layers.dot_rows_oi``,
``activations.swiglu``): the norm in float32, cast to the compute dtype before the product,
products accumulated in float32 and rounded to the compute dtype, the activation in float32.
Each program computes a block of ``block_n`` outputs for all M rows, looping over the input in
chunks of ``block_k`` (a Triton dot from 16 rows on, a multiply and sum below). ``interpret=True`` runs
them on the CPU (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_ROWS = 16  # a Triton dot needs every dimension >= 16
MAX_ROWS = 64  # more rows (a prefill) are a GEMM: XLA's kernels serve them
BLOCK_N = 32
BLOCK_K = 128


def pow2_rows(m: int) -> int:
  """Rows of a block: the next power of two (Triton's block shapes are powers of two; the rows
  past M are masked on load and store)."""
  return 1 << max(m - 1, 0).bit_length()


def rows_product(x_MK, w, in_out: bool):
  """x times a weight chunk in float32: ``w`` is [N, K] (x w^T) or with ``in_out`` [K, N]
  (x w). A Triton dot from ``MIN_ROWS`` rows on; below it a multiply and a sum over the chunk
  (a matrix-vector product: no row padding, no copy of the result)."""
  contract = 0 if in_out else 1
  if x_MK.shape[0] >= MIN_ROWS:
    dims = (((1,), (contract,)), ((), ()))
    return lax.dot_general(x_MK, w, dims, preferred_element_type=jnp.float32)
  x = x_MK.astype(jnp.float32)
  if in_out:
    return jnp.sum(x[:, :, None] * w.astype(jnp.float32)[None, :, :], axis=1)
  return jnp.sum(x[:, None, :] * w.astype(jnp.float32)[None, :, :], axis=2)


def _chunk(w_ref, cols, in_out: bool):
  """The rows of the weight block that chunk ``cols`` of the input meets."""
  return w_ref[cols, :] if in_out else w_ref[:, cols]


def _weight_spec(d: int, bn: int, in_out: bool, offset: int = 0):
  """Block ``j`` (+ ``offset`` blocks) of ``bn`` outputs of a weight [N, D] (or [D, N])."""
  if in_out:
    return pl.BlockSpec((d, bn), lambda j: (0, j + offset))
  return pl.BlockSpec((bn, d), lambda j: (j + offset, 0))


def divisor_block(n: int, want: int) -> int:
  """The largest power of two <= ``want`` that divides ``n`` (at least 16 when possible)."""
  b = want
  while b > 1 and n % b:
    b //= 2
  return b


def compiler_params(num_warps: int = 4, num_stages: int = 2):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _inv_rms(x_ref, d: int, block_k: int, eps: float):
  """1 / rms of each row of ``x_ref`` [M, D], in float32, summed in chunks of ``block_k``."""

  def body(i, acc):
    xk = x_ref[:, pl.ds(i * block_k, block_k)].astype(jnp.float32)
    return acc + jnp.sum(xk * xk, axis=1)

  ss = lax.fori_loop(0, d // block_k, body, jnp.zeros((x_ref.shape[0],), jnp.float32))
  return lax.rsqrt(ss / d + eps)


def _normed_product(x_ref, s_ref, w_ref, inv, d, block_k, dtype, in_out):
  """sum over chunks of (x * inv * scale in x's dtype, then ``dtype``) times the weight
  chunk, float32."""
  n = w_ref.shape[1] if in_out else w_ref.shape[0]

  def body(i, acc):
    cols = pl.ds(i * block_k, block_k)
    xk = x_ref[:, cols].astype(jnp.float32) * inv[:, None]
    xk = (xk * s_ref[cols].astype(jnp.float32)[None, :]).astype(x_ref.dtype).astype(dtype)
    return acc + rows_product(xk, _chunk(w_ref, cols, in_out).astype(dtype), in_out)

  return lax.fori_loop(0, d // block_k, body, jnp.zeros((x_ref.shape[0], n), jnp.float32))


def _norm_matvec_kernel(x_ref, s_ref, w_ref, o_ref, *, eps, block_k, dtype, in_out):
  d = x_ref.shape[1]
  inv = _inv_rms(x_ref, d, block_k, eps)
  acc = _normed_product(x_ref, s_ref, w_ref, inv, d, block_k, dtype, in_out)
  o_ref[...] = acc.astype(dtype).astype(o_ref.dtype)


def _norm_glu_kernel(x_ref, s_ref, g_ref, u_ref, o_ref, *, eps, block_k, dtype, in_out):
  d = x_ref.shape[1]
  inv = _inv_rms(x_ref, d, block_k, eps)
  gate = _normed_product(x_ref, s_ref, g_ref, inv, d, block_k, dtype, in_out).astype(dtype)
  up = _normed_product(x_ref, s_ref, u_ref, inv, d, block_k, dtype, in_out).astype(dtype)
  g = gate.astype(jnp.float32)
  o_ref[...] = (g * jax.nn.sigmoid(g) * up.astype(jnp.float32)).astype(dtype).astype(o_ref.dtype)


def _matvec_residual_kernel(x_ref, w_ref, r_ref, o_ref, *, block_k, dtype, in_out):
  k = x_ref.shape[1]
  n = w_ref.shape[1] if in_out else w_ref.shape[0]

  def body(i, acc):
    cols = pl.ds(i * block_k, block_k)
    w = _chunk(w_ref, cols, in_out).astype(dtype)
    return acc + rows_product(x_ref[:, cols].astype(dtype), w, in_out)

  acc = lax.fori_loop(0, k // block_k, body, jnp.zeros((x_ref.shape[0], n), jnp.float32))
  o_ref[...] = (r_ref[...] + acc.astype(dtype)).astype(o_ref.dtype)


_STATIC = ("eps", "dtype", "in_out", "interpret", "block_n", "block_k")


def _out_in_shape(w, in_out: bool):
  return w.shape[::-1] if in_out else w.shape


@functools.partial(jax.jit, static_argnames=_STATIC)
def norm_matvec(
  x_MD, scale_D, w, *, eps, dtype, in_out=False, interpret=False, block_n=BLOCK_N, block_k=BLOCK_K
):
  """RMSNorm(x) * scale times ``w`` [N, D] (with ``in_out``: [D, N]) -> [M, N] in ``dtype``."""
  dtype = jnp.dtype(dtype)
  (n, d), m = _out_in_shape(w, in_out), x_MD.shape[0]
  bn, bk = divisor_block(n, block_n), divisor_block(d, block_k)
  return pl.pallas_call(
    functools.partial(_norm_matvec_kernel, eps=eps, block_k=bk, dtype=dtype, in_out=in_out),
    grid=(n // bn,),
    in_specs=[
      pl.BlockSpec((pow2_rows(m), d), lambda j: (0, 0)),
      pl.BlockSpec((d,), lambda j: (0,)),
      _weight_spec(d, bn, in_out),
    ],
    out_specs=pl.BlockSpec((pow2_rows(m), bn), lambda j: (0, j)),
    out_shape=jax.ShapeDtypeStruct((m, n), dtype),
    compiler_params=compiler_params(),
    interpret=interpret,
    name="decode_norm_matvec",
  )(x_MD, scale_D, w)


@functools.partial(jax.jit, static_argnames=_STATIC)
def norm_matvec_glu(
  x_MD, scale_D, w, *, eps, dtype, in_out=False, interpret=False, block_n=BLOCK_N, block_k=BLOCK_K
):
  """silu(gate) * up of RMSNorm(x) * scale against a fused gate/up weight [2F, D] (with
  ``in_out``: [D, 2F]) -> [M, F] in ``dtype``."""
  dtype = jnp.dtype(dtype)
  (n2, d), m = _out_in_shape(w, in_out), x_MD.shape[0]
  f = n2 // 2
  bn, bk = divisor_block(f, block_n), divisor_block(d, block_k)
  return pl.pallas_call(
    functools.partial(_norm_glu_kernel, eps=eps, block_k=bk, dtype=dtype, in_out=in_out),
    grid=(f // bn,),
    in_specs=[
      pl.BlockSpec((pow2_rows(m), d), lambda j: (0, 0)),
      pl.BlockSpec((d,), lambda j: (0,)),
      _weight_spec(d, bn, in_out),  # gate outputs
      _weight_spec(d, bn, in_out, f // bn),  # up outputs
    ],
    out_specs=pl.BlockSpec((pow2_rows(m), bn), lambda j: (0, j)),
    out_shape=jax.ShapeDtypeStruct((m, f), dtype),
    compiler_params=compiler_params(),
    interpret=interpret,
    name="decode_norm_glu",
  )(x_MD, scale_D, w, w)


@functools.partial(jax.jit, static_argnames=_STATIC[1:])
def matvec_residual(
  x_MK, w, res_MN, *, dtype, in_out=False, interpret=False, block_n=BLOCK_N, block_k=BLOCK_K
):
  """res + x w^T (``w`` [N, K]; with ``in_out`` [K, N]: res + x w), the product in ``dtype``
  -> [M, N] in res's dtype promoted with ``dtype``."""
  dtype = jnp.dtype(dtype)
  (n, k), m = _out_in_shape(w, in_out), x_MK.shape[0]
  bn, bk = divisor_block(n, block_n), divisor_block(k, block_k)
  return pl.pallas_call(
    functools.partial(_matvec_residual_kernel, block_k=bk, dtype=dtype, in_out=in_out),
    grid=(n // bn,),
    in_specs=[
      pl.BlockSpec((pow2_rows(m), k), lambda j: (0, 0)),
      _weight_spec(k, bn, in_out),
      pl.BlockSpec((pow2_rows(m), bn), lambda j: (0, j)),
    ],
    out_specs=pl.BlockSpec((pow2_rows(m), bn), lambda j: (0, j)),
    out_shape=jax.ShapeDtypeStruct((m, n), jnp.result_type(res_MN.dtype, dtype)),
    compiler_params=compiler_params(),
    interpret=interpret,
    name="decode_matvec_residual",
  )(x_MK, w, res_MN)
