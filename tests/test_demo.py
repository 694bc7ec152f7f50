"""The `make demo` pieces on a tiny, fast setting: configs/demo.py, a few training steps, then
tools/demo_sample.py on that work directory, and the loss-curve PNG writer.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_demo.py
"""

import json
import os
import struct

import numpy as np
import pytest
from conftest import TINY_SHAPE, load_tool

from lca_jax import configs_io
from lca_jax.cli import train as train_cli
from lca_jax.eval import curves
from lca_jax.model.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CONFIG = os.path.join(ROOT, "configs", "demo.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# configs/demo.py shrunk to seconds: one stage layer each, 32-byte rows, 4 steps, a 2-batch eval
SHRINK = TINY_SHAPE + [
  "train.global_batch_bytes=256",
  "train.steps=4",
  "train.log_every=1",
  "train.eval_every=4",
  "train.eval_batches=2",
  "train.checkpoint_every=4",
  "optim.warmup_steps=1",
]

ORDER = (
  "== held-out bits per byte",
  "== learned segmentation",
  "== next-byte (ntp) [model.generate] ==",
  "== multi-byte (verify, n=2) [model.generate] ==",
  "ntp and verify texts identical:",
  "== multi-byte (threshold, tau=",
  "== loss curve (bits per byte vs step, both heads) ==",
)


def png_size(path):
  """(width, height) from a PNG's IHDR chunk; AssertionError when the file is not a PNG."""
  with open(path, "rb") as f:
    head = f.read(33)
  assert head[:8] == PNG_MAGIC, head[:8]
  assert head[12:16] == b"IHDR"
  return struct.unpack(">II", head[16:24])


def _fake_workdir(path, steps=(1, 50, 100), evals=(50, 100)):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for s in steps:
      f.write(json.dumps(dict(step=s, bpb_ntp=8.0 - s / 50, bpb_mbp=8.5 - s / 60)) + "\n")
    f.write('{"step": 150, "bpb_nt')  # a line cut by an interrupted writer
  with open(os.path.join(path, "eval.jsonl"), "w") as f:
    for s in evals:
      f.write(json.dumps(dict(step=s, bpb_ntp=7.0 - s / 50, bpb_mbp=None)) + "\n")
  return str(path)


def test_loss_curve_png(tmp_path):
  wd = _fake_workdir(tmp_path / "wd")
  rows = curves.read_jsonl(os.path.join(wd, "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 50, 100]  # the cut line is skipped
  ev = curves.read_jsonl(os.path.join(wd, "eval.jsonl"))
  assert curves._series(ev, "bpb_mbp") == ([], [])  # null values are not drawn
  assert curves._series(ev, "bpb_ntp") == ([50, 100], [6.0, 5.0])
  path = curves.write_loss_curve(wd)
  assert path == os.path.join(wd, "loss_curve.png")
  w, h = png_size(path)
  assert (w, h) == (700, 450)
  other = curves.write_loss_curve(wd, str(tmp_path / "c.png"))
  assert png_size(other) == (700, 450)


def test_loss_curve_needs_metrics(tmp_path):
  with pytest.raises(FileNotFoundError, match="no metrics.jsonl or eval.jsonl"):
    curves.write_loss_curve(str(tmp_path))
  assert not os.listdir(tmp_path)


def test_demo_config():
  """configs/demo.py loads, builds a valid LCA-MBP ModelConfig, and its batch layout is whole."""
  cfg = configs_io.load_config(DEMO_CONFIG)
  m = ModelConfig.from_dict(cfg.model.to_dict())
  assert m.has_lca and m.boundaries == "learned"
  rows = cfg.train.global_batch_bytes // cfg.data.seq_len
  assert rows * cfg.data.seq_len == cfg.train.global_batch_bytes
  assert rows % cfg.train.micro_batch_size == 0
  assert cfg.data.train_files == "" and cfg.data.eval_files == ""  # the bundled corpus split
  with open(DEMO_CONFIG, encoding="utf-8") as f:
    assert "lca-train --config configs/demo.py" in f.read()


def test_first_difference_and_word_edges():
  tool = load_tool("demo_sample")
  assert tool.first_difference([1, 2, 3], [1, 2, 3]) == -1
  assert tool.first_difference([1, 2, 3], [1, 5, 3]) == 1
  assert tool.first_difference([1, 2], [1, 2, 3]) == 2
  # "ab cd": closes after 'b' (next byte a space: a word edge) and after 'c' (inside a word)
  assert tool.word_edge_share("ab cd", np.array([0, 1, 0, 1, 0])) == (2, 1)
  assert tool._tau_ladder(0.5) == [0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05, 0.0]
  assert tool._tau_ladder(0.05) == [0.05, 0.0]
  assert [tool._rate(x) for x in (0.0, 0.004, 0.011, 1.0)] == ["0.00", "0.004", "0.01", "1.00"]


@pytest.fixture(scope="module")
def demo_workdir(tmp_path_factory):
  """configs/demo.py (shrunk) trained for 4 steps through the lca-train CLI."""
  wd = str(tmp_path_factory.mktemp("demo_wd"))
  rc = train_cli.main(
    ["--config", DEMO_CONFIG, "--workdir", wd] + [f"--config.{o}" for o in SHRINK]
  )
  assert rc == 0
  return wd


DEMO_ARGS = ["--max-bytes", "12", "--n", "2", "--repeats", "1", "--heldout-bytes", "0"]


def test_demo_sample_sections_in_order(demo_workdir, capsys):
  rc = load_tool("demo_sample").main(
    ["--checkpoint", demo_workdir, "--temperature", "0", "--prompt", "A cat "] + DEMO_ARGS
  )
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "failed" not in out and "Traceback" not in out, out
  pos = [out.find(s) for s in ORDER]
  assert all(p >= 0 for p in pos), list(zip(ORDER, pos))
  assert pos == sorted(pos), list(zip(ORDER, pos))
  # held-out figures are the last eval.jsonl row's
  ev = curves.read_jsonl(os.path.join(demo_workdir, "eval.jsonl"))[-1]
  assert ev["step"] == 4
  assert f"next-byte head {ev['bpb_ntp']:.3f} bpb, multi-byte head {ev['bpb_mbp']:.3f} bpb" in out
  # greedy verify must reproduce ntp: the line says so, and it agrees with our own comparison
  model = __import__("lca_jax").load(demo_workdir)
  a = model.generate(["A cat "], mode="ntp", max_bytes=12, temperature=0.0).ids[0]
  b = model.generate(["A cat "], mode="verify", n=2, max_bytes=12, temperature=0.0).ids[0]
  same = list(a) == list(b)
  assert same  # the engine's contract (docs/design.md §6.3)
  assert ("ntp and verify texts identical: yes" in out) == same
  # threshold stops at the first tau that accepts something (0 accepts every candidate)
  assert "acceptance n/a" in out.split("== multi-byte (verify")[0]
  thr = out.split("== multi-byte (threshold, tau=")
  ladder = load_tool("demo_sample")._tau_ladder(0.5)
  assert 2 <= len(thr) <= 1 + len(ladder)
  for section, tau in zip(thr[1:-1], ladder):  # the taus that accepted nothing: one line each
    assert section.startswith(f"{tau}, n=2)"), section
    assert "nothing accepted, so the text is ntp's" in section, section
  last = thr[-1]
  assert "acceptance 0.00," not in last and "bytes/step histogram" in last
  png = os.path.join(demo_workdir, "loss_curve.png")
  assert out.rstrip().endswith(png)
  assert png_size(png)[0] > 0


def test_demo_sample_reports_a_mismatch(demo_workdir, capsys, monkeypatch):
  """The identity line is computed: a verify result whose bytes differ is reported as such."""
  import lca_jax

  real = lca_jax.api.Model.generate

  def corrupted(self, prompts, **kw):
    res = real(self, prompts, **kw)
    if kw.get("mode") == "verify":  # one byte more than ntp's text
      res.ids[0] = np.concatenate([res.ids[0], np.asarray([3 + ord("#")], res.ids[0].dtype)])
    return res

  monkeypatch.setattr(lca_jax.api.Model, "generate", corrupted)
  rc = load_tool("demo_sample").main(
    ["--checkpoint", demo_workdir, "--temperature", "0", "--curve", "", "--prompt", "A cat "]
    + DEMO_ARGS
  )
  out = capsys.readouterr().out
  assert rc == 0
  n = len(
    lca_jax.load(demo_workdir)
    .generate(["A cat "], mode="ntp", max_bytes=12, temperature=0.0)
    .ids[0]
  )
  assert f"ntp and verify texts identical: NO (first difference at generated byte {n})" in out
  assert "== loss curve" not in out
