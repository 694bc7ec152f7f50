"""Training objective lambda0 CE(NT) + lambda1 CE(MBP) + lambda2 L_BP, with metrics.

See docs/design.md §4. A target x_{t+k} is valid when it lies in the same (non-padding)
document as byte t, and, for SFT, when ``loss_mask`` marks it (prompt bytes carry no loss).
CE averages over valid targets.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from lca_jax.model import boundaries as bnd
from lca_jax.model.config import ModelConfig

LN2 = 0.6931471805599453


def shifted_targets(ids_BT, doc_BT, k: int, loss_mask_BT=None):
  """Targets x_{t+k} for rows t, and their validity (same document, not padding, masked in)."""
  b, t = ids_BT.shape
  pad = lambda a, v: jnp.concatenate([a[:, k:], jnp.full((b, k), v, a.dtype)], axis=1)
  tgt = pad(ids_BT, 0)
  valid = (pad(doc_BT, 0) == doc_BT) & (doc_BT != 0)
  if loss_mask_BT is not None:
    valid = valid & (pad(loss_mask_BT, 0) > 0)
  return tgt, valid


def masked_ce(logits_BTV, tgt_BT, valid_BT):
  """(mean CE over valid targets in nats, number of valid targets)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), tgt_BT)
  n = jnp.sum(valid_BT)
  return jnp.sum(ce * valid_BT) / jnp.maximum(n, 1), n


def compute_loss(cfg: ModelConfig, out: dict, batch: dict, lambdas=(1.0, 1.0, 10.0)):
  """Scalar loss and a dict of float32 metrics from a forward ``out`` and a ``batch``.

  ``batch``: ids [B,T], optional segment_ids (doc ids, 0 = padding) and loss_mask.
  """
  ids = batch["ids"]
  doc = batch.get("segment_ids")
  if doc is None:
    doc = jnp.ones_like(ids)
  lmask = batch.get("loss_mask")
  l0, l1, l2 = lambdas
  tgt, valid = shifted_targets(ids, doc, 1, lmask)
  ce_nt, n_nt = masked_ce(out["ntp_logits"], tgt, valid)
  loss = l0 * ce_nt
  m = {"ce_ntp": ce_nt, "bpb_ntp": ce_nt / LN2, "n_targets": n_nt.astype(jnp.float32)}
  if out.get("mbp_logits") is not None:
    tgt2, valid2 = shifted_targets(ids, doc, 2, lmask)
    ce_mbp, _ = masked_ce(out["mbp_logits"], tgt2, valid2)
    loss = loss + l1 * ce_mbp
    m.update(ce_mbp=ce_mbp, bpb_mbp=ce_mbp / LN2)
  if out.get("mlp_mbp_logits") is not None:
    ces = []
    for i in range(out["mlp_mbp_logits"].shape[1]):
      tgt_i, valid_i = shifted_targets(ids, doc, 2 + i, lmask)
      ce_i, _ = masked_ce(out["mlp_mbp_logits"][:, i], tgt_i, valid_i)
      m[f"bpb_mlp_mbp_{i + 1}"] = ce_i / LN2
      ces.append(ce_i)
    ce_mbp = jnp.mean(jnp.stack(ces))
    loss = loss + l1 * ce_mbp
    m.update(ce_mbp=ce_mbp, bpb_mbp=ce_mbp / LN2)
  if out.get("boundaries_st") is not None:
    real = doc != 0
    bp = jnp.float32(0.0)
    if cfg.boundaries == "learned":
      bp = bnd.boundary_loss(out["boundaries_st"], real, cfg.bp_prior, cfg.bp_beta)
      loss = loss + l2 * bp
    n_real = jnp.sum(real).astype(jnp.float32)
    n_closed = jnp.sum(out["n_closed"]).astype(jnp.float32)
    m.update(
      bp_loss=bp,
      bytes_per_latent=n_real / jnp.maximum(n_closed, 1.0),
      boundary_rate=n_closed / jnp.maximum(n_real, 1.0),
      overflow=jnp.sum(out["overflow"]).astype(jnp.float32),
    )
  m["loss"] = loss
  return loss, m
