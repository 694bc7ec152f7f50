"""The production programs, built from abstract arguments on a target's devices.

Each builder returns a ``Program``: a name, the jitted function's ``Lowered`` form (traced for
the target's platform: inside ``backend.target("gpu")`` or ``backend.target("tpu")`` and, for
the sharded steps, the run's mesh context)
and what the report needs besides the HLO (sequence length, state bytes per device). The train
and eval steps are those ``lca-train`` runs (``train.loop.prepare`` over the target's devices,
so the mesh, batch plan, shardings and donation are the run's own); the decode programs are
those ``generate`` runs (``decode.engine.lower_abstract``: prefill + the decode loop).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from lca_jax import backend
from lca_jax.decode import engine
from lca_jax.model.config import ModelConfig
from lca_jax.model.layers import decode_weights
from lca_jax.param_tree import abstract_params
from lca_jax.train import loop
from lca_jax.train import sharding as shd

BATCH_KEYS = ("ids", "segment_ids", "positions")


@dataclasses.dataclass
class Program:
  name: str
  lowered: Any  # jax.stages.Lowered
  seq_len: int  # T: a buffer with two dimensions >= T is reported
  state_bytes: int  # per device: parameters + optimizer state (train), parameters (eval, decode)
  info: dict  # what the program is (shapes, mode, mesh)
  lower_s: float = 0.0  # seconds to trace and lower it
  decode: bool = False  # a decode program (prefill + decode loop)
  bytes_per_step: float = 0.0  # decode: bytes a step commits at most (rows x bytes per row)
  cfg: Optional[ModelConfig] = None  # the model (for the time estimate's workload)


def shard_bytes(tree) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest
  shard of each leaf)."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
  return total


def _batch(shape: Sequence[int], sharding) -> dict:
  return {k: jax.ShapeDtypeStruct(tuple(shape), jnp.int32, sharding=sharding) for k in BATCH_KEYS}


def platform_of(devices) -> str:
  """'tpu' for TPU devices, else 'gpu' (the platform a deviceless program is traced for)."""
  return "tpu" if next(iter(devices)).platform == "tpu" else "gpu"


def train_programs(config, devices) -> list:
  """The train step and the eval step ``lca-train`` compiles for ``config`` on ``devices``."""
  t0 = time.perf_counter()
  setup = loop.prepare(config, devices)
  plan, mesh = setup.plan, setup.mesh
  info = dict(
    mesh={a: int(mesh.shape[a]) for a in shd.AXES},
    seq_len=plan.seq_len,
    micro_batch=plan.micro,
    micro_batch_per_device=plan.micro // shd.batch_shards(mesh),
    accum=plan.accum,
    # the kernel the program runs ("auto" resolved for the target's platform) and what the
    # config asked for
    attention_impl=backend.attention_impl(setup.model_cfg.attention_impl, platform_of(devices)),
    attention_requested=setup.model_cfg.attention_impl,
    remat=setup.model_cfg.remat,
    dtype=setup.model_cfg.dtype,
  )
  with backend.target(platform_of(devices)), shd.mesh_context(mesh):
    train = setup.train_step.lower(
      setup.abstract,
      _batch((plan.accum, plan.micro, plan.seq_len), shd.batch_sharding(mesh, True)),
    )
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    eval_ = setup.eval_step.lower(
      setup.abstract.params,
      _batch((plan.micro, plan.seq_len), shd.batch_sharding(mesh, False)),
    )
    eval_s = time.perf_counter() - t0
  return [
    Program(
      "train_step",
      train,
      plan.seq_len,
      shard_bytes(setup.abstract),
      info,
      train_s,
      cfg=setup.model_cfg,
    ),
    Program(
      "eval_step",
      eval_,
      plan.seq_len,
      shard_bytes(setup.abstract.params),
      info,
      eval_s,
      cfg=setup.model_cfg,
    ),
  ]


def decode_program(
  cfg: ModelConfig, device, *, batch: int, prompt_len: int, max_bytes: int, **options
) -> Program:
  """The decode program ``generate`` runs on one device for ``batch`` prompts of
  ``prompt_len`` bytes and ``max_bytes`` new bytes, with the weights an ``api.Model`` passes
  (``decode_weights``: fused projections, stored in the compute dtype)."""
  sharding = SingleDeviceSharding(device)
  params = jax.eval_shape(lambda p: decode_weights(p, cfg.dtype, True), abstract_params(cfg))
  params = jax.tree_util.tree_map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), params
  )
  t0 = time.perf_counter()
  with backend.target(platform_of([device])):
    lowered = engine.lower_abstract(
      cfg, params, batch, prompt_len, sharding, max_bytes=max_bytes, **options
    )
  lower_s = time.perf_counter() - t0
  mode = options.get("mode", "ntp")
  info = dict(batch=batch, prompt_len=prompt_len, max_bytes=max_bytes, mode=mode, dtype=cfg.dtype)
  info.update({k: v for k, v in options.items() if k != "mode"})
  width = options.get("n", 3) if mode != "ntp" else 1
  return Program(
    f"decode_{mode}_b{batch}",
    lowered,
    cfg.max_seq_len,
    shard_bytes(params),
    info,
    lower_s,
    decode=True,
    bytes_per_step=batch * width,
    cfg=cfg,
  )
