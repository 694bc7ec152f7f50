"""The FastAPI app of ``lca-serve``: OpenAI's completions and chat completions (streaming as
server-sent events, or one JSON response), ``/v1/models``, ``/health`` and ``/metrics``.

Every error is an OpenAI-style JSON body ``{"error": {"message", "type", "param", "code"}}``:
400 for bad input (``schema``), 404 for an unknown model or path, 429 when the queue is full,
503 when the decode loop is not running, 504 when a request outlives ``request_timeout`` (in a
stream: an ``error`` event, then ``[DONE]``), and 500 (no traceback; the server logs it) for a
bug. A client that disconnects cancels its request: its slot is freed before the next chunk.
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
from lca_jax.serve import schema
from lca_jax.serve.metrics import Metrics
from lca_jax.serve.scheduler import Job, Scheduler
from lca_jax.serve.schema import GenRequest, ModelInfo, ServeError
from lca_jax.serve.slots import GroupKey, RowParams

POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


def _error(e: ServeError, metrics: Metrics, endpoint: str) -> JSONResponse:
  metrics.requests.labels(endpoint, str(e.status)).inc()
  return JSONResponse(e.body(), status_code=e.status)


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


class _Call:
  """One request's jobs and the queue their events arrive on (in the event loop)."""

  def __init__(self, req: GenRequest, scheduler: Scheduler, timeout: float):
    loop = asyncio.get_running_loop()
    self.req = req
    self.queue: asyncio.Queue = asyncio.Queue()
    deadline = time.monotonic() + timeout if timeout > 0 else math.inf
    self.jobs = []
    base = req.seed if req.seed is not None else secrets.randbits(63)
    group = GroupKey(req.mode, req.mbp_n, req.temperature == 0)
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
        )
        self.jobs.append(Job(ids, group, row, req.stop, sink, deadline))

  def prompt_of(self, idx: int) -> str:
    return self.req.prompt_texts[idx // self.req.n]

  def cancel(self):
    for j in self.jobs:
      j.cancel()


def create_app(scheduler: Scheduler, info: ModelInfo, request_timeout: float = 0.0) -> FastAPI:
  """The app over a started ``scheduler``; ``request_timeout`` seconds (0 = none) per request."""
  metrics = scheduler.metrics
  app = FastAPI(title="lca-serve", docs_url=None, redoc_url=None, openapi_url=None)
  created = int(time.time())

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
      "context_bytes": info.context,
      "multi_byte": info.has_mbp,
    }
    return {"object": "list", "data": [card]}

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await _generate(request, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await _generate(request, chat=True)

  async def _generate(request: Request, chat: bool):
    endpoint = "chat" if chat else "completions"
    try:
      raw = await request.body()
      try:
        body = json.loads(raw)
      except (UnicodeDecodeError, ValueError) as e:
        raise ServeError(f"the request body is not valid JSON ({e})") from None
      req = schema.parse(body, info, chat)
      call = _Call(req, scheduler, request_timeout)
      scheduler.submit(call.jobs)
    except ServeError as e:
      return _error(e, metrics, endpoint)
    metrics.requests.labels(endpoint, "200").inc()
    if req.stream:
      return StreamingResponse(
        _stream(call, chat), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
      )
    return await _collect(request, call, chat, endpoint)

  async def _collect(request: Request, call: _Call, chat: bool, endpoint: str):
    req = call.req
    texts = [call.prompt_of(i) if req.echo else "" for i in range(len(call.jobs))]
    ends: List[Optional[dict]] = [None] * len(call.jobs)
    left = len(call.jobs)
    try:
      while left:
        try:
          idx, kind, data = await asyncio.wait_for(call.queue.get(), POLL_S)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            call.cancel()
            return Response(status_code=499)
          continue
        if kind == "delta":
          texts[idx] += data
        elif kind == "end":
          ends[idx] = data
          left -= 1
        else:
          call.cancel()
          return _error(data, metrics, endpoint)
    finally:
      call.cancel()
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    choices = []
    for i, (t, e) in enumerate(zip(texts, ends)):
      c = {"index": i, "logprobs": None, "finish_reason": e["finish_reason"]}
      if chat:
        c["message"] = {"role": "assistant", "content": t}
      else:
        c["text"] = t
      choices.append(c)
    return {
      "id": rid,
      "object": "chat.completion" if chat else "text_completion",
      "created": int(time.time()),
      "model": info.name,
      "choices": choices,
      "usage": _usage(req, ends),
    }

  async def _stream(call: _Call, chat: bool):
    req = call.req
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    head = {
      "id": rid,
      "object": "chat.completion.chunk" if chat else "text_completion",
      "created": int(time.time()),
      "model": info.name,
    }

    def event(idx, text=None, finish=None, role=False):
      if chat:
        delta = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
          delta["content"] = text
        choice = {"index": idx, "delta": delta, "logprobs": None, "finish_reason": finish}
      else:
        choice = {"index": idx, "text": text or "", "logprobs": None, "finish_reason": finish}
      return "data: " + json.dumps({**head, "choices": [choice]}, ensure_ascii=False) + "\n\n"

    ends: List[Optional[dict]] = [None] * len(call.jobs)
    left = len(call.jobs)
    try:
      for i in range(len(call.jobs)):
        if chat:
          yield event(i, role=True)
        elif req.echo:
          yield event(i, text=call.prompt_of(i))
      while left:
        idx, kind, data = await call.queue.get()
        if kind == "delta":
          yield event(idx, text=data)
        elif kind == "end":
          ends[idx] = data
          left -= 1
          yield event(idx, finish=data["finish_reason"])
        else:
          call.cancel()
          yield "data: " + json.dumps(data.body()) + "\n\n"
          yield "data: [DONE]\n\n"
          return
      if req.include_usage:
        usage = {**head, "choices": [], "usage": _usage(req, ends)}
        yield "data: " + json.dumps(usage) + "\n\n"
      yield "data: [DONE]\n\n"
    finally:  # a client that went away: its slots are freed before the next chunk
      call.cancel()

  return app
