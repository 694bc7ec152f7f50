"""Pure, jitted train and eval steps.

``train_step(state, batch) -> (state, metrics)``: ``batch`` arrays are [accum, rows, T]
(``ids``, ``segment_ids``, ``positions``, optional ``loss_mask``); the gradient is the mean of
the ``accum`` micro-batch gradients (``lax.scan``), clipped and applied with Adam. The step
key is ``fold_in(state.rng, state.step)``, micro-batch ``i`` uses ``fold_in(step_key, i)``,
split into the Gumbel (boundaries) and dropout streams; so a run is a function of the seed,
the data and the step count, which is what makes resuming exact.

Each micro-batch loss is ``compute_loss`` (a mean over that micro-batch's valid targets);
micro-batches are weighted equally (exact for ``concat`` packing, where all rows are full).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from lca_jax.model.config import ModelConfig
from lca_jax.model.hierarchical import ByteLM
from lca_jax.model.loss import LN2, compute_loss, masked_ce, shifted_targets

SUMMED = ("overflow", "n_targets")  # summed over micro-batches; other metrics are averaged


def _global_norm(tree):
  tree_mod = getattr(optax, "tree", None)
  if tree_mod is not None and hasattr(tree_mod, "norm"):
    return tree_mod.norm(tree)
  return optax.global_norm(tree)


def _forward(model, params, mb, *, train, rng=None):
  rngs = None
  if rng is not None:
    g, d = jax.random.split(rng)
    rngs = {"gumbel": g, "dropout": d}
  return model.apply(
    {"params": params},
    mb["ids"],
    mb.get("segment_ids"),
    mb.get("positions"),
    train=train,
    rngs=rngs,
  )


def make_train_step(cfg: ModelConfig, tx, schedule, lambdas: Sequence[float], grad_shardings=None):
  """The un-jitted step function; jit it with shardings and ``donate_argnums=0``."""
  model = ByteLM(cfg)
  lambdas = tuple(float(x) for x in lambdas)

  def loss_fn(params, mb, rng):
    out = _forward(model, params, mb, train=True, rng=rng)
    return compute_loss(cfg, out, mb, lambdas)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(state, batch):
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    accum = batch["ids"].shape[0]
    if accum == 1:
      (_, metrics), grads = grad_fn(
        state.params, jax.tree_util.tree_map(lambda x: x[0], batch), jax.random.fold_in(key, 0)
      )
    else:

      def body(carry, xs):
        i, mb = xs
        (_, m), g = grad_fn(state.params, mb, jax.random.fold_in(key, i))
        g_acc, m_acc = carry
        g_acc = jax.tree_util.tree_map(jnp.add, g_acc, g)
        if grad_shardings is not None:
          g_acc = jax.lax.with_sharding_constraint(g_acc, grad_shardings)
        return (g_acc, jax.tree_util.tree_map(jnp.add, m_acc, m)), None

      mb0 = jax.tree_util.tree_map(lambda x: x[0], batch)
      m_shape = jax.eval_shape(lambda: loss_fn(state.params, mb0, key)[1])
      zeros = lambda t: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), t)
      g0 = jax.tree_util.tree_map(jnp.zeros_like, state.params)
      (grads, msum), _ = jax.lax.scan(body, (g0, zeros(m_shape)), (jnp.arange(accum), batch))
      grads = jax.tree_util.tree_map(lambda g: g / accum, grads)
      metrics = {k: (v if k in SUMMED else v / accum) for k, v in msum.items()}
    grad_norm = _global_norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=grad_norm, lr=schedule(state.step))
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return step


def make_eval_step(cfg: ModelConfig, lambdas: Sequence[float]):
  """``eval_step(params, batch[rows, T]) -> sums``: summed nats and target counts per head,
  plus count-weighted sums of the boundary metrics. ``finish_eval`` turns sums into bpb."""
  model = ByteLM(cfg)
  lambdas = tuple(float(x) for x in lambdas)

  def eval_step(params, batch):
    out = _forward(model, params, batch, train=False)
    _, m = compute_loss(cfg, out, batch, lambdas)
    ids, doc = batch["ids"], batch["segment_ids"]
    lmask = batch.get("loss_mask")
    tgt, valid = shifted_targets(ids, doc, 1, lmask)
    ce, n = masked_ce(out["ntp_logits"], tgt, valid)
    n = n.astype(jnp.float32)
    sums = {"nats_ntp": ce * n, "n_ntp": n}
    if out.get("mbp_logits") is not None:
      tgt2, valid2 = shifted_targets(ids, doc, 2, lmask)
      ce2, n2 = masked_ce(out["mbp_logits"], tgt2, valid2)
      n2 = n2.astype(jnp.float32)
      sums.update(nats_mbp=ce2 * n2, n_mbp=n2)
    elif "ce_mbp" in m:  # MLP heads: mean over heads, weighted by next-byte targets
      sums.update(nats_mbp=m["ce_mbp"] * n, n_mbp=n)
    for k in ("bp_loss", "bytes_per_latent", "overflow"):
      if k in m:
        sums[k] = m[k] * n if k != "overflow" else m[k]
    return sums

  return eval_step


def finish_eval(total: dict) -> dict:
  """Summed eval outputs -> {bpb_ntp, bpb_mbp, bp_loss, bytes_per_latent, overflow}."""
  out = {}
  n = max(float(total.get("n_ntp", 0.0)), 1.0)
  out["bpb_ntp"] = float(total["nats_ntp"]) / n / LN2
  if "nats_mbp" in total:
    out["bpb_mbp"] = float(total["nats_mbp"]) / max(float(total["n_mbp"]), 1.0) / LN2
  for k in ("bp_loss", "bytes_per_latent"):
    if k in total:
      out[k] = float(total[k]) / n
  if "overflow" in total:
    out["overflow"] = float(total["overflow"])
  out["bytes"] = float(total.get("n_ntp", 0.0))
  return out
