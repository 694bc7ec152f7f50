"""Shared CLI plumbing: one-line errors (exit status 2) instead of tracebacks."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Callable, Optional

from lca_jax.errors import LcaError
from lca_jax.model.config import DTYPES


class CliError(LcaError):
  """An error to report in one line."""


def fail(msg: str):
  raise CliError(msg)


def option_message(msg: str, options) -> str:
  """A library message about argument ``name`` ("max_bytes must be ...") as one about its
  command-line option ("--max-bytes must be ...") when ``name`` is one of ``options``."""
  name = msg.split(" ", 1)[0]
  return "--" + name.replace("_", "-") + msg[len(name) :] if name in options else msg


def add_dtype_option(parser, verb: str):
  """``--dtype``: the compute dtype to ``verb`` a checkpoint in (``lca_jax.load(dtype=)``)."""
  parser.add_argument(
    "--dtype",
    choices=DTYPES,
    help=f"compute dtype (default: the checkpoint's); on a CPU {verb} a bfloat16 checkpoint in "
    "float32: XLA:CPU computes bfloat16 dots in float32 anyway, after converting every step",
  )


def trained_length(checkpoint: str) -> Optional[int]:
  """``data.seq_len`` of the work directory ``checkpoint`` trained (None for other layouts)."""
  from lca_jax.workdir.config_file import trained_seq_len  # pylint: disable=g-import-not-at-top

  return trained_seq_len(checkpoint)


def say(name: str, msg: str) -> None:
  """One line about a chosen default on stderr: ``NAME: MSG``."""
  print(f"{name}: {msg}", file=sys.stderr, flush=True)


def length_default(name: str, option: str, checkpoint: str, cap: int) -> int:
  """The value of a left-out length ``option`` (bytes per row): the length the work directory
  ``checkpoint`` trained at, at most ``cap`` (the model's max_seq_len), said in one line;
  ``cap`` for a checkpoint that does not record one."""
  trained = trained_length(checkpoint)
  if trained is None:
    return cap
  value = min(trained, cap)
  say(name, f"{option} {value} (the length the work directory trained at)")
  return value


def prog() -> str:
  return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "lca"


def one_line_warnings(name: Optional[str] = None) -> None:
  """Warnings a run survives (a corrupt checkpoint step skipped, a bad data shard) print as one
  line, ``PROG: warning: MESSAGE``, not Python's two (file:line: Category: message, then the
  source line that issued it, which reads like the start of a traceback)."""
  who = name or prog()

  def fmt(message, category, filename, lineno, line=None):  # noqa: ARG001 - warnings' signature
    return f"{who}: warning: {' '.join(str(message).split())}\n"

  warnings.formatwarning = fmt


def run_main(fn: Callable[[], int]) -> int:
  """Run ``fn``; user-facing errors (bad paths, configs, prompts) become one line on stderr."""
  try:
    return fn()
  except LcaError as e:  # every user-facing error of the package (lca_jax/errors.py)
    print(f"{prog()}: error: {e}", file=sys.stderr, flush=True)
    return 2
  except OSError as e:  # a path that cannot be read or written: one line, not a traceback
    msg = f"{e.strerror or e}: {e.filename}" if e.filename else str(e)
    print(f"{prog()}: error: {msg}", file=sys.stderr, flush=True)
    return 2
  except KeyboardInterrupt:
    print(f"{prog()}: interrupted", file=sys.stderr, flush=True)
    return 130
