"""lca-serve: an OpenAI-compatible HTTP server for a checkpoint, with continuous batching.

    lca-serve --checkpoint workdirs/demo [--host 127.0.0.1 --port 8000 --max-batch 32]
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "The hacker", "max_tokens": 64, "temperature": 0}'

Endpoints: POST /v1/completions and /v1/chat/completions (the checkpoint's SFT chat format;
``stream: true`` for server-sent events; ``logprobs``, ``echo``), POST /tokenize and
/detokenize, GET /v1/models, /health, /metrics (Prometheus). With --api-key KEY every path but
/health and /metrics needs ``Authorization: Bearer KEY`` (401 without).
Tokens are byte ids (``max_tokens`` counts bytes, and eos). lca extras in a request body: ``mode`` (ntp |
threshold | verify), ``tau``, ``mbp_n``, ``top_k``, ``ignore_eos``. Up to --max-batch requests
decode together; a new one joins the running batch between decode chunks of --chunk-steps
steps, and a finished or cancelled one leaves it at once. Requests beyond the slots wait in a
queue of --max-queue choices; past that the server answers 429. Every request has a
--context of bytes for prompt + generation (default: the model's max_seq_len, at most 1024; a
longer context makes every step read a longer cache). Greedy and sampled requests of one mode
decode in one batch. At start it compiles ntp, greedy and sampled (OpenAI's default
temperature 1), for every prompt bucket (--no-warmup skips it); other modes compile on their
first request. It binds --host:--port before loading the checkpoint, and prints its
``serving ... on http://...`` line once bound. Bad options and a port in use: one line on
stderr, exit status 2, at once.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import List, Optional

from lca_jax.cli.common import add_dtype_option, fail, one_line_warnings, run_main

DEFAULT_CONTEXT = 1024


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="lca-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--checkpoint", required=True, help="workdir or upstream dir (config.json + model.safetensors)"
  )
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
  p.add_argument("--port", type=int, default=8000)
  p.add_argument("--max-batch", type=int, default=32, help="requests decoded at once (slots)")
  p.add_argument("--max-queue", type=int, help="choices waiting for a slot before 429s")
  p.add_argument("--context", type=int, help="bytes of prompt + generation per request")
  p.add_argument("--chunk-steps", type=int, default=8, help="decode steps between admissions")
  p.add_argument(
    "--request-timeout", type=float, default=600.0, help="seconds a request may take (0 = none)"
  )
  p.add_argument("--model-name", help="the model id clients name (default: the directory name)")
  p.add_argument("--max-groups", type=int, default=4, help="batches of distinct modes at once")
  p.add_argument("--no-warmup", action="store_true", help="compile on first use instead")
  p.add_argument(
    "--api-key", default="", help="the key clients send as 'Authorization: Bearer KEY'"
  )
  p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
  add_dtype_option(p, "serve")
  return p


def _check(args):
  if not 0 < args.port < 65536:
    fail(f"--port must be in [1, 65535], got {args.port}")
  if not 1 <= args.max_batch <= 1024:
    fail(f"--max-batch must be in [1, 1024], got {args.max_batch}")
  if args.max_queue is not None and args.max_queue < 0:
    fail(f"--max-queue must be >= 0, got {args.max_queue}")
  if args.context is not None and args.context < 2:
    fail(f"--context must be >= 2 bytes, got {args.context}")
  if not 1 <= args.chunk_steps <= 4096:
    fail(f"--chunk-steps must be in [1, 4096], got {args.chunk_steps}")
  if not args.request_timeout >= 0:
    fail(f"--request-timeout must be >= 0 seconds, got {args.request_timeout}")
  if args.max_groups < 1:
    fail(f"--max-groups must be >= 1, got {args.max_groups}")
  if not os.path.isdir(args.checkpoint):
    fail(f"checkpoint directory does not exist: {args.checkpoint}")


def bind(host: str, port: int) -> socket.socket:
  """A listening TCP socket on ``host:port``, bound before anything slow (loading, compiling),
  so that a port in use is a one-line error at once; the server serves on this socket."""
  try:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
  except OSError as e:
    fail(f"cannot listen on {host}:{port}: {e.strerror or e}")
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(2048)
  except OSError as e:
    sock.close()
    fail(f"cannot listen on {host}:{port}: {e.strerror or e} (--port picks another)")
  return sock


def main(argv: Optional[List[str]] = None) -> int:
  args = build_parser().parse_args(argv)
  one_line_warnings("lca-serve")
  return run_main(lambda: _main(args))


def _main(args) -> int:
  _check(args)
  sock = bind(args.host, args.port)
  try:
    return _serve(args, sock)
  finally:
    sock.close()


def _serve(args, sock: socket.socket) -> int:
  # deferred: jax, the model and the web stack take seconds to import
  import uvicorn  # pylint: disable=g-import-not-at-top

  from lca_jax import api, xla_cache  # pylint: disable=g-import-not-at-top
  from lca_jax.decode.batch import GroupKey  # pylint: disable=g-import-not-at-top
  from lca_jax.decode.request import MAX_N  # pylint: disable=g-import-not-at-top
  from lca_jax.serve.app import create_app  # pylint: disable=g-import-not-at-top
  from lca_jax.serve.scheduler import Scheduler  # pylint: disable=g-import-not-at-top
  from lca_jax.serve.schema import ModelInfo  # pylint: disable=g-import-not-at-top

  xla_cache.enable()
  model = api.load(args.checkpoint, dtype=args.dtype)
  cfg = model.cfg
  context = args.context or min(cfg.max_seq_len, DEFAULT_CONTEXT)
  if context > cfg.max_seq_len:
    fail(f"--context {context} is longer than the model's max_seq_len ({cfg.max_seq_len})")
  name = args.model_name or os.path.basename(os.path.normpath(os.path.abspath(args.checkpoint)))
  info = ModelInfo(
    name=name,
    context=context,
    has_mbp=cfg.has_mbp,
    max_n=cfg.n_mlp_mbp + 1 if cfg.n_mlp_mbp else MAX_N,
    max_choices=args.max_batch,
    n_tokens=cfg.n_tokens,
  )
  max_queue = 4 * args.max_batch if args.max_queue is None else args.max_queue
  sched = Scheduler(model, args.max_batch, context, args.chunk_steps, max_queue, args.max_groups)
  if not args.no_warmup:
    print("lca-serve: compiling ntp, greedy and sampled (warm-up)", file=sys.stderr, flush=True)
    sched.warm(GroupKey("ntp", 1))
  sched.start()
  app = create_app(sched, info, args.request_timeout, args.api_key)
  config = uvicorn.Config(
    app, host=args.host, port=args.port, log_level=args.log_level, access_log=False
  )
  server = uvicorn.Server(config)
  print(
    f"lca-serve: serving {name} ({cfg.kind}, context {context} bytes, {args.max_batch} slots) "
    f"on http://{args.host}:{args.port}",
    file=sys.stderr,
    flush=True,
  )
  try:
    server.run(sockets=[sock])
  finally:
    sched.stop()
  return 0 if sched.error is None else 1


if __name__ == "__main__":
  sys.exit(main())
