"""Smoke test of tools/count_params.py (parameter counts of config files, JSON).

XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_tool_count_params.py
"""

import json
import os

from conftest import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "count_params.py")


def _tool():
  return load_tool("count_params")


def test_count_params_tiny(capsys):
  paths = [os.path.join(ROOT, "configs", f"tiny_{v}.py") for v in ("lca_mbp", "fxt")]
  _tool().main(paths)
  out = json.loads(capsys.readouterr().out)
  assert set(out) == {"params", "millions", "max_rel_diff"}
  assert list(out["params"]) == paths and list(out["millions"]) == paths
  assert all(isinstance(n, int) and n > 0 for n in out["params"].values())
  # fxt is lca_mbp without the MBP stage
  assert out["params"][paths[1]] < out["params"][paths[0]]
  assert 0 < out["max_rel_diff"] < 1


def test_paper_default_paths():
  """No arguments means the five paper configs, named relative to the repository root (running
  them takes ~10 s of tracing on CPU: only their presence is checked here)."""
  paper = _tool().PAPER
  assert len(paper) == 5
  for p in paper:
    assert os.path.isfile(os.path.join(ROOT, p)), p
