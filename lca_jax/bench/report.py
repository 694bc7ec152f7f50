"""What a tool prints: one JSON object on stdout, progress and errors as lines on stderr."""

from __future__ import annotations

import json
import sys


def print_json(obj, indent: int = 1):
  """``obj`` as indented JSON on stdout; returns ``obj``."""
  print(json.dumps(obj, indent=indent))
  return obj


def progress(prog: str, msg: str) -> None:
  """``PROG: MSG`` on stderr as a phase ends: a run cut short by a timeout shows how far it got."""
  print(f"{prog}: {msg}", file=sys.stderr, flush=True)


def error(prog: str, msg) -> int:
  """``PROG: error: MSG`` on stderr; returns the exit status of bad input, 2."""
  print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
  return 2
