"""Turning logits into bytes: temperature, top-k, top-p, greedy; speculative acceptance."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

NEG = -1e30


class SamplingParams(NamedTuple):
  """Dynamic sampling knobs (traced: no recompilation when they change). Each is a scalar for
  the whole batch, or a [B] array with one value per row (the server's continuous batches)."""

  temperature: jax.Array  # > 0 (ignored when greedy)
  top_k: jax.Array  # int32, 0 = off
  top_p: jax.Array  # float32, 1.0 = off
  # [B] bool, in a sampled program only: the rows that decode greedily (argmax of the raw
  # logits, as a greedy program does), so that greedy and sampled requests share one batch;
  # None: every row samples
  greedy: Any = None


def _per_row(v, ndim: int):
  """A knob as it broadcasts against an array of ``ndim`` dims whose first is the batch: a
  scalar as it is, a [B] array as [B, 1, ...]."""
  v = jnp.asarray(v)
  return v if v.ndim == 0 else v.reshape(v.shape + (1,) * (ndim - v.ndim))


def _batched(key) -> bool:
  """Whether ``key`` is one raw PRNG key per row ([B, 2]) rather than one for the batch."""
  return jnp.ndim(key) == 2


def split2(key):
  """Two keys from ``key`` (one key, or one per row: [B, 2] -> two [B, 2])."""
  if _batched(key):
    ks = jax.vmap(jax.random.split)(key)
    return ks[:, 0], ks[:, 1]
  k1, k2 = jax.random.split(key)
  return k1, k2


def categorical(key, lp):
  """``jax.random.categorical`` over the last axis; with one key per row ([B, 2]) each row
  draws from its own key."""
  if _batched(key):
    return jax.vmap(lambda k, x: jax.random.categorical(k, x, axis=-1))(key, lp)
  return jax.random.categorical(key, lp, axis=-1)


def log_probs(logits, sp: SamplingParams):
  """Log-probabilities of the processed distribution (temperature, then top-k, then top-p).
  The sort that top-k / top-p need runs only when one of them is on (a ``lax.cond``)."""
  x = logits.astype(jnp.float32) / jnp.maximum(_per_row(sp.temperature, logits.ndim), 1e-6)
  filtering = (sp.top_k > 0) | (sp.top_p < 1.0)
  filtering = jnp.any(filtering) if jnp.ndim(filtering) else filtering  # any row filters
  return jax.lax.cond(
    filtering, _filtered_log_probs, lambda x, sp: jax.nn.log_softmax(x, axis=-1), x, sp
  )


def _filtered_log_probs(x, sp: SamplingParams):
  v = x.shape[-1]
  srt = jnp.sort(x, axis=-1)[..., ::-1]
  top_k, top_p = _per_row(sp.top_k, x.ndim - 1), _per_row(sp.top_p, x.ndim)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
  kth = jnp.take_along_axis(
    srt, jnp.broadcast_to(k - 1, x.shape[:-1])[..., None].astype(jnp.int32), -1
  )
  x = jnp.where(x < kth, NEG, x)
  srt = jnp.where(srt < kth, NEG, srt)
  cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), axis=-1)
  # keep the smallest prefix whose mass reaches top_p (always at least the top token)
  n_keep = jnp.sum((cum - jax.nn.softmax(srt, axis=-1)) <= top_p, axis=-1, keepdims=True)
  cutoff = jnp.take_along_axis(srt, jnp.maximum(n_keep - 1, 0), -1)
  x = jnp.where((x < cutoff) & (top_p < 1.0), NEG, x)
  return jax.nn.log_softmax(x, axis=-1)


def choose(logits, key, sp: SamplingParams, greedy: bool):
  """(token, probability of that token under the processed distribution, log-probs).

  Greedy picks the argmax of the raw logits; its probability is the plain softmax (as upstream).
  In a sampled program, the rows of ``sp.greedy`` do the same.
  """
  if greedy:
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  else:
    lp = log_probs(logits, sp)
    tok = categorical(key, lp).astype(jnp.int32)
    if sp.greedy is not None:
      g = _per_row(sp.greedy, tok.ndim)
      raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
      tok = jnp.where(g, jnp.argmax(logits, axis=-1).astype(jnp.int32), tok)
      lp = jnp.where(g[..., None], raw, lp)
  p = jnp.exp(jnp.take_along_axis(lp, tok[..., None], -1)[..., 0])
  return tok, p, lp


def row_greedy(sp: SamplingParams, shape):
  """Which rows decode greedily in a sampled program ([B] bool; all False without
  ``sp.greedy``), broadcast to ``shape`` (the batch first)."""
  if sp.greedy is None:
    return jnp.zeros(shape, bool)
  return jnp.broadcast_to(_per_row(sp.greedy, len(shape)), shape)


def speculative_accept(draft, lq, lp, key):
  """Leviathan et al. acceptance of draft tokens [B, N] drafted from log-probs lq [B, N, V],
  checked against target log-probs lp [B, N, V] (target at the same positions).

  Returns (number of leading accepted drafts [B], replacement token at the first rejection [B]
  sampled from norm(max(p - q, 0)) (undefined where all were accepted)). ``key``: one, or one
  per row ([B, 2]).
  """
  k_u, k_r = split2(key)
  q_tok = jnp.exp(jnp.take_along_axis(lq, draft[..., None], -1)[..., 0])
  p_tok = jnp.exp(jnp.take_along_axis(lp, draft[..., None], -1)[..., 0])
  if _batched(k_u):
    u = jax.vmap(lambda k: jax.random.uniform(k, draft.shape[1:]))(k_u)
  else:
    u = jax.random.uniform(k_u, draft.shape)
  ok = u * q_tok <= p_tok
  n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)
  idx = jnp.minimum(n_acc, draft.shape[1] - 1)
  p_r = jnp.exp(jnp.take_along_axis(lp, idx[:, None, None], 1)[:, 0])
  q_r = jnp.exp(jnp.take_along_axis(lq, idx[:, None, None], 1)[:, 0])
  resid = jnp.maximum(p_r - q_r, 0.0)
  resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p_r)
  repl = categorical(k_r, jnp.log(resid + 1e-38)).astype(jnp.int32)
  return n_acc, repl
