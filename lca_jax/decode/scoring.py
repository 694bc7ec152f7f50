"""Log-probabilities of a prompt's own bytes (what a server's ``echo`` with ``logprobs``
returns, and lm-evaluation-harness's loglikelihood scores): one full forward of the model over
the prompt, padded to a power-of-two length so that few programs compile.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from lca_jax import vocab


class PromptLogprobs(NamedTuple):
  """Per prompt id t: log p(id_t | ids before it) (NaN for the first, which has no context),
  and the ``top`` most likely ids at t with their log-probabilities ([T, top]; row 0 empty)."""

  lp_T: np.ndarray
  top_ids_TK: np.ndarray
  top_lp_TK: np.ndarray


def padded_length(n: int, limit: int) -> int:
  """``n`` rounded up to a power of two (at least 16), at most ``limit``."""
  p = 16
  while p < n:
    p *= 2
  return max(n, min(p, limit))


def prompt_logprobs(model, ids: np.ndarray, top: int) -> PromptLogprobs:
  """The log-probabilities of ``ids`` (1 <= size <= the model's ``max_seq_len``) under
  ``model`` (an ``api.Model``), in float64 from the forward's next-byte logits; the padding
  past the prompt does not change them (the model is causal)."""
  ids = np.asarray(ids, np.int64).reshape(-1)
  t = ids.size
  padded = np.full((padded_length(t, model.cfg.max_seq_len),), vocab.BYTE_OFFSET, np.int64)
  padded[:t] = ids
  logits = np.asarray(model.forward(padded)["ntp_logits"][: t - 1], np.float64)  # row t: t + 1
  m = logits.max(-1, keepdims=True)
  lp_TV = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
  lp = np.full((t,), np.nan)
  lp[1:] = lp_TV[np.arange(t - 1), ids[1:]]
  top_ids = np.zeros((t, top), np.int64)
  top_lp = np.zeros((t, top))
  if top and t > 1:
    order = np.argsort(-lp_TV, axis=-1, kind="stable")[:, :top]
    top_ids[1:] = order
    top_lp[1:] = np.take_along_axis(lp_TV, order, -1)
  return PromptLogprobs(lp, top_ids, top_lp)
