"""Timing loops: wall time of single calls and medians of jitted calls."""

from __future__ import annotations

import statistics
import time

import jax


def timed(fn, *args) -> float:
  """Seconds ``fn(*args)`` takes (its result dropped)."""
  t0 = time.perf_counter()
  fn(*args)
  return time.perf_counter() - t0


def median_ms(fn, args, iters: int, warmup: int) -> float:
  """Median wall time in ms of ``fn(*args)`` (already jitted) over ``iters`` calls, after
  ``warmup`` untimed ones, each waited for (``jax.block_until_ready``)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)
