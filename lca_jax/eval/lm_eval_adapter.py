"""lca-jax checkpoints as an lm-evaluation-harness model (``--model lca_jax``).

    lca-lm-eval --model lca_jax \\
      --model_args checkpoint=DIR,mode=verify,n=3,dtype=float32 --tasks TASKS

``--model_args``: ``checkpoint`` (anything ``lca_jax.load`` reads), ``step``, ``dtype``, the
decoding options of ``generate_until`` (``mode``, ``n``, ``tau``, ``drafter`` (a checkpoint, for
drafter mode), ``seed``; ``Model.generate``), ``stop_chunk`` (bytes decoded between two checks
of the stop strings, default ``STOP_CHUNK``), ``max_length`` (default the model context) and
``eos_tag`` (a string that stands for the eos id in a prompt, e.g. ``<eos>`` in a chat
history; default none, ``<eos>`` once a chat template was applied). Tokens are the UTF-8 bytes
of the text, ids as in ``lca_jax.vocab`` (byte b is id b + 3), so a continuation's
loglikelihood is the sum over its bytes, and lm-eval's byte-based metrics (``bits_per_byte``)
count the same units.

* ``loglikelihood``: next-byte log-probabilities of the continuation given the context (an empty
  context is the eos id, as lm-eval's ``hf`` model does); ``is_greedy`` when every byte is the
  argmax. Context/continuation pairs are encoded by lm-eval's ``TemplateLM`` as for ``hf``.
* ``loglikelihood_rolling``: the document in disjoint windows of ``max_length`` bytes (lm-eval's
  rolling windows, eos as the first context).
* ``generate_until``: ``Model.generate`` (ntp or a multi-byte mode) over ``batch_size`` slots
  (``eval.stop_decode``): each request's ``max_gen_toks`` bytes (default 256), decoded
  ``stop_chunk`` bytes per call while a row has stop strings (``until``); a row whose text
  contains one is finished after that chunk and cut before it, and its slot takes the next
  request. A prompt keeps its last ``max_length - max_gen_toks`` bytes, at least half the
  context (a longer budget is then cut to what the context leaves).
* ``apply_chat_template`` (``--apply_chat_template``): the SFT chat format of
  ``lca_jax.data.sft_format`` (``<|user|>\n...``, replies ending with eos), eos written as
  ``eos_tag``.

``batch_size``: an integer, or ``auto`` (``auto:N`` alike): the largest power of two up to
``max_batch_size`` (default ``AUTO_MAX_BATCH``) whose decode caches at ``max_length`` fit half
the free memory of the device (the host's for CPU devices); a model whose one row does not fit
is refused with a message.

Requests are sorted by length (longest first) and run ``batch_size`` at a time; row lengths are
padded to a power of two (at least ``MIN_PAD``) and the last batch with copies of its first row,
so one program serves many batches. ``tally`` (:class:`lca_jax.eval.tally.Tally`) adds up the
decoding figures of the ``generate_until`` calls: bytes/s, bytes generated, acceptance rate,
accepted-bytes histogram, compile time.
"""

from __future__ import annotations

import collections
import os
from typing import List, Optional

import jax
import lm_eval.models  # noqa: F401  (lm-eval's own models, before the registry is non-empty)
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

import lca_jax
from lca_jax import vocab
from lca_jax.data import sft_format
from lca_jax.decode import engine, policies
from lca_jax.errors import LcaError
from lca_jax.eval.stop_decode import Request, decode_until
from lca_jax.eval.tally import Tally

MIN_PAD = 32
DEFAULT_MAX_GEN = 256
STOP_CHUNK = 32  # bytes decoded between two checks of the stop strings
AUTO_MAX_BATCH = 64
CHAT_EOS_TAG = "<eos>"


class AdapterError(LcaError, ValueError):
  """Model arguments lm-eval passed that the adapter cannot use."""


def _pad_len(n: int, limit: int) -> int:
  p = MIN_PAD
  while p < n:
    p *= 2
  return min(p, limit)


def decode_cache_bytes(cfg, length: int) -> int:
  """Bytes of one row's decode caches for ``length`` bytes: keys and values of every byte-level
  layer (encoder, decoder, LCA-MBP) and of the latent LM over length + 1 slots, its outputs
  and inputs per slot, and next-byte logits (float32)."""
  item = np.dtype(cfg.dtype).itemsize
  kv = 2 * cfg.n_kv_heads * cfg.head_dim * item
  byte_layers = cfg.n_enc + (cfg.n_dec + cfg.n_mbp if cfg.hierarchical else 0)
  latent = (cfg.n_lm * kv + 2 * cfg.d_model * item) * (length + 1) if cfg.hierarchical else 0
  return byte_layers * kv * length + latent + 4 * cfg.n_tokens


def free_memory_bytes(device) -> int:
  """Free memory of ``device``: its allocator's limit less what is in use, or for a device
  without memory statistics (CPU) the host's available memory."""
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def auto_batch_size(cfg, length: int, max_batch: int, free: int) -> int:
  """The largest power of two <= ``max_batch`` whose decode caches at ``length`` bytes fit in
  half of ``free`` bytes; refuses (``AdapterError``) when one row does not."""
  row = decode_cache_bytes(cfg, length)
  fits = free // 2 // row
  if fits < 1:
    raise AdapterError(
      f"batch_size=auto: one row's decode caches at {length} bytes ({row / 2**20:.1f} MiB) do "
      f"not fit half the free memory ({free / 2**20:.1f} MiB); pass an integer batch_size"
    )
  b = 1
  while 2 * b <= min(fits, max_batch):
    b *= 2
  return b


def _batch_size(value, max_batch_size, cfg, length: int) -> int:
  """``batch_size`` as lm-eval passes it: an integer, ``auto`` or ``auto:N``."""
  cap = int(max_batch_size) if max_batch_size else None
  if isinstance(value, str) and value.split(":")[0].strip() == "auto":
    return auto_batch_size(cfg, length, cap or AUTO_MAX_BATCH, free_memory_bytes(jax.devices()[0]))
  try:
    b = int(value)
  except (TypeError, ValueError):
    raise AdapterError(f"batch_size must be an integer or auto, got {value!r}") from None
  if b < 1:
    raise AdapterError(f"batch_size must be >= 1, got {b}")
  return min(b, cap) if cap else b


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
    stop_chunk: int = STOP_CHUNK,
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
    self._batch_size = _batch_size(batch_size, max_batch_size, model.cfg, self._max_length)
    self.stop_chunk = int(stop_chunk)
    if self.stop_chunk < 1:
      raise AdapterError(f"stop_chunk must be >= 1, got {stop_chunk}")
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
    """The UTF-8 bytes of ``string``, each ``eos_tag`` as the eos id."""
    return self._tagged_ids(string).tolist()

  def chat_template(self, chat_template=False) -> str:
    return "lca_jax.data.sft_format chat" if chat_template else ""

  def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
    """``chat_history`` in the SFT chat format (``sft_format.render_chat``), eos as
    ``eos_tag`` (``<eos>`` unless set); with ``add_generation_prompt`` followed by the
    assistant marker, else a last assistant message is left open (no eos) to be continued."""
    if self.eos_tag is None:
      self.eos_tag = CHAT_EOS_TAG
    msgs = list(chat_history)
    if add_generation_prompt:
      ids = sft_format.chat_prompt_ids(msgs)
    elif msgs and msgs[-1].get("role") == "assistant":
      head = sft_format.chat_prompt_ids(msgs[:-1])
      ids = np.concatenate([head, vocab.encode(msgs[-1]["content"])])
    else:
      ids = np.concatenate([s for s, _ in sft_format.render_chat(msgs)] or [np.zeros(0, int)])
    parts = np.split(ids, np.flatnonzero(ids == vocab.EOS_ID))
    text = vocab.decode(parts[0])
    for p in parts[1:]:
      text += self.eos_tag + vocab.decode(p[1:])
    return text

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
    """The ids of a generation prompt (eos for an empty one)."""
    if not context:
      return np.array([vocab.EOS_ID], np.int32)
    return self._tagged_ids(context)

  def _tagged_ids(self, context: str) -> np.ndarray:
    """UTF-8 bytes of ``context``, each ``eos_tag`` as the eos id."""
    if not self.eos_tag or self.eos_tag not in context:
      return vocab.encode(context)
    eos = np.array([vocab.EOS_ID], np.int32)
    parts = [vocab.encode(p) for p in context.split(self.eos_tag)]
    return np.concatenate([x for p in parts for x in (eos, p)][1:]).astype(np.int32)

  def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
    groups = collections.defaultdict(list)
    limit = int(self.model.cfg.max_seq_len)
    for i, req in enumerate(requests):
      context, kw = req.args
      kw = dict(kw or {})
      until = kw.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      max_gen = int(kw.pop("max_gen_toks", DEFAULT_MAX_GEN))
      sample = bool(kw.pop("do_sample", False))
      temperature = float(kw.pop("temperature", 0.0)) if sample else 0.0
      top_p = float(kw.pop("top_p", 1.0)) if sample else 1.0
      keep = max(self.max_length - max_gen, self.max_length // 2)
      prompt = self._prompt_ids(context)[-keep:]
      budget = max(1, min(max_gen, limit - len(prompt)))
      groups[(temperature, top_p)].append((i, Request(prompt, until, budget)))
    out: List[Optional[str]] = [None] * len(requests)
    for (temperature, top_p), items in groups.items():
      items.sort(key=lambda x: -len(x[1].prompt))

      def generate(prompts, max_bytes, real):
        self._calls += 1
        before = engine.compiled_count()
        res = self.model.generate(
          prompts,
          mode=self.mode,
          n=self.n,
          tau=self.tau,
          max_bytes=max_bytes,
          temperature=temperature,
          top_p=top_p,
          seed=self.seed + self._calls,
          drafter=self.drafter,
          pad_to=_pad_len(max(len(p) for p in prompts), self.max_length),
          budget_pad_to=DEFAULT_MAX_GEN,
        )
        self.tally.add(res, real, engine.compiled_count() > before)
        return res

      decode_until(generate, [r for _, r in items], self.batch_size, self.stop_chunk)
      for i, req in items:
        out[i] = req.text
        self.cache_hook.add_partial("generate_until", requests[i].args, req.text)
    return out
