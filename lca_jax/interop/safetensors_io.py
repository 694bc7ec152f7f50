"""safetensors files read and written without the safetensors package.

``read_safetensors`` memory-maps a ``.safetensors`` file and returns read-only numpy arrays of
any dtype of the format (bfloat16 and float8 through ml_dtypes); ``write_safetensors`` writes a
dict of numpy arrays atomically (8-byte aligned data section, as the reference writer). A file
that is corrupt or holds a tensor that cannot be represented is a ``CheckpointError``. The
mapping between these tensors and our parameter tree is in :mod:`lca_jax.interop.upstream`.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from typing import Dict

import ml_dtypes
import numpy as np

from lca_jax.interop.errors import CheckpointError

_ST_DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "U16": np.dtype(np.uint16),
  "U32": np.dtype(np.uint32),
  "U64": np.dtype(np.uint64),
  "BOOL": np.dtype(np.bool_),
  "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
  """name -> read-only numpy array (memory-mapped). Any dtype of the format, bf16 included."""
  try:
    with open(path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      if size < 8:
        raise ValueError("file shorter than its header")
      n = struct.unpack("<Q", f.read(8))[0]
      if n > size - 8:
        raise ValueError(f"header length {n} exceeds the file")
      header = json.loads(f.read(n).decode("utf-8"))
      buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + n else b""
  except (OSError, ValueError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path}: corrupt or unreadable safetensors file ({e})") from None
  out = {}
  base = 8 + n
  for name, info in header.items():
    if name == "__metadata__":
      continue
    try:
      dt = _ST_DTYPES[info["dtype"]]
      shape = tuple(int(s) for s in info["shape"])
      start, end = (int(o) for o in info["data_offsets"])
    except KeyError as e:
      raise CheckpointError(
        f"{path}: tensor {name}: unsupported or missing dtype/shape/offsets ({e})"
      ) from None
    count = math.prod(shape)
    if end - start != count * dt.itemsize or base + end > size:
      raise CheckpointError(
        f"{path}: tensor {name}: data offsets [{start}, {end}] do not fit "
        f"shape {shape} {info['dtype']} or the file"
      )
    out[name] = (
      np.frombuffer(buf, dt, count, base + start).reshape(shape) if count else np.zeros(shape, dt)
    )
  return out


def write_safetensors(path: str, sd: Dict[str, np.ndarray]) -> None:
  """Write ``sd`` (numpy arrays: float32/bfloat16/...) as safetensors, atomically."""
  header, offset, arrays = {}, 0, []
  for name in sorted(sd):
    a = np.ascontiguousarray(sd[name])
    if a.dtype not in _ST_CODES:
      raise CheckpointError(f"tensor {name}: dtype {a.dtype} cannot be written to safetensors")
    if a.dtype.byteorder == ">":
      a = a.astype(a.dtype.newbyteorder("<"))
    header[name] = {
      "dtype": _ST_CODES[a.dtype],
      "shape": list(a.shape),
      "data_offsets": [offset, offset + a.nbytes],
    }
    offset += a.nbytes
    arrays.append(a)
  hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
  hb += b" " * (-len(hb) % 8)  # 8-byte alignment of the data section, as the reference writer
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(hb)))
    f.write(hb)
    for a in arrays:
      f.write(a.tobytes())
  os.replace(tmp, path)
