"""Writing a fresh lca-train work directory from params held in memory, without the training stack.

``write_workdir`` saves the params of a model as checkpoint step 0 in the layout that
``lca_jax.train.checkpoint`` writes (items ``params``, ``step``, ``rng``, ``meta``; no optimizer
or data state) beside a run config holding only the model. ``lca_jax.load`` / ``lca-sample``
serve it and ``train.init_from=<workdir>`` fine-tunes from it (fresh optimizer); ``lca-train``
cannot resume it in place (no optimizer or data state, no run config) and says so as a config
mismatch. A work directory that ``lca-train`` resumes is written by
``lca_jax.train.loop.write_resumable_workdir``.

``seed_key`` is the ``rng`` item of a step-0 state (``lca_jax.train.state`` builds its states
with it).
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from lca_jax.model.config import ModelConfig
from lca_jax.workdir.config_file import write_run_config
from lca_jax.workdir.params import checkpoint_dir


def seed_key(seed: int) -> jax.Array:
  """The uint32 key data a state of ``seed`` starts from (its ``rng`` item)."""
  return jax.random.key_data(jax.random.key(int(seed)))


def write_workdir(
  out: str, params, cfg: ModelConfig, *, meta: Optional[dict] = None, seed: int = 0
) -> str:
  """Write ``params`` (float32 or castable; numpy or jax arrays) of ``cfg`` into the new or
  empty directory ``out`` (created when missing) as checkpoint step 0 with the run config
  ``{"model": ...}``; ``meta`` is stored in the step's ``meta`` item beside the model and step.
  Returns ``out``."""
  os.makedirs(out, exist_ok=True)
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  arrays = jax.tree_util.tree_map(lambda a: jax.device_put(np.asarray(a, np.float32), dev), params)
  write_run_config(out, {"model": cfg.to_dict()}, cfg)
  handlers = {name: ocp.StandardCheckpointHandler() for name in ("params", "step", "rng")}
  handlers["meta"] = ocp.JsonCheckpointHandler()
  opts = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
  with ocp.CheckpointManager(checkpoint_dir(out), options=opts, item_handlers=handlers) as mngr:
    mngr.save(
      0,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(arrays),
        step=ocp.args.StandardSave({"step": jnp.zeros((), jnp.int32)}),
        rng=ocp.args.StandardSave({"key": seed_key(seed)}),
        meta=ocp.args.JsonSave(dict(meta or {}, model=cfg.to_dict(), step=0)),
      ),
      force=True,
    )
    mngr.wait_until_finished()
  return out
