"""lca-jax checkpoints as an lm-evaluation-harness model (``--model lca_jax``).

    lca-lm-eval --model lca_jax \\
      --model_args checkpoint=DIR,mode=verify,n=3,dtype=float32 --tasks TASKS

``--model_args``: ``checkpoint`` (anything ``lca_jax.load`` reads), ``step``, ``dtype``, the
decoding options of ``generate_until`` (``mode``, ``n``, ``tau``, ``drafter`` (a checkpoint, for
drafter mode), ``seed``; ``Model.generate``), ``max_length`` (default the model context) and
``eos_tag`` (a string that stands for the eos id in a generation prompt, e.g. ``<eos>`` in a
chat history; default none). Tokens are the UTF-8 bytes of the text, ids as in
``lca_jax.vocab`` (byte b is id b + 3), so a continuation's loglikelihood is the sum over its
bytes, and lm-eval's byte-based metrics (``bits_per_byte``) count the same units.

* ``loglikelihood``: next-byte log-probabilities of the continuation given the context (an empty
  context is the eos id, as lm-eval's ``hf`` model does); ``is_greedy`` when every byte is the
  argmax. Context/continuation pairs are encoded by lm-eval's ``TemplateLM`` as for ``hf``.
* ``loglikelihood_rolling``: the document in disjoint windows of ``max_length`` bytes (lm-eval's
  rolling windows, eos as the first context).
* ``generate_until``: ``Model.generate`` in batches (ntp or a multi-byte mode), each request's
  ``max_gen_toks`` bytes (default 256), cut at the first stop string of ``until`` in the decoded
  text. A prompt keeps its last ``max_length - max_gen_toks`` bytes, at least half the context
  (a longer budget is then cut to what the context leaves). Generation runs to eos or the byte budget; stop strings do not end it early.

Requests are sorted by length (longest first) and run ``batch_size`` at a time; row lengths are
padded to a power of two (at least ``MIN_PAD``) and the last batch with copies of its first row,
so one program serves many batches. ``tally`` (:class:`lca_jax.eval.tally.Tally`) adds up the
decoding figures of the ``generate_until`` calls: bytes/s, acceptance rate, accepted-bytes
histogram, compile time.
"""

from __future__ import annotations

import collections
from typing import List, Optional

import lm_eval.models  # noqa: F401  (lm-eval's own models, before the registry is non-empty)
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

import lca_jax
from lca_jax import vocab
from lca_jax.decode import engine, policies
from lca_jax.errors import LcaError
from lca_jax.eval.tally import Tally

MIN_PAD = 32
DEFAULT_MAX_GEN = 256


class AdapterError(LcaError, ValueError):
  """Model arguments lm-eval passed that the adapter cannot use."""


def _pad_len(n: int, limit: int) -> int:
  p = MIN_PAD
  while p < n:
    p *= 2
  return min(p, limit)


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@register_model("lca_jax", "lca-jax")
class LcaJaxLM(TemplateLM):
  """lm-eval ``LM`` over ``lca_jax.load(checkpoint)``; see the module docstring."""

  def __init__(
    self,
    checkpoint: Optional[str] = None,
    step: Optional[int] = None,
    dtype: Optional[str] = None,
    mode: str = "ntp",
    n: int = 3,
    tau: float = 0.9,
    max_length: Optional[int] = None,
    batch_size=1,
    max_batch_size: Optional[int] = None,
    device: Optional[str] = None,
    drafter=None,
    seed: int = 0,
    eos_tag: Optional[str] = None,
    model=None,
  ):
    super().__init__()
    if model is None:
      if not checkpoint:
        raise AdapterError("--model_args needs checkpoint=DIR")
      model = lca_jax.load(str(checkpoint), step=step, dtype=dtype)
    self.model = model
    if mode not in policies.POLICIES:
      raise AdapterError(f"unknown mode {mode!r}; choose one of {', '.join(policies.POLICIES)}")
    self.mode, self.n, self.tau = mode, int(n), float(tau)
    if isinstance(drafter, str) and drafter:
      drafter = lca_jax.load(drafter, dtype=dtype)
    self.drafter = drafter or None
    self.seed = int(seed)
    self.eos_tag = str(eos_tag) if eos_tag else None
    limit = int(model.cfg.max_seq_len)
    self._max_length = min(int(max_length), limit) if max_length else limit
    try:  # "auto" (lm-eval's --batch_size auto) has no meaning here: one row at a time
      self._batch_size = max(1, int(batch_size))
    except (TypeError, ValueError):
      self._batch_size = 1
    if max_batch_size:
      self._batch_size = min(self._batch_size, int(max_batch_size))
    self.tally = Tally(policies.POLICIES[mode])
    self._calls = 0

  # ---- what lm-eval reads -------------------------------------------------------------------
  @property
  def eot_token_id(self) -> int:
    return vocab.EOS_ID

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def batch_size(self) -> int:
    return self._batch_size

  @property
  def tokenizer_name(self) -> str:
    return "lca_jax-bytes"

  def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> List[int]:
    return vocab.encode(string).tolist()

  def tok_decode(self, ids) -> str:
    return vocab.decode(ids)

  # ---- scoring ------------------------------------------------------------------------------
  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    rows = []
    for _, context_enc, continuation_enc in requests:
      whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1) :]
      k = min(len(continuation_enc), len(whole) - 1)
      rows.append((whole[:-1], k, whole[len(whole) - k :]))
    res = self._score_rows(rows)
    for (ctx_cont, _, _), r in zip(requests, res):
      if ctx_cont is not None:
        self.cache_hook.add_partial("loglikelihood", ctx_cont, r)
    return res

  def _score_rows(self, rows):
    """(inputs, k, targets) -> (sum of log-probs of the k targets predicted by the last k
    input positions, all of them the argmax)."""
    out = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    bs = self.batch_size
    for at in range(0, len(order), bs):
      idx = order[at : at + bs]
      width = _pad_len(len(rows[idx[0]][0]), self.max_length)
      batch = np.full((bs, width), vocab.PAD_ID, np.int32)
      for r, i in enumerate(idx):
        batch[r, : len(rows[i][0])] = rows[i][0]
      batch[len(idx) :] = batch[0]
      logits = self.model.forward(batch)["ntp_logits"]
      for r, i in enumerate(idx):
        inputs, k, tgt = rows[i]
        lp = _log_softmax(logits[r, len(inputs) - k : len(inputs)])
        tgt = np.asarray(tgt)
        out[i] = (float(lp[np.arange(k), tgt].sum()), bool((lp.argmax(-1) == tgt).all()))
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
    windows, owner = [], []
    for i, (string,) in enumerate(req.args for req in requests):
      for ctx, cont in map(
        lm_utils.make_disjoint_window,
        lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string),
          prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length,
          context_len=1,
        ),
      ):
        windows.append((None, ctx, cont))
        owner.append(i)
    sums = [0.0] * len(requests)
    for i, (lp, _) in zip(owner, self._loglikelihood_tokens(windows)):
      sums[i] += lp
    for req, s in zip(requests, sums):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, s)
    return sums

  # ---- generation ---------------------------------------------------------------------------
  def _prompt_ids(self, context: str) -> np.ndarray:
    """The ids of a generation prompt: its UTF-8 bytes, each ``eos_tag`` as the eos id."""
    if not context:
      return np.array([vocab.EOS_ID], np.int32)
    if not self.eos_tag or self.eos_tag not in context:
      return vocab.encode(context)
    eos = np.array([vocab.EOS_ID], np.int32)
    parts = [vocab.encode(p) for p in context.split(self.eos_tag)]
    return np.concatenate([x for p in parts for x in (eos, p)][1:]).astype(np.int32)

  def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
    groups = collections.defaultdict(list)
    for i, req in enumerate(requests):
      context, kw = req.args
      kw = dict(kw or {})
      until = kw.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      max_gen = int(kw.pop("max_gen_toks", DEFAULT_MAX_GEN))
      sample = bool(kw.pop("do_sample", False))
      temperature = float(kw.pop("temperature", 0.0)) if sample else 0.0
      top_p = float(kw.pop("top_p", 1.0)) if sample else 1.0
      groups[(max_gen, temperature, top_p)].append((i, context, until))
    out: List[Optional[str]] = [None] * len(requests)
    for (max_gen, temperature, top_p), items in groups.items():
      items.sort(key=lambda x: -len(x[1].encode("utf-8")))
      bs = self.batch_size
      for at in range(0, len(items), bs):
        chunk = items[at : at + bs]
        keep = max(self.max_length - max_gen, self.max_length // 2)
        prompts = [self._prompt_ids(c)[-keep:] for _, c, _ in chunk]
        prompts += [prompts[0]] * (bs - len(prompts))
        before = engine.compiled_count()
        res = self.model.generate(
          prompts,
          mode=self.mode,
          n=self.n,
          tau=self.tau,
          max_bytes=max_gen,
          temperature=temperature,
          top_p=top_p,
          seed=self.seed + self._calls,
          drafter=self.drafter,
          pad_to=_pad_len(max(len(p) for p in prompts), self.max_length),
          budget_pad_to=DEFAULT_MAX_GEN,
        )
        self._calls += 1
        self.tally.add(res, len(chunk), engine.compiled_count() > before)
        for r, (i, context, until) in enumerate(chunk):
          text = vocab.decode(res.ids[r], stop_at_eos=True)
          for stop in until:
            if stop:
              text = text.split(stop)[0]
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
    return out
