"""Activations with hand-written gradients that keep only their inputs for the backward pass.

Autodiff of ``silu(gate) * up`` keeps sigmoid(gate), silu(gate) and the product for the
backward pass, each written by a pass of its own over a [tokens, d_inner] array; exact gelu
keeps erfc and exp terms the same way. Here the forward is one elementwise pass and the
backward recomputes the cheap terms from the inputs it already holds (the inputs are outputs
of matrix products that autodiff keeps anyway), so a layer's MLP saves three [tokens, d_inner]
arrays and four passes over them (measured on the d 256 / inner 1024 model at 4 x 1024 bytes:
docs/design.md §5.3). Values equal the plain formulas; gradients equal autodiff's up to float
rounding (tests/test_activations.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


@jax.custom_vjp
def swiglu(gate, up):
  """silu(gate) * up, computed in float32, returned in ``up``'s dtype."""
  g = gate.astype(jnp.float32)
  return (g * jax.nn.sigmoid(g) * up.astype(jnp.float32)).astype(up.dtype)


def _swiglu_fwd(gate, up):
  return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, dy):
  gate, up = res
  g, u, d = gate.astype(jnp.float32), up.astype(jnp.float32), dy.astype(jnp.float32)
  s = jax.nn.sigmoid(g)
  silu = g * s
  dg = d * u * (s + silu * (1.0 - s))  # d silu / dg = s (1 + g (1 - s))
  return dg.astype(gate.dtype), (d * silu).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)


@jax.custom_vjp
def gelu_exact(x):
  """x Phi(x) with the exact (erf) Phi, as ``jax.nn.gelu(x, approximate=False)`` and torch's
  ``nn.GELU()``; float32 inside."""
  xf = x.astype(jnp.float32)
  return (xf * _cdf(xf)).astype(x.dtype)


def _cdf(xf):
  """Phi(x) = erfc(-x / sqrt 2) / 2 (no cancellation for x << 0, as jax.nn.gelu)."""
  return 0.5 * jax.lax.erfc(-xf * _INV_SQRT2)


def _gelu_fwd(x):
  return gelu_exact(x), x


def _gelu_bwd(x, dy):
  xf = x.astype(jnp.float32)
  cdf = _cdf(xf)
  pdf = _INV_SQRT2PI * jnp.exp(-0.5 * xf * xf)
  return ((dy.astype(jnp.float32) * (cdf + xf * pdf)).astype(x.dtype),)


gelu_exact.defvjp(_gelu_fwd, _gelu_bwd)
