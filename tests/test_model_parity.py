"""Parity with the paper's PyTorch code: ``lca_jax.load(dir).forward`` on the reference vectors.

tests/data/reference/{lca_small,lca_gqa,fxt_small} hold upstream checkpoints and what upstream
computed for two inputs (README there): next-byte logits, LCA-MBP logits (absent for FxT) and
hard inference boundaries. Logits must agree within REL_IMPL of their scale (float32 vs
float32, another implementation on another machine), boundaries exactly; a batch of two rows
must give each row's single-row result (within REL_REORDER: the batch shape changes matmul
blocking).
"""

import functools
import os

import numpy as np
import pytest
from conftest import REF_DIR, REF_NAMES, REL_IMPL, assert_close_rel

import lca_jax


@functools.lru_cache(maxsize=None)
def _model(name):
  return lca_jax.load(os.path.join(REF_DIR, name))


@functools.lru_cache(maxsize=None)
def _vectors(name):
  return dict(np.load(os.path.join(REF_DIR, name, "vectors.npz")))


@functools.lru_cache(maxsize=None)
def _single(name, i):
  return _model(name).forward(_vectors(name)[f"input_{i}"])


def _check_against_reference(out, v, i, n=None):
  """``out`` (one row) against reference input i, on the first ``n`` positions."""
  n = len(v[f"input_{i}"]) if n is None else n
  np.testing.assert_array_equal(out["boundaries"][:n], v[f"boundaries_{i}"][:n])
  assert_close_rel(out["ntp_logits"][:n], v[f"ntp_logits_{i}"][:n], REL_IMPL)
  if f"mbp_logits_{i}" in v:
    assert_close_rel(out["mbp_logits"][:n], v[f"mbp_logits_{i}"][:n], REL_IMPL)
  else:
    assert out["mbp_logits"] is None


@pytest.mark.parametrize("i", [0, 1])
@pytest.mark.parametrize("name", REF_NAMES)
def test_reference_vectors(name, i):
  v = _vectors(name)
  out = _single(name, i)
  T = len(v[f"input_{i}"])
  assert out["ntp_logits"].shape == (T, 261)
  assert out["boundaries"].shape == (T,) and out["boundaries"].dtype == np.int32
  assert out["mlp_mbp_logits"] is None
  _check_against_reference(out, v, i)
  # the reference inputs exercise several groups, not a degenerate segmentation
  assert 3 <= out["boundaries"].sum() < T


@pytest.mark.parametrize("name", REF_NAMES)
def test_batch_equals_rows(name):
  """[2, T] forward == per-row forwards. Row 1 is input_1 padded with bytes at the end (the
  inputs differ in length); by causality its first len(input_1) positions are input_1's."""
  v = _vectors(name)
  x0, x1 = v["input_0"], v["input_1"]
  T = len(x0)
  assert len(x1) <= T
  x1_padded = np.concatenate([x1, x0[: T - len(x1)]])
  both = _model(name).forward(np.stack([x0, x1_padded]))
  assert both["ntp_logits"].shape == (2, T, 261)
  for row, (i, n) in enumerate([(0, T), (1, len(x1))]):
    one = _single(name, i)
    got = {k: (None if both[k] is None else both[k][row][:n]) for k in both}
    np.testing.assert_array_equal(got["boundaries"], one["boundaries"][:n])
    for k in ("ntp_logits", "mbp_logits"):
      if one[k] is None:
        assert got[k] is None
      else:
        assert_close_rel(got[k], one[k][:n])
    _check_against_reference(got, v, i, n)
