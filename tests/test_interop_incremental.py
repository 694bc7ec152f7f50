"""The hierarchical caches of the PyTorch reference (lca_jax/interop/torch_incremental.py).

Fed in ragged chunks, left-padded, rolled back or reordered, the cached forward gives the full
forward's logits (next-byte, LCA-MBP, MLP-MBP) within REL_REORDER of their scale, for every
model kind; the LCA-MBP stack runs only when its logits are asked for.
"""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import REL_REORDER, assert_close_rel, random_ids, random_params, tiny_config  # noqa: E402

from lca_jax.interop import upstream  # noqa: E402
from lca_jax.interop.torch_incremental import HierCache  # noqa: E402
from lca_jax.interop.torch_model import load_torch_model  # noqa: E402

VARIANTS = ("lca_mbp", "spacebyte", "llamabyte", "mlp_mbp")
KEYS = ("ntp_logits", "mbp_logits", "mlp_mbp_logits")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  @functools.lru_cache(maxsize=None)
  def get(variant):
    cfg = tiny_config(variant, max_seq_len=128)
    path = str(tmp_path_factory.mktemp(variant))
    upstream.write_dir(path, random_params(cfg, seed=4), cfg)
    return load_torch_model(path)

  return get


def _ids(seed, shape):
  return torch.tensor(random_ids(np.random.default_rng(seed), shape), dtype=torch.long)


def _check(got, want, sl=slice(None)):
  for key in KEYS:
    if want.get(key) is None:
      assert got.get(key) is None, key
      continue
    w = want[key][..., sl, :] if key == "mlp_mbp_logits" else want[key][:, sl]
    assert_close_rel(got[key].numpy(), w.numpy(), REL_REORDER, err_msg=key)


def _cat(outs):
  keys = [k for k in KEYS if outs[0].get(k) is not None]
  return {k: torch.cat([o[k] for o in outs], dim=-2) for k in keys}


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunks_match_full_forward(models, variant):
  m = models(variant)
  ids = _ids(1, (3, 45))
  want = m.forward(ids)
  cache = HierCache(m, 3, capacity=4)  # grows several times
  outs, t = [], 0
  for k in (7, 1, 1, 5, 1, 12, 1, 17):
    outs.append(cache.extend(ids[:, t : t + k], with_mbp=True))
    t += k
  _check(_cat(outs), want)
  assert cache.ncol == 45 and cache.pos.tolist() == [45] * 3


@pytest.mark.parametrize("variant", ("lca_mbp", "spacebyte"))
def test_left_padding_is_skipped(models, variant):
  m = models(variant)
  ids = _ids(2, (2, 30))
  valid = torch.ones_like(ids, dtype=torch.bool)
  valid[1, :9] = False
  cache = HierCache(m, 2)
  got = cache.extend(ids, valid, with_mbp=True)
  nxt = _ids(3, (2, 4))
  more = cache.extend(nxt, with_mbp=True)
  row = torch.cat([ids[1:, 9:], nxt[1:]], 1)
  want = m.forward(row)
  for key in [k for k in ("ntp_logits", "mbp_logits") if want.get(k) is not None]:
    both = torch.cat([got[key][1:, 9:], more[key][1:]], 1)
    assert_close_rel(both.numpy(), want[key].numpy(), REL_REORDER, err_msg=key)
  assert cache.pos.tolist() == [34, 25]


@pytest.mark.parametrize("variant", ("lca_mbp", "spacebyte", "mlp_mbp"))
def test_rollback_then_continue(models, variant):
  m = models(variant)
  ids = _ids(4, (3, 40))
  want = m.forward(ids)
  cache = HierCache(m, 3)
  cache.extend(ids[:, :20], with_mbp=True)
  junk = _ids(5, (3, 6))
  cache.extend(torch.cat([ids[:, 20:23], junk[:, 3:]], 1), with_mbp=True)
  keep = torch.tensor([0, 2, 3])
  cache.rollback(keep)
  assert cache.pos.tolist() == [20, 22, 23]
  # each row feeds its own next 10 bytes
  block = torch.stack([ids[r, 20 + k : 30 + k] for r, k in enumerate(keep.tolist())])
  got = cache.extend(block, with_mbp=True)
  for r, k in enumerate(keep.tolist()):
    row = lambda out: {key: None if out.get(key) is None else out[key][r : r + 1] for key in KEYS}
    _check(row(got), row(want), slice(20 + k, 30 + k))


def test_reorder_cache(models):
  m = models("lca_mbp")
  ids = _ids(6, (3, 30))
  cache = HierCache(m, 3)
  cache.extend(ids[:, :20])
  idx = torch.tensor([2, 2, 0])
  cache.reorder_cache(idx)
  got = cache.extend(ids[idx, 20:], with_mbp=True)
  _check(got, m.forward(ids[idx]), slice(20, 30))


def test_mbp_runs_only_when_asked(models):
  m = models("lca_mbp")
  ids = _ids(7, (2, 24))
  want = m.forward(ids)["mbp_logits"][:, 20:]
  calls = []
  hook = m.blocks[3][0].register_forward_hook(lambda *a: calls.append(1))
  try:
    cache = HierCache(m, 2)
    out = cache.extend(ids[:, :16])
    for t in range(16, 20):
      out = cache.extend(ids[:, t : t + 1])
    assert not calls and "mbp_logits" not in out
    out = cache.extend(ids[:, 20:], with_mbp=True)  # catches up on the 20 columns fed without
    assert len(calls) == 1
    assert_close_rel(out["mbp_logits"].numpy(), want.numpy(), REL_REORDER)
    m.forward(ids, with_mbp=False)
    assert len(calls) == 1
  finally:
    hook.remove()
