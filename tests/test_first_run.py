"""What a new user trips on (issue 71), each met as the user meets it: the CLIs as processes.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_first_run.py

A parquet run without files is refused, not trained on the bundled corpus; a run's header
names the data it reads.
"""

import os

from conftest import ROOT, TRAIN_TINY, run_cli_process

TINY_CONFIG = os.path.join(ROOT, "configs", "tiny_lca_mbp.py")


def train_process(workdir, *overrides, timeout: float = 300):
  """``lca-train`` on the tiny config with TRAIN_TINY and ``overrides``, as a process."""
  argv = ["--config", TINY_CONFIG, "--workdir", str(workdir)]
  argv += [f"--config.{o}" for o in TRAIN_TINY + list(overrides)]
  return run_cli_process("lca_jax.cli.train", *argv, timeout=timeout)


def test_parquet_without_train_files_is_an_error_not_the_bundled_corpus(tmp_path):
  wd = tmp_path / "wd"
  p = train_process(wd, "data.format=parquet", "train.steps=2")
  assert p.returncode == 2, p.stderr
  err = p.stderr.strip()
  assert len(err.splitlines()) == 1 and "Traceback" not in err, err
  assert "data.train_files" in err and "parquet" in err, err
  assert not wd.exists()  # refused before the work directory is made
