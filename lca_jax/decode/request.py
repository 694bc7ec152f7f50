"""A decode request's options and prompts, checked once for every front end: ``generate``
(``engine``), ``lca-sample`` and the server (``serve.schema`` maps a ``DecodeError`` naming an
option to a 400 naming that field).

``check_options`` checks and normalizes the decoding options (types, ranges, NaN) without a
model; ``encode_prompts`` turns str / bytes / id prompts into id arrays; ``check_prompts``
checks them (and the mode) against a model.
"""

from __future__ import annotations

import math
import numbers
from typing import List, Optional

import numpy as np

from lca_jax import vocab
from lca_jax.decode.policies import POLICIES
from lca_jax.errors import LcaError
from lca_jax.model.config import ModelConfig

MAX_N = 64  # most bytes proposed per step (``n``) in the multi-byte modes
_INT32_MAX = 2**31 - 1


class DecodeError(LcaError, ValueError):
  """An inference request that cannot be served: a generate() or forward() call with a bad
  argument (mode, n, tau, max_bytes, a prompt longer than the context, ...). ``option``: the
  name of the bad option where one is at fault (``check_options``), else None."""

  def __init__(self, message: str, option: Optional[str] = None):
    super().__init__(message)
    self.option = option


def _kind(v) -> str:
  """'i' for an integer, 'f' for a real number (Python, numpy or a 0-d array), else ''."""
  if isinstance(v, (bool, np.bool_, str, bytes)):
    return ""
  if isinstance(v, numbers.Integral):
    return "i"
  if isinstance(v, numbers.Real):
    return "f"
  if getattr(v, "ndim", None) == 0 and getattr(v, "dtype", None) is not None:
    k = np.dtype(v.dtype).kind
    return "i" if k in "iu" else "f" if k == "f" else ""
  return ""


def is_int(v) -> bool:
  """Whether ``v`` is an integer (Python, numpy or a 0-d integer array; not a bool)."""
  return _kind(v) == "i"


def _int_arg(name: str, v) -> int:
  if not is_int(v):
    raise DecodeError(f"{name} must be an integer, got {type(v).__name__} {v!r}", name)
  return int(v)


def _real_arg(name: str, v) -> float:
  if not _kind(v):
    raise DecodeError(f"{name} must be a number, got {type(v).__name__} {v!r}", name)
  v = float(v)
  if not math.isfinite(v):
    raise DecodeError(f"{name} must be a finite number, got {v}", name)
  return v


def _need(ok: bool, name: str, message: str):
  if not ok:
    raise DecodeError(message, name)


def check_options(
  mode: str = "ntp",
  tau: float = 0.9,
  n: int = 3,
  max_bytes: int = 256,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  pad_to: int = 32,
  budget_pad_to: int = 1,
) -> dict:
  """The decoding options of ``generate`` checked (types, ranges, NaN) without a model; returns
  them normalized (Python ints / floats). Raises ``DecodeError`` naming the first bad one
  (``DecodeError.option``).

  ``mode`` one of ``policies.POLICIES`` (ntp, threshold, verify, drafter and any added with
  ``policies.register``); ``n`` in [2, MAX_N] in the multi-byte modes (ignored in ntp);
  ``max_bytes`` >= 1; ``tau`` in [0, 1]; ``temperature`` >= 0 (0 = greedy); ``top_k`` >= 0
  (0 = off); ``top_p`` in (0, 1]; ``seed``, ``pad_to`` and ``budget_pad_to`` (>= 1) integers."""
  _need(
    isinstance(mode, str) and mode in POLICIES,
    "mode",
    f"unknown mode {mode!r}; choose one of {', '.join(POLICIES)}",
  )
  n = _int_arg("n", n)
  if POLICIES[mode].multi_byte:
    _need(n >= 2, "n", f"n must be >= 2 in {mode} mode (bytes proposed per step), got {n}")
    _need(n <= MAX_N, "n", f"n must be at most {MAX_N} (bytes proposed per step), got {n}")
  max_bytes = _int_arg("max_bytes", max_bytes)
  _need(max_bytes >= 1, "max_bytes", f"max_bytes must be >= 1, got {max_bytes}")
  tau = _real_arg("tau", tau)
  _need(0.0 <= tau <= 1.0, "tau", f"tau must be a probability in [0, 1], got {tau}")
  temperature = _real_arg("temperature", temperature)
  _need(
    temperature >= 0, "temperature", f"temperature must be >= 0 (0 = greedy), got {temperature}"
  )
  top_k = _int_arg("top_k", top_k)
  # an int32 on the device; any k past the vocabulary keeps all
  _need(
    0 <= top_k <= _INT32_MAX, "top_k", f"top_k must be in [0, {_INT32_MAX}] (0 = off), got {top_k}"
  )
  top_p = _real_arg("top_p", top_p)
  _need(0.0 < top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {top_p}")
  seed = _int_arg("seed", seed)
  # a PRNG key takes any 64-bit integer
  _need(-(2**63) <= seed < 2**63, "seed", f"seed must be a 64-bit integer, got {seed}")
  pad_to = _int_arg("pad_to", pad_to)
  _need(pad_to >= 1, "pad_to", f"pad_to must be >= 1, got {pad_to}")
  budget_pad_to = _int_arg("budget_pad_to", budget_pad_to)
  _need(budget_pad_to >= 1, "budget_pad_to", f"budget_pad_to must be >= 1, got {budget_pad_to}")
  return dict(
    mode=mode,
    tau=tau,
    n=n,
    max_bytes=max_bytes,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    seed=seed,
    pad_to=pad_to,
    budget_pad_to=budget_pad_to,
  )


def seed_key_words(seed: int) -> np.ndarray:
  """A 64-bit ``seed`` (negative ones as their two's complement) as the two uint32 words of
  ``jax.random.PRNGKey(seed)``."""
  v = int(seed) & (2**64 - 1)
  return np.array([v >> 32, v & 0xFFFFFFFF], np.uint32)


def encode_prompts(prompts) -> List[np.ndarray]:
  """Prompts -> int32 id arrays. A str is encoded as UTF-8, bytes as they are; anything else
  is vocabulary ids (byte b is id b + 3, lca_jax.vocab). A flat list of ints is ONE prompt of
  ids (``[123]`` is the byte 'x'), a list of str / bytes / id sequences is a batch."""
  if isinstance(prompts, (str, bytes)) or (isinstance(prompts, np.ndarray) and prompts.ndim <= 1):
    prompts = [prompts]
  elif isinstance(prompts, (list, tuple)) and prompts and all(is_int(x) for x in prompts):
    prompts = [np.asarray(prompts, np.int64)]
  try:
    prompts = list(prompts)
  except TypeError:
    raise DecodeError(
      f"prompts must be a str, bytes, an id array or a list of them, got {type(prompts).__name__}"
    ) from None
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      out.append(vocab.encode(p))
    elif isinstance(p, (bytes, bytearray)):
      out.append(vocab.encode_bytes(bytes(p)))
    else:
      try:
        a = np.asarray(p)
      except (TypeError, ValueError):
        a = np.asarray(None)
      if a.size and a.dtype.kind not in "iu":
        raise DecodeError(
          f"prompt {i} must be a str, bytes or integer vocabulary ids, got "
          f"{type(p).__name__} of {a.dtype}"
        )
      a = a.reshape(-1).astype(np.int64)
      if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max):
        raise DecodeError(f"prompt {i} has ids outside [0, {vocab.NUM_BASE_TOKENS})")
      out.append(a.astype(np.int32))
  return out


def check_prompts(prompts: List[np.ndarray], n_tokens: int, limit: int):
  """Each encoded prompt holds at least one id, all in [0, n_tokens), and leaves at least one
  byte of a ``limit``-byte context to generate."""
  if not prompts:
    raise DecodeError("no prompt given")
  for i, p in enumerate(prompts):
    if p.size == 0:
      raise DecodeError(f"prompt {i} is empty; give at least one byte")
    if p.size > limit:
      raise DecodeError(
        f"prompt {i} is {p.size} bytes, longer than the model context ({limit} bytes)"
      )
    if p.size == limit:
      raise DecodeError(
        f"prompt {i} is {p.size} bytes and fills the model context ({limit} "
        f"bytes): no room to generate; give at most {limit - 1} bytes"
      )
    if p.min() < 0 or p.max() >= n_tokens:
      raise DecodeError(f"prompt {i} has ids outside [0, {n_tokens})")


def is_model(m) -> bool:
  """Whether ``m`` is a model handle (``api.Model`` or alike: a ``cfg`` and ``params``)."""
  return isinstance(getattr(m, "cfg", None), ModelConfig) and hasattr(m, "params")


def check_request(model, mode: str, n: int, drafter, prompts: List[np.ndarray]):
  """The model (and drafter) can decode ``prompts`` in ``mode`` with ``n`` bytes per step."""
  if not is_model(model):
    raise DecodeError(f"generate needs a model from lca_jax.load(...), got {type(model).__name__}")
  cfg = model.cfg
  policy = POLICIES[mode]
  if policy.uses_drafter and drafter is None:
    raise DecodeError(f"{mode} mode needs a drafter model (an LCA-MBP or MLP-MBP checkpoint)")
  if policy.uses_drafter and not is_model(drafter):
    raise DecodeError(
      "drafter must be a model loaded with lca_jax.load(...) (an LCA-MBP or "
      f"MLP-MBP checkpoint), got {type(drafter).__name__} {drafter!r:.60}"
    )
  drafting = drafter.cfg if policy.uses_drafter else cfg
  if policy.multi_byte and not drafting.has_mbp:
    who = "the drafter" if policy.uses_drafter else "this model"
    raise DecodeError(
      f"{mode} mode needs a multi-byte head, and {who} has none "
      f"({drafting.kind}, n_mbp={drafting.n_mbp}); use --mode ntp",
      "mode",
    )
  if policy.multi_byte and drafting.n_mlp_mbp and n - 1 > drafting.n_mlp_mbp:
    raise DecodeError(
      f"an MLP-MBP model with {drafting.n_mlp_mbp} heads drafts at most "
      f"{drafting.n_mlp_mbp + 1} bytes per step; got n={n}",
      "n",
    )
  if policy.uses_drafter and drafter.cfg.n_tokens != cfg.n_tokens:
    raise DecodeError(
      f"the drafter's vocabulary ({drafter.cfg.n_tokens} ids) differs from the "
      f"verifier's ({cfg.n_tokens} ids); both must use the same byte vocabulary"
    )
  check_prompts(prompts, cfg.n_tokens, min(cfg.max_seq_len, drafting.max_seq_len))
