"""Estimated time of a compiled TPU program, op by op, from its optimized HLO.

A TPU executable has no thunk sequence to walk (``estimate`` walks a GPU's): the TPU runs the
optimized HLO's entry computation op after op, each top-level fusion, convolution, copy,
collective or custom call (a Pallas kernel lowered by Mosaic: ``tpu_custom_call``) as one
program on the chip. Each is priced by ``estimate.kernel_cost`` (FLOPs of its dots, bytes of
its operands and results, max(FLOPs / dot peak, bytes / HBM bandwidth) at the fractions of
``hardware.Tpu``); a Pallas attention kernel (``estimate.PALLAS_PRODUCTS``) from its query
operand and the keys it visits per query (``Hints.keys_per_query``). Async copies between HBM
and on-chip memory (``copy-start``: prefetches that overlap the computation) and the halves
that wait for async work (``*-done``) cost nothing of their own; a dynamic-update-slice or
scatter outside a fusion moves its update (the buffer is updated in place), a slice its slice; every other op but a scalar
one (the scalar unit's: loop counters, predicates) adds ``OP_S``.

Loops run their condition and body ``trips`` times: XLA's ``known_trip_count`` when the HLO
has it (``hlo.Instr.trip_count``), else the count a counted loop's condition states (an index
from a constant start compared with a constant bound: the scans over layers and micro-batches),
else ``Hints.trips`` by the loop's source path (the blockwise attention's tile loops), else
once, counted in ``unknown_loops``. Conditionals run the branch ``branch`` picks.

``compiler_seconds`` reads XLA's own whole-program estimate (``cost_analysis()``'s
``optimal_seconds``); it holds only for a program without loops (a loop's body is counted once)
and is negative when XLA has none. ``step_estimate`` takes it where it holds, else this model,
and says which (``source``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from lca_jax.perf import estimate, hlo, hlo_stats
from lca_jax.perf.estimate import Hints, Tally
from lca_jax.perf.hardware import Tpu

# ops that start no work of their own: plumbing, the halves that wait for async work, prefetches
FREE = hlo_stats.FREE_OPS | frozenset(
  {
    "copy-start",
    "copy-done",
    "slice-done",
    "async-done",
    "async-update",
    "all-gather-done",
    "all-reduce-done",
    "collective-permute-done",
    "send-done",
    "recv-done",
    "after-all",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "add-dependency",
    "domain",
  }
)
# custom calls that only mark buffers or async boundaries for the compiler
FREE_TARGETS = ("AllocateBuffer", "PrepareAsyncCallStart", "PrepareAsyncCallDone")
COMPILER = "compiler (cost_analysis optimal_seconds)"
# what an op costs besides its FLOPs and bytes (the core issuing it, its pipeline filling and
# draining): a guess, like the GPU's launch constants, until a TPU measures it
OP_S = 1e-6
MODEL = "per-op model (lca_jax.perf.tpu)"
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_DIRECTION = re.compile(r"direction=(\w+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KERNEL_NAME = re.compile(r'"kernel_name"\s*:\s*"([^"]+)"|kernel_name=\\?"?([\w.\-]+)')


def _constant(module: hlo.Module, name: str, depth: int = 0) -> Optional[int]:
  """The integer value of scalar ``name`` when it is a constant (through copies)."""
  instr = module.by_name.get(name)
  if instr is None or depth > 4:
    return None
  if instr.op == "constant" and re.fullmatch(r"-?\d+", instr.args.strip()):
    return int(instr.args)
  if instr.op in ("copy", "bitcast", "convert") and instr.operands:
    return _constant(module, instr.operands[0], depth + 1)
  return None


def _tuple_index(module: hlo.Module, name: str) -> Optional[int]:
  """``i`` when ``name`` is ``get-tuple-element(parameter), index=i``."""
  instr = module.by_name.get(name)
  if instr is None or instr.op != "get-tuple-element":
    return None
  m = re.search(r"index=(\d+)", instr.attrs)
  return int(m.group(1)) if m else None


def counted_trips(module: hlo.Module, loop: hlo.Instr) -> Optional[int]:
  """Trips of a counted loop: its condition compares a tuple element (the index) with a
  constant bound (``i < N``), the loop starts the index at a constant and its body adds a
  constant step (``_step``); None otherwise."""
  cond = _CONDITION.search(loop.attrs)
  root = module.root(cond.group(1)) if cond else None
  if root is None or root.op != "compare" or len(root.operands) != 2 or not loop.operands:
    return None
  direction = _DIRECTION.search(root.attrs)
  direction = direction.group(1) if direction else ""
  a, b = root.operands
  if direction in ("GT", "GE"):
    a, b = b, a
    direction = {"GT": "LT", "GE": "LE"}[direction]
  index, bound = _tuple_index(module, a), _constant(module, b)
  if index is None or bound is None or direction not in ("LT", "LE"):
    return None
  init = module.by_name.get(loop.operands[0])
  if init is None or init.op != "tuple" or index >= len(init.operands):
    return None
  start = _constant(module, init.operands[index])
  if start is None:
    return None
  step = _step(module, loop, index)
  return max(-(-(bound - start + (direction == "LE")) // step), 0)


def _step(module: hlo.Module, loop: hlo.Instr, index: int) -> int:
  """What the loop body adds to its index (tuple element ``index``) each trip: 1 unless the
  body's root sets it to index + constant (XLA:TPU's collective matmul loops step by 2)."""
  body = _BODY.search(loop.attrs)
  root = module.root(body.group(1)) if body else None
  if root is None or root.op != "tuple" or index >= len(root.operands):
    return 1
  update = module.by_name.get(root.operands[index])
  if update is None or update.op != "add" or len(update.operands) != 2:
    return 1
  a, b = update.operands
  for counter, constant in ((a, b), (b, a)):
    k = _constant(module, constant)
    if _tuple_index(module, counter) == index and k is not None and k > 0:
      return k
  return 1


def trips(module: hlo.Module, loop: hlo.Instr, hints: Hints) -> Optional[float]:
  """A while loop's trip count (module docstring), None when nothing says."""
  if loop.trip_count is not None:
    return float(loop.trip_count)
  counted = counted_trips(module, loop)
  if counted is not None:
    return float(counted)
  return Hints.lookup(hints.trips, loop.op_name)


def _target(instr: hlo.Instr) -> str:
  m = _TARGET.search(instr.attrs)
  return m.group(1) if m else ""


def kernel_name(instr: hlo.Instr) -> str:
  """The Pallas kernel a ``tpu_custom_call`` runs (its name, else its source path)."""
  m = _KERNEL_NAME.search(instr.attrs)
  return (m.group(1) or m.group(2)) if m else instr.op_name


def pallas_flops(module: hlo.Module, instr: hlo.Instr, hints: Hints) -> float:
  """FLOPs of a Pallas attention kernel from its first 4-D operand (the queries, in any
  order of B, T, H, D) and the keys it visits per query; 0 for any other kernel."""
  name = kernel_name(instr) + " " + instr.op_name
  kernel = next((k for k in estimate.PALLAS_PRODUCTS if k in name), None)
  keys = Hints.lookup(hints.keys_per_query, instr.op_name)
  ops = [hlo.arrays(module.type_of(o)) for o in instr.operands]
  q = next((a[0][1] for a in ops if a and len(a[0][1]) == 4), None)
  if kernel is None or keys is None or q is None:
    return 0.0
  b, h, t, d = q
  return 2.0 * estimate.PALLAS_PRODUCTS[kernel] * b * t * h * d * keys


class Walker:
  """Walks a TPU program's computations and prices each op once (cached by name)."""

  def __init__(
    self, module: hlo.Module, chip: Tpu, hints: Hints = Hints(), n_devices: int = 1, op_s=OP_S
  ):
    self.module, self.chip, self.hints, self.n_devices = module, chip, hints, n_devices
    self.op_s = op_s
    self._costs: dict = {}

  def cost(self, instr: hlo.Instr) -> Optional[estimate.KernelCost]:
    if instr.name not in self._costs:
      c = estimate.kernel_cost(self.module, instr.name, self.chip, self.hints, self.n_devices)
      if c is not None and instr.op in estimate.IN_PLACE and len(instr.operands) > 1:
        # an update in place outside a fusion: reads and writes the update, not the buffer
        update = hlo.nbytes(self.module.type_of(instr.operands[estimate.IN_PLACE[instr.op]]))
        c = self._bytes(c, 2.0 * update)
      elif c is not None and instr.op in estimate.SLICING:  # reads and writes the slice
        c = self._bytes(c, 2.0 * hlo.nbytes(instr.type))
      elif c is not None and instr.op == "slice-start":
        # an async slice into another memory space (a weight's rows prefetched into VMEM): its
        # type is ((operands), slices, s32[] context); it reads the slices from HBM once
        c = self._bytes(c, hlo.nbytes(instr.type) - _operand_bytes(self.module, instr))
      if c is not None and instr.op == "custom-call" and _target(instr) == "tpu_custom_call":
        flops = pallas_flops(self.module, instr, self.hints)
        peak = self.chip.bf16_flops
        c = dataclasses.replace(
          c,
          category="attention" if flops else c.category,
          flops=flops,
          compute_s=flops / (peak * self.chip.dot_efficiency),
          floor_s=max(flops / peak, c.bytes / self.chip.memory_bytes_per_s),
        )
      self._costs[instr.name] = c
    return self._costs[instr.name]

  def _bytes(self, c: estimate.KernelCost, nbytes: float) -> estimate.KernelCost:
    bw = self.chip.memory_bytes_per_s
    return dataclasses.replace(
      c,
      bytes=nbytes,
      memory_s=nbytes / (bw * self.chip.memory_efficiency),
      floor_s=max(c.flops / self.chip.bf16_flops, nbytes / bw),
    )

  def loop(self, instr: hlo.Instr, branch: str = "max", times: Optional[float] = None) -> Tally:
    """A while loop: condition and body ``times`` times (default: its trip count)."""
    tally = Tally()
    n = trips(self.module, instr, self.hints) if times is None else times
    if n is None:
      tally.unknown_loops += 1
      n = 1.0
    once = Tally()
    for pattern in (_CONDITION, _BODY):
      m = pattern.search(instr.attrs)
      if m:
        once.add(self.walk(m.group(1), branch))
    tally.add(once, n)
    return tally

  def walk(self, computation: str, branch: str = "max") -> Tally:
    """What one run of ``computation`` costs (its top-level ops; fusion bodies are priced
    with their fusion)."""
    tally = Tally()
    for instr in self.module.computations.get(computation, []):
      op = instr.op
      if op in FREE or (op == "custom-call" and _target(instr) in FREE_TARGETS):
        continue
      if op == "while":
        tally.add(self.loop(instr, branch))
      elif op == "conditional":
        runs = [self.walk(c, branch) for c in instr.called]
        if runs:
          pick = max if branch == "max" else min
          tally.add(pick(runs, key=Tally.time_s))
      elif op in ("call", "async-start"):
        for c in instr.called:
          tally.add(self.walk(c, branch))
      else:
        cost = self.cost(instr)
        if cost is not None:
          tally.kernels.setdefault(instr.name, [0.0, cost])[0] += 1
          if instr.shape or op in ("fusion", "custom-call"):  # scalar ops: the scalar unit's
            tally.launches += 1
            tally.launches_s += self.op_s
    return tally


def _operand_bytes(module: hlo.Module, instr: hlo.Instr) -> float:
  return sum(hlo.nbytes(module.type_of(o)) for o in instr.operands)


def _size(module: hlo.Module, computation: str, seen=None) -> int:
  """Ops a computation runs (its own and those of the loops, calls and branches inside)."""
  seen = set() if seen is None else seen
  if computation in seen:
    return 0
  seen.add(computation)
  n = 0
  for instr in module.computations.get(computation, []):
    if instr.op in FREE:
      continue
    n += 1
    if instr.op in ("while", "conditional", "call"):
      n += sum(_size(module, c, seen) for c in instr.called)
  return n


def program_estimate(
  hlo_text: str, chip: Tpu, hints: Hints = Hints(), n_devices=1, top=15, op_s: float = OP_S
):
  """``estimate.summary`` of one run of the whole program (conditionals at their costliest
  branch); ``launches`` counts the ops run, ``launch_s`` their fixed cost (``OP_S`` each)."""
  module = hlo.parse(hlo_text)
  walker = Walker(module, chip, hints, n_devices, op_s)
  return estimate.summary(walker.walk(module.entry), chip, top)


def decode_steps(hlo_text: str, chip: Tpu, hints: Hints = Hints(), top=15):
  """(idle step, LM step) summaries of one step of the decode loop (the while loop that runs
  the most ops: its condition and body once), the conditionals at their cheapest branch (the
  latent LM does not run) and at their costliest (it runs)."""
  module = hlo.parse(hlo_text)
  loops = [i for instrs in module.computations.values() for i in instrs if i.op == "while"]
  if not loops:
    raise ValueError("the program has no decode loop (no while loop)")
  loop = max(loops, key=lambda i: sum(_size(module, c) for c in i.called))
  walker = Walker(module, chip, hints)
  return tuple(
    estimate.summary(walker.loop(loop, branch, times=1.0), chip, top) for branch in ("min", "max")
  )


def compiler_seconds(compiled) -> Optional[float]:
  """XLA's whole-program estimate (``optimal_seconds`` of ``cost_analysis()``), None when the
  compiler gives none."""
  try:
    ca = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 - a backend without a cost analysis
    return None
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  value = (ca or {}).get("optimal_seconds")
  return None if value is None else float(value)


def has_loops(hlo_text: str) -> bool:
  return any(
    i.op == "while" for instrs in hlo.parse(hlo_text).computations.values() for i in instrs
  )


def step_estimate(model_s: float, compiler_s: Optional[float], loops: bool) -> dict:
  """The estimate to report: XLA's where it holds (positive, a program without loops), else
  the per-op model's, with the reason."""
  if compiler_s is not None and compiler_s > 0 and not loops:
    return dict(step_s=compiler_s, source=COMPILER, compiler_s=compiler_s, model_s=model_s)
  why = (
    "the compiler gives none"
    if compiler_s is None
    else "its loops are counted once by the compiler"
    if loops
    else "the compiler's is not positive"
  )
  return dict(step_s=model_s, source=MODEL, why=why, compiler_s=compiler_s, model_s=model_s)
