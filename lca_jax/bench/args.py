"""Argument helpers shared by the tools: one-line usage errors, comma lists, counts, shapes."""

from __future__ import annotations

import argparse
import sys

from lca_jax import configs_io
from lca_jax.errors import LcaError


class BenchError(LcaError, ValueError):
  """Bad input: reported in one line, exit status 2."""


def one_line_parser(prog: str, **kw) -> argparse.ArgumentParser:
  """An ArgumentParser (and its subparsers) whose usage errors are one line on stderr,
  ``PROG: error: MESSAGE``, exit status 2."""

  class _Parser(argparse.ArgumentParser):
    def error(self, message):
      print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
      sys.exit(2)

  return _Parser(prog=prog, **kw)


def int_list(s: str) -> list:
  """'1,8,32' -> [1, 8, 32] (blank items skipped); ValueError on a non-integer item."""
  return [int(x) for x in str(s).split(",") if x.strip()]


def flag(name: str) -> str:
  """The option of attribute ``name``: 'new_bytes' -> '--new-bytes'."""
  return "--" + name.replace("_", "-")


def check_min(args, names, lo: int = 1, error=None) -> None:
  """Each attribute of ``names`` is >= ``lo``; otherwise ``error(message)`` (default: raise
  BenchError) naming the option."""
  for name in names:
    v = getattr(args, name)
    if v < lo:
      msg = f"{flag(name)} must be >= {lo}, got {v}"
      if error is None:
        raise BenchError(msg)
      error(msg)


def parse_layers(s: str):
  """'2,4,2,2' -> (enc, lm, dec, mbp); BenchError naming --layers otherwise."""
  try:
    return configs_io.parse_layers(s)
  except configs_io.ConfigFileError as e:
    raise BenchError(str(e)) from None


def add_shape_args(p, d_model=None, d_inner=None, n_heads=None, n_kv_heads=None, layers=None):
  """The model shape flags --d-model --d-inner --n-heads --n-kv-heads --layers."""
  p.add_argument("--d-model", type=int, default=d_model)
  p.add_argument("--d-inner", type=int, default=d_inner)
  p.add_argument("--n-heads", type=int, default=n_heads)
  p.add_argument("--n-kv-heads", type=int, default=n_kv_heads, help="0 = --n-heads")
  p.add_argument("--layers", default=layers, help="ENC,LM,DEC,MBP layer counts")


def shape_of(args) -> dict:
  """The shape flags' values of parsed ``args`` (None: not given)."""
  return {k: getattr(args, k) for k in ("d_model", "d_inner", "n_heads", "n_kv_heads", "layers")}
