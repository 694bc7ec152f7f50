"""Fused activations (lca_jax/model/activations.py): values equal the plain formulas, gradients
equal autodiff's of them, in float32 and bfloat16, on random inputs over a wide range."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_rel

from lca_jax.model.activations import gelu_exact, swiglu

EPS = {jnp.float32: np.finfo(np.float32).eps, jnp.bfloat16: 2.0**-7}


def _inputs(dtype, shape=(64, 96)):
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  # a wide range: sigmoid / erfc saturate on both sides, gradients change sign
  g = (jax.random.normal(k[0], shape) * 6.0).astype(dtype)
  u = (jax.random.normal(k[1], shape) * 3.0).astype(dtype)
  dy = jax.random.normal(k[2], shape).astype(dtype)
  return g, u, dy


def _plain_swiglu(g, u):
  gf = g.astype(jnp.float32)
  return (nn.silu(gf) * u.astype(jnp.float32)).astype(u.dtype)


def _plain_gelu(x):
  return jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_values_and_gradients(dtype):
  g, u, dy = _inputs(dtype)
  tol = 8 * EPS[dtype]
  assert_close_rel(swiglu(g, u), _plain_swiglu(g, u), tol)
  got = jax.vjp(swiglu, g, u)[1](dy)
  want = jax.vjp(_plain_swiglu, g, u)[1](dy)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype == dtype
    assert_close_rel(a, b, tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gelu_exact_values_and_gradients(dtype):
  x, _, dy = _inputs(dtype)
  tol = 8 * EPS[dtype]
  assert_close_rel(gelu_exact(x), _plain_gelu(x), tol)
  (got,) = jax.vjp(gelu_exact, x)[1](dy)
  (want,) = jax.vjp(_plain_gelu, x)[1](dy)
  assert got.dtype == dtype
  assert_close_rel(got, want, tol)
