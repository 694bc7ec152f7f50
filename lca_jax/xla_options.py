"""XLA:CPU compile options of the decode executables.

XLA:CPU sends dots to YNNPACK fusions by default. Decoding multiplies a few rows (the bytes of a
step, the rows of a batch) by every weight, which runs faster through its Eigen path.

The train step does not use them (they would speed a tensor-split step on a CPU host and not a
data-parallel one; docs/performance.md has both): a ``jax.jit`` given ``compiler_options`` cannot be traced inside another
transformation (``jax.make_jaxpr``, a caller's own jit or scan), and ``Setup.train_step`` stays
composable. (docs/design.md §5.3.)

On a GPU the decode executables are compiled with command buffers over loops and
conditionals as well as kernels (``GPU_OPTIONS``): XLA then records the whole decode loop as one
CUDA graph whose device-side conditional nodes run the steps, so the host neither launches each
step's kernels nor reads the loop's predicate back after every step. ``LCA_JAX_GPU_GRAPHS=0``
compiles with XLA's defaults instead (each step's body one graph launch, the predicate read
back per step). Other backends get no options; an XLA that does not know the CPU option (an
older jaxlib) compiles with its defaults.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import jax

from lca_jax import backend

CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
GPU_OPTIONS = {
  "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
}


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
  on_cpu = backend.is_cpu()
  return dict(CPU_OPTIONS) if on_cpu and _cpu_options_known() else None


def decode_options() -> Optional[dict]:
  """The compile options of a decode executable on the platform it is traced for
  (``backend.platform``): ``cpu_options()`` on the CPU, ``GPU_OPTIONS`` on a GPU (unless
  ``LCA_JAX_GPU_GRAPHS=0``), else None."""
  if backend.platform() == "gpu":
    return None if os.environ.get("LCA_JAX_GPU_GRAPHS", "1") == "0" else dict(GPU_OPTIONS)
  return cpu_options()
