"""Load test of lca-serve on the loopback interface: throughput and latency at several numbers of
concurrent clients (one JSON object on stdout).

    python tools/bench_serve.py --checkpoint workdirs/demo [--clients 1,8,32] [--requests 4]
        [--max-tokens 64] [--prompt-bytes 32] [--mode ntp] [--sampled-share 0.5]
        [--server-args "--chunk-steps 8"] [--server-root /tmp/other-checkout]
    python tools/bench_serve.py --url http://127.0.0.1:8000 --clients 1,8

With ``--checkpoint`` it starts ``lca-serve`` itself on a free loopback port (``--max-batch``
the largest client count, ``--context`` as given) and stops it at the end; with ``--url`` it
loads a server already running on this machine (loopback addresses only); ``--server-root``
starts the server of another checkout of lca-jax (run there, with it on ``PYTHONPATH``; e.g. a
``git worktree`` of an older commit, to compare before and after with the same load). Each client is a thread that
sends ``--requests`` streaming completions one after another: ``--sampled-share`` of a round's
requests (spread evenly: 0.5 is every other one) sample at ``--temperature`` (seeded), the
others are greedy; ``ignore_eos`` so that each generates exactly ``--max-tokens`` bytes, a
prompt of ``--prompt-bytes`` bytes that differs per client; "bytes" count the tokens ``usage``
reports, every byte and the odd special id. A greedy request, and a sampled one, first warm
the server up (not timed). Per client count: requests/s and bytes/s (all clients together, over
the wall time of the round), p50 / p99 time to first byte (request sent to the first text
event) and per-byte latency ((last event - first event) / (bytes - 1) of each request), plus
the errors, and ``client_cpu_s``: the CPU time of this tool's own clients in the round (they
share the machine with the server); at the end ``bytes_per_s_ratio``: bytes/s at the largest
client count over bytes/s at the smallest. Bounded: at most ``MAX_CLIENTS`` clients and
``MAX_REQUESTS`` requests per round. Bad input: an argparse error (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # lca_jax from this checkout, installed or not
  sys.path.insert(0, ROOT)

from lca_jax.bench import args as bargs  # noqa: E402
from lca_jax.bench import report  # noqa: E402
from lca_jax.bench.serve import is_loopback_url, prompt_text, run  # noqa: E402
from lca_jax.serve.process import ServerProcess  # noqa: E402

MAX_CLIENTS = 256
MAX_REQUESTS = 4096


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--checkpoint", help="start lca-serve on this checkpoint (loopback)")
  src.add_argument("--url", help="a running lca-serve on this machine, e.g. http://127.0.0.1:8000")
  ap.add_argument("--clients", default="1,8,32", help="concurrent clients per round")
  ap.add_argument("--requests", type=int, default=4, help="requests per client per round")
  ap.add_argument("--max-tokens", type=int, default=64, help="bytes generated per request")
  ap.add_argument("--prompt-bytes", type=int, default=32)
  ap.add_argument("--mode", default="ntp", choices=["ntp", "threshold", "verify"])
  ap.add_argument("--mbp-n", type=int, default=3)
  ap.add_argument("--tau", type=float, default=0.9)
  ap.add_argument("--temperature", type=float, default=1.0, help="of the sampled requests")
  ap.add_argument(
    "--sampled-share", type=float, default=0.5, help="share of the requests that sample"
  )
  ap.add_argument("--server-root", help="start the lca-serve of this lca-jax checkout")
  ap.add_argument("--context", type=int, default=512, help="--context of a started server")
  ap.add_argument("--server-args", default="", help="more lca-serve options (with --checkpoint)")
  ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
  args = ap.parse_args(argv)
  try:
    args.client_counts = bargs.int_list(args.clients)
  except ValueError:
    ap.error(f"--clients must be comma-separated integers, got {args.clients!r}")
  if not args.client_counts or not all(1 <= c <= MAX_CLIENTS for c in args.client_counts):
    ap.error(f"--clients must be integers in [1, {MAX_CLIENTS}], got {args.clients!r}")
  if args.requests < 1 or max(args.client_counts) * args.requests > MAX_REQUESTS:
    ap.error(f"--requests must be >= 1 with at most {MAX_REQUESTS} requests per round")
  if args.max_tokens < 2:
    ap.error("--max-tokens must be >= 2 (per-byte latency needs two bytes)")
  if args.prompt_bytes < 1:
    ap.error("--prompt-bytes must be >= 1")
  if args.prompt_bytes + args.max_tokens > args.context and args.checkpoint:
    ap.error("--prompt-bytes + --max-tokens must fit --context")
  if not 0.0 <= args.sampled_share <= 1.0:
    ap.error(f"--sampled-share must be in [0, 1], got {args.sampled_share}")
  if not 0.0 < args.temperature <= 2.0:
    ap.error(f"--temperature must be in (0, 2], got {args.temperature}")
  if args.server_root and not os.path.isdir(os.path.join(args.server_root, "lca_jax")):
    ap.error(f"--server-root must be an lca-jax checkout, got {args.server_root}")
  if args.server_root and args.url:
    ap.error("--server-root starts a server: give --checkpoint, not --url")
  if args.url and not is_loopback_url(args.url):
    ap.error(f"--url must be a loopback address (127.0.0.0/8, ::1, localhost), got {args.url}")
  try:
    args.server_argv = shlex.split(args.server_args)
  except ValueError as e:
    ap.error(f"--server-args: {e}")
  return args


def main(argv=None):
  args = parse_args(argv)
  server = None
  if args.checkpoint:
    server_argv = ["--max-batch", str(max(args.client_counts)), "--context", str(args.context)]
    env = cwd = None
    if args.server_root:
      cwd = os.path.abspath(args.server_root)
      env = {**os.environ, "PYTHONPATH": cwd}
    checkpoint = os.path.abspath(args.checkpoint)
    server = ServerProcess(checkpoint, server_argv + args.server_argv, env, cwd).start()
    url = server.url
  else:
    url = args.url.rstrip("/")
  body = {
    "prompt": [prompt_text(args.prompt_bytes, i) for i in range(max(args.client_counts))],
    "max_tokens": args.max_tokens,
    "mode": args.mode,
    "mbp_n": args.mbp_n,
    "tau": args.tau,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
  }
  try:
    model, rounds = run(
      url,
      args.client_counts,
      args.requests,
      body,
      args.timeout,
      args.sampled_share,
      args.temperature,
    )
  finally:
    if server is not None:
      server.stop()
  lo, hi = rounds[0], rounds[-1]
  out = {
    "url": None if server else url,
    "checkpoint": args.checkpoint,
    "model": model,
    "mode": args.mode,
    "sampled_share": args.sampled_share,
    "temperature": args.temperature,
    "server_root": args.server_root,
    "max_tokens": args.max_tokens,
    "prompt_bytes": args.prompt_bytes,
    "requests_per_client": args.requests,
    "server_args": server.cmd[3:] if server else None,
    "rounds": rounds,
    "bytes_per_s_ratio": hi["bytes_per_s"] / lo["bytes_per_s"] if lo["bytes_per_s"] else None,
    "ratio_of": [lo["clients"], hi["clients"]],
    "cpu_count": os.cpu_count(),
  }
  return report.print_json(out)


if __name__ == "__main__":
  main()
