"""Smoke test of tools/bench_decode.py (decode throughput of a checkpoint, one JSON object).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_tool_bench_decode.py

Runs on random params of a tiny LCA-MBP model (the session's ``tiny_upstream_checkpoint``);
two of the four modes, since every mode is one engine compile (seconds each on CPU). A second
run builds a random model from the shape flags (ntp only, two batch sizes); the model-source
options are checked by parsing alone.
"""

import json
import os
from types import SimpleNamespace

import pytest
from conftest import load_tool

from lca_jax.decode import engine
from lca_jax.perf import hlo_stats

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
  "--stream-mb",
  "2",
  "--stream-repeats",
  "1",
]
RESULT_KEYS = {
  "bytes_per_s",
  "decode_bytes_per_s",
  "prefill_s",
  "step_time_from",
  "steps",
  "bytes_per_step",
  "acceptance_rate",
  "latent_steps_per_byte",
  "compile_s",
  "ms_per_step",
  "cache_len",
  "read_bytes_per_step",
  "read_param_bytes",
  "read_kv_bytes",
  "lm_fraction",
  "bound_ms_per_step",
  "ms_per_step_over_bound",
  "step_hlo",
}
HLO_KEYS = {"ops", "dots", "fusions", "cache_copies", "cache_copy_bytes", "min_cache_bytes"}
SHAPE = ["--d-model", "32", "--d-inner", "64", "--n-heads", "2", "--layers", "1,1,1,1"]


def _tool():
  return load_tool("bench_decode")


def _check_row(row, key):
  assert RESULT_KEYS <= set(row), key
  assert row["bytes_per_s"] > 0 and row["steps"] > 0, key
  assert row["decode_bytes_per_s"] > 0 and row["prefill_s"] > 0, key
  assert row["ms_per_step"] > 0 and row["bound_ms_per_step"] > 0, key
  assert row["read_bytes_per_step"] == pytest.approx(
    row["read_param_bytes"] + row["read_kv_bytes"], abs=2
  )
  assert row["ms_per_step_over_bound"] == pytest.approx(
    row["ms_per_step"] / row["bound_ms_per_step"], rel=0.02
  )
  assert 0 <= row["lm_fraction"] <= 1, key
  assert HLO_KEYS <= set(row["step_hlo"]), key
  hlo = row["step_hlo"]
  assert hlo["ops"] > 0 and hlo["min_cache_bytes"] > 0 and hlo["cache_copies"] >= 0, key


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
    "model",
    "stream_gb_s",
    "stream",
  } <= set(out)
  assert out["stream_gb_s"] > 0 and out["model"]["params"] > 0
  res = out["results"]
  assert set(res) == {"ntp_b1", "threshold_b1", "naive_full_forward_b1"}
  for key in ("ntp_b1", "threshold_b1"):
    _check_row(res[key], key)
  assert res["ntp_b1"]["acceptance_rate"] is None and res["ntp_b1"]["bytes_per_step"] == 1.0
  assert 0 <= res["threshold_b1"]["acceptance_rate"] <= 1
  assert res["naive_full_forward_b1"]["bytes_per_s"] > 0
  assert set(out["ratios"]) == {
    "ntp_b1_vs_naive",
    "threshold_b1_vs_ntp_b1",
    "threshold_b1_step_vs_ntp_b1_step",
  }
  step_ratio = res["threshold_b1"]["ms_per_step"] / res["ntp_b1"]["ms_per_step"]
  assert out["ratios"]["threshold_b1_step_vs_ntp_b1_step"] == pytest.approx(step_ratio, abs=0.01)


def test_modes_are_timed_in_alternating_rounds():
  """Every mode is warmed up first, then each round calls every mode once (and its prefill
  call): a ratio between modes compares calls of the same minutes. The decode figures are the
  fastest call minus the fastest prefill."""
  calls = []

  class Fake:
    def generate(self, prompts, mode, max_bytes, budget_pad_to=1):
      del prompts
      # the prefill call runs in the full call's executable: its room is the full budget
      assert budget_pad_to == (1 if max_bytes == 9 else 9), (max_bytes, budget_pad_to)
      calls.append((mode, max_bytes))
      per_step = {"ntp": 0.001, "threshold": 0.002}[mode] * (1 + 0.1 * (len(calls) % 3))
      return SimpleNamespace(
        bytes_per_s=max_bytes / (0.01 + per_step * max_bytes),
        elapsed_s=0.01 + per_step * max_bytes,
        steps=max_bytes,
        ids=[[0] * max_bytes],
        compile_s=0.0,
      )

  kws = {m: dict(mode=m, max_bytes=9) for m in ("ntp", "threshold")}
  out = _tool().timed_decodes(Fake(), [None], kws, repeats=3)
  warm = [("ntp", 9), ("ntp", 1), ("threshold", 9), ("threshold", 1)]
  assert calls == warm + warm * 3
  # calls 5..16 of the rounds: the fastest full call and the fastest prefill of each mode
  assert out["ntp"]["separable"] and out["threshold"]["separable"]
  for m, base in (("ntp", 0.001), ("threshold", 0.002)):
    full = [0.01 + base * (1 + 0.1 * (i % 3)) * 9 for i, c in enumerate(calls, 1) if c == (m, 9)]
    pre = [0.01 + base * (1 + 0.1 * (i % 3)) for i, c in enumerate(calls, 1) if c == (m, 1)]
    expect = (min(full[1:]) - min(pre[1:])) / 8 * 1e3
    assert out[m]["ms_per_step"] == pytest.approx(expect, rel=1e-9), m


def test_bench_decode_random_shape(capsys):
  argv = SHAPE + TINY + ["--modes", "ntp", "--batch", "1,2", "--naive-bytes", "0"]
  out = _tool().main(argv)
  assert json.loads(capsys.readouterr().out) == out
  assert out["checkpoint"] is None and out["model"]["source"].startswith("random")
  assert (out["model"]["d_model"], out["model"]["n_heads"]) == (32, 2)
  assert out["model"]["layers"] == dict(enc=1, lm=1, dec=1, mbp=1, mlp_mbp=0)
  res = out["results"]
  assert set(res) == {"ntp_b1", "ntp_b2"}  # --naive-bytes 0: no naive loop, no ratio against it
  for key in res:
    _check_row(res[key], key)
  # two rows read at least twice the caches of one (the LM runs when either closes a group)
  b1, b2 = res["ntp_b1"], res["ntp_b2"]
  assert b1["cache_len"] == b2["cache_len"] and b2["lm_fraction"] >= b1["lm_fraction"]
  assert b2["read_kv_bytes"] >= 2 * b1["read_kv_bytes"] - 2
  assert out["ratios"] == {}


def test_bench_decode_profile(capsys):
  """--profile: the loop body's ops found in the profiler's events, per step, by kind."""
  argv = SHAPE + TINY + ["--modes", "ntp", "--batch", "2", "--naive-bytes", "0", "--profile"]
  out = _tool().main(argv)
  capsys.readouterr()
  prof = out["results"]["ntp_b2"]["step_profile"]
  assert prof["steps"] == out["results"]["ntp_b2"]["steps"]
  kinds = prof["thread_ms_per_step_by_kind"]
  assert kinds and all(v >= 0 for v in kinds.values())
  assert prof["thread_ms_per_step"] == pytest.approx(sum(kinds.values()), rel=0.01, abs=1e-3)
  assert prof["thread_ms_per_step"] > 0


def test_step_op_kinds_names_the_loop_body_ops():
  """The cache products of a decode step are batched dots, the weights' plain dots."""
  tool = _tool()
  model = tool.random_model(
    tool.model_config(None, (), d_model=32, d_inner=64, n_heads=2, layers="1,1,1,1")
  )
  text = engine.compiled_decode(model, ["abc", "de"], mode="ntp", max_bytes=4).as_text()
  kinds = hlo_stats.step_op_kinds(text)
  assert kinds and not {"while", "conditional", "parameter", "tuple"} & set(kinds.values())
  assert {"dot", "cache_dot"} <= set(kinds.values())


def test_hlo_step_without_a_decode_loop_is_reported_not_raised():
  """Another backend's optimized HLO whose decode loop is not found (a GPU's may differ) gives
  an error entry, so the timed rows of a long run are kept."""
  tool = _tool()
  model = tool.random_model(
    tool.model_config(None, (), d_model=32, d_inner=64, n_heads=2, layers="1,1,1,1")
  )
  text = "HloModule m\n\nENTRY %main (p: f32[2]) -> f32[2] {\n  %p = f32[2] parameter(0)\n}\n"
  out = tool.hlo_step(model, ["abc"], text, 40)
  assert out == {"error": "no while loop reachable from the entry computation"}


def test_model_sources():
  tool = _tool()
  a = tool.parse_args(SHAPE + ["--n-kv-heads", "1"])
  c = a.cfg
  assert (c.d_model, c.d_inner, c.n_heads, c.n_kv_heads) == (32, 64, 2, 1)
  assert (c.n_enc, c.n_lm, c.n_dec, c.n_mbp) == (1, 1, 1, 1)
  assert (c.dtype, c.dropout, c.attention_impl) == ("float32", 0.0, "xla")
  c = tool.parse_args(["--d-model", "128"]).cfg  # missing flags: the 11M shape
  assert (c.d_model, c.d_inner, c.n_heads, c.n_kv_heads) == (128, 1024, 4, 4)
  assert (c.n_enc, c.n_lm, c.n_dec, c.n_mbp) == (2, 4, 2, 2)
  cfg_file = os.path.join(ROOT, "configs", "tiny_lca_mbp.py")
  c = tool.parse_args(["--config", cfg_file, "--config.model.d_model=32", "--n-heads", "2"]).cfg
  assert (c.d_model, c.n_heads, c.n_kv_heads, c.d_inner) == (32, 2, 2, 192)  # rest: the file's
  c = tool.parse_args(["--config", cfg_file, "--config.model.n_lm", "3"]).cfg
  assert c.n_lm == 3
  assert tool.parse_args(["--checkpoint", "/some/dir"]).cfg is None


@pytest.mark.parametrize(
  "argv, needle",
  [
    ([], "give a model"),
    (["--checkpoint", "/x", "--d-model", "32"], "--checkpoint"),
    (["--config.model.d_model=32"], "need --config"),
    (["--d-model", "32", "--layers", "1,1"], "--layers"),
    (["--d-model", "30", "--n-heads", "4"], "divisible"),
    (["--config", "/nonexistent.py"], "not found"),
    (
      ["--config", os.path.join(ROOT, "configs", "tiny_lca_mbp.py"), "--config.model.nope=1"],
      "nope",
    ),
    (["--d-model", "32", "--bogus"], "--bogus"),
    (["--d-model", "32", "--batch", "0"], "--batch"),
    (["--d-model", "32", "--stream-mb", "-1"], "--stream-mb"),
  ],
)
def test_bad_model_source(argv, needle, capsys):
  with pytest.raises(SystemExit) as e:
    _tool().parse_args(argv)
  assert e.value.code == 2
  assert needle in capsys.readouterr().err


@pytest.mark.parametrize("modes", ["", "ntp,greedy"])
def test_bad_modes(modes, capsys):
  with pytest.raises(SystemExit) as e:
    _tool().main(["--checkpoint", "/nonexistent", "--modes", modes])
  assert e.value.code == 2
  assert "--modes" in capsys.readouterr().err
