"""Smoke test of tools/bench_serve.py (lca-serve under concurrent clients, one JSON object).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_bench_serve.py

One run on the session's tiny random LCA-MBP checkpoint (the tool starts and stops the server
itself; a 64-byte context keeps its warm-up compiles few), two client counts; the options are
checked by parsing alone.
"""

import pytest
from conftest import load_tool

from lca_jax.bench.serve import is_sampled

pytest.importorskip("httpx")  # the serve extra (requirements.txt has it)
pytest.importorskip("fastapi")

ROUND_KEYS = {
  "clients",
  "requests",
  "sampled",
  "errors",
  "error_examples",
  "wall_s",
  "requests_per_s",
  "bytes",
  "bytes_per_s",
  "ttfb_ms_p50",
  "ttfb_ms_p99",
  "per_byte_ms_p50",
  "per_byte_ms_p99",
  "client_cpu_s",
}


def _tool():
  return load_tool("bench_serve")


def test_bench_serve_tiny(tiny_upstream_checkpoint, capsys):
  argv = ["--checkpoint", tiny_upstream_checkpoint, "--clients", "1,3", "--requests", "2"]
  argv += ["--max-tokens", "12", "--prompt-bytes", "8", "--context", "64"]
  out = _tool().main(argv)
  assert '"bytes_per_s_ratio"' in capsys.readouterr().out
  assert [r["clients"] for r in out["rounds"]] == [1, 3]
  for r in out["rounds"]:
    assert set(r) == ROUND_KEYS
    assert r["errors"] == 0 and r["requests"] == 2 * r["clients"]
    assert r["sampled"] == r["requests"] // 2  # --sampled-share 0.5: every other request
    assert r["bytes"] == 12 * r["requests"]  # ignore_eos: every request generates max_tokens
    assert r["bytes_per_s"] > 0 and r["ttfb_ms_p50"] > 0 and r["per_byte_ms_p50"] >= 0
  assert out["bytes_per_s_ratio"] > 0 and out["ratio_of"] == [1, 3]
  assert out["sampled_share"] == 0.5 and out["temperature"] == 1.0


def test_sampled_share_spreads_evenly():
  assert [is_sampled(k, 0.5) for k in range(6)] == [False, True] * 3
  assert sum(is_sampled(k, 0.25) for k in range(40)) == 10
  assert not any(is_sampled(k, 0.0) for k in range(8))
  assert all(is_sampled(k, 1.0) for k in range(8))


def test_prompts_differ_per_client():
  tool = _tool()
  prompts = [tool.prompt_text(32, i) for i in range(8)]
  assert len(set(prompts)) == 8 and all(len(p) == 32 for p in prompts)


@pytest.mark.parametrize(
  "argv,needle",
  [
    (["--url", "http://10.0.0.1:8000"], "loopback"),
    (["--url", "http://example.com"], "loopback"),
    (["--checkpoint", "x", "--clients", "0"], "--clients"),
    (["--checkpoint", "x", "--clients", "a,b"], "--clients"),
    (["--checkpoint", "x", "--clients", "256", "--requests", "100"], "--requests"),
    (["--checkpoint", "x", "--max-tokens", "1"], "--max-tokens"),
    (["--checkpoint", "x", "--context", "16", "--max-tokens", "64"], "--context"),
    (["--checkpoint", "x", "--sampled-share", "1.5"], "--sampled-share"),
    (["--checkpoint", "x", "--temperature", "0"], "--temperature"),
    (["--checkpoint", "x", "--server-root", "/nonexistent"], "--server-root"),
    ([], "--checkpoint"),
  ],
)
def test_bad_options(argv, needle, capsys):
  with pytest.raises(SystemExit) as e:
    _tool().parse_args(argv)
  assert e.value.code == 2 and needle in capsys.readouterr().err


def test_loopback_urls():
  tool = _tool()
  for url in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:80", "http://127.5.0.1"):
    assert tool.is_loopback_url(url), url
