"""Load test of lca-serve on the loopback interface: throughput and latency at several numbers of
concurrent clients (one JSON object on stdout).

    python tools/bench_serve.py --checkpoint workdirs/demo [--clients 1,8,32] [--requests 4]
        [--max-tokens 64] [--prompt-bytes 32] [--mode ntp] [--server-args "--chunk-steps 8"]
    python tools/bench_serve.py --url http://127.0.0.1:8000 --clients 1,8

With ``--checkpoint`` it starts ``lca-serve`` itself on a free loopback port (``--max-batch``
the largest client count, ``--context`` as given) and stops it at the end; with ``--url`` it
loads a server already running on this machine (loopback addresses only). Each client is a
thread that sends ``--requests`` streaming completions one after another (greedy unless
``--temperature``, ``ignore_eos`` so that each generates exactly ``--max-tokens`` bytes, a
prompt of ``--prompt-bytes`` bytes that differs per client; "bytes" count the tokens
``usage`` reports, every byte and the odd special id); one request first warms the
server up (not timed). Per client count: requests/s and bytes/s (all clients together, over
the wall time of the round), p50 / p99 time to first byte (request sent to the first text
event) and per-byte latency ((last event - first event) / (bytes - 1) of each request), plus
the errors, and ``client_cpu_s``: the CPU time of this tool's own clients in the round (they
share the machine with the server); at the end ``bytes_per_s_ratio``: bytes/s at the largest
client count over bytes/s at the smallest. Bounded: at most ``MAX_CLIENTS`` clients and
``MAX_REQUESTS`` requests per round. Bad input: an argparse error (exit status 2).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shlex
import sys
import threading
import time
import urllib.parse

import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from lca_jax.serve.process import ServerProcess  # noqa: E402

MAX_CLIENTS = 256
MAX_REQUESTS = 4096
WORDS = "the quick brown fox jumps over lazy dogs while hackers read the jargon file".split()


def prompt_text(n_bytes: int, client: int) -> str:
  """``n_bytes`` bytes of ASCII words, different for each client."""
  words = [WORDS[(client * 7 + i * 3) % len(WORDS)] for i in range(n_bytes)]
  return (f"{client} " + " ".join(words))[:n_bytes]


def is_loopback_url(url: str) -> bool:
  host = urllib.parse.urlsplit(url).hostname or ""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def one_request(http: httpx.Client, url: str, body: dict) -> dict:
  """One streaming completion: times of the first and last text events, bytes generated."""
  t0 = time.perf_counter()
  first = last = None
  n_bytes, error = 0, None
  with http.stream("POST", url + "/v1/completions", json=body) as r:
    if r.status_code != 200:
      r.read()
      return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
    for line in r.iter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      ev = json.loads(line[6:])
      if "error" in ev:
        error = ev["error"]["message"]
        continue
      if ev.get("usage"):
        n_bytes = ev["usage"]["completion_tokens"]
      if any(c.get("text") for c in ev.get("choices", [])):
        now = time.perf_counter()
        first = now if first is None else first
        last = now
  if error or first is None:
    return {"error": error or "no text"}
  return {"ttfb_s": first - t0, "span_s": last - first, "bytes": n_bytes, "total_s": last - t0}


def run_round(url: str, clients: int, requests: int, body: dict, timeout: float) -> dict:
  results = [[] for _ in range(clients)]

  def client(i):
    with httpx.Client(timeout=timeout) as http:
      for _ in range(requests):
        results[i].append(one_request(http, url, {**body, "prompt": body["prompt"][i]}))

  threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
  cpu0 = time.process_time()
  t0 = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  wall = time.perf_counter() - t0
  cpu = time.process_time() - cpu0
  flat = [r for rs in results for r in rs]
  ok = [r for r in flat if "error" not in r]
  ttfb = np.array([r["ttfb_s"] for r in ok])
  per_byte = np.array([r["span_s"] / (r["bytes"] - 1) for r in ok if r["bytes"] > 1])
  pct = lambda a, q: float(np.percentile(a, q)) * 1e3 if a.size else None
  total_bytes = sum(r["bytes"] for r in ok)
  return {
    "clients": clients,
    "requests": len(flat),
    "errors": len(flat) - len(ok),
    "error_examples": sorted({r["error"] for r in flat if "error" in r})[:3],
    "wall_s": wall,
    "requests_per_s": len(ok) / wall,
    "bytes": total_bytes,
    "bytes_per_s": total_bytes / wall,
    "ttfb_ms_p50": pct(ttfb, 50),
    "ttfb_ms_p99": pct(ttfb, 99),
    "per_byte_ms_p50": pct(per_byte, 50),
    "per_byte_ms_p99": pct(per_byte, 99),
    "client_cpu_s": cpu,
  }


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
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--context", type=int, default=512, help="--context of a started server")
  ap.add_argument("--server-args", default="", help="more lca-serve options (with --checkpoint)")
  ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
  args = ap.parse_args(argv)
  try:
    args.client_counts = [int(x) for x in args.clients.split(",") if x.strip()]
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
    server = ServerProcess(args.checkpoint, server_argv + args.server_argv).start()
    url = server.url
  else:
    url = args.url.rstrip("/")
  try:
    n = max(args.client_counts)
    body = {
      "prompt": [prompt_text(args.prompt_bytes, i) for i in range(n)],
      "max_tokens": args.max_tokens,
      "temperature": args.temperature,
      "mode": args.mode,
      "mbp_n": args.mbp_n,
      "tau": args.tau,
      "ignore_eos": True,
      "stream": True,
      "stream_options": {"include_usage": True},
    }
    with httpx.Client(timeout=args.timeout) as http:  # warm-up: compiles the mode's programs
      warm = one_request(http, url, {**body, "prompt": body["prompt"][0]})
      if "error" in warm:
        raise SystemExit(f"bench_serve: the warm-up request failed: {warm['error']}")
      model = http.get(url + "/v1/models").json()["data"][0]["id"]
    rounds = [run_round(url, c, args.requests, body, args.timeout) for c in args.client_counts]
  finally:
    if server is not None:
      server.stop()
  lo, hi = rounds[0], rounds[-1]
  out = {
    "url": None if server else url,
    "checkpoint": args.checkpoint,
    "model": model,
    "mode": args.mode,
    "max_tokens": args.max_tokens,
    "prompt_bytes": args.prompt_bytes,
    "requests_per_client": args.requests,
    "server_args": server.cmd[3:] if server else None,
    "rounds": rounds,
    "bytes_per_s_ratio": hi["bytes_per_s"] / lo["bytes_per_s"] if lo["bytes_per_s"] else None,
    "ratio_of": [lo["clients"], hi["clients"]],
    "cpu_count": os.cpu_count(),
  }
  print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main()
