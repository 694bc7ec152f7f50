"""The thunk sequence XLA:GPU dumps while it compiles: what the runtime launches.

``xla_dump_to=DIR`` writes ``*.thunk_sequence_after_thunk_passes.txt`` (or
``*.thunk_sequence.txt`` when no pass changed it): one line per thunk (kernel, copy, library
call, collective) with containers (command buffer = one CUDA graph, while loop, conditional)
whose children are indented under labels ('condition' / 'body' of a loop, 'branch_N' of a
conditional). ``*.thunk_metadata.txt`` names the HLO instruction of each thunk id
(``profile_annotation``). ``parse(text, names)`` gives the tree; ``read_dump(dir)`` both texts.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Dict, List, Optional

_THUNK = re.compile(r"^(\s*)(\d+): (k\w+)\s*(?:\[[^\]]*\])?\s*(\S*)")
_LABELS = r"condition|body|branch_\d+|true_branch|false_branch"
_LABEL = re.compile(rf"^(\s*)({_LABELS}):\s*$")
# an empty branch prints "No thunks." with the next label on the same line
_EMPTY = re.compile(rf"^\s*No thunks\.\s*(?:({_LABELS}):)?\s*$")
_META = re.compile(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)')
SEQUENCE = ("*.thunk_sequence_after_thunk_passes.txt", "*.thunk_sequence.txt")
METADATA = "*.thunk_metadata.txt"


@dataclasses.dataclass
class Thunk:
  """One thunk: ``kind`` (kCustomKernel, kCopy, kGemm, kWhile, kCommandBuffer, ...), its id,
  the HLO instruction it runs (``hlo``, from the metadata; '' when unknown) and its children
  under labels (None for a command buffer's, 'condition' / 'body', 'branch_N')."""

  kind: str
  indent: int
  id: int = 0
  hlo: str = ""
  children: Dict[Optional[str], List["Thunk"]] = dataclasses.field(default_factory=dict)
  label: Optional[str] = None  # where the next child goes

  def add(self, child: "Thunk"):
    self.children.setdefault(self.label, []).append(child)


def parse_metadata(text: str) -> Dict[int, str]:
  """Thunk id -> the HLO instruction it runs."""
  return {int(i): name for name, i in _META.findall(text)}


def parse(text: str, names: Optional[Dict[int, str]] = None) -> Thunk:
  """The thunk sequence as a tree under a root 'kSequence' thunk; indentation gives the nesting.
  ``names``: thunk id -> HLO instruction (``parse_metadata``)."""
  names = names or {}
  root = Thunk("kSequence", -1)
  stack = [root]
  for line in text.splitlines():
    m = _THUNK.match(line)
    if m:
      indent = len(m.group(1))
      while stack[-1].indent >= indent:
        stack.pop()
      node = Thunk(m.group(3), indent, int(m.group(2)), names.get(int(m.group(2)), ""))
      stack[-1].add(node)
      stack.append(node)
      continue
    m = _EMPTY.match(line)
    if m:
      if m.group(1):  # the label that follows belongs to the same container
        stack[-1].label = m.group(1)
        stack[-1].children.setdefault(m.group(1), [])
      continue
    m = _LABEL.match(line)
    if m:
      indent = len(m.group(1))
      # a loop's 'condition:' is printed at column 0 however deep the loop is: it follows
      # the loop's own line
      while stack[-1].indent > indent and not (
        m.group(2) == "condition" and stack[-1].kind == "kWhile"
      ):
        stack.pop()
      stack[-1].label = m.group(2)
      stack[-1].children.setdefault(m.group(2), [])  # kept when it stays empty
  return root


def _read(pattern: str) -> str:
  found = sorted(glob.glob(pattern), key=os.path.getsize)
  if not found:
    return ""
  with open(found[-1]) as f:
    return f.read()


def read_dump(directory: str) -> tuple:
  """(thunk sequence text, metadata text) of the largest module XLA dumped into
  ``directory`` ('' for what is missing)."""
  seq = ""
  for pattern in SEQUENCE:
    seq = _read(os.path.join(directory, pattern))
    if seq:
      break
  return seq, _read(os.path.join(directory, METADATA))


def loops(t: Thunk, in_graph: bool = False):
  """Every while loop under ``t``, with whether it runs inside a command buffer."""
  for kids in t.children.values():
    for c in kids:
      if c.kind == "kWhile":
        yield c, in_graph
      yield from loops(c, in_graph or c.kind == "kCommandBuffer")


def kernels(t: Thunk, pick=max) -> int:
  """Device work items one run of ``t`` executes (kernels, copies, library calls): a
  conditional's largest branch (``pick=min``: its smallest), a loop's condition and body once."""
  if not t.children:
    return 0 if t.kind in ("kCommandBuffer", "kSequence") else 1
  if t.kind == "kConditional":
    return pick(sum(kernels(k, pick) for k in c) for c in t.children.values())
  return sum(kernels(c, pick) for kids in t.children.values() for c in kids)


def decode_loop(root: Thunk):
  """(the decode loop: the while loop that runs the most kernels, whether it runs inside a
  command buffer)."""
  found = list(loops(root))
  if not found:
    raise ValueError("no while loop in the thunk sequence")
  return max(found, key=lambda lt: kernels(lt[0]))
