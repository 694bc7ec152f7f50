"""Smoke test of tools/bench_model.py (forward + backward time per row of configs, JSON).

XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_tool_bench_model.py
"""

import json
import os

from conftest import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "bench_model.py")
# The flat variant: its compile is a third of a hierarchical one's, and the tool's code is the
# same for every variant.
CONFIG = os.path.join(ROOT, "configs", "tiny_llamabyte.py")
TINY = [
  "--seq-len",
  "32",
  "--batch",
  "2",
  "--repeats",
  "1",
  "--set",
  "d_model=32",
  "--set",
  "d_inner=64",
  "--set",
  "n_heads=2",
  "--set",
  "n_kv_heads=2",
]
RESULT_KEYS = {
  "params",
  "fwd_bwd_s_per_row",
  "fwd_bwd_s_median",
  "runs_s",
  "cpu_s_per_row",
  "bytes_per_s",
  "init_s",
  "compile_and_first_step_s",
  "loss",
}


def _tool():
  return load_tool("bench_model")


def test_bench_model_tiny(capsys):
  _tool().main([CONFIG] + TINY)
  captured = capsys.readouterr()
  out = json.loads(captured.out)
  assert {"backend", "device", "jax", "seq_len", "batch", "repeats", "overrides", "results"} <= set(
    out
  )
  assert out["seq_len"] == 32 and out["batch"] == 2 and out["repeats"] == 1
  assert out["overrides"] == TINY[7::2]
  assert list(out["results"]) == ["tiny_llamabyte"]
  r = out["results"]["tiny_llamabyte"]
  assert RESULT_KEYS <= set(r), r
  assert r["params"] > 0 and r["fwd_bwd_s_per_row"] > 0 and len(r["runs_s"]) == 1
  assert 0 < r["loss"] < 20, r["loss"]  # finite: about ln(256) on random bytes
  assert "tiny_llamabyte:" in captured.err and "s/row" in captured.err
