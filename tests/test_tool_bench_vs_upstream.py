"""Smoke test of tools/bench_vs_upstream.py (lca-jax vs the paper's PyTorch training step).

    LCA_UPSTREAM_SRC=/tmp/upstream XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        .venv/bin/python -m pytest -q tests/test_tool_bench_vs_upstream.py

The throughput run needs a checkout of the paper's code (the folder holding
src/model/modern_fxt.py) named by LCA_UPSTREAM_SRC; without one it is skipped. The bad-input
checks run always.
"""

import os

import pytest
from conftest import load_tool

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


def test_train_tiny():
  out = _tool().main(["train", "--upstream-src", _upstream_src()] + TINY)
  assert set(out) >= {"machine", "model", "params", "shapes"}
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
