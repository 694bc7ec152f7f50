"""Smoke test of tools/bench_hf.py (transformers generate on a to-hf export, with and without
its caches, next to lca_jax generate; JSON).

XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_tool_bench_hf.py
"""

import json

import pytest
from conftest import load_tool

pytest.importorskip("torch")
pytest.importorskip("transformers")

TINY = ["--d-model", "32", "--d-inner", "64", "--n-heads", "2", "--layers", "1,1,1,1"]
TINY += ["--prompt-bytes", "8", "--torch-threads", "1"]


def _tool():
  return load_tool("bench_hf")


def test_bench_hf_tiny(capsys):
  assert _tool().main(TINY + ["--new-bytes", "4,8", "--uncached-max", "4"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert [r["new_bytes"] for r in out["rows"]] == [4, 8]
  for row in out["rows"]:
    for way in ("hf_cached", "lca_jax"):
      assert row[way]["s"] > 0
      assert row[way]["bytes_per_s"] == pytest.approx(row["new_bytes"] / row[way]["s"], rel=1e-2)
  assert out["rows"][0]["hf_uncached"]["s"] > 0
  assert out["rows"][1]["hf_uncached"] == {"s": None, "bytes_per_s": None}  # past --uncached-max
  assert set(out["hf_cached_time_ratio"]) == {"8/4"}
  assert out["machine"]["torch_threads"] == 1 and out["model"]["layers"]["mbp"] == 1


@pytest.mark.parametrize(
  "argv, msg",
  [
    (["--new-bytes", "4,x"], "--new-bytes must be integers"),
    (["--new-bytes", "0"], "--new-bytes must be integers >= 1"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--new-bytes", "5000"], "exceed the model context"),
    (["--dtype", "float16"], "invalid choice"),
  ],
)
def test_bench_hf_bad_input(capsys, argv, msg):
  assert _tool().main(TINY + argv) == 2
  err = capsys.readouterr().err
  assert msg in err and err.count("error:") == 1
