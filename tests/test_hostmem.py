"""lca_jax.hostmem: when a program re-executes itself with glibc's malloc.hugetlb tunable."""

import os
import subprocess
import sys
import textwrap

from lca_jax import hostmem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_thp_mode_reads_the_bracketed_mode(tmp_path):
  p = tmp_path / "enabled"
  p.write_text("always [madvise] never\n")
  assert hostmem.thp_mode(str(p)) == "madvise"
  p.write_text("[always] madvise never\n")
  assert hostmem.thp_mode(str(p)) == "always"
  p.write_text("garbage\n")
  assert hostmem.thp_mode(str(p)) is None
  assert hostmem.thp_mode(str(tmp_path / "missing")) is None


def test_with_tunable_keeps_other_tunables():
  assert hostmem.with_tunable(None) == "glibc.malloc.hugetlb=1"
  assert hostmem.with_tunable("glibc.malloc.arena_max=2") == (
    "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
  )
  assert hostmem.with_tunable("glibc.malloc.hugetlb=0:a.b=1") == "a.b=1:glibc.malloc.hugetlb=1"


def test_should_reexec_only_where_it_helps():
  yes = dict(environ={}, mode="madvise", glibc=(2, 36))
  assert hostmem.should_reexec(**yes)
  assert not hostmem.should_reexec(**{**yes, "mode": "always"})  # already huge
  assert not hostmem.should_reexec(**{**yes, "mode": "never"})
  assert not hostmem.should_reexec(**{**yes, "mode": None})
  assert not hostmem.should_reexec(**{**yes, "glibc": None})  # musl, macOS
  assert not hostmem.should_reexec(**{**yes, "glibc": (2, 34)})  # no such tunable yet
  assert not hostmem.should_reexec(**{**yes, "environ": {"LCA_JAX_HUGE_PAGES": "0"}})
  set_ = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
  assert not hostmem.should_reexec(**{**yes, "environ": set_})  # no loop: set once


def test_original_environ_is_the_environment_the_user_started_with():
  b = hostmem.BEFORE
  tun = "glibc.malloc.hugetlb=1"
  assert hostmem.original_environ({"A": "1"}) == {"A": "1"}  # never re-executed
  assert hostmem.original_environ({"A": "1", "GLIBC_TUNABLES": tun, b: ""}) == {"A": "1"}
  kept = {"GLIBC_TUNABLES": "x.y=2:" + tun, b: "x.y=2"}
  assert hostmem.original_environ(kept) == {"GLIBC_TUNABLES": "x.y=2"}


def test_use_huge_pages_reexecutes_once_with_the_same_argv(tmp_path):
  """A program calling use_huge_pages() first runs again with the tunable set where the machine
  allows it (once: the second run sees it), with the same arguments and pid; elsewhere it
  runs once, unchanged."""
  script = tmp_path / "prog.py"
  script.write_text(
    textwrap.dedent(
      """
      import os, sys
      print("run", os.getpid(), os.environ.get("GLIBC_TUNABLES", ""), sys.argv[1:], flush=True)
      from lca_jax import hostmem
      hostmem.use_huge_pages()
      print("before", hostmem.original_environ().get("GLIBC_TUNABLES"), flush=True)
      print("done", flush=True)
      """
    )
  )
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hostmem.OPT_OUT)}
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  out = subprocess.run(
    [sys.executable, str(script), "a", "b c"], env=env, capture_output=True, text=True, timeout=60
  )
  assert out.returncode == 0, out.stderr
  runs = [line.split(" ", 3) for line in out.stdout.splitlines() if line.startswith("run")]
  assert out.stdout.splitlines()[-1] == "done"
  assert "before None" in out.stdout.splitlines()  # as started: no tunable, either way
  expect = sys.platform.startswith("linux") and hostmem.should_reexec(
    env, hostmem.thp_mode(), hostmem.glibc_version()
  )
  if expect:
    assert len(runs) == 2, out.stdout
    assert runs[0][1] == runs[1][1]  # same process (execve)
    assert runs[1][2] == "glibc.malloc.hugetlb=1"
    assert runs[0][3] == runs[1][3] == "['a', 'b c']"
  else:
    assert len(runs) == 1, out.stdout
  env[hostmem.OPT_OUT] = "0"
  out = subprocess.run(
    [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
  )
  assert out.returncode == 0 and out.stdout.count("run") == 1, out.stdout
