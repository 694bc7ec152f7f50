"""Smoke test of tools/bench_decode.py (decode throughput of a checkpoint, one JSON object).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_tool_bench_decode.py

Runs on random params of a tiny LCA-MBP model (the session's ``tiny_upstream_checkpoint``);
two of the four modes, since every mode is one engine compile (seconds each on CPU).
"""

import json
import os

import pytest
from conftest import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "bench_decode.py")
TINY = [
  "--prompt-bytes",
  "16",
  "--new-bytes",
  "16",
  "--batch",
  "1",
  "--naive-bytes",
  "4",
  "--repeats",
  "1",
  "--n",
  "2",
  "--modes",
  "ntp,threshold",
]
RESULT_KEYS = {
  "bytes_per_s",
  "steps",
  "bytes_per_step",
  "acceptance_rate",
  "latent_steps_per_byte",
  "compile_s",
}

pytestmark = pytest.mark.usefixtures("fast_compile")


def _tool():
  return load_tool("bench_decode")


def test_bench_decode_tiny(tiny_upstream_checkpoint, capsys):
  out = _tool().main(["--checkpoint", tiny_upstream_checkpoint] + TINY)
  assert json.loads(capsys.readouterr().out) == out
  assert {
    "checkpoint",
    "device",
    "prompt_bytes",
    "new_bytes",
    "tau",
    "n",
    "results",
    "ratios",
  } <= set(out)
  res = out["results"]
  assert set(res) == {"ntp_b1", "threshold_b1", "naive_full_forward_b1"}
  for key in ("ntp_b1", "threshold_b1"):
    assert RESULT_KEYS <= set(res[key]), key
    assert res[key]["bytes_per_s"] > 0 and res[key]["steps"] > 0, key
  assert res["ntp_b1"]["acceptance_rate"] is None and res["ntp_b1"]["bytes_per_step"] == 1.0
  assert 0 <= res["threshold_b1"]["acceptance_rate"] <= 1
  assert res["naive_full_forward_b1"]["bytes_per_s"] > 0
  assert set(out["ratios"]) == {"ntp_b1_vs_naive", "threshold_b1_vs_ntp_b1"}


@pytest.mark.parametrize("modes", ["", "ntp,greedy"])
def test_bad_modes(modes, capsys):
  with pytest.raises(SystemExit) as e:
    _tool().main(["--checkpoint", "/nonexistent", "--modes", modes])
  assert e.value.code == 2
  assert "--modes" in capsys.readouterr().err
