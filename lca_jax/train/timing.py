"""Timing lca-train's jitted step on host batches read beforehand (the benchmark tools)."""

from __future__ import annotations

import time

import jax

from lca_jax.train import sharding as shd


def time_train_steps(setup, host_batches, warmup: int) -> dict:
  """Initialise a state, run ``warmup`` untimed steps (the first compiles), then time the rest.

  Returns init_s, first_step_s (compile + first step), warmup_s (all warm-up steps),
  step_s (mean over the timed steps) and metrics (the timed steps' metrics, on the host).
  """
  t0 = time.perf_counter()
  state = setup.init_state()
  jax.block_until_ready(state)
  init_s = time.perf_counter() - t0
  first_s = None
  with shd.mesh_context(setup.mesh):
    t0 = time.perf_counter()
    for i, b in enumerate(host_batches[:warmup]):
      state, m = setup.train_step(state, setup.device_batch(b))
      if i == 0:
        jax.block_until_ready((state, m))
        first_s = time.perf_counter() - t0
    jax.block_until_ready(state)
    warmup_s = time.perf_counter() - t0
    ms = []
    t0 = time.perf_counter()
    for b in host_batches[warmup:]:
      state, m = setup.train_step(state, setup.device_batch(b))
      ms.append(m)
    jax.block_until_ready((state, ms))
    total = time.perf_counter() - t0
  steps = len(host_batches) - warmup
  return dict(
    init_s=init_s,
    first_step_s=first_s,
    warmup_s=warmup_s,
    step_s=total / max(steps, 1),
    metrics=jax.device_get(ms),
  )
