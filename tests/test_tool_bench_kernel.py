"""Smoke test of tools/bench_kernel.py (Pallas LCA attention vs dense-masked and blockwise XLA
vs causal SDPA, one JSON object).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_tool_bench_kernel.py

``--small``: tiny shapes and Pallas interpret mode, so it runs on CPU (the times mean nothing);
one block configuration, since each is two interpret-mode compiles.
"""

import importlib.util
import json
import os

import pytest
from conftest import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "bench_kernel.py")
TIMES = {
  "fwd_ms",
  "fwd_bwd_ms",
  "fwd_tflops_unmasked",
  "fwd_bwd_tflops_unmasked",
  "fwd_tflops_dense_equiv",
  "fwd_bwd_tflops_dense_equiv",
}


def _tool():
  return load_tool("bench_kernel")


def test_bench_kernel_small(capsys):
  out = _tool().main(["--small", "--pallas-blocks", "32x32", "--dtype", "float32"])
  assert json.loads(capsys.readouterr().out) == out
  assert {"device", "backend", "jax", "interpret", "shape", "lca", "results"} <= set(out)
  assert out["interpret"] and out["shape"] == {
    "B": 2,
    "T": 96,
    "H": 4,
    "KV": 2,
    "D": 32,
    "dtype": "float32",
  }
  assert 0 < out["lca"]["density_vs_dense"] < 1
  # the tool records a failing implementation as {"error": ...} and goes on: none may fail here
  assert set(out["results"]) == {"pallas_32x32", "xla_dense", "xla_blockwise", "sdpa_causal"}
  for name, r in out["results"].items():
    extra = {"implementation"} if name == "sdpa_causal" else set()
    assert set(r) == TIMES | extra, (name, r)
    assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0, name
  assert out["results"]["sdpa_causal"]["implementation"] == "xla"  # cuDNN on a GPU only
  assert out["best_pallas"] == "pallas_32x32"
  for other in ("xla_dense", "xla_blockwise", "sdpa_causal"):
    assert set(out[f"speedup_pallas_vs_{other}"]) == {"fwd", "fwd_bwd"}, other
  # float32: the kernel and the model's blockwise path agree with the dense-masked reference
  # (outputs are convex combinations of standard normal values, of scale ~1)
  assert out["max_abs_diff_pallas_vs_xla"] < 1e-4
  assert out["max_abs_diff_blockwise_vs_xla"] < 1e-4


@pytest.mark.parametrize(
  "args, message",
  [
    (["--impls", "cudnn"], "--impls: unknown cudnn"),
    (["--pallas-blocks", "32"], "--pallas-blocks: '32' is not BLOCK_QxBLOCK_K"),
    (["--aot", "x100"], "unknown target 'x100'"),
  ],
)
def test_bad_input_is_one_line(args, message, capsys):
  with pytest.raises(SystemExit) as e:
    _tool().main(["--small", *args])
  err = capsys.readouterr().err
  assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(
  not __import__("lca_jax.aot.targets", fromlist=["x"]).plugin_available(),
  reason="jax's CUDA plugin is not installed (make gpu-aot)",
)
def test_bench_kernel_aot_estimates_the_programs_for_a_gpu_without_one():
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  cudnn = importlib.util.find_spec("nvidia.cudnn") is not None  # requirements-gpu-aot.txt
  impls = "pallas,xla_dense" + (",sdpa_causal" if cudnn else "")
  args = ["--small", "--aot", "h100", "--impls", impls, "--pallas-blocks", "32x32"]
  r = subprocess.run(
    [sys.executable, TOOL] + args,
    capture_output=True,
    text=True,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    timeout=600,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  out = json.loads(r.stdout)
  assert out["target"] == "h100:1"
  pallas, dense = out["results"]["pallas_32x32"], out["results"]["xla_dense"]
  assert pallas["fwd_bwd_est_ms"] >= pallas["fwd_bwd_floor_ms"] > 0 and pallas["fwd_flops"] > 0
  assert dense["fwd_flops"] > pallas["fwd_flops"]  # the dense mask computes every pair
  if cudnn:  # cuDNN's causal attention lowers without a GPU and is priced at half the square
    sdpa = out["results"]["sdpa_causal"]
    assert "error" not in sdpa, sdpa
    assert dense["fwd_flops"] > sdpa["fwd_flops"] > 0 and sdpa["fwd_est_ms"] > 0
