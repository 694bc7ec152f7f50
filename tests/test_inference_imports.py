"""Loading and decoding an lca-train work directory import nothing from ``lca_jax.train``: a
fresh process runs ``lca_jax.load`` on a tiny work directory and ``generate``, then lists the
modules it imported."""

import json
import os
import subprocess
import sys

from conftest import ROOT, random_params, tiny_config

from lca_jax.workdir import write

_CHILD = """
import json, sys
import lca_jax
model = lca_jax.load(sys.argv[1])
res = model.generate("ab", max_bytes=2)
print(json.dumps({
  "texts": len(res.texts),
  "train": sorted(m for m in sys.modules if m == "lca_jax.train" or m.startswith("lca_jax.train.")),
}))
"""


def test_load_and_generate_import_no_training_module(tmp_path):
  cfg = tiny_config("lca_mbp", max_seq_len=64)
  wd = write.write_workdir(str(tmp_path), random_params(cfg), cfg)
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run(
    [sys.executable, "-c", _CHILD, wd],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["texts"] == 1
  assert got["train"] == []
