"""Smoke test of tools/bench_vs_upstream.py (lca-jax vs the paper's PyTorch code: training step
and cached decoding).

    LCA_UPSTREAM_SRC=/tmp/upstream XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        .venv/bin/python -m pytest -q tests/test_tool_bench_vs_upstream.py

The throughput runs need a checkout of the paper's code (the folder holding
src/model/modern_fxt.py) named by LCA_UPSTREAM_SRC; without one it is skipped. The bad-input
checks run always.
"""

import argparse
import os

import pytest
from conftest import load_tool

from lca_jax.train import optim

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "bench_vs_upstream.py")
TINY = [
  "--d-model",
  "32",
  "--d-inner",
  "64",
  "--n-heads",
  "2",
  "--layers",
  "1,1,1,1",
  "--shapes",
  "1x64",
  "--steps",
  "1",
  "--warmup",
  "1",
]


DECODE_TINY = [
  "--sizes",
  "d32:64:2:1,1,1,1",
  "--prompt-bytes",
  "32",
  "--new-bytes",
  "8",
  "--repeats",
  "1",
  "--stream-mb",
  "2",
  "--stream-repeats",
  "1",
  "--torch-threads",
  "1",
]


def _tool():
  return load_tool("bench_vs_upstream")


def _upstream_src():
  src = os.environ.get("LCA_UPSTREAM_SRC", "").strip()
  if not src:
    pytest.skip(
      "no upstream checkout: set LCA_UPSTREAM_SRC to the paper's code "
      "(the folder holding src/model/modern_fxt.py)"
    )
  if not os.path.isfile(os.path.join(src, "src", "model", "modern_fxt.py")):
    pytest.skip(f"LCA_UPSTREAM_SRC={src} holds no src/model/modern_fxt.py")
  return src


@pytest.mark.parametrize("env", ["own", "same"])
def test_train_tiny(env):
  out = _tool().main(["train", "--upstream-src", _upstream_src(), "--upstream-env", env] + TINY)
  assert set(out) >= {"machine", "model", "params", "shapes", "upstream_env"}
  assert out["upstream_env"]["mode"] == env
  if env == "same":  # one process: the paper's code runs with lca_jax's allocator setting
    assert out["upstream_env"]["glibc_tunables"] == out["machine"]["glibc_tunables"]
  else:  # a child with the environment the program was started with (pytest's: unchanged)
    assert out["upstream_env"]["glibc_tunables"] == os.environ.get("GLIBC_TUNABLES", "")
  assert out["machine"]["cores"] == os.cpu_count() and out["machine"]["torch"]
  assert out["params"]["match"], out["params"]
  assert (
    out["params"]["lca_jax"] - out["params"]["lca_jax_vocab_padding"] == out["params"]["upstream"]
  )
  r = out["shapes"]["1x64"]
  for side in ("upstream", "lca_jax"):
    assert r[side]["bytes_per_s"] > 0 and r[side]["step_s"] > 0
    assert r[side]["final_loss"] == r[side]["final_loss"]  # finite-ish: not NaN
  assert r["lca_jax"]["compile_s"] > 0
  assert r["ratio"] == pytest.approx(r["lca_jax"]["bytes_per_s"] / r["upstream"]["bytes_per_s"])
  # rounds of alternating blocks: every timed step of each side, the ratio of each round
  n = len(r["upstream"]["step_s_all"])
  assert n == len(r["lca_jax"]["step_s_all"]) >= 1
  lo, hi = r["ratio_rounds_range"]
  assert 0 < lo <= r["ratio_rounds_median"] <= hi
  assert out["machine"]["thp_mode"] in (None, "always", "madvise", "never")


@pytest.mark.parametrize(
  "argv, needle",
  [
    (["train"], "--upstream-src"),
    (["train", "--upstream-src", "/nonexistent/upstream"], "no such directory"),
    (["train", "--upstream-src", ROOT], "not the paper's code"),
  ],
)
def test_bad_upstream_src(argv, needle, capsys):
  with pytest.raises(SystemExit) as e:
    _tool().main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("shapes", ["4by1024", "0x64", "4x", "1x64,1x64"])
def test_bad_shapes(shapes, tmp_path, capsys):
  fake = tmp_path / "src" / "model"
  fake.mkdir(parents=True)
  (fake / "modern_fxt.py").write_text("")  # passes the layout check; shapes are checked next
  with pytest.raises(SystemExit) as e:
    _tool().main(["train", "--upstream-src", str(tmp_path), "--shapes", shapes])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "--shapes" in err and "Traceback" not in err


def test_upstream_process_reports_a_failure_in_one_line(tmp_path):
  """The child that runs the paper's code sends its failure back; the parent raises it as the
  tool's one-line error and the child is gone."""
  fake = tmp_path / "src" / "model"
  fake.mkdir(parents=True)
  (fake / "modern_fxt.py").write_text("X = 1\n")  # importable, but no FxTTransformerLM
  tool = _tool()
  hp = argparse.Namespace(seed=0, lr=1e-3, clip=0.0)
  with pytest.raises(tool.BenchError, match="has no FxTTransformerLM") as e:
    tool.UpstreamProcess(str(tmp_path), {}, "cpu", hp)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("flag", ["--steps", "--rounds", "--warmup"])
def test_bad_counts(flag, tmp_path, capsys):
  fake = tmp_path / "src" / "model"
  fake.mkdir(parents=True)
  (fake / "modern_fxt.py").write_text("")
  with pytest.raises(SystemExit) as e:
    _tool().main(["train", "--upstream-src", str(tmp_path), flag, "0"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and flag in err and "Traceback" not in err


def test_decode_tiny():
  out = _tool().main(["decode", "--upstream-src", _upstream_src()] + DECODE_TINY)
  assert set(out) >= {"machine", "sizes", "upstream_call", "lca_jax_call"}
  assert out["prompt_bytes"] == 32
  r = out["sizes"]["d32:64:2:1,1,1,1"]
  assert r["stream_gb_s"] > 0 and r["stream"]["matrix_bytes"] <= 2.1e6  # --stream-mb 2
  assert r["params"]["match"], r["params"]
  assert r["model"]["upstream_model_config"] == "[1, (1,), 1, 1]"
  for side in ("upstream", "lca_jax"):
    assert r[side]["bytes_per_s"] > 0 and r[side]["ms_per_step"] > 0, side
    assert 0 < r[side]["bytes"] <= 8, side
  ours = r["lca_jax"]
  assert ours["bytes"] == 8 and ours["steps"] == 8  # ntp, ignore_eos: one byte per step
  assert ours["compile_s"] > 0 and ours["bound_ms_per_step"] > 0
  assert ours["ms_per_step_over_bound"] == pytest.approx(
    ours["ms_per_step"] / ours["bound_ms_per_step"], rel=0.02
  )
  assert r["ratio"] == pytest.approx(ours["bytes_per_s"] / r["upstream"]["bytes_per_s"])


def test_lca_decode_side_without_upstream(tmp_path):
  """The lca_jax side of ``decode`` (converter round trip, timed ntp calls, bound) runs in every
  CI, not only where a checkout of the paper's code is at hand."""
  tool = _tool()
  args = tool._parser().parse_args(["decode", "--upstream-src", "-"] + DECODE_TINY)
  ((name, cfg),) = [(n, tool.decode_model_config(s)) for n, s in tool.parse_sizes(args.sizes)]
  tool.write_random_dir(str(tmp_path), cfg, seed=0)
  model = tool.load_lca_dir(str(tmp_path), cfg)
  prompt = tool.bench_decode.prompt_ids(args.prompt_bytes)
  row = tool.lca_decode(model, prompt, args, stream_bps=1e10)
  assert row["bytes"] == 8 and row["steps"] == 8, row  # ntp, ignore_eos: one byte per step
  assert row["bytes_per_s"] > 0 and row["decode_bytes_per_s"] > 0 and row["prefill_s"] > 0
  assert row["bound_ms_per_step"] > 0 and row["ms_per_step"] > 0, row


def test_parse_sizes():
  tool = _tool()
  got = tool.parse_sizes("11m,d64:128:4:1,1,1,1,374m,d64:128:4:2:1,2,1,0")
  assert [k for k, _ in got] == ["11m", "d64:128:4:1,1,1,1", "374m", "d64:128:4:2:1,2,1,0"]
  assert got[1][1] == dict(d_model=64, d_inner=128, n_heads=4, n_kv_heads=0, layers="1,1,1,1")
  assert got[2][1] is None  # configs/lca_mbp.py's own shape
  c = tool.decode_model_config(got[2][1])
  assert (c.d_model, c.d_inner, c.n_heads, c.n_enc, c.n_lm, c.n_dec, c.n_mbp) == (
    1024,
    4096,
    8,
    2,
    16,
    2,
    2,
  )
  assert c.dtype == "float32"
  c = tool.decode_model_config(got[0][1])
  assert (c.d_model, c.d_inner, c.n_heads, c.n_lm) == (256, 1024, 4, 4)
  c = tool.decode_model_config(got[3][1])
  assert (c.n_heads, c.n_kv_heads, c.n_lm, c.n_mbp) == (4, 2, 2, 0)


@pytest.mark.parametrize(
  "argv, needle",
  [
    (["--sizes", "12m"], "--sizes"),
    (["--sizes", "d64:128:4:1,1,1"], "--sizes"),
    (["--sizes", "11m,11m"], "repeats"),
    (["--sizes", "d64:128:3:1,1,1,1"], "divisible"),
    (["--sizes", "11m", "--temperature", "1.0"], "--temperature"),
    (["--sizes", "11m", "--temperature", "0"], "--temperature"),
    (["--sizes", "11m", "--new-bytes", "0"], "--new-bytes"),
    (["--sizes", "11m", "--prompt-bytes", "4000", "--new-bytes", "200"], "context"),
    (["--sizes", "11m", "--torch-threads", "-1"], "--torch-threads"),
  ],
)
def test_bad_decode_input(argv, needle, tmp_path, capsys):
  fake = tmp_path / "src" / "model"
  fake.mkdir(parents=True)
  (fake / "modern_fxt.py").write_text("")  # passes the layout check; the rest is checked next
  with pytest.raises(SystemExit) as e:
    _tool().main(["decode", "--upstream-src", str(tmp_path)] + argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


@pytest.mark.parametrize(
  "argv, needle",
  [
    (["decode"], "--upstream-src"),
    (["decode", "--upstream-src", "/nonexistent/upstream"], "no such directory"),
    (["decode", "--upstream-src", ROOT], "not the paper's code"),
  ],
)
def test_bad_decode_upstream_src(argv, needle, capsys):
  with pytest.raises(SystemExit) as e:
    _tool().main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_lca_side_learning_rate_is_constant_like_upstream():
  """The upstream side's torch Adam runs at --lr from its first step: lca_jax's schedule must
  too (with the base config's warmup it would stay near 0 for the whole benchmark)."""
  tool = _tool()
  args = tool._parser().parse_args(["train", "--upstream-src", ROOT, "--lr", "0.001"])
  config, _ = tool.lca_config(args, tool.parse_layers(args.layers), 1, 64, "", 4096)
  schedule = optim.make_schedule(config.optim, int(config.train.steps))
  for step in (0, 1, int(config.train.steps) - 1):
    assert float(schedule(step)) == pytest.approx(0.001, rel=1e-6), step
