"""XLA:CPU compile options of the decode executables.

XLA:CPU sends dots to YNNPACK fusions by default. Decoding multiplies a few rows (the bytes of a
step, the rows of a batch) by every weight, which runs faster through its Eigen path (2-core
AMD EPYC dev VM): [3, 1024] x [1024, 1024] 829 -> 572 us, [32, 1024] x [1024, 1024] 1621 ->
977 us.

The train step would gain too on a CPU host split into two devices (both executables in one
process, 5 alternating repetitions each, d 256, layers 2/4/2/2): 1 x 4096 bytes
tensor-parallel 5.08 -> 4.76 s per step, 4 x 1024 data-parallel unchanged (3.33 vs 3.38 s).
It does not use them: a ``jax.jit`` given ``compiler_options`` cannot be traced inside another
transformation (``jax.make_jaxpr``, a caller's own jit or scan), and ``Setup.train_step`` stays
composable. (docs/design.md §5.3.)

Accelerator backends get no options; an XLA that does not know the option (an older jaxlib)
compiles with its defaults.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax

CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.lru_cache(maxsize=None)
def _cpu_options_known() -> bool:
  """Whether this jaxlib's XLA:CPU accepts ``CPU_OPTIONS`` (one tiny compile, once)."""
  try:
    jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options=dict(CPU_OPTIONS))
  except Exception as e:  # noqa: BLE001 - XLA's error type differs across jaxlib versions
    if not any(name in str(e) for name in CPU_OPTIONS):
      raise
    return False
  return True


def cpu_options() -> Optional[dict]:
  """``CPU_OPTIONS`` when the default backend is the CPU and XLA knows them, else None
  (compile with the defaults)."""
  on_cpu = jax.default_backend() == "cpu"
  return dict(CPU_OPTIONS) if on_cpu and _cpu_options_known() else None
