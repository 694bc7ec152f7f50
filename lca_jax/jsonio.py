"""Strict JSON for every ``--json`` output and results file (RFC 8259: no NaN or Infinity).

``json.dumps`` writes ``NaN`` / ``Infinity`` by default, which strict parsers (JavaScript's
``JSON.parse``, jq, Go, serde) reject. Here a non-finite number becomes ``null`` (e.g.
``acceptance_rate`` in ntp mode, where no candidate is proposed), numpy scalars and arrays
become plain numbers and lists, and ``allow_nan=False`` guarantees nothing slips through.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np


def jsonable(x: Any) -> Any:
  """``x`` with NaN / +-inf replaced by None, numpy values as Python ones, tuples as lists
  and dict keys as strings."""
  if isinstance(x, np.ndarray):
    return jsonable(x.tolist())
  if isinstance(x, np.generic):
    x = x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {str(k): jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v) for v in x]
  return x


def dumps(obj: Any, **kw) -> str:
  """``json.dumps`` of ``jsonable(obj)`` that never writes NaN or Infinity."""
  return json.dumps(jsonable(obj), allow_nan=False, **kw)


def dump(obj: Any, f, **kw) -> None:
  json.dump(jsonable(obj), f, allow_nan=False, **kw)
