"""Import rules between layers (issue 52): ``lca_jax.interop`` imports neither ``lca_jax.api``
nor the training stack, ``lca_jax.workdir`` nothing of the training stack, and
``lca_jax.train`` reaches ``lca_jax.load`` through ``lca_jax.api`` itself, never through the
package root. Checked in a fresh process (what an import really pulls in, the package
``__init__`` included) and on the source (every import statement, function-level ones too)."""

import ast
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

PKG = os.path.join(ROOT, "lca_jax")

_CHILD = """
import json, sys
import lca_jax.interop.convert, lca_jax.interop.hf_export, lca_jax.workdir.write
print(json.dumps(sorted(
  m for m in sys.modules
  if m in ("lca_jax.train", "lca_jax.api") or m.startswith(("lca_jax.train.", "lca_jax.api."))
)))
"""


def _is_above_interop(name: str) -> bool:
  return any(name == top or name.startswith(top + ".") for top in ("lca_jax.api", "lca_jax.train"))


def _submodules() -> set:
  """The names ``from lca_jax import NAME`` can import as a module (not a package attribute)."""
  out = set()
  for entry in os.listdir(PKG):
    if entry.endswith(".py") and entry != "__init__.py":
      out.add(entry[:-3])
    elif os.path.isfile(os.path.join(PKG, entry, "__init__.py")):
      out.add(entry)
  return out


def _imports(path: str):
  """(line, module name) of every import in ``path``; ``from lca_jax import x`` gives
  ``lca_jax.x``, and a name of the package root itself (``load``, ``Model``) stays
  ``lca_jax:<name>``."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  subs = _submodules()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      if node.module == "lca_jax":
        for alias in node.names:
          sep = "." if alias.name in subs else ":"
          yield node.lineno, f"lca_jax{sep}{alias.name}"
      else:
        yield node.lineno, node.module


def _sources(sub: str):
  folder = os.path.join(PKG, sub)
  return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".py"))


def test_interop_imports_pull_in_neither_api_nor_train():
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run(
    [sys.executable, "-c", _CHILD],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("sub", ["interop", "workdir"])
def test_no_source_below_api_imports_api_or_train(sub):
  bad = [
    f"{os.path.relpath(path, ROOT)}:{line}: {name}"
    for path in _sources(sub)
    for line, name in _imports(path)
    if (sub == "interop" and _is_above_interop(name))
    or name in ("lca_jax.train",)
    or name.startswith("lca_jax.train.")
    or name == "lca_jax"
    or name.startswith("lca_jax:")
  ]
  assert not bad, bad


def test_train_reaches_load_through_api_not_the_package_root():
  bad = [
    f"{os.path.relpath(path, ROOT)}:{line}: {name}"
    for path in _sources("train")
    for line, name in _imports(path)
    if name == "lca_jax" or name.startswith("lca_jax:")
  ]
  assert not bad, bad


def test_the_checks_see_what_they_forbid(tmp_path):
  """The source checks find a root import, a name of the root and a function-level import."""
  path = tmp_path / "m.py"
  path.write_text(
    "import lca_jax\nfrom lca_jax import load, api\n\n\ndef f():\n  from lca_jax.train import loop\n"
  )
  got = list(_imports(str(path)))
  assert got == [(1, "lca_jax"), (2, "lca_jax:load"), (2, "lca_jax.api"), (6, "lca_jax.train")]
  assert _is_above_interop("lca_jax.api") and _is_above_interop("lca_jax.train.loop")
  assert not _is_above_interop("lca_jax.apis")
