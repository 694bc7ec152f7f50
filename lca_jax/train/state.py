"""The train state and its sharded construction from the abstract state (docs/design.md §5.3).

    abstract = jax.eval_shape(init)                   # no memory
    shardings = logical names -> mesh axes            # sharding.shardings_from_logical
    state = jax.jit(init, out_shardings=shardings)()  # each device builds only its shards

Parameters are float32 (the master weights) whatever ``ModelConfig.dtype`` is; the model casts
to the compute dtype inside its layers.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from lca_jax.model.config import ModelConfig
from lca_jax.param_tree import abstract_params_boxed, init_boxed_params, strip_boxes
from lca_jax.train import sharding as shd
from lca_jax.workdir.write import seed_key


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps completed
  params: Any  # float32 master weights (unboxed)
  opt_state: Any
  rng: jax.Array  # uint32 key data; step keys are fold_in(rng, step)


def _boxed_state(cfg, tx, seed):
  boxed = init_boxed_params(cfg, seed)
  return TrainState(
    step=jnp.zeros((), jnp.int32), params=boxed, opt_state=tx.init(boxed), rng=seed_key(seed)
  )


def _state(cfg, tx, seed):
  params = strip_boxes(init_boxed_params(cfg, seed))
  return TrainState(
    step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=seed_key(seed)
  )


def state_shardings(cfg: ModelConfig, tx, mesh, seed: int = 0):
  """(abstract unboxed TrainState with shardings attached, TrainState of NamedShardings)."""
  boxed = jax.eval_shape(lambda: _boxed_state(cfg, tx, seed))
  abstract = jax.eval_shape(lambda: _state(cfg, tx, seed))
  specs = nn.get_partition_spec(boxed)
  shardings = shd.shardings_from_logical(specs, abstract, mesh)
  abstract = jax.tree_util.tree_map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
  )
  return abstract, shardings


def param_shardings(cfg: ModelConfig, mesh):
  boxed = abstract_params_boxed(cfg)
  abstract = strip_boxes(boxed)
  return shd.shardings_from_logical(nn.get_partition_spec(boxed), abstract, mesh)


def make_init_fn(cfg: ModelConfig, tx, seed: int, shardings):
  """jitted () -> fresh TrainState laid out as ``shardings`` (each device builds its shards)."""
  return jax.jit(lambda: _state(cfg, tx, seed), out_shardings=shardings)


def create_state(cfg: ModelConfig, tx, mesh, seed: int, shardings=None) -> TrainState:
  """A freshly initialised, sharded TrainState (each device computes only its shards)."""
  if shardings is None:
    _, shardings = state_shardings(cfg, tx, mesh, seed)
  with shd.mesh_context(mesh):
    return make_init_fn(cfg, tx, seed, shardings)()


def state_from_params(params, tx, seed: int, shardings) -> TrainState:
  """A step-0 TrainState around given params (``train.init_from``): fresh optimizer state."""
  fn = jax.jit(
    lambda p: TrainState(
      step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p), rng=seed_key(seed)
    ),
    out_shardings=shardings,
  )
  return fn(jax.device_put(params, shardings.params))
