"""Requests of the OpenAI-compatible endpoints, checked: a JSON body in, a ``GenRequest`` out,
or a ``ServeError`` that the app turns into an OpenAI-style error response (status 400 for bad
input, 404 for an unknown model).

Tokens are the byte vocabulary's ids (``lca_jax.vocab``): each byte is one (not each
character), and so is the eos that ends a reply; ``max_tokens`` counts them, ``usage`` counts
them (``*_tokens``) and the bytes alone (``prompt_bytes``, ``completion_bytes``). A completion
``prompt`` is a string, a list of strings, a list of token ids (one prompt) or a list of such
lists (what lm-evaluation-harness's ``local-completions`` sends). The decoding options are
checked by the decode runtime's own ``decode.request.check_options`` (an error names the
field). The lca extras of a body: ``mode`` (ntp | threshold | verify), ``tau`` (threshold
mode's acceptance probability, in [0, 1]), ``mbp_n`` (bytes proposed per step in the
multi-byte modes, in [2, 64]), ``top_k`` (0 = off) and ``ignore_eos`` (generate ``max_tokens``
bytes whatever the model says; for load tests).

Every field is honoured or refused: ``logprobs`` (completions: an integer in [0, 20], the
alternatives per token; chat: true, with ``top_logprobs`` in [0, 20]) in ntp mode; ``echo``
(with ``max_tokens: 0`` the prompt alone, and with ``logprobs`` its log-probabilities);
``stop``; ``user`` (an opaque id). Penalties, ``logit_bias``, ``suffix``, tools and functions
are refused unless neutral (0, empty, absent); ``best_of`` other than ``n`` and a
``response_format`` other than text are refused; a field the endpoint does not know is
refused (400 naming it).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import numpy as np

from lca_jax import vocab
from lca_jax.data.sft_format import chat_prompt_ids
from lca_jax.decode.batch import TOP_LOGPROBS
from lca_jax.decode.policies import POLICIES
from lca_jax.decode.request import DecodeError, check_options, check_prompts, encode_prompts
from lca_jax.errors import LcaError

MODES = ("ntp", "threshold", "verify")
MAX_STOPS = 4
MAX_STOP_BYTES = 256
DEFAULT_MAX_TOKENS = 16  # completions, as OpenAI's API; chat defaults to the context left
MAX_TEMPERATURE = 2.0  # OpenAI's range
_COMMON = {
  "model",
  "max_tokens",
  "temperature",
  "top_p",
  "n",
  "stream",
  "stream_options",
  "stop",
  "seed",
  "user",
  "logprobs",
  "presence_penalty",
  "frequency_penalty",
  "logit_bias",
  "mode",
  "tau",
  "mbp_n",
  "top_k",
  "ignore_eos",
}
FIELDS = {
  False: _COMMON | {"prompt", "echo", "best_of", "suffix"},
  True: _COMMON
  | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
  },
}
# the check_options name of a decoding option -> the request field
_FIELD_OF = {"n": "mbp_n", "top_k": "top_k", "max_bytes": "max_tokens"}


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
  n_tokens: int = vocab.NUM_BASE_TOKENS  # the model's vocabulary (ids a prompt may hold)


@dataclasses.dataclass
class GenRequest:
  """One checked request: one or more prompts (as ids), ``n`` choices each."""

  chat: bool
  prompts: List[np.ndarray]
  prompt_texts: List[str]
  max_tokens: int  # 0: no generation (completions with echo)
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
  logprobs: Optional[int] = None  # alternatives per token, or None: no log-probabilities


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


def _real(body: dict, name: str, default):
  v = body.get(name)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise _bad(f"{name} must be a number, got {type(v).__name__} {v!r:.40}", name)
  return float(v)


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


def _known_fields(body: dict, chat: bool):
  """Refuse a field the endpoint does not know (none is accepted and ignored)."""
  for name in body:
    if name not in FIELDS[chat]:
      where = "/v1/chat/completions" if chat else "/v1/completions"
      raise _bad(f"{name} is not a field of {where} on this server", name)


def _unsupported(body: dict):
  """Refuse options the server does not implement unless they are at their neutral value
  (zero, empty or absent: a neutral value asks for nothing)."""
  neutral = {
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
    if (isinstance(v, dict) or isinstance(v, list)) and not v:
      continue
    if not any(v is o or (type(v) is type(o) and v == o) for o in ok):
      raise _bad(f"{name} is not supported by this server", name)
  fmt = body.get("response_format")
  if fmt is not None and fmt != {"type": "text"}:
    raise _bad("response_format other than {'type': 'text'} is not supported", "response_format")
  user = body.get("user")
  if user is not None and not isinstance(user, str):
    raise _bad("user must be a string", "user")


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


def chat_prompt(body: dict) -> Tuple[np.ndarray, str]:
  """The prompt ids of a body's ``messages`` (the checkpoint's SFT chat format) and its text."""
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


def _is_ids(x) -> bool:
  return isinstance(x, list) and bool(x) and all(type(v) is int for v in x)


def completion_prompts(body: dict) -> Tuple[List[np.ndarray], List[str]]:
  """The prompt ids and texts of a body's ``prompt``: a string, a list of strings, a list of
  token ids or a list of such lists (the prompts as ``decode.request.encode_prompts`` takes
  them)."""
  p = body.get("prompt")
  if isinstance(p, str) or _is_ids(p):
    items = [p]
  elif isinstance(p, list) and p and all(isinstance(x, str) or _is_ids(x) for x in p):
    items = p
  else:
    raise _bad(
      "prompt must be a string, a list of strings, a list of token ids or a list of such lists",
      "prompt",
    )
  try:
    ids = encode_prompts(items)
  except DecodeError as e:
    raise _bad(str(e), "prompt") from None
  texts = [
    x if isinstance(x, str) else vocab.decode(i, specials="render") for x, i in zip(items, ids)
  ]
  return ids, texts


def _logprobs(body: dict, chat: bool) -> Optional[int]:
  """Alternatives per token (0 = the chosen token's alone), or None: no log-probabilities."""
  if chat:
    on = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0, hi=TOP_LOGPROBS)
    if top is not None and not on:
      raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if on else None
  return _int(body, "logprobs", None, lo=0, hi=TOP_LOGPROBS)


def _decode_options(body: dict, mode: str, max_tokens: int, name: str) -> dict:
  """The decoding options of a body, checked by the decode runtime (``check_options``)."""
  temperature = _real(body, "temperature", 1.0)
  if temperature > MAX_TEMPERATURE:
    raise _bad(f"temperature must be in [0, {MAX_TEMPERATURE}], got {temperature}", "temperature")
  seed = _int(body, "seed", None)
  try:
    return check_options(
      mode=mode,
      tau=_real(body, "tau", 0.9),
      n=_int(body, "mbp_n", 3),
      max_bytes=max(max_tokens, 1),
      temperature=temperature,
      top_k=_int(body, "top_k", 0),
      top_p=_real(body, "top_p", 1.0),
      seed=0 if seed is None else seed,
    )
  except DecodeError as e:
    field = _FIELD_OF.get(e.option, e.option)
    field = name if field == "max_tokens" else field
    raise _bad(str(e).replace(f"{e.option} ", f"{field} ", 1), field) from None


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
  _known_fields(body, chat)
  _unsupported(body)
  if chat:
    ids, text = chat_prompt(body)
    prompts, texts = [ids], [text]
  else:
    prompts, texts = completion_prompts(body)
  param = "messages" if chat else "prompt"
  for p in prompts:
    if p.size >= info.context:
      raise _bad(
        f"the prompt is {p.size} bytes; the context is {info.context} bytes (prompt + "
        f"generation), so give at most {info.context - 1}",
        param,
      )
  try:
    check_prompts(prompts, info.n_tokens, info.context)
  except DecodeError as e:
    raise _bad(str(e), param) from None
  echo = False if chat else _bool(body, "echo", False)
  longest = max(p.size for p in prompts)
  room = info.context - longest
  name = "max_tokens"
  if body.get("max_tokens") is None and chat and body.get("max_completion_tokens") is not None:
    name = "max_completion_tokens"
  max_tokens = _int(body, name, min(room, DEFAULT_MAX_TOKENS) if not chat else room)
  if max_tokens < (0 if echo else 1):
    why = "" if chat else " (0 only with echo: the prompt alone)"
    raise _bad(f"{name} must be >= {0 if echo else 1}{why}, got {max_tokens}", name)
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
  opts = _decode_options(body, mode, max_tokens, name)
  multi = POLICIES[mode].multi_byte
  if multi:
    if not info.has_mbp:
      raise _bad(f"mode {mode} needs a multi-byte head, and the served model has none", "mode")
    if opts["n"] > info.max_n:
      raise _bad(f"mbp_n must be <= {info.max_n} for the served model, got {opts['n']}", "mbp_n")
  logprobs = _logprobs(body, chat)
  if logprobs is not None and mode != "ntp":
    raise _bad(f"logprobs are given in ntp mode only, not {mode}", "logprobs")
  n = _int(body, "n", 1, lo=1)
  if n * len(prompts) > info.max_choices:
    raise _bad(
      f"n x prompts is {n * len(prompts)}, more than the server's {info.max_choices} slots", "n"
    )
  best_of = _int(body, "best_of", None, lo=1)
  if best_of is not None and best_of != n:
    raise _bad("best_of other than n is not supported", "best_of")
  stream_opts = body.get("stream_options")
  if stream_opts is not None and not isinstance(stream_opts, dict):
    raise _bad("stream_options must be an object", "stream_options")
  stream = _bool(body, "stream", False)
  return GenRequest(
    chat=chat,
    prompts=prompts,
    prompt_texts=texts,
    max_tokens=max_tokens,
    temperature=opts["temperature"],
    top_p=opts["top_p"],
    top_k=opts["top_k"],
    seed=_int(body, "seed", None),
    stop=_stops(body),
    n=n,
    stream=stream,
    include_usage=bool(stream and stream_opts and _bool(stream_opts, "include_usage", False)),
    mode=mode,
    tau=opts["tau"],
    mbp_n=opts["n"] if multi else 1,
    ignore_eos=_bool(body, "ignore_eos", False),
    echo=echo,
    logprobs=logprobs,
  )


def tokenize_body(body, info: ModelInfo) -> Tuple[np.ndarray, str]:
  """The ids and text of a /tokenize body: ``{"prompt": str}`` or ``{"messages": [...]}``."""
  if not isinstance(body, dict):
    raise _bad("the request body must be a JSON object")
  unknown = set(body) - {"model", "prompt", "messages", "add_special_tokens"}
  if unknown:
    raise _bad(f"{sorted(unknown)[0]} is not a field of /tokenize", sorted(unknown)[0])
  if body.get("add_special_tokens") not in (None, False):
    raise _bad("add_special_tokens: the byte vocabulary adds none", "add_special_tokens")
  if ("prompt" in body) == ("messages" in body):
    raise _bad("give one of prompt or messages")
  if "messages" in body:
    return chat_prompt(body)
  p = body["prompt"]
  if not isinstance(p, str):
    raise _bad("prompt must be a string", "prompt")
  return vocab.encode(p), p


def detokenize_body(body, info: ModelInfo) -> str:
  """The text of a /detokenize body ``{"tokens": [ids]}`` (specials rendered as tags)."""
  if not isinstance(body, dict):
    raise _bad("the request body must be a JSON object")
  unknown = set(body) - {"model", "tokens"}
  if unknown:
    raise _bad(f"{sorted(unknown)[0]} is not a field of /detokenize", sorted(unknown)[0])
  toks = body.get("tokens")
  if not isinstance(toks, list) or not all(type(t) is int for t in toks):
    raise _bad("tokens must be a list of integer token ids", "tokens")
  if any(not 0 <= t < info.n_tokens for t in toks):
    raise _bad(f"tokens must lie in [0, {info.n_tokens})", "tokens")
  return vocab.decode(np.asarray(toks, np.int64), specials="render")
