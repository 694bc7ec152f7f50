"""Smoke test of tools/demo_sample.py (greedy and multi-byte samples, learned segmentation).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_tool_demo_sample.py

Runs on random params of a tiny LCA-MBP model (the session's ``tiny_upstream_checkpoint``), so
the text is noise; the test checks that every section is printed and that no decoding path
fell back or failed.
"""

import os

from conftest import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "demo_sample.py")
TINY = ["--max-bytes", "8", "--n", "2", "--sentence", "The cat sat.", "--prompt", "A cat "]


def _tool():
  return load_tool("demo_sample")


def _no_fallback(text):
  assert "failed" not in text and "Traceback" not in text, text


def test_demo_sample_engine(tiny_upstream_checkpoint, capsys):
  """model.generate: ntp, threshold, a sampled continuation; segmentation of held-out text."""
  rc = _tool().main(
    ["--checkpoint", tiny_upstream_checkpoint, "--heldout-bytes", "12", "--temperature", "0.7"]
    + TINY
  )
  out = capsys.readouterr().out
  assert rc == 0
  _no_fallback(out)
  assert out.startswith("model: hierarchical, d=32, layers enc/lm/dec/mbp = 1/1/1/1")
  for title in (
    "== next-byte (ntp) [model.generate] ==",
    "== multi-byte (threshold, tau=0.5, n=2) [model.generate] ==",
    "== sampled next-byte (temperature 0.7, seed 0) [model.generate] ==",
    "== learned segmentation",
    "== segmentation of held-out text (first 12 bytes",
  ):
    assert title in out, title
  assert "bytes/step histogram" in out
  assert "boundaries in 12 bytes" in out and "boundary probability min" in out


def test_demo_sample_reference_loop(tiny_upstream_checkpoint, capsys):
  """--reference: the full-forward loop in both modes; sampling and held-out text skipped."""
  rc = _tool().main(
    [
      "--checkpoint",
      tiny_upstream_checkpoint,
      "--reference",
      "--heldout-bytes",
      "0",
      "--temperature",
      "0",
    ]
    + TINY
  )
  out = capsys.readouterr().out
  assert rc == 0
  _no_fallback(out)
  assert "== next-byte (ntp) [reference loop: full forward per step] ==" in out
  assert "== multi-byte (threshold, tau=0.5, n=2) [reference loop: full forward per step] ==" in out
  assert "[model.generate]" not in out and "held-out" not in out
  assert "boundaries in 12 bytes" in out


def test_demo_sample_bad_checkpoint(tmp_path, capsys):
  rc = _tool().main(["--checkpoint", str(tmp_path / "missing")])
  assert rc == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("demo_sample: error:") and len(err.splitlines()) == 1
