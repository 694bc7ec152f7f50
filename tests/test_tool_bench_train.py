"""Smoke test of tools/bench_train.py (training throughput of a config, one JSON object).

XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_tool_bench_train.py
"""

import os

import pytest
from conftest import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "bench_train.py")

# 8 rows: one per virtual host device; 32 bytes each, one micro-batch per step.
TINY = [
  "--config.model.d_model=32",
  "--config.model.d_inner=64",
  "--config.model.n_heads=2",
  "--config.model.n_kv_heads=2",
  "--config.model.n_lm=1",
  "--config.model.n_mbp=1",
  "--config.data.seq_len=32",
  "--config.train.micro_batch_size=8",
  "--config.train.global_batch_bytes=256",
  "--config.train.progress_bar=False",
]
KEYS = {
  "config",
  "backend",
  "device_kind",
  "devices",
  "mesh",
  "params",
  "dtype",
  "seq_len",
  "rows",
  "accum",
  "bytes_per_step",
  "warmup_steps",
  "timed_steps",
  "init_s",
  "warmup_s",
  "step_time_s",
  "bytes_per_s",
  "tflops_per_device",
  "mfu",
  "final_loss",
}


def _tool():
  return load_tool("bench_train")


def test_bench_train_tiny(capsys):
  out = _tool().main(
    ["--config", os.path.join(ROOT, "configs", "tiny_lca_mbp.py"), "--steps", "1", "--warmup", "1"]
    + TINY
  )
  assert KEYS <= set(out)
  assert out["seq_len"] == 32 and out["rows"] == 8 and out["bytes_per_step"] == 256
  assert out["timed_steps"] == 1 and out["warmup_steps"] == 1
  assert out["step_time_s"] > 0 and out["bytes_per_s"] > 0 and out["params"] > 0
  assert '"bytes_per_s"' in capsys.readouterr().out


def test_bench_train_profile(capsys):
  """--profile: the traced steps' ops found in the profiler's events, by kind, model part and
  stage; every stage and the main parts are there."""
  out = _tool().main(
    ["--config", os.path.join(ROOT, "configs", "tiny_lca_mbp.py"), "--steps", "2", "--warmup", "1"]
    + ["--profile", "2"]
    + TINY
  )
  prof = out["step_profile"]
  assert prof["steps"] == 2 and prof["wall_s_per_step"] > 0
  total = prof["thread_s_per_step"]
  assert total > 0
  for key in ("by_kind", "by_part", "by_stage"):  # each splits the same total
    assert abs(sum(prof[key].values()) - total) <= 1e-3 * total + 4e-4, (key, prof[key])
  for part in ("mlp", "attention_proj", "attention_loops", "norm"):
    assert prof["by_part"].get(part, 0) > 0, prof["by_part"]
  for stage in ("encoder", "latent_lm", "decoder", "mbp_head"):
    assert prof["by_stage"].get(stage, 0) > 0, prof["by_stage"]
  assert prof["loop_s_per_step"] > 0  # the blockwise attention's tile loops
  capsys.readouterr()


def test_bench_train_profile_bad_count(capsys):
  with pytest.raises(SystemExit) as e:
    _tool().main(["--steps", "2", "--profile", "3"])
  assert e.value.code == 2
  assert "--profile must be in [0, --steps]" in capsys.readouterr().err
