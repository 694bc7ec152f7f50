"""The one owner of the weights a decode program runs with.

``for_model`` is the tree a call passes (an ``api.Model`` keeps it built once: ``build``);
``in_program`` is what the program does with it (the fused q/k/v and gate/up kernels of
``layers.fuse_decode_params`` and the compute-dtype weights of
``layers.compute_dtype_weights``, built once per call outside the decode loop; a tree that
``build`` made is returned as it is).
"""

from __future__ import annotations

import functools

import jax

from lca_jax.decode.policies import Plan
from lca_jax.model.layers import decode_weights


def build(params, dtype):
  """The fused decode tree of ``params`` in compute ``dtype``, built by one jitted call (what
  ``api.Model.decode_params`` keeps)."""
  return jax.jit(functools.partial(decode_weights, dtype=dtype))(params)


def in_program(plan: Plan, params, dtype):
  """The parameters the decode runs with: with ``plan.fuse_projections``, plus the fused
  q/k/v and gate/up kernels (3 dots fewer per layer). A tree that ``build`` made passes
  unchanged; raw params get them built here, once per call, never inside the loop, where the
  latent LM's and the MBP window's ``lax.cond`` branches would copy them every step. The
  weights every use casts to ``dtype`` are stored in it: a bfloat16 model's steps read them
  at 2 bytes each."""
  return decode_weights(params, dtype, plan.fuse_projections)


def for_model(model, plan: Plan):
  """The parameter tree a call passes: with fusion, the model's kept fused tree
  (``api.Model.decode_params``) where it has one, else its params (``in_program`` fuses
  those inside the call)."""
  if plan.fuse_projections and callable(getattr(model, "decode_params", None)):
    return model.decode_params()
  return model.params
