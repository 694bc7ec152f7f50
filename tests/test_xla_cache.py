"""The programs' persistent XLA compilation cache (lca_jax/xla_cache.py): a second run of a
program loads what the first compiled and prints the same output; a directory that cannot be
used is a one-line error when asked for, and no cache (not an error) when it is the default."""

import os
import subprocess
import sys

import jax
import pytest
from conftest import random_params, tiny_config

from lca_jax import xla_cache
from lca_jax.cli import sample as sample_cli
from lca_jax.interop import upstream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# lca-sample in a child process; prints the generated text, then the cache hits of the run
DRIVER = """
import sys
import jax.monitoring
hits = []
jax.monitoring.register_event_listener(
  lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None
)
from lca_jax.cli import sample
rc = sample.main(sys.argv[1:])
print("HITS", len(hits))
sys.exit(rc)
"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  cfg = tiny_config("fxt", max_seq_len=64)
  path = str(tmp_path_factory.mktemp("tiny_fxt"))
  upstream.write_dir(path, random_params(cfg), cfg)
  return path


def _sample(ckpt, env):
  argv = ["--checkpoint", ckpt, "--prompt", "The kernel ", "--max-bytes", "8"]
  proc = subprocess.run(
    [sys.executable, "-c", DRIVER, *argv],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr
  text, hits = proc.stdout.rsplit("HITS", 1)
  return text, int(hits)


def test_second_run_loads_the_compiled_programs(tiny_dir, tmp_path):
  cache = tmp_path / "xla"
  env = dict(os.environ, LCA_JAX_XLA_CACHE=str(cache))
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the tiny model compiles in < 1 s
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  first, hits_first = _sample(tiny_dir, env)
  entries = sorted(p.name for p in cache.iterdir() if p.name.endswith("-cache"))
  assert hits_first == 0 and entries, (hits_first, entries)
  second, hits_second = _sample(tiny_dir, env)
  assert hits_second >= 1
  assert second == first  # the loaded programs decode the same bytes
  # off: nothing read
  _, hits_off = _sample(tiny_dir, dict(env, LCA_JAX_XLA_CACHE="off"))
  assert hits_off == 0


@pytest.mark.skipif(
  bool(jax.config.jax_compilation_cache_dir), reason="this test process has a cache of its own"
)
def test_off_and_unusable_default_change_nothing(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  assert xla_cache.enable({xla_cache.ENV: "0"}) is None
  assert xla_cache.enable({xla_cache.ENV: " OFF "}) is None
  # the default directory cannot be created under a file: no cache, no error
  assert xla_cache.enable({"XDG_CACHE_HOME": str(blocker)}) is None
  assert not jax.config.jax_compilation_cache_dir


def test_unusable_directory_asked_for_is_one_line_error(tmp_path, monkeypatch, capsys):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(xla_cache.XlaCacheError, match="LCA_JAX_XLA_CACHE"):
    xla_cache.enable({xla_cache.ENV: str(blocker)})
  monkeypatch.setenv(xla_cache.ENV, str(blocker / "sub"))
  rc = sample_cli.main(["--checkpoint", str(tmp_path), "--prompt", "x"])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and len(err.splitlines()) == 1 and "LCA_JAX_XLA_CACHE" in err, err
