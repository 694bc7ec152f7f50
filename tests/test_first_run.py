"""What a new user trips on (issue 71), each met as the user meets it: the CLIs as processes.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_first_run.py

A parquet run without files is refused, not trained on the bundled corpus; a run's header
names the data it reads; a batch job's log (stderr not a terminal) has a plain line per log
step, the first without the compile's bytes/s; evaluation and sampling default to the length
the work directory trained at, and sampling past it is warned about.
"""

import json
import os
import re

import pytest
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


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A tiny run of 4 steps as a process, its stderr a pipe (as in a batch job), the progress
  bar left on: (work directory, the run's stderr). It trains at data.seq_len=32."""
  wd = tmp_path_factory.mktemp("first_run") / "wd"
  p = train_process(wd, "train.steps=4", "train.log_every=2", "train.progress_bar=True")
  assert p.returncode == 0, p.stderr
  return str(wd), p.stderr


def test_a_batch_job_log_has_a_plain_line_per_log_step_and_names_its_data(trained):
  _, err = trained
  assert "\r" not in err  # no progress bar in a log file
  assert "lca-train: data: bundled corpus (" in err
  lines = [ln for ln in err.splitlines() if re.match(r"lca-train: step \d+/4: ", ln)]
  assert [ln.split(":")[1] for ln in lines] == [" step 1/4", " step 2/4", " step 4/4"]
  assert "loss" in lines[0] and "lr" in lines[0] and "not timed" in lines[0]  # compile
  assert all(re.search(r"lr [0-9.e-]+, [\d,]+ bytes/s$", ln) for ln in lines[1:]), lines


def test_bpb_defaults_to_the_length_the_work_directory_trained_at(trained, tmp_path):
  wd, _ = trained
  data = tmp_path / "held.txt"
  data.write_text("\n\n".join(f"paragraph {i}: the quick brown fox jumps." for i in range(8)))
  argv = ["bpb", "--checkpoint", wd, "--data", str(data), "--format", "text", "--json"]
  p = run_cli_process("lca_jax.cli.eval", *argv)
  assert p.returncode == 0, p.stderr
  assert "lca-eval: --seq-len 32 (the length the work directory trained at)" in p.stderr
  assert json.loads(p.stdout)["seq_len"] == 32
  p = run_cli_process("lca_jax.cli.eval", *argv, "--seq-len", "64")  # an explicit flag wins
  assert p.returncode == 0, p.stderr
  assert "--seq-len" not in p.stderr and json.loads(p.stdout)["seq_len"] == 64


def test_sampling_stays_within_the_trained_length_or_says_it_does_not(trained):
  wd, _ = trained
  argv = ["--checkpoint", wd, "--prompt", "The hacker", "--json", "--ignore-eos"]
  p = run_cli_process("lca_jax.cli.sample", *argv)
  assert p.returncode == 0, p.stderr
  assert "lca-sample: --max-bytes 22 (prompt + generation within 32 bytes" in p.stderr
  assert len(json.loads(p.stdout)["ids"]) == 22 and "warning" not in p.stderr
  p = run_cli_process("lca_jax.cli.sample", *argv, "--max-bytes", "40")  # explicit: it runs past
  assert p.returncode == 0, p.stderr
  warning = [ln for ln in p.stderr.splitlines() if "warning" in ln]
  assert len(warning) == 1 and "runs past 32 bytes" in warning[0], p.stderr
  assert len(json.loads(p.stdout)["ids"]) == 40
