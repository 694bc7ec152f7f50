"""Boundary decisions: learned predictor (Gumbel-sigmoid straight-through), SpaceByte rule, loss.

Convention (docs/design.md §2.4): b_t = 1 means byte t CLOSES its group.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lca_jax.model.activations import gelu_exact
from lca_jax.model.layers import Dense


class BoundaryPredictor(nn.Module):
  """logit_t = W2 gelu(W1 h_t + c1) + c2 with exact (erf) gelu."""

  d_inner: int

  @nn.compact
  def __call__(self, h_BTD):
    h = h_BTD.astype(jnp.float32)
    h = Dense(self.d_inner, ("embed", "mlp"), jnp.float32, use_bias=True, name="fc1")(h)
    h = gelu_exact(h)
    logit = Dense(1, ("mlp", None), jnp.float32, use_bias=True, name="fc2")(h)
    return logit[..., 0]


def hard_boundaries(logits_BT):
  """Inference decision: 1[sigmoid(logit) > 0.5], no noise."""
  return (jax.nn.sigmoid(logits_BT) > 0.5).astype(jnp.float32)


def gumbel_boundaries(logits_BT, rng, temp: float):
  """Relaxed Bernoulli sample, straight-through: value hard, gradient of the soft sample."""
  u = jax.random.uniform(rng, logits_BT.shape, jnp.float32, 1e-6, 1.0 - 1e-6)
  soft = jax.nn.sigmoid((logits_BT + jnp.log(u) - jnp.log1p(-u)) / temp)
  hard = (soft > 0.5).astype(jnp.float32)
  return hard - jax.lax.stop_gradient(soft) + soft


def space_like(ids_BT):
  """Not an ASCII letter/digit and not a UTF-8 continuation byte; specials count as space-like."""
  byte = ids_BT - 3
  is_byte = (ids_BT >= 3) & (ids_BT < 259)
  alnum = (
    ((byte >= ord("a")) & (byte <= ord("z")))
    | ((byte >= ord("A")) & (byte <= ord("Z")))
    | ((byte >= ord("0")) & (byte <= ord("9")))
  )
  continuation = (byte >= 0x80) & (byte < 0xC0)
  return ~(is_byte & (alnum | continuation))


def spacebyte_boundaries(
  ids_BT, max_group: int, forced_BT=None, doc_BT=None, prev_space_B=None, open_len_B=None
):
  """SpaceByte heuristic: byte t closes a group when it is space-like and byte t-1 is not,
  or when the group has reached ``max_group`` bytes (or where ``forced_BT`` is set).

  Byte 0's predecessor is ``prev_space_B`` (default: not space-like, i.e. no predecessor) and
  the group open before byte 0 already has ``open_len_B`` bytes (default 0): the full forward
  uses the defaults, cached decoding continues from the committed bytes. With ``doc_BT``
  (segmented packing) the predecessor of each document's first byte counts as not space-like,
  so that no decision reads another document. Causal by construction (uses x_{t-1}, x_t only,
  plus the running group length). Returns float32 0/1 [B, T].
  """
  b = ids_BT.shape[0]
  sl = space_like(ids_BT)
  first = jnp.zeros((b, 1), bool) if prev_space_B is None else prev_space_B[:, None]
  prev = jnp.concatenate([first, sl[:, :-1]], axis=1)
  if doc_BT is not None:
    prev = prev & jnp.pad(doc_BT[:, 1:] == doc_BT[:, :-1], ((0, 0), (1, 0)), constant_values=False)
  rule = sl & ~prev
  if forced_BT is not None:
    rule = rule | (forced_BT > 0)

  def step(length, r_t):
    close = r_t | (length + 1 >= max_group)
    return jnp.where(close, 0, length + 1), close

  init = jnp.zeros(b, jnp.int32) if open_len_B is None else open_len_B.astype(jnp.int32)
  _, closes = jax.lax.scan(step, init, rule.T)
  return closes.T.astype(jnp.float32)


def boundary_loss(b_BT, real_BT, alpha: float, beta: float):
  """mean over rows of relu(r - alpha) + relu(beta - r), r = mean of b over real bytes."""
  real = real_BT.astype(jnp.float32)
  r = jnp.sum(b_BT * real, axis=1) / jnp.maximum(jnp.sum(real, axis=1), 1.0)
  return jnp.mean(jax.nn.relu(r - alpha) + jax.nn.relu(beta - r))
