"""The error type of the upstream (PyTorch) checkpoint layout, shared by its readers and writers.

``CheckpointError`` is raised for an upstream directory that cannot be read or written: a
missing or corrupt ``config.json`` / ``model.safetensors``, a tensor of the wrong shape or dtype,
an unsupported model variant. Kept apart so that :mod:`lca_jax.interop.upstream` and
:mod:`lca_jax.interop.safetensors_io` raise the same type without importing each other.
"""

from __future__ import annotations

from lca_jax.errors import LcaError


class CheckpointError(LcaError, ValueError):
  """An upstream directory that cannot be read or written (missing file, bad shape, unknown
  variant)."""
