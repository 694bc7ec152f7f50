"""What the estimate needs beyond the compiled program: the work of a step, from the config.

* ``train_hints``: the expected trip count of the blockwise attention's tile loops (XLA does not
  know it: the tiles follow the mask) and the keys a Pallas attention kernel visits per query,
  per attention stack (matched by the stack's name in the op's source path), on the regular
  layout of ``perf.costs`` (groups of 1 / bp_prior bytes, one document per row).
* ``train_useful_flops``: the useful FLOPs of a whole step (``perf.costs.useful_flops`` x the
  accumulated micro-batches): what MFU divides by.
* ``decode_rates``: a decode program's bytes/s from its idle and LM step estimates at a given
  bytes per group and accepted bytes per step, with the memory floor of ``perf.bounds``
  (the weights and caches a step must read / the GPU's bandwidth) beside it.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from lca_jax.kernels.lca_attention import query_block_key_bounds
from lca_jax.model.attention import LOOPS_PER_BLOCK, schedule
from lca_jax.model.config import ModelConfig
from lca_jax.param_tree import abstract_params
from lca_jax.perf import bounds, costs
from lca_jax.perf.estimate import Hints
from lca_jax.perf.hardware import Gpu

PALLAS_BLOCK = 64  # the Pallas kernels' default block_q = block_k (kernels.lca_attention)
STACK_PATHS = {"encoder": "/encoder/", "lm": "/lm/", "decoder": "/decoder/", "mbp": "/mbp/"}


def group_len(cfg: ModelConfig, bytes_per_group: Optional[float] = None) -> float:
  """Bytes per group: given, else the rate the boundary loss trains towards (1 / bp_prior)."""
  if bytes_per_group:
    return float(bytes_per_group)
  return 1.0 / cfg.bp_prior if cfg.bp_prior > 0 else 3.0


def train_hints(
  cfg: ModelConfig,
  seq_len: int,
  bytes_per_group: Optional[float] = None,
  pallas_block: int = PALLAS_BLOCK,
):
  """``Hints`` for a train or eval step of ``cfg`` at ``seq_len`` bytes per row, the Pallas
  kernels' blocks at most ``pallas_block`` (the TPU kernel's are 128)."""
  doc, _, plan = costs.regular_layout(cfg, 1, seq_len, group_len(cfg, bytes_per_group))
  trips, keys = [], []
  for name, _, lo, bq, bk in costs.attention_stacks(cfg, doc, plan):
    t = lo.shape[1]
    sched = schedule(lo, min(bq, t), min(bk, t))
    per_block = float(np.mean(np.asarray(sched.n_tiles_N)))
    trips.append((STACK_PATHS[name], per_block / LOOPS_PER_BLOCK))
    b = min(pallas_block, max(16, 1 << (t - 1).bit_length()))
    keys.append((STACK_PATHS[name], pallas_keys_per_query(lo, b, b)))
  return Hints(trips=tuple(trips), keys_per_query=tuple(keys))


def pallas_keys_per_query(k_start_BT, block_q: int, block_k: int) -> float:
  """Keys a Pallas LCA kernel visits per query: the whole key blocks of each query block
  (``query_block_key_bounds`` over the padded sequence, as the kernel computes them), in
  (query, key) pairs per row position."""
  b, t = k_start_BT.shape
  step = max(block_q, block_k)
  pad = -(-t // step) * step
  k_start = jnp.pad(k_start_BT, ((0, 0), (0, pad - t)), constant_values=pad)
  lo, hi = query_block_key_bounds(k_start, block_q, block_k)
  return float(np.sum(np.asarray(hi - lo))) * block_q * block_k / (b * t)


def train_useful_flops(
  cfg: ModelConfig, rows: int, seq_len: int, accum: int, bytes_per_group: Optional[float] = None
) -> float:
  """Useful FLOPs of one train step: ``accum`` micro-batches of ``rows`` x ``seq_len``."""
  doc, _, plan = costs.regular_layout(cfg, rows, seq_len, group_len(cfg, bytes_per_group))
  return costs.useful_flops(cfg, abstract_params(cfg), doc, plan)["total"] * accum


def decode_rates(
  cfg: ModelConfig,
  gpu: Gpu,
  idle_s: float,
  lm_s: float,
  *,
  mode: str,
  batch: int,
  width: int,
  prompt_len: int,
  max_bytes: int,
  bytes_per_group: Optional[float] = None,
  accepted: Optional[float] = None,
) -> dict:
  """Bytes/s of a decode program whose idle step takes ``idle_s`` and LM step ``lm_s``.

  Each row commits ``accepted`` bytes a step (1 in ``ntp``; in ``verify`` / ``threshold`` the
  acceptance given, at most ``width``); a row closes a group with probability accepted /
  bytes_per_group, so the LM runs in a fraction ``bounds.lm_fraction`` of the steps. The
  floor: the bytes the step must read (``bounds.step_read_bytes``) at the datasheet bandwidth."""
  k = 1.0 if mode == "ntp" else float(min(accepted or width, width))
  g = group_len(cfg, bytes_per_group)
  f_lm = bounds.lm_fraction(1.0 / g, k, batch) if cfg.hierarchical else 0.0
  step_s = (1.0 - f_lm) * idle_s + f_lm * lm_s
  length = bounds.cache_len([prompt_len], max_bytes, width, cfg.max_seq_len)
  read = bounds.step_read_bytes(cfg, mode, batch, width, length, 1.0 / g, k)
  floor_s = read["total"] / gpu.memory_bytes_per_s
  out_bytes = batch * k
  return dict(
    bytes_per_group=g,
    accepted_per_step=k,
    lm_fraction=round(f_lm, 4),
    step_s=step_s,
    bytes_per_s=out_bytes / step_s,
    floor_step_s=floor_s,
    floor_bytes_per_s=out_bytes / floor_s,
    estimate_over_floor=step_s / floor_s,
    read_bytes=read["total"],
  )
