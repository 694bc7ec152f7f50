"""What one decode step costs, read from the optimized HLO of the compiled decode loop.

The engine compiles prefill + ``lax.while_loop``; the loop's body is one decode step. These
functions parse ``compiled.as_text()`` (no run needed) and report, for that body and every
computation it calls (conditional branches, nested loops; fusions count as one op each): the
number of ops the runtime executes per step at most (of a conditional, its largest branch), how
many are dots and fusions, and every ``copy`` with its size. A copy of a cache-sized buffer in a decode step is a bug (the step should update
its caches in place: see ``layers.cached_attention``), and so is a concatenate of weights
(``step_concatenates``, fusion bodies included: the fused decode kernels are built once per
call, before the loop, see ``layers.fuse_decode_params``).
"""

from __future__ import annotations

import re
from typing import Dict, List

import numpy as np

# ops that cost nothing at run time (aliases, tuple plumbing, literals)
FREE_OPS = frozenset({"parameter", "get-tuple-element", "tuple", "constant", "bitcast"})
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2}
_HEADER = re.compile(r"^(?:ENTRY )?(%?[\w.\-]+) .*\{\s*$")
_OP = re.compile(r"(?:^|\s)([a-z][\w\-]*)\(")  # first ``name(`` after the result type
_SHAPE = re.compile(r"=\s*([a-z]+\d*)\[([\d,]*)\]")


def computations(hlo_text: str) -> Dict[str, List[str]]:
  """Computation name -> its instruction lines; the entry computation is also under 'ENTRY'."""
  comps: Dict[str, List[str]] = {}
  cur = None
  for line in hlo_text.splitlines():
    m = _HEADER.match(line)
    if m and not line.startswith(" "):
      cur = m.group(1)
      comps[cur] = []
      if line.startswith("ENTRY"):
        comps["ENTRY"] = comps[cur]
    elif cur is not None and line.startswith("  ") and "=" in line:
      comps[cur].append(line.strip())
  return comps


def instr_name(instr: str) -> str:
  """An instruction's own name, without ``%`` (what XLA:CPU's profiler events are named)."""
  return instr.split(" = ", 1)[0].replace("ROOT ", "").strip().lstrip("%")


def op_name(instr: str) -> str:
  m = _OP.search(instr.split(" = ", 1)[-1])
  return m.group(1) if m else ""


def result_bytes(instr: str) -> int:
  """Bytes of an instruction's (array) result; 0 for tuples."""
  m = _SHAPE.search(instr)
  if not m:
    return 0
  dims = [int(d) for d in m.group(2).split(",") if d]
  itemsize = _DTYPE_BYTES.get(m.group(1), 8 if m.group(1).endswith("64") else 4)
  return int(np.prod(dims, dtype=np.int64)) * itemsize if dims else itemsize


def called(instr: str, into_fusions: bool = False) -> List[str]:
  """Computations an instruction runs (fusion bodies only with ``into_fusions``: for counting,
  a fusion is one op)."""
  names = []
  keys = ("body", "condition", "to_apply", "true_computation", "false_computation")
  for key in keys + (("calls",) if into_fusions else ()):
    m = re.search(rf"\b{key}=(%?[\w.\-]+)", instr)
    if m:
      names.append(m.group(1))
  m = re.search(r"branch_computations=\{([^}]*)\}", instr)
  if m:
    names += [n.strip() for n in m.group(1).split(",") if n.strip()]
  return names


def decode_loop_body(hlo_text: str) -> str:
  """Name of the body of the decode loop: of the while loops reached from the entry computation
  (through calls; loops nested in another loop's body are not candidates), the one whose body
  runs the most instructions. Not simply the first: a sampled decode splits its PRNG keys
  before the loop, in a small while loop of its own (threefry)."""
  comps = computations(hlo_text)
  todo, seen, bodies = ["ENTRY"], set(), []
  while todo:
    name = todo.pop(0)
    if name in seen:
      continue
    seen.add(name)
    for instr in comps.get(name, []):
      if op_name(instr) == "while":
        bodies.append(re.search(r"\bbody=(%?[\w.\-]+)", instr).group(1))
      if op_name(instr) == "call":
        todo += called(instr)
  if not bodies:
    raise ValueError("no while loop reachable from the entry computation")
  return max(bodies, key=lambda body: sum(1 for _ in _instructions_under(comps, body)))


def _instructions_under(comps, root: str, into_fusions: bool = False):
  """Instruction lines of computation ``root`` and every computation it calls, each once (and
  the bodies of its fusions with ``into_fusions``)."""
  seen, todo = set(), [root]
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for instr in comps[name]:
      todo += called(instr, into_fusions)
      yield instr


def _step_instructions(hlo_text: str, into_fusions: bool = False):
  """Instruction lines of one decode step: the loop body and every computation it calls, each
  once (and the bodies of its fusions with ``into_fusions``)."""
  yield from _instructions_under(computations(hlo_text), decode_loop_body(hlo_text), into_fusions)


def result_dims(instr: str) -> tuple:
  """Dimensions of an instruction's (array) result; () for scalars and tuples."""
  m = _SHAPE.search(instr)
  return tuple(int(d) for d in m.group(2).split(",") if d) if m else ()


def step_concatenates(hlo_text: str) -> List[dict]:
  """Every concatenate one decode step executes, fused or not (dtype, dims, bytes): weights
  concatenated inside the loop would be copied every step (see
  ``layers.fuse_decode_params``)."""
  out = []
  for instr in _step_instructions(hlo_text, into_fusions=True):
    if op_name(instr) == "concatenate":
      dtype = _SHAPE.search(instr).group(1)
      out.append({"dtype": dtype, "dims": result_dims(instr), "bytes": result_bytes(instr)})
  return out


def _most_run(comps, name: str, memo: dict) -> np.ndarray:
  """(ops, dots, fusions) that one run of computation ``name`` executes at most: its own ops,
  those of the computations it calls (a loop's body and condition once), and of a conditional
  the branch that runs the most ops (only one runs)."""
  if name in memo:
    return memo[name]
  memo[name] = total = np.zeros(3, np.int64)  # a cycle (none in HLO) would count 0
  for instr in comps.get(name, []):
    op = op_name(instr)
    if op in FREE_OPS or not op:
      continue
    total += (1, op == "dot", op == "fusion")
    runs = [_most_run(comps, c, memo) for c in called(instr)]
    if op == "conditional" and runs:
      total += max(runs, key=lambda c: c[0])
    else:
      total += sum(runs, np.zeros(3, np.int64))
  return total


def step_stats(hlo_text: str, min_copy_bytes: int = 0) -> dict:
  """Ops one decode step runs at most (the loop body and what it calls; of a conditional, the
  branch with the most ops: the latent LM compiled for several widths runs one of them), dots
  and fusions among them, and the copies of at least ``min_copy_bytes`` bytes anywhere in the
  step, any branch (shape string and bytes)."""
  comps = computations(hlo_text)
  ops, dots, fusions = (int(x) for x in _most_run(comps, decode_loop_body(hlo_text), {}))
  copies = []
  for instr in _step_instructions(hlo_text):
    if op_name(instr) == "copy" and result_bytes(instr) >= min_copy_bytes:
      copies.append(
        {"shape": _SHAPE.search(instr).group(0)[1:].strip(), "bytes": result_bytes(instr)}
      )
  return {"ops": ops, "dots": dots, "fusions": fusions, "copies": copies}


# control flow: its run time is that of the ops it runs, which are counted themselves
CONTROL_OPS = frozenset({"while", "conditional", "call"})


def step_op_kinds(hlo_text: str) -> Dict[str, str]:
  """Name (without %) -> kind of every op one decode step runs: ``cache_dot`` (a dot with batch
  dimensions, rows and heads: the attention products over the KV caches), ``dot`` (the weight
  products), ``fusion``, or the op's own name; free ops and control flow are left
  out. For attributing profiler events to a step (tools/bench_decode.py --profile)."""
  kinds = {}
  for instr in _step_instructions(hlo_text):
    op = op_name(instr)
    if not op or op in FREE_OPS or op in CONTROL_OPS:
      continue
    name = instr_name(instr)
    if op == "dot":
      op = "cache_dot" if "lhs_batch_dims=" in instr else "dot"
    kinds[name] = op
  return kinds
