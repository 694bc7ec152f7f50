"""Host memory of XLA:CPU steps on transparent huge pages (glibc's ``malloc.hugetlb`` tunable).

XLA:CPU allocates a step's temporary buffer (hundreds of MB for a train step: the activations
kept for the backward pass) with ``malloc`` at every execution, and glibc serves a request that
large with a fresh ``mmap`` that it unmaps again on ``free``. Each step then faults in and
zeroes every 4 KiB page of it (strace: one ``mmap`` / ``munmap`` of the buffer per execution;
``getrusage``: hundreds of thousands of minor faults, a large share of the step in kernel
time).

On Linux whose transparent huge pages are in ``madvise`` mode (the default of Debian, Ubuntu
and others), glibc >= 2.35 marks its mmap-ed chunks MADV_HUGEPAGE when started with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: the step's buffers then take about a thousand
faults of 2 MiB pages, and the step spends far less time in the kernel (docs/design.md §5.3;
timings in docs/performance.md).

A glibc tunable is read once, when the process starts, so ``use_huge_pages`` re-executes the
program with it set (same argv, same pid: ``os.execve``). The CLIs call it first thing when they
run as programs (``main()`` without arguments), before jax starts any thread; a library user
sets ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in the environment instead. Nothing happens
where it cannot help or could surprise: not Linux/glibc >= 2.35, THP mode ``always`` (already
huge) or ``never``, the tunable already set, ``LCA_JAX_HUGE_PAGES=0``, or an interactive
interpreter / IPython kernel (never restarted under its user).
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Mapping, Optional

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "LCA_JAX_HUGE_PAGES"  # "0": never re-execute
BEFORE = "LCA_JAX_GLIBC_TUNABLES_BEFORE"  # GLIBC_TUNABLES as the user started the program
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)


def thp_mode(path: str = THP_ENABLED) -> Optional[str]:
  """The bracketed mode of the kernel's THP setting ('always', 'madvise', 'never'), or None."""
  try:
    with open(path, encoding="ascii") as f:
      text = f.read()
  except OSError:
    return None
  start, end = text.find("["), text.find("]")
  return text[start + 1 : end] if 0 <= start < end else None


def describe() -> dict:
  """What a benchmark should print beside its figures: the THP mode and GLIBC_TUNABLES."""
  return dict(thp_mode=thp_mode(), glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""))


def glibc_version() -> Optional[tuple[int, int]]:
  """(major, minor) of the C library when it is glibc, else None."""
  lib, version = platform.libc_ver()
  if lib != "glibc":
    return None
  try:
    major, minor = (int(x) for x in version.split(".")[:2])
  except ValueError:
    return None
  return major, minor


def with_tunable(tunables: Optional[str]) -> str:
  """A GLIBC_TUNABLES value that keeps ``tunables`` and sets malloc.hugetlb to 1."""
  kept = [t for t in (tunables or "").split(":") if t and not t.startswith(TUNABLE + "=")]
  return ":".join(kept + [f"{TUNABLE}=1"])


def should_reexec(environ: Mapping[str, str], mode: Optional[str], glibc) -> bool:
  """Whether re-executing with the tunable would change anything (see the module docstring)."""
  if environ.get(OPT_OUT, "") == "0" or mode != "madvise":
    return False
  if glibc is None or tuple(glibc) < MIN_GLIBC:
    return False
  return TUNABLE + "=" not in environ.get("GLIBC_TUNABLES", "")


def original_environ(environ: Optional[Mapping[str, str]] = None) -> dict:
  """A copy of ``environ`` (default: this process's) as the user started the program, before
  ``use_huge_pages`` added the tunable: for a child process that should run as it would
  without lca_jax (tools/bench_vs_upstream.py runs the paper's code so)."""
  env = dict(os.environ if environ is None else environ)
  if BEFORE in env:
    before = env.pop(BEFORE)
    if before:
      env["GLIBC_TUNABLES"] = before
    else:
      env.pop("GLIBC_TUNABLES", None)
  return env


def _interactive() -> bool:
  return bool(hasattr(sys, "ps1") or sys.flags.interactive) or any(
    m in sys.modules for m in ("IPython", "ipykernel")
  )


def use_huge_pages() -> None:
  """Re-execute this program with the tunable set when that helps; call it before anything
  starts threads (first line of a CLI run as a program). Returns only when nothing is done."""
  if not sys.platform.startswith("linux") or _interactive():
    return
  if not should_reexec(os.environ, thp_mode(), glibc_version()):
    return
  argv = list(getattr(sys, "orig_argv", []))
  if len(argv) < 2 or not sys.executable:
    return
  env = dict(os.environ)
  env[BEFORE] = env.get("GLIBC_TUNABLES", "")
  env["GLIBC_TUNABLES"] = with_tunable(env.get("GLIBC_TUNABLES"))
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    os.execve(sys.executable, [sys.executable] + argv[1:], env)
  except OSError:  # could not re-execute: go on as we are, only slower
    return
