"""jit(forward + backward) of every variant: finite loss, finite gradients for every parameter,
the training metrics, and live gradients where the design says they flow.

One compiled value-and-grad per variant (loss weights are traced arguments, so one compile
serves several weightings). The batch has two rows: one document filling the row (what concat
packing gives) and three documents plus padding (segmented packing).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  VARIANTS,
  assert_close_rel,
  random_ids,
  random_params,
  segmented_layout,
  tiny_config,
  train_forward,
)

from lca_jax.model.hierarchical import ByteLM
from lca_jax.model.loss import compute_loss

T = 32
PRETRAIN = (1.0, 1.0, 10.0)
NO_BP = (1.0, 1.0, 0.0)  # boundary predictor reached only through the straight-through pooling


def _batch():
  rng = np.random.default_rng(11)
  doc, pos = segmented_layout((12, 10, 6), T)
  return {
    "ids": jnp.asarray(random_ids(rng, (2, T))),
    "segment_ids": jnp.asarray(np.stack([np.ones(T, np.int32), doc])),
    "positions": jnp.asarray(np.stack([np.arange(T, dtype=np.int32), pos])),
  }


@functools.lru_cache(maxsize=None)
def _step(cfg):
  model = ByteLM(cfg)

  def loss_fn(params, batch, lambdas, key):
    return compute_loss(cfg, train_forward(model, params, batch, key), batch, lambdas)

  return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


@functools.lru_cache(maxsize=None)
def _run(cfg, lambdas=PRETRAIN):
  params = random_params(cfg, seed=2)
  (loss, metrics), grads = _step(cfg)(
    params, _batch(), jnp.asarray(lambdas, jnp.float32), jax.random.PRNGKey(4)
  )
  return (
    float(loss),
    {k: float(v) for k, v in metrics.items()},
    jax.tree_util.tree_map(np.asarray, grads),
  )


def _flat(tree):
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check(cfg):
  loss, metrics, grads = _run(cfg)
  assert np.isfinite(loss)
  assert all(np.isfinite(v) for v in metrics.values()), metrics
  flat = _flat(grads)
  params = _flat(random_params(cfg, seed=2))
  assert flat.keys() == params.keys()
  for name, g in flat.items():
    assert g.shape == params[name].shape, name
    assert np.all(np.isfinite(g)), f"non-finite gradient for {name}"
  assert "bpb_ntp" in metrics and metrics["n_targets"] == (T - 1) + (12 - 1 + 10 - 1 + 6 - 1)
  assert_close_rel(metrics["bpb_ntp"], metrics["ce_ntp"] / np.log(2), 1e-6)
  # every stack and the unembedding learn (no parameter group is cut off from the loss)
  for prefix in ("['token_embedding']", "['encoder']", "['head']", "['norm']"):
    assert any(np.abs(g).max() > 0 for n, g in flat.items() if n.startswith(prefix)), prefix
  if not cfg.hierarchical:
    return metrics, flat
  for key in ("bp_loss", "bytes_per_latent", "overflow", "boundary_rate"):
    assert key in metrics, key
  assert metrics["overflow"] == 0 and metrics["bytes_per_latent"] >= 1.0
  for prefix in ("['lm']", "['decoder']", "['null_group']"):
    assert any(np.abs(g).max() > 0 for n, g in flat.items() if n.startswith(prefix)), prefix
  if cfg.n_mbp:
    assert "bpb_mbp" in metrics
    assert any(np.abs(g).max() > 0 for n, g in flat.items() if n.startswith("['mbp']"))
  for i in range(cfg.n_mlp_mbp):
    assert f"bpb_mlp_mbp_{i + 1}" in metrics
    assert any(np.abs(g).max() > 0 for n, g in flat.items() if n.startswith(f"['mlp_mbp_{i}']"))
  if cfg.boundaries == "learned":
    assert metrics["bp_loss"] >= 0
    bp = [g for n, g in flat.items() if n.startswith("['boundary_predictor']")]
    assert bp and all(np.abs(g).max() > 0 for g in bp)
  else:
    assert metrics["bp_loss"] == 0.0
    assert not any(n.startswith("['boundary_predictor']") for n in flat)
  return metrics, flat


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_backward_xla(variant):
  _check(tiny_config(variant, attention_impl="xla"))


def test_straight_through_reaches_boundary_predictor():
  """With lambda_BP = 0 the boundary predictor still gets gradient: through the straight-through
  boundary values in the pooling weights (docs/design.md §2.6)."""
  cfg = tiny_config("lca_mbp")
  loss, metrics, grads = _run(cfg, NO_BP)
  assert np.isfinite(loss)
  bp = [g for n, g in _flat(grads).items() if n.startswith("['boundary_predictor']")]
  assert bp and all(np.all(np.isfinite(g)) and np.abs(g).max() > 0 for g in bp)
  # and the BP loss term is what lambda_BP weights
  loss_full, metrics_full, _ = _run(cfg, PRETRAIN)
  # a difference of two losses: its rounding error is at the losses' scale
  assert_close_rel(loss_full - loss, 10.0 * metrics_full["bp_loss"], scale=abs(loss_full))


@pytest.mark.parametrize("remat,impl", [(False, "xla"), (True, "xla"), (False, "pallas")])
def test_scanned_layers_same_loss_and_gradients(remat, impl):
  """``scan_min_layers`` (a stack's layers as one lax.scan over their stacked parameters)
  computes what the unrolled stacks compute: every stack of several layers scanned, packed and
  padded rows, remat or not, the Pallas kernels (interpreted here) inside the scan too."""
  layers = dict(n_enc=2, n_lm=3, n_dec=2, n_mbp=2)
  cfg = tiny_config("lca_mbp", **layers, remat=remat, scan_min_layers=2, attention_impl=impl)
  loss, metrics, grads = _run(cfg.replace(scan_min_layers=0))
  loss_s, metrics_s, grads_s = _run(cfg)
  assert_close_rel(loss_s, loss)
  for name in metrics:
    assert_close_rel(metrics_s[name], metrics[name], err_msg=name)
  g, gs = _flat(grads), _flat(grads_s)
  assert g.keys() == gs.keys()
  for name in g:
    assert_close_rel(gs[name], g[name], err_msg=name)


@pytest.mark.parametrize("variant", ["lca_mbp"])
def test_forward_backward_pallas(variant):
  """attention_impl='pallas' (interpret mode on CPU) gives the XLA path's loss and gradients.

  LCA-MBP uses the kernel in every stack (causal stacks with all-zero group ids, the MBP head
  with the LCA mask), so one variant covers every use of the kernel.
  """
  cfg = tiny_config(variant, attention_impl="pallas")
  _check(cfg)
  loss_p, metrics_p, grads_p = _run(cfg)
  loss_x, metrics_x, grads_x = _run(tiny_config(variant, attention_impl="xla"))
  assert_close_rel(loss_p, loss_x)
  gp, gx = _flat(grads_p), _flat(grads_x)
  for name in gx:
    assert_close_rel(gp[name], gx[name], err_msg=name)


def test_remat_same_gradients():
  """remat=True (activation checkpointing per block) changes memory, not the numbers. Remat
  wraps Block inside Stack, the same for every stack, so the cheapest model covers it."""
  cfg = tiny_config("llamabyte")
  loss, _, grads = _run(cfg)
  loss_r, _, grads_r = _run(cfg.replace(remat=True))
  assert_close_rel(loss_r, loss)
  g, gr = _flat(grads), _flat(grads_r)
  for name in g:
    assert_close_rel(gr[name], g[name], err_msg=name)
