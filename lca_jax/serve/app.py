"""The FastAPI app of ``lca-serve``: OpenAI's completions and chat completions (streaming as
server-sent events, or one JSON response), ``/v1/models``, vLLM's ``/tokenize`` and
``/detokenize``, ``/health`` and ``/metrics``.

Every error is an OpenAI-style JSON body ``{"error": {"message", "type", "param", "code"}}``:
400 for bad input (``schema``), 401 for a missing or wrong API key (``api_key``: every path but
``/health`` and ``/metrics`` needs ``Authorization: Bearer <key>``), 404 for an unknown model
or path, 429 when the queue is full, 503 when the decode loop is not running, 504 when a
request outlives ``request_timeout`` (in a stream: an ``error`` event, then ``[DONE]``), and
500 (no traceback; the server logs it) for a bug. A client that disconnects cancels its
request: its slot is freed before the next chunk. Each request is counted once in
``lca_serve_requests_total``, with the status it ended with (499: the client went away).

Log-probabilities (``logprobs``) name each token by its text: the character of an ASCII byte,
``"bytes:\\xNN"`` for a byte of a multi-byte UTF-8 character (OpenAI's spelling for partial
characters), ``<eos>`` for the end; chat's entries also give the byte itself (``bytes``). With
``echo``, the prompt's own log-probabilities come first (the first token has none: null).
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import sys
import time
import traceback
from typing import List, Optional

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lca_jax import vocab
from lca_jax.decode.batch import GroupKey, RowParams
from lca_jax.decode.scoring import prompt_logprobs
from lca_jax.serve import schema
from lca_jax.serve.metrics import Metrics
from lca_jax.serve.scheduler import Job, Scheduler, TokenLogprob
from lca_jax.serve.schema import GenRequest, ModelInfo, ServeError

POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key


def token_text(i: int) -> str:
  """A token's name in log-probabilities: an ASCII byte's character, ``bytes:\\xNN`` for any
  other byte, the tag of a special id (``<eos>``)."""
  if vocab.BYTE_OFFSET <= i < vocab.BYTE_OFFSET + vocab.NUM_BYTES:
    b = i - vocab.BYTE_OFFSET
    return chr(b) if b < 0x80 else f"bytes:\\x{b:02x}"
  return vocab.token_str(i)


def _token_bytes(i: int) -> Optional[List[int]]:
  if vocab.BYTE_OFFSET <= i < vocab.BYTE_OFFSET + vocab.NUM_BYTES:
    return [i - vocab.BYTE_OFFSET]
  return None


def _prompt_entries(ids: np.ndarray, top: int, model) -> List[Optional[TokenLogprob]]:
  """The prompt's ids as ``TokenLogprob``s (the first one None: nothing predicts it)."""
  p = prompt_logprobs(model, ids, top)
  out: List[Optional[TokenLogprob]] = [None]
  for t in range(1, ids.size):
    pairs = tuple((int(a), float(b)) for a, b in zip(p.top_ids_TK[t], p.top_lp_TK[t]))
    out.append(TokenLogprob(int(ids[t]), float(p.lp_T[t]), pairs))
  return out


def _completion_logprobs(ids: List[int], entries, text_start: int) -> dict:
  """OpenAI's completions ``logprobs`` object for ``ids`` (``entries``: their
  ``TokenLogprob``s, None where a token has none), offsets counted from ``text_start``."""
  dec = vocab.StreamDecoder()
  offsets, n = [], text_start
  for i in ids:
    offsets.append(n)
    n += len(dec.push([i]))
  return {
    "tokens": [token_text(i) for i in ids],
    "token_logprobs": [None if e is None else e.logprob for e in entries],
    "top_logprobs": [None if e is None else {token_text(t): v for t, v in e.top} for e in entries],
    "text_offset": offsets,
  }


def _chat_logprobs(entries: List[TokenLogprob]) -> dict:
  item = lambda i, v: {"token": token_text(i), "logprob": v, "bytes": _token_bytes(i)}
  return {
    "content": [
      {**item(e.id, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]} for e in entries
    ]
  }


def _usage(req: GenRequest, ends: List[dict]) -> dict:
  prompt = int(sum(p.size for p in req.prompts))
  completion = sum(e["completion_tokens"] for e in ends)
  steps = sum(e["steps"] for e in ends)
  cand = sum(e["candidates"] for e in ends)
  return {
    "prompt_tokens": prompt,
    "completion_tokens": completion,
    "total_tokens": prompt + completion,
    "prompt_bytes": int(sum(np.sum(vocab.is_byte_id(p)) for p in req.prompts)),
    "completion_bytes": sum(e["completion_bytes"] for e in ends),
    "decode_steps": steps,
    "bytes_per_step": completion / steps if steps else None,
    "acceptance_rate": sum(e["accepted"] for e in ends) / cand if cand else None,
    "mode": req.mode,
  }


_NOTHING = dict(completion_tokens=0, completion_bytes=0, steps=0, candidates=0, accepted=0)


class _Call:
  """One request's jobs and the queue their events arrive on (in the event loop)."""

  def __init__(self, req: GenRequest, timeout: float):
    loop = asyncio.get_running_loop()
    self.req = req
    self.queue: asyncio.Queue = asyncio.Queue()
    deadline = time.monotonic() + timeout if timeout > 0 else math.inf
    self.jobs = []
    if req.max_tokens == 0:  # echo alone: nothing to decode
      return
    base = req.seed if req.seed is not None else secrets.randbits(63)
    group = GroupKey(req.mode, req.mbp_n)
    for p_i, ids in enumerate(req.prompts):
      for c in range(req.n):
        idx = p_i * req.n + c

        def sink(kind, data, idx=idx):
          loop.call_soon_threadsafe(self.queue.put_nowait, (idx, kind, data))

        row = RowParams(
          budget=req.max_tokens,
          ignore_eos=req.ignore_eos,
          seed=base + idx,
          tau=req.tau,
          temperature=req.temperature,
          top_k=req.top_k,
          top_p=req.top_p,
          logprobs=req.logprobs is not None,
        )
        self.jobs.append(Job(ids, group, row, req.stop, sink, deadline, req.logprobs))

  @property
  def n_choices(self) -> int:
    return len(self.req.prompts) * self.req.n

  def prompt_of(self, idx: int) -> str:
    return self.req.prompt_texts[idx // self.req.n]

  def prompt_ids_of(self, idx: int) -> np.ndarray:
    return self.req.prompts[idx // self.req.n]

  def cancel(self):
    for j in self.jobs:
      j.cancel()


def _auth_error() -> JSONResponse:
  e = ServeError(
    "a valid API key is needed: Authorization: Bearer <key>", 401, code="invalid_api_key"
  )
  return JSONResponse(e.body(), status_code=401)


def create_app(
  scheduler: Scheduler, info: ModelInfo, request_timeout: float = 0.0, api_key: str = ""
) -> FastAPI:
  """The app over a started ``scheduler``; ``request_timeout`` seconds (0 = none) per request;
  ``api_key`` (empty: none) that every path but /health and /metrics asks for."""
  metrics: Metrics = scheduler.metrics
  model = scheduler.model
  app = FastAPI(title="lca-serve", docs_url=None, redoc_url=None, openapi_url=None)
  created = int(time.time())

  def count(endpoint: str, status: int):
    metrics.requests.labels(endpoint, str(status)).inc()

  def error(e: ServeError, endpoint: str) -> JSONResponse:
    count(endpoint, e.status)
    return JSONResponse(e.body(), status_code=e.status)

  @app.middleware("http")
  async def _auth(request: Request, call_next):
    if api_key and request.url.path not in OPEN_PATHS:
      given = request.headers.get("authorization", "")
      if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        return _auth_error()
    return await call_next(request)

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    e = ServeError(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code, kind=kind)
    return JSONResponse(e.body(), status_code=exc.status_code)

  @app.exception_handler(Exception)
  async def _bug(request: Request, exc: Exception):
    print(f"lca-serve: error in {request.url.path}:\n{traceback.format_exc()}", file=sys.stderr)
    e = ServeError("internal server error; see the server log", 500)
    return JSONResponse(e.body(), status_code=500)

  @app.get("/health")
  async def health():
    ok = scheduler.alive
    body = {
      "status": "ok" if ok else "unavailable",
      "model": info.name,
      "slots": scheduler.slots,
      "active": scheduler.n_active,
      "queued": scheduler.queued,
    }
    return JSONResponse(body, status_code=200 if ok else 503)

  @app.get("/metrics")
  async def prometheus():
    return Response(metrics.render(), media_type=metrics.content_type)

  @app.get("/v1/models")
  async def models():
    card = {
      "id": info.name,
      "object": "model",
      "created": created,
      "owned_by": "lca-jax",
      "max_model_len": info.context,
      "context_bytes": info.context,
      "multi_byte": info.has_mbp,
    }
    return {"object": "list", "data": [card]}

  async def _body(request: Request):
    raw = await request.body()
    try:
      return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
      raise ServeError(f"the request body is not valid JSON ({e})") from None

  @app.post("/tokenize")
  async def tokenize(request: Request):
    try:
      ids, _ = schema.tokenize_body(await _body(request), info)
    except ServeError as e:
      return error(e, "tokenize")
    count("tokenize", 200)
    return {"tokens": ids.tolist(), "count": int(ids.size), "max_model_len": info.context}

  @app.post("/detokenize")
  async def detokenize(request: Request):
    try:
      text = schema.detokenize_body(await _body(request), info)
    except ServeError as e:
      return error(e, "detokenize")
    count("detokenize", 200)
    return {"prompt": text}

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await _generate(request, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await _generate(request, chat=True)

  async def _generate(request: Request, chat: bool):
    endpoint = "chat" if chat else "completions"
    try:
      req = schema.parse(await _body(request), info, chat)
      call = _Call(req, request_timeout)
      if call.jobs:
        scheduler.submit(call.jobs)
    except ServeError as e:
      return error(e, endpoint)
    echo_lps = None
    if req.echo and req.logprobs is not None:  # the prompts' own, off the event loop
      top = req.logprobs
      echo_lps = [await asyncio.to_thread(_prompt_entries, p, top, model) for p in req.prompts]
    if req.stream:
      return StreamingResponse(
        _stream(call, chat, endpoint, echo_lps),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
      )
    return await _collect(request, call, chat, endpoint, echo_lps)

  def _echo(call: _Call, idx: int, echo_lps):
    """(text, ids, entries) the choice starts with: its prompt with ``echo``, else nothing."""
    if not call.req.echo:
      return "", [], []
    ids = call.prompt_ids_of(idx).tolist()
    entries = echo_lps[idx // call.req.n] if echo_lps is not None else [None] * len(ids)
    return call.prompt_of(idx), ids, list(entries)

  async def _collect(request: Request, call: _Call, chat: bool, endpoint: str, echo_lps):
    req = call.req
    n = call.n_choices
    starts = [_echo(call, i, echo_lps) for i in range(n)]
    texts = [s[0] for s in starts]
    gen_lps: List[list] = [[] for _ in range(n)]
    ends: List[Optional[dict]] = [None] * n
    if not call.jobs:
      ends = [dict(finish_reason="length", **_NOTHING) for _ in range(n)]
    left = len(call.jobs)
    try:
      while left:
        try:
          idx, kind, data = await asyncio.wait_for(call.queue.get(), POLL_S)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            call.cancel()
            count(endpoint, 499)
            return Response(status_code=499)
          continue
        if kind == "delta":
          texts[idx] += data[0]
          gen_lps[idx] += data[1] or []
        elif kind == "end":
          ends[idx] = data
          left -= 1
        else:
          call.cancel()
          return error(data, endpoint)
    finally:
      call.cancel()
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    choices = []
    for i, (t, e) in enumerate(zip(texts, ends)):
      lp = None
      if req.logprobs is not None:
        if chat:
          lp = _chat_logprobs(gen_lps[i])
        else:
          _, ids, entries = starts[i]
          ids = ids + [x.id for x in gen_lps[i]]
          lp = _completion_logprobs(ids, entries + gen_lps[i], 0)
      c = {"index": i, "logprobs": lp, "finish_reason": e["finish_reason"]}
      if chat:
        c["message"] = {"role": "assistant", "content": t}
      else:
        c["text"] = t
      choices.append(c)
    count(endpoint, 200)
    return {
      "id": rid,
      "object": "chat.completion" if chat else "text_completion",
      "created": int(time.time()),
      "model": info.name,
      "choices": choices,
      "usage": _usage(req, ends),
    }

  async def _stream(call: _Call, chat: bool, endpoint: str, echo_lps):
    req = call.req
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    head = {
      "id": rid,
      "object": "chat.completion.chunk" if chat else "text_completion",
      "created": int(time.time()),
      "model": info.name,
    }
    offsets = [0] * call.n_choices  # text sent per choice (completions' text_offset)

    def event(idx, text=None, finish=None, role=False, ids=(), entries=()):
      lp = None
      if req.logprobs is not None and (ids or entries):
        if chat:
          lp = _chat_logprobs(list(entries))
        else:
          lp = _completion_logprobs(list(ids), list(entries), offsets[idx])
      offsets[idx] += len(text or "")
      if chat:
        delta = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
          delta["content"] = text
        choice = {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": finish}
      else:
        choice = {"index": idx, "text": text or "", "logprobs": lp, "finish_reason": finish}
      return "data: " + json.dumps({**head, "choices": [choice]}, ensure_ascii=False) + "\n\n"

    ends: List[Optional[dict]] = [None] * call.n_choices
    left = len(call.jobs)
    status = 200
    try:
      for i in range(call.n_choices):
        if chat:
          yield event(i, role=True)
        elif req.echo:
          text, ids, entries = _echo(call, i, echo_lps)
          yield event(i, text=text, ids=ids, entries=entries)
        if not call.jobs:
          ends[i] = dict(finish_reason="length", **_NOTHING)
          yield event(i, finish="length")
      while left:
        idx, kind, data = await call.queue.get()
        if kind == "delta":
          text, entries = data
          entries = entries or []
          yield event(idx, text=text, ids=[e.id for e in entries], entries=entries)
        elif kind == "end":
          ends[idx] = data
          left -= 1
          yield event(idx, finish=data["finish_reason"])
        else:
          call.cancel()
          status = data.status
          yield "data: " + json.dumps(data.body()) + "\n\n"
          yield "data: [DONE]\n\n"
          return
      if req.include_usage:
        usage = {**head, "choices": [], "usage": _usage(req, ends)}
        yield "data: " + json.dumps(usage) + "\n\n"
      yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):  # the client went away
      status = 499
      raise
    finally:  # a client that went away: its slots are freed before the next chunk
      call.cancel()
      count(endpoint, status)

  return app
