"""safetensors files read and written through the safetensors package (its numpy API).

``read_safetensors`` returns numpy arrays of every dtype the package reads into numpy (float32,
float16, bfloat16 through ml_dtypes, the integer and bool types); ``write_safetensors`` writes a
dict of numpy arrays atomically. A file that is missing, truncated or corrupt, a tensor of a
dtype numpy cannot hold (float8) and a tensor that cannot be written are a ``CheckpointError``
with a one-line message, never the package's own exception. The mapping between these tensors
and our parameter tree is in :mod:`lca_jax.interop.upstream`.
"""

from __future__ import annotations

import os
from typing import Dict

import ml_dtypes
import numpy as np
import safetensors
from safetensors import numpy as st_numpy

from lca_jax.interop.errors import CheckpointError

# The dtypes written: those safetensors.numpy also reads back into numpy.
_WRITABLE = frozenset(
  np.dtype(t)
  for t in (
    np.float64,
    np.float32,
    np.float16,
    ml_dtypes.bfloat16,
    np.int64,
    np.int32,
    np.int16,
    np.int8,
    np.uint64,
    np.uint32,
    np.uint16,
    np.uint8,
    np.bool_,
  )
)
# What reading or writing a file can raise: the package's own error, the OS's, and numpy's for
# a dtype it has no type for.
_ERRORS = (safetensors.SafetensorError, OSError, ValueError, TypeError, AttributeError)


def _one_line(e: BaseException) -> str:
  return " ".join(str(e).split()) or type(e).__name__


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
  """name -> numpy array of every tensor of the file at ``path``, bf16 included."""
  path = os.fspath(path)
  out = {}
  try:
    with safetensors.safe_open(path, framework="np") as f:
      for name in f.keys():
        try:
          out[name] = f.get_tensor(name)
        except (AttributeError, TypeError):  # a dtype numpy has no type for (float8)
          raise CheckpointError(
            f"{path}: tensor {name}: dtype {f.get_slice(name).get_dtype()} cannot be read "
            "into numpy"
          ) from None
  except CheckpointError:
    raise
  except _ERRORS as e:
    raise CheckpointError(
      f"{path}: corrupt or unreadable safetensors file ({_one_line(e)})"
    ) from None
  return out


def _new_file(path: str) -> int:
  """Create the empty file ``path`` as ``open`` does and return its permission bits: the mode
  the umask gives this process's new files (0644 under the usual 022)."""
  with open(path, "wb"):
    pass
  return os.stat(path).st_mode & 0o777


def write_safetensors(path: str, sd: Dict[str, np.ndarray]) -> None:
  """Write ``sd`` (numpy arrays: float32/bfloat16/...) as safetensors, atomically, with the
  mode of the process's other new files (the package itself writes 0600)."""
  path = os.fspath(path)
  arrays = {}
  for name in sorted(sd):
    a = np.ascontiguousarray(sd[name])  # the package writes an array's buffer as it lies
    if a.dtype.newbyteorder("=") not in _WRITABLE:
      raise CheckpointError(f"tensor {name}: dtype {a.dtype} cannot be written to safetensors")
    arrays[name] = a
  tmp = path + ".tmp"
  try:
    mode = _new_file(tmp)
    st_numpy.save_file(arrays, tmp)  # replaces tmp by a file of mode 0600
    os.chmod(tmp, mode)
    os.replace(tmp, path)
  except _ERRORS as e:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise CheckpointError(f"{path}: cannot write safetensors file ({_one_line(e)})") from None
