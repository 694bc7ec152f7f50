"""Load on a running lca-serve: streaming clients in threads, each sending requests one after
another, greedy and sampled mixed in a given share, and the round's throughput and latency
percentiles."""

from __future__ import annotations

import ipaddress
import json
import math
import threading
import time
import urllib.parse

import httpx
import numpy as np

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


def is_sampled(k: int, share: float) -> bool:
  """Whether the ``k``-th request of a round samples: ``share`` of them, spread evenly (with
  0.5 every other one)."""
  return math.floor((k + 1) * share) > math.floor(k * share)


def request_body(body: dict, client: int, k: int, share: float, temperature: float) -> dict:
  """The ``k``-th request of a round, from ``client``: its prompt (the client's item of
  ``body["prompt"]``), greedy or sampled at ``temperature`` (seeded by ``k``)."""
  sampled = is_sampled(k, share)
  t = temperature if sampled else 0.0
  return {**body, "prompt": body["prompt"][client], "temperature": t, "seed": k}


def run_round(
  url: str,
  clients: int,
  requests: int,
  body: dict,
  timeout: float,
  sampled_share: float = 0.0,
  temperature: float = 1.0,
) -> dict:
  """``clients`` threads, each sending ``requests`` completions of ``body``, ``sampled_share``
  of them sampled (``request_body``); the round's figures."""
  results = [[] for _ in range(clients)]

  def client(i):
    with httpx.Client(timeout=timeout) as http:
      for r in range(requests):
        req = request_body(body, i, i * requests + r, sampled_share, temperature)
        results[i].append(one_request(http, url, req))

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
    "sampled": sum(is_sampled(k, sampled_share) for k in range(clients * requests)),
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


def run(
  url: str,
  client_counts,
  requests: int,
  body: dict,
  timeout: float,
  sampled_share: float = 0.0,
  temperature: float = 1.0,
):
  """Untimed requests first (a greedy one, and a sampled one when some sample: they compile
  what the server did not warm up), then a round per client count: (the model's id, the
  rounds). SystemExit when a warm-up request fails."""
  with httpx.Client(timeout=timeout) as http:
    for share in (0.0, 1.0) if sampled_share > 0 else (0.0,):  # all greedy, all sampled
      warm = one_request(http, url, request_body(body, 0, 0, share, temperature))
      if "error" in warm:
        raise SystemExit(f"bench_serve: the warm-up request failed: {warm['error']}")
    model = http.get(url + "/v1/models").json()["data"][0]["id"]
  rounds = [
    run_round(url, c, requests, body, timeout, sampled_share, temperature) for c in client_counts
  ]
  return model, rounds
