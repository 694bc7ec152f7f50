"""Optimizer: global-norm clipping, then Adam (or AdamW), linear warmup then cosine decay."""

from __future__ import annotations

import optax


def decay_horizon(optim_cfg, total_steps: int) -> int:
  """Steps over which warmup + cosine run: ``optim.decay_steps`` or, if 0, ``train.steps``.
  ``optim_cfg``: the optim section, a ConfigDict or a dict (a saved run config's)."""
  n = int(optim_cfg.get("decay_steps", 0) or 0) or int(total_steps)
  return max(n, int(optim_cfg["warmup_steps"]) + 1)


def make_schedule(optim_cfg, total_steps: int) -> optax.Schedule:
  """0 -> lr linearly over ``warmup_steps``, then cosine to ``lr * final_lr_ratio``."""
  lr = float(optim_cfg.lr)
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=lr,
    warmup_steps=int(optim_cfg.warmup_steps),
    decay_steps=decay_horizon(optim_cfg, total_steps),
    end_value=lr * float(optim_cfg.final_lr_ratio),
  )


def make_optimizer(optim_cfg, total_steps: int):
  """(optax transformation, schedule)."""
  schedule = make_schedule(optim_cfg, total_steps)
  kw = dict(b1=float(optim_cfg.b1), b2=float(optim_cfg.b2), eps=float(optim_cfg.eps))
  wd = float(optim_cfg.get("weight_decay", 0.0) or 0.0)
  adam = optax.adamw(schedule, weight_decay=wd, **kw) if wd else optax.adam(schedule, **kw)
  parts = []
  if optim_cfg.clip_norm and float(optim_cfg.clip_norm) > 0:
    parts.append(optax.clip_by_global_norm(float(optim_cfg.clip_norm)))
  parts.append(adam)
  return optax.chain(*parts), schedule
