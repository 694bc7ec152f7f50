"""The model's parameter tree without allocating it: shapes, dtypes and logical partitioning.

``abstract_params_boxed`` keeps flax's ``Partitioned`` boxes (the logical axis names sharding
reads); ``abstract_params`` is the unboxed tree of ShapeDtypeStructs that checkpoint restores
and cost models take. Parameters are float32 (the master weights) whatever
``ModelConfig.dtype`` is; the model casts to the compute dtype inside its layers.
"""

from __future__ import annotations

import jax
from flax.core import meta

from lca_jax.model.config import ModelConfig
from lca_jax.model.hierarchical import init_params


def strip_boxes(tree):
  """Unbox flax ``Partitioned`` metadata without applying sharding constraints (safe on
  abstract trees and outside jit)."""
  return jax.tree_util.tree_map(
    lambda x: x.value if isinstance(x, meta.AxisMetadata) else x,
    tree,
    is_leaf=lambda x: isinstance(x, meta.AxisMetadata),
  )


def init_boxed_params(cfg: ModelConfig, seed: int):
  """Freshly initialised params of ``cfg`` from ``seed``, in their ``Partitioned`` boxes."""
  k = jax.random.fold_in(jax.random.key(int(seed)), 1)
  return init_params(cfg, k, seq_len=8, batch=1)


def abstract_params_boxed(cfg: ModelConfig, seed: int = 0):
  """Shapes + logical partitioning of the params (nothing allocated)."""
  return jax.eval_shape(lambda: init_boxed_params(cfg, seed))


def abstract_params(cfg: ModelConfig, dtype=None, sharding=None):
  """Unboxed abstract params (ShapeDtypeStructs), optionally with a dtype and one sharding."""
  return jax.tree_util.tree_map(
    lambda a: jax.ShapeDtypeStruct(a.shape, dtype or a.dtype, sharding=sharding),
    strip_boxes(abstract_params_boxed(cfg)),
  )
