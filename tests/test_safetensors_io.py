"""safetensors files through the safetensors package (lca_jax/interop/safetensors_io.py): exact
round trips of the dtypes the layouts use, and a damaged file is one ``CheckpointError`` line
(``lca_jax.load`` and ``lca-convert`` then report it in one line), never the package's own
exception."""

import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from conftest import REF_DIR
from safetensors.numpy import save_file

import lca_jax
from lca_jax.cli import convert as convert_cli
from lca_jax.interop import upstream
from lca_jax.interop.errors import CheckpointError
from lca_jax.interop.safetensors_io import read_safetensors, write_safetensors


def _bits(a):
  return np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def test_round_trip_is_exact(tmp_path):
  rng = np.random.default_rng(0)
  sd = {
    "bf16": rng.standard_normal((5, 3)).astype(ml_dtypes.bfloat16),
    "f32": rng.standard_normal((4,)).astype(np.float32),
    "f16": rng.standard_normal((2, 2)).astype(np.float16),
    "i64": np.arange(3, dtype=np.int64),
    "big_endian": np.arange(4, dtype=">f4"),
    "strided": rng.standard_normal((4, 6)).astype(np.float32)[:, ::2],
    "empty": np.zeros((0, 3), np.float32),
  }
  path = str(tmp_path / "x.safetensors")
  write_safetensors(path, sd)
  assert os.listdir(tmp_path) == ["x.safetensors"]  # written through a tmp file, renamed
  got = read_safetensors(path)
  assert sorted(got) == sorted(sd)
  for k, a in sd.items():
    want = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("="))
    assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
    np.testing.assert_array_equal(_bits(got[k]), _bits(want), err_msg=k)


def test_reads_what_torch_writes(tmp_path):
  torch = pytest.importorskip("torch")
  from safetensors.torch import save_file as torch_save  # pylint: disable=g-import-not-at-top

  w = torch.randn(3, 4).to(torch.bfloat16)
  path = str(tmp_path / "t.safetensors")
  torch_save({"w": w, "b": torch.ones(2)}, path, metadata={"format": "pt"})
  got = read_safetensors(path)
  assert got["w"].dtype == np.dtype(ml_dtypes.bfloat16) and got["b"].dtype == np.float32
  np.testing.assert_array_equal(
    got["w"].view(np.uint16), w.view(torch.int16).numpy().view(np.uint16)
  )


def _damaged(tmp_path, how: str) -> str:
  path = str(tmp_path / f"{how}.safetensors")
  write_safetensors(path, {"a": np.ones((8, 8), np.float32), "b": np.zeros(3, np.float32)})
  with open(path, "rb") as f:
    data = f.read()
  data = {
    "truncated": data[:-10],
    "header_only": data[:8],
    "empty": b"",
    "garbage_header": data[:8] + b"{nope" + data[13:],
    "header_too_long": (10**12).to_bytes(8, "little") + data[8:],
    "trailing_bytes": data + b"xx",
  }[how]
  with open(path, "wb") as f:
    f.write(data)
  return path


@pytest.mark.parametrize(
  "how",
  ["truncated", "header_only", "empty", "garbage_header", "header_too_long", "trailing_bytes"],
)
def test_damaged_file_is_one_checkpoint_error(tmp_path, how):
  path = _damaged(tmp_path, how)
  with pytest.raises(CheckpointError, match="corrupt or unreadable safetensors file") as e:
    read_safetensors(path)
  assert path in str(e.value) and "\n" not in str(e.value)


def test_missing_file_and_unreadable_dtype_are_checkpoint_errors(tmp_path):
  with pytest.raises(CheckpointError, match="corrupt or unreadable"):
    read_safetensors(str(tmp_path / "nope.safetensors"))
  path = str(tmp_path / "f8.safetensors")
  save_file({"q": np.ones(4, ml_dtypes.float8_e4m3fn)}, path)
  with pytest.raises(CheckpointError, match="tensor q: dtype F8_E4M3 cannot be read"):
    read_safetensors(path)


def test_unwritable_tensor_is_a_checkpoint_error(tmp_path):
  with pytest.raises(CheckpointError, match="tensor c: dtype complex128 cannot be written"):
    write_safetensors(str(tmp_path / "c.safetensors"), {"c": np.ones(2, np.complex128)})
  with pytest.raises(CheckpointError, match="cannot write safetensors file"):
    write_safetensors(str(tmp_path / "no" / "dir.safetensors"), {"a": np.ones(2, np.float32)})
  assert os.listdir(tmp_path) == []


def test_truncated_checkpoint_through_load_and_the_cli(tmp_path, capsys):
  src = str(tmp_path / "src")
  shutil.copytree(os.path.join(REF_DIR, "lca_small"), src)
  st = os.path.join(src, "model.safetensors")
  os.chmod(st, 0o644)
  with open(st, "rb") as f:
    data = f.read()
  with open(st, "wb") as f:
    f.write(data[: len(data) // 2])
  with pytest.raises(CheckpointError, match="corrupt or unreadable"):
    upstream.read_dir(src)
  with pytest.raises(lca_jax.LoadError, match="corrupt or unreadable"):
    lca_jax.load(src)
  out = str(tmp_path / "wd")
  assert convert_cli.main(["from-torch", "--torch-dir", src, "--out", out]) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
  assert "lca-convert: error:" in err and "corrupt or unreadable safetensors file" in err
  assert not os.path.exists(out)
