"""Compiled decode programs: the compiler options they are built with, and the bounded cache
that keeps them by static signature (``generate``'s calls and the server's slot batches).
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, NamedTuple

import jax

from lca_jax import backend, xla_options


def compile_lowered(lowered):
  """``lowered.compile`` with the decode options of ``lca_jax/xla_options.py``: on the CPU dots
  of a few rows through Eigen rather than YNNPACK, on a GPU the decode loop as one CUDA graph."""
  opts = xla_options.decode_options()
  return lowered.compile(compiler_options=opts) if opts else lowered.compile()


class Executable(NamedTuple):
  exe: Any
  compile_s: float
  extra: Any  # what the builder keeps beside it (``engine``: the sink its stream goes to)


class ExecutableCache:
  """The most recently used ``capacity`` executables, by static signature (LRU eviction). The
  signature a caller gives is extended with whether the step runs the fused decode kernels
  (``backend.fused_decode_kernels``): the same shapes trace to different programs with and
  without them.

  Bounded on purpose: the JIT code of one XLA:CPU decode executable occupies ~900 memory
  mappings, and a process may hold at most ``vm.max_map_count`` of them (65530 by default on
  Linux); an unbounded cache aborted a long process (the test suite) inside XLA once ~70
  signatures had been compiled. ``built`` counts compilations (never decreases)."""

  def __init__(self, capacity: int):
    self.capacity = capacity
    self.built = 0
    self._entries: collections.OrderedDict = collections.OrderedDict()

  def get(self, sig, build: Callable[[], Executable]) -> Executable:
    sig = (sig, backend.fused_decode_kernels())
    if sig in self._entries:
      self._entries.move_to_end(sig)
      return self._entries[sig]
    ex = build()
    self.built += 1
    self._entries[sig] = ex
    while len(self._entries) > self.capacity:
      self._entries.popitem(last=False)
    return ex

  def jit(self, sig, fn, args, donate=(), on_compile=None) -> Executable:
    """``fn`` jitted, lowered for ``args`` and compiled (``compile_lowered``) the first time
    ``sig`` is asked for; ``on_compile(seconds)`` after a compile."""

    def build():
      t0 = time.perf_counter()
      exe = compile_lowered(jax.jit(fn, donate_argnums=donate).lower(*args))
      seconds = time.perf_counter() - t0
      if on_compile is not None:
        on_compile(seconds)
      return Executable(exe, seconds, None)

    return self.get(sig, build)

  def clear(self):
    self._entries.clear()

  def __len__(self):
    return len(self._entries)
