"""Requests of the OpenAI-compatible endpoints, checked: a JSON body in, a ``GenRequest`` out,
or a ``ServeError`` that the app turns into an OpenAI-style error response (status 400 for bad
input, 404 for an unknown model).

Tokens are the byte vocabulary's ids (``lca_jax.vocab``): each byte is one (not each
character), and so is the eos that ends a reply; ``max_tokens`` counts them, ``usage`` counts
them (``*_tokens``) and the bytes alone (``prompt_bytes``, ``completion_bytes``). The lca extras of a body: ``mode`` (ntp | threshold | verify), ``tau`` (threshold mode's
acceptance probability, in [0, 1]), ``mbp_n`` (bytes proposed per step in the multi-byte modes,
in [2, 64]), ``top_k`` (0 = off) and ``ignore_eos`` (generate ``max_tokens`` bytes whatever the
model says; for load tests). Fields the server does not implement are refused when set to
anything but their neutral value (``logprobs``, penalties, ``logit_bias``, ``best_of`` > n,
``suffix``, tools); other unknown fields are ignored, as OpenAI's clients send a few.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

import numpy as np

from lca_jax import vocab
from lca_jax.data.sft_format import chat_prompt_ids
from lca_jax.decode.engine import MAX_N
from lca_jax.decode.policies import POLICIES
from lca_jax.errors import LcaError

MODES = ("ntp", "threshold", "verify")
MAX_STOPS = 4
MAX_STOP_BYTES = 256
DEFAULT_MAX_TOKENS = 16  # completions, as OpenAI's API; chat defaults to the context left


class ServeError(LcaError, ValueError):
  """A request the server refuses, with its HTTP status and OpenAI error fields."""

  def __init__(
    self, message: str, status: int = 400, param: Optional[str] = None, code=None, kind=None
  ):
    super().__init__(message)
    self.status = status
    self.param = param
    self.code = code
    self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

  def body(self) -> dict:
    return {
      "error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}
    }


@dataclasses.dataclass(frozen=True)
class ModelInfo:
  """What request checking needs to know of the served model."""

  name: str
  context: int  # bytes of prompt + generation per request
  has_mbp: bool
  max_n: int  # most bytes per step the multi-byte head drafts (MAX_N, or an MLP head count + 1)
  max_choices: int  # the most prompts x n of one request (the server's slots)


@dataclasses.dataclass
class GenRequest:
  """One checked request: one or more prompts (as ids), ``n`` choices each."""

  chat: bool
  prompts: List[np.ndarray]
  prompt_texts: List[str]
  max_tokens: int
  temperature: float
  top_p: float
  top_k: int
  seed: Optional[int]
  stop: Tuple[str, ...]
  n: int
  stream: bool
  include_usage: bool
  mode: str
  tau: float
  mbp_n: int
  ignore_eos: bool
  echo: bool


def _bad(msg: str, param: Optional[str] = None) -> ServeError:
  return ServeError(msg, 400, param)


def _int(body: dict, name: str, default, lo=None, hi=None):
  v = body.get(name)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, int):
    if isinstance(v, float) and v.is_integer():
      v = int(v)
    else:
      raise _bad(f"{name} must be an integer, got {type(v).__name__} {v!r:.40}", name)
  if lo is not None and v < lo:
    raise _bad(f"{name} must be >= {lo}, got {v}", name)
  if hi is not None and v > hi:
    raise _bad(f"{name} must be <= {hi}, got {v}", name)
  return v


def _real(body: dict, name: str, default, lo, hi, lo_open=False):
  v = body.get(name)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise _bad(f"{name} must be a number, got {type(v).__name__} {v!r:.40}", name)
  v = float(v)
  if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
    rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
    raise _bad(f"{name} must be in {rng}, got {v}", name)
  return v


def _bool(body: dict, name: str, default: bool) -> bool:
  v = body.get(name)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise _bad(f"{name} must be true or false, got {v!r:.40}", name)
  return v


def _stops(body: dict) -> Tuple[str, ...]:
  v = body.get("stop")
  if v is None:
    return ()
  stops = [v] if isinstance(v, str) else v
  if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
    raise _bad("stop must be a string or a list of strings", "stop")
  if len(stops) > MAX_STOPS:
    raise _bad(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
  for s in stops:
    if not s:
      raise _bad("stop strings must not be empty", "stop")
    if len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES:
      raise _bad(f"a stop string may have at most {MAX_STOP_BYTES} bytes", "stop")
  return tuple(stops)


def _unsupported(body: dict):
  """Refuse options the server does not implement unless they are at their neutral value."""
  neutral = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None,),
    "suffix": (None, ""),
    "tools": (None,),
    "functions": (None,),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
  }
  for name, ok in neutral.items():
    v = body.get(name)
    if v in ({},) or (isinstance(v, list) and not v):
      continue
    if not any(v is o or (type(v) is type(o) and v == o) for o in ok):
      raise _bad(f"{name} is not supported by this server", name)
  fmt = body.get("response_format")
  if fmt is not None and fmt != {"type": "text"}:
    raise _bad("response_format other than {'type': 'text'} is not supported", "response_format")


def _text_of(content, i: int) -> str:
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    parts = []
    for p in content:
      if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
        raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
      parts.append(p["text"])
    return "".join(parts)
  raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _chat_prompt(body: dict) -> Tuple[np.ndarray, str]:
  msgs = body.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise _bad("messages must be a non-empty list of {role, content}", "messages")
  clean = []
  for i, m in enumerate(msgs):
    if not isinstance(m, dict):
      raise _bad(f"messages[{i}] must be an object with role and content", "messages")
    role = m.get("role")
    role = "system" if role == "developer" else role
    if role not in ("system", "user", "assistant"):
      raise _bad(
        f"messages[{i}].role must be system, developer, user or assistant, got {role!r:.40}",
        "messages",
      )
    clean.append({"role": role, "content": _text_of(m.get("content"), i)})
  ids = chat_prompt_ids(clean)
  return ids, vocab.decode(ids, specials="render")


def _completion_prompts(body: dict) -> List[str]:
  p = body.get("prompt")
  prompts = [p] if isinstance(p, str) else p
  if not isinstance(prompts, list) or not prompts or not all(isinstance(x, str) for x in prompts):
    raise _bad("prompt must be a string or a non-empty list of strings", "prompt")
  for x in prompts:
    if not x:
      raise _bad("prompt is empty; give at least one byte", "prompt")
  return prompts


def parse(body, info: ModelInfo, chat: bool) -> GenRequest:
  """Check a decoded JSON body of /v1/completions (``chat`` False) or /v1/chat/completions."""
  if not isinstance(body, dict):
    raise _bad("the request body must be a JSON object")
  model = body.get("model")
  if model is not None and not isinstance(model, str):
    raise _bad("model must be a string", "model")
  if model not in (None, "", info.name):
    raise ServeError(
      f"model {model!r:.80} is not served here; use {info.name!r}", 404, "model", "model_not_found"
    )
  _unsupported(body)
  if chat:
    ids, text = _chat_prompt(body)
    prompts, texts = [ids], [text]
  else:
    texts = _completion_prompts(body)
    prompts = [vocab.encode(t) for t in texts]
  for p in prompts:
    if p.size >= info.context:
      raise _bad(
        f"the prompt is {p.size} bytes; the context is {info.context} bytes (prompt + "
        f"generation), so give at most {info.context - 1}",
        "messages" if chat else "prompt",
      )
  longest = max(p.size for p in prompts)
  room = info.context - longest
  name = "max_tokens"
  if body.get("max_tokens") is None and chat and body.get("max_completion_tokens") is not None:
    name = "max_completion_tokens"
  max_tokens = _int(body, name, min(room, DEFAULT_MAX_TOKENS) if not chat else room, lo=1)
  if max_tokens > room:
    raise _bad(
      f"{name} is {max_tokens} bytes, but the prompt ({longest} bytes) leaves {room} of the "
      f"{info.context}-byte context",
      name,
    )
  mode = body.get("mode", "ntp")
  if mode is None:
    mode = "ntp"
  if mode not in MODES:
    raise _bad(f"mode must be one of {', '.join(MODES)}, got {mode!r:.40}", "mode")
  mbp_n = _int(body, "mbp_n", 3, lo=2, hi=MAX_N)
  if POLICIES[mode].multi_byte:
    if not info.has_mbp:
      raise _bad(f"mode {mode} needs a multi-byte head, and the served model has none", "mode")
    if mbp_n > info.max_n:
      raise _bad(f"mbp_n must be <= {info.max_n} for the served model, got {mbp_n}", "mbp_n")
  n = _int(body, "n", 1, lo=1)
  if n * len(prompts) > info.max_choices:
    raise _bad(
      f"n x prompts is {n * len(prompts)}, more than the server's {info.max_choices} slots", "n"
    )
  best_of = _int(body, "best_of", None, lo=1)
  if best_of is not None and best_of != n:
    raise _bad("best_of other than n is not supported", "best_of")
  opts = body.get("stream_options")
  if opts is not None and not isinstance(opts, dict):
    raise _bad("stream_options must be an object", "stream_options")
  stream = _bool(body, "stream", False)
  seed = _int(body, "seed", None, lo=-(2**63), hi=2**64 - 1)
  return GenRequest(
    chat=chat,
    prompts=prompts,
    prompt_texts=texts,
    max_tokens=max_tokens,
    temperature=_real(body, "temperature", 1.0, 0.0, 2.0),
    top_p=_real(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
    top_k=_int(body, "top_k", 0, lo=0, hi=2**31 - 1),
    seed=seed,
    stop=_stops(body),
    n=n,
    stream=stream,
    include_usage=bool(stream and opts and _bool(opts, "include_usage", False)),
    mode=mode,
    tau=_real(body, "tau", 0.9, 0.0, 1.0),
    mbp_n=mbp_n if POLICIES[mode].multi_byte else 1,
    ignore_eos=_bool(body, "ignore_eos", False),
    echo=False if chat else _bool(body, "echo", False),
  )
