"""Load on a running lca-serve: streaming clients in threads, each sending requests one after
another, and the round's throughput and latency percentiles."""

from __future__ import annotations

import ipaddress
import json
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


def run_round(url: str, clients: int, requests: int, body: dict, timeout: float) -> dict:
  """``clients`` threads, each sending ``requests`` completions of ``body`` (its prompt: the
  client's item of ``body["prompt"]``); the round's figures."""
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


def run(url: str, client_counts, requests: int, body: dict, timeout: float):
  """One untimed request (it compiles the mode's programs), then a round per client count:
  (the model's id, the rounds). SystemExit when the warm-up request fails."""
  with httpx.Client(timeout=timeout) as http:
    warm = one_request(http, url, {**body, "prompt": body["prompt"][0]})
    if "error" in warm:
      raise SystemExit(f"bench_serve: the warm-up request failed: {warm['error']}")
    model = http.get(url + "/v1/models").json()["data"][0]["id"]
  return model, [run_round(url, c, requests, body, timeout) for c in client_counts]
