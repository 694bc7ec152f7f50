"""XLA's optimized HLO text (``compiled.as_text()``) as instructions with shapes.

``parse(text)`` gives a ``Module``: every computation's instructions (name, result type, op,
operand names, called computations, the rest of the line), a table from instruction name to
instruction (names are unique in a module) and which computations are fusion bodies. Shapes
come from the result types: ``arrays(type)`` lists a (possibly tuple) type's arrays as
(element type, dims), ``nbytes(type)`` their bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Dict, List, Optional, Tuple

_ARRAY = re.compile(r"\b(pred|bf16|tf32|f8\w*|[fsuc]\d+)\[([\d,]*)\]")
_LINE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"\s*([a-z][\w\-]*)\(")
_NAME = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(
  r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')

_ITEMSIZE = {"pred": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "tf32": 4, "c64": 8, "c128": 16}


def itemsize(dtype: str) -> float:
  if dtype in _ITEMSIZE:
    return _ITEMSIZE[dtype]
  if dtype.startswith("f8"):
    return 1
  bits = int(re.sub(r"\D", "", dtype) or 32)
  return bits / 8


def arrays(type_str: str) -> List[Tuple[str, Tuple[int, ...]]]:
  """(element type, dims) of every array in a result type (one for an array, several for a
  tuple)."""
  return [
    (dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(type_str)
  ]


def nbytes(type_str: str) -> float:
  return float(sum(itemsize(dt) * math.prod(dims) for dt, dims in arrays(type_str)))


@dataclasses.dataclass
class Instr:
  name: str
  type: str  # result type text: "bf16[8,128]{1,0}" or a tuple "(s32[], f32[4])"
  op: str
  operands: List[str]
  called: List[str]  # computations it runs (fusion body, loop body / condition, branches)
  attrs: str  # the rest of the line (attributes, metadata, backend config)
  root: bool = False
  args: str = ""  # the text between the op's parentheses ("0" for parameter(0))

  @property
  def op_name(self) -> str:
    m = _OP_NAME.search(self.attrs)
    return m.group(1) if m else ""

  @property
  def trip_count(self) -> Optional[int]:
    """A while loop's trip count when XLA knows it (``known_trip_count``), else None."""
    m = _TRIP.search(self.attrs)
    return int(m.group(1)) if m else None

  @property
  def shape(self) -> Tuple[int, ...]:
    a = arrays(self.type)
    return a[0][1] if a else ()

  @property
  def dtype(self) -> str:
    a = arrays(self.type)
    return a[0][0] if a else ""


def _balanced(s: str, start: int) -> int:
  """Index just past the parenthesis group opening at ``s[start]``."""
  depth = 0
  for i in range(start, len(s)):
    if s[i] == "(":
      depth += 1
    elif s[i] == ")":
      depth -= 1
      if depth == 0:
        return i + 1
  return len(s)


def parse_instr(line: str) -> Optional[Instr]:
  m = _LINE.match(line)
  if not m:
    return None
  rest = m.group(3)
  if rest.startswith("("):
    end = _balanced(rest, 0)
  else:
    end = rest.find(" ")
    end = len(rest) if end < 0 else end
  type_str, rest = rest[:end], rest[end:]
  op = _OP.match(rest)
  if not op:
    return None
  open_at = op.end() - 1
  close = _balanced(rest, open_at)
  operands = _NAME.findall(rest[open_at:close])
  attrs = rest[close:]
  called = [c for _, c in _CALLED.findall(attrs)]
  branches = _BRANCHES.search(attrs)
  if branches:
    called += [n.strip().lstrip("%") for n in branches.group(1).split(",") if n.strip()]
  args = rest[open_at + 1 : close - 1]
  return Instr(m.group(2), type_str, op.group(1), operands, called, attrs, bool(m.group(1)), args)


@dataclasses.dataclass
class Module:
  computations: Dict[str, List[Instr]]
  entry: str
  by_name: Dict[str, Instr]
  fusion_bodies: frozenset

  def root(self, computation: str) -> Optional[Instr]:
    instrs = self.computations.get(computation, [])
    return next((i for i in instrs if i.root), instrs[-1] if instrs else None)

  def type_of(self, name: str) -> str:
    instr = self.by_name.get(name)
    return instr.type if instr else ""


def parse(text: str) -> Module:
  comps: Dict[str, List[Instr]] = {}
  entry, cur = "", None
  for line in text.splitlines():
    if not line.startswith(" "):
      m = _HEADER.match(line)
      if m:
        cur = m.group(2)
        comps[cur] = []
        if m.group(1):
          entry = cur
      elif line.startswith("}"):
        cur = None
      continue
    if cur is not None:
      instr = parse_instr(line)
      if instr is not None:
        comps[cur].append(instr)
  by_name = {i.name: i for instrs in comps.values() for i in instrs}
  bodies = frozenset(
    c for instrs in comps.values() for i in instrs if i.op == "fusion" for c in i.called
  )
  return Module(comps, entry, by_name, bodies)
