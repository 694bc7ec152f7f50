"""The platform a program is traced for: where backend-specific choices are made.

A few choices in the model and the decode engine depend on the backend that runs the program:
Pallas kernels are interpreted on the CPU and lowered to Triton on GPUs, the CPU runs a
cached attention of a few columns as matrix-vector products, the blockwise attention runs one
loop nest per core on the CPU, and the decode executables get XLA:CPU options. Those choices
ask ``platform()``, which is ``jax.default_backend()`` unless a ``target(...)`` block says which
platform the program being traced and compiled is for: a deviceless compile for a GPU on a
GPU-less host (``lca_jax.aot``) runs with jax's CPU backend as the default and traces inside
``target("gpu")``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator, Optional

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_TARGET: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
  "lca_jax_target_platform", default=None
)


def platform() -> str:
  """'cpu', 'gpu' or 'tpu': the ``target`` in force, else jax's default backend ('cuda' and
  'rocm' count as 'gpu')."""
  p = _TARGET.get() or jax.default_backend()
  return "gpu" if p in ("cuda", "rocm") else p


def is_cpu() -> bool:
  return platform() == "cpu"


def cpu_threads() -> int:
  """Cores the CPU backend runs on (1 on other platforms): independent loop nests per call."""
  return (os.cpu_count() or 1) if is_cpu() else 1


def row_major_kernels() -> bool:
  """Whether decoding stores its weight matrices [out, in] (``layers.transpose_kernels``): on
  GPUs, where a one-row product against [in, out] can cost XLA two kernels and a weight-size
  temporary."""
  return platform() == "gpu"


@contextlib.contextmanager
def target(name: str) -> Iterator[None]:
  """Trace and compile for ``name`` (one of ``PLATFORMS``) inside the block."""
  if name not in PLATFORMS:
    raise ValueError(f"platform must be one of {PLATFORMS}, got {name!r}")
  token = _TARGET.set(name)
  try:
    yield
  finally:
    _TARGET.reset(token)
