"""Compiling the production programs for GPUs on a host without one (deviceless AOT).

``targets`` names the GPUs and gives abstract devices of them, ``programs`` builds the train,
eval and decode programs from abstract arguments on those devices, ``report`` reads what each
compiled program needs (memory against the device's, compile time, kernels, custom calls,
kernels per decode step). ``lca-train --aot h100:8`` and ``tools/gpu_aot.py`` are built on it.
"""

import os
import sys


def import_jax_for_gpu_targets():
  """Import jax to compile for GPUs on this host: with ``JAX_PLATFORMS=cpu`` (no GPU client is
  started, whatever the host has), and without the lines the CUDA plugin's native code writes
  to the process's stderr while it loads on a host without a driver ("Could not find cuda
  drivers on your machine"): they say nothing about a deviceless compile. An import error
  still raises."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "jax" in sys.modules:
    return
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    with open(os.devnull, "w") as null:
      os.dup2(null.fileno(), 2)
      import jax  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  finally:
    os.dup2(saved, 2)
    os.close(saved)
