"""The closing summary of tools/gpu_check.sh: measured figures with the estimate beside each.

    .venv/bin/python -m pytest -q tests/test_gpu_check_summary.py

The parts' JSON files are written here in the shapes the tools print (bench_kernel,
bench_train, bench_decode, gpu_aot, bench_kernel --aot), with round numbers whose estimate
lines can be worked out by hand.
"""

import json

import pytest

from lca_jax.bench import gpu_check_summary as summary


def _write(d, name, obj):
  (d / f"{name}.out").write_text(json.dumps(obj))


def _decode_program(mode, batch, n=None):
  step = lambda s, floor: {"step_s": s, "floor_s": floor}
  return {
    "program": f"decode_{mode}_b{batch}",
    "mode": mode,
    "batch": batch,
    "n": n,
    "estimate": {
      "lm_fraction": 0.333,
      "idle_step": step(1e-4, 1e-5),
      "lm_step": step(3e-4, 2e-5),
      "step_s": 0.0,
    },
  }


@pytest.fixture
def out(tmp_path):
  _write(
    tmp_path,
    "bench_kernel",
    {
      "best_pallas": "pallas_32x32",
      "results": {
        "pallas_32x32": {"fwd_ms": 0.23, "fwd_bwd_ms": 0.97},
        "xla_dense": {"fwd_ms": 7.8, "fwd_bwd_ms": 20.7},
      },
    },
  )
  _write(
    tmp_path,
    "bench_train_pallas",
    {
      "attention_impl": "pallas",
      "micro_batch": 16,
      "step_time_s": 4.0,
      "bytes_per_s": 16384.0,
      "mfu": 0.35,
      "cost": {"compile_s": 60},
    },
  )
  _write(
    tmp_path,
    "bench_train_unrolled",
    {
      "attention_impl": "xla",
      "micro_batch": 16,
      "step_time_s": 9.0,
      "bytes_per_s": 7000.0,
      "mfu": None,
      "cost": {"compile_s": 90},
    },
  )
  row = {"bytes_per_s": 3000, "ms_per_step": 0.5, "bytes_per_step": 1.0, "lm_fraction": 0.5}
  _write(tmp_path, "bench_decode_b1", {"n": 3, "results": {"ntp_b1": row, "verify_b1": row}})
  _write(tmp_path, "bench_decode_xla", {"n": 3, "results": {"ntp_b1": row}})
  _write(tmp_path, "bench_decode_b32", {"n": 3, "results": {"ntp_b32": row}})
  _write(tmp_path, "bench_decode_n6", "not json at all")
  train = {
    "program": "train_step",
    "attention_impl": "pallas",
    "micro_batch": 16,
    "estimate": {"step_s": 3.2, "mfu": 0.4},
  }
  programs = [train, _decode_program("ntp", 1), _decode_program("verify", 1, n=3)]
  _write(tmp_path, "estimate_programs", {"programs": programs})
  _write(
    tmp_path,
    "estimate_kernels",
    {"results": {"pallas_32x32": {"fwd_est_ms": 0.082, "fwd_bwd_est_ms": 0.827}}},
  )
  return tmp_path


def test_estimate_beside_each_measured_figure(out):
  lines = {ln.split(":")[0] + ":" + ln.split(":")[1]: ln for ln in summary.summary_lines(str(out))}
  kernel = lines["bench_kernel: fwd/fwd+bwd ms"]
  assert "pallas_32x32 0.23/0.97 (est 0.082/0.827)" in kernel
  assert "xla_dense 7.8/20.7" in kernel and "xla_dense 7.8/20.7 (est" not in kernel
  train = next(v for k, v in lines.items() if k.startswith("bench_train_pallas"))
  assert "estimate step 3.200 s, MFU 0.400, measured/estimate 1.25" in train
  unrolled = next(v for k, v in lines.items() if k.startswith("bench_train_unrolled"))
  assert "no estimate (unrolled stacks" in unrolled
  # ntp at the measured LM share 0.5: (1e-4 + 3e-4) / 2 = 0.2 ms, floor 0.015 ms, 1 byte a step
  ntp = lines["bench_decode_b1: ntp_b1"]
  assert "estimate 0.2 ms/step (floor 0.015), 5000 bytes/s, measured/estimate 2.50" in ntp
  assert "estimate 0.2 ms/step" in lines["bench_decode_b1: verify_b1"]
  assert "no estimate (fused decode kernels off" in lines["bench_decode_xla: ntp_b1"]
  assert lines["bench_decode_b32: ntp_b32"].endswith("; no estimate of this program")
  assert not any(k.startswith("bench_decode_n6") for k in lines)  # its JSON did not parse


def test_without_estimates(out):
  (out / "estimate_programs.out").unlink()
  (out / "estimate_kernels.out").unlink()
  lines = summary.summary_lines(str(out))
  assert lines[-1].startswith("estimates: none")
  assert not any("estimate" in ln for ln in lines[:-1] if "no estimate (" not in ln)


def test_main_usage(tmp_path, capsys):
  assert summary.main([str(tmp_path / "missing")]) == 2
  assert "usage:" in capsys.readouterr().err
  assert summary.main([str(tmp_path)]) == 0
