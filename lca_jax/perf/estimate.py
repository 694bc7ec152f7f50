"""Estimated time of a compiled GPU program, kernel by kernel, without a GPU.

Every kernel the runtime launches (a thunk of the dumped thunk sequence, ``thunks``) is priced
from the HLO instruction it runs (``hlo``):

* FLOPs: of every dot in it (a fusion's body, nested fusions included) 2 M N K from the HLO
  shapes; a cuBLAS call from its dot dimensions; a cuDNN attention from q, k and the mask
  type; a Pallas kernel (``__gpu$xla.gpu.triton``) from its operands and the keys it visits
  per query (``Hints.keys_per_query``: the blocks it computes under the mask), with the number
  of products per (query, key) pair of ``PALLAS_PRODUCTS``.
* bytes: the operands it reads and the results it writes. A fusion parameter that the body
  only slices (``dynamic-slice``, ``slice``, ``gather``: itself or in a fusion nested in it)
  counts the slices; a buffer updated in place (``dynamic-update-slice``, ``scatter``) counts
  the update, not the buffer; a copy reads and writes.
* time = max(FLOPs / (dot peak of its operand type x ``dot_efficiency``), bytes / (bandwidth x
  ``memory_efficiency``)) + the launch cost (``hardware.Launch``: a node inside a CUDA graph,
  or a host launch); collectives bytes / NVLink (ring: an all-reduce moves 2 (n - 1) / n of
  its bytes, all-gather and reduce-scatter (n - 1) / n), counted as if nothing overlapped them.

The walk: a command buffer outside a graph is one host launch; a while loop runs its condition
and body ``trip_count`` times (XLA's ``known_trip_count``; else ``Hints.trips`` by the loop's
source path; else once, counted in ``unknown_loops``) plus a host sync per trip outside a
graph; a conditional runs the branch ``branch`` picks ('max': the most expensive, 'min': the
cheapest) plus a sync outside a graph.

``floor_s`` is the same sum at the datasheet peaks with no launch cost: the roofline floor the
estimate never goes below. What it leaves out: overlap of independent kernels (streams), caches
(every operand is read from HBM), tile quantisation and occupancy inside a kernel, and any
time the host spends outside launches.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

from lca_jax.perf import hlo, thunks
from lca_jax.perf.hardware import Gpu, Launch

# products of a D-long dot per (query, key) pair per head: forward QK^T, PV; backward dq:
# QK^T (recomputed), dO V^T, dS K; dk/dv: QK^T, P^T dO, dO V^T, dS^T Q
PALLAS_PRODUCTS = {"lca_attention_fwd": 2, "lca_attention_bwd_dq": 3, "lca_attention_bwd_dkdv": 4}
# the fused decode kernels (kernels/decode_fused.py): rows x their weight (the largest operand)
PALLAS_ROWS_TIMES_WEIGHT = ("decode_norm_matvec", "decode_norm_glu", "decode_matvec_residual")
# kernels that read the buffers they update in place (kernels/decode_attention.py: attention over
# the cache it writes the new entries into): priced at every operand, not only the update
PALLAS_READS_UPDATED = ("decode_cache_attention",)
SLICING = frozenset({"dynamic-slice", "slice", "gather"})
# updates of a buffer in place: the operand that holds the update (the buffer is operand 0)
IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}
TRANSPARENT = frozenset({"bitcast", "reshape", "get-tuple-element"})
COLLECTIVES = {
  "all-reduce": 2.0,  # ring: 2 (n - 1) / n of the bytes
  "all-reduce-start": 2.0,
  "all-gather": 1.0,  # (n - 1) / n of the gathered bytes
  "all-gather-start": 1.0,
  "reduce-scatter": 1.0,
  "all-to-all": 1.0,
  "collective-permute": None,  # each device sends its bytes once
  "collective-permute-start": None,
}
CATEGORIES = ("gemm", "attention", "elementwise", "copy", "collective", "launch")
ATTENTION_SCOPES = ("/attn/", "lca_attention", "blockwise_attention", "dot_product_attention")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CONV_LABELS = re.compile(r"dim_labels=\w+_(\w+)->")
_CONV_LHS = re.compile(r"dim_labels=(\w+)_")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_CUBLAS_CONTRACT = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CAUSAL = re.compile(r'"mask_type":\s*"CAUSAL"')  # cuDNN attention's backend config
_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_NO_WORK = ("Done", "kWaitForStreams", "kSequence")
_ALIASED = re.compile(r":\s*\((\d+),")  # {output}: (operand index, {shape index})


@dataclasses.dataclass(frozen=True)
class Hints:
  """What the compiled program cannot say, by the source path of the op (first match).

  ``trips``: (substring of a while loop's op_name, expected trip count) for loops whose count
  XLA does not know (the blockwise attention's tile loops); ``keys_per_query``: (substring of a
  Pallas kernel's op_name, keys it visits per query row, in whole blocks)."""

  trips: Tuple[Tuple[str, float], ...] = ()
  keys_per_query: Tuple[Tuple[str, float], ...] = ()

  @staticmethod
  def lookup(pairs, path: str) -> Optional[float]:
    return next((v for k, v in pairs if k in path), None)


@dataclasses.dataclass
class KernelCost:
  name: str
  category: str
  flops: float
  bytes: float
  compute_s: float  # FLOPs at the achievable dot peak
  memory_s: float  # bytes at the achievable bandwidth (or over NVLink for a collective)
  floor_s: float  # the same at the datasheet peaks


def _operand_types(module: hlo.Module, instr: hlo.Instr) -> List[str]:
  return [module.type_of(o) for o in instr.operands]


def _dot_flops(module: hlo.Module, instr: hlo.Instr) -> Tuple[float, str, bool]:
  """(FLOPs, operand type, HIGHEST precision) of a dot or convolution instruction."""
  lhs = hlo.arrays(module.type_of(instr.operands[0])) if instr.operands else []
  if not lhs:
    return 0.0, "", False
  dtype, dims = lhs[0]
  out = math.prod(instr.shape)
  if instr.op == "dot":
    m = _CONTRACT.search(instr.attrs)
    k = math.prod(dims[int(c)] for c in m.group(1).split(",") if c) if m else 1
  else:  # convolution: each output element sums kernel window x input features
    rhs = hlo.arrays(module.type_of(instr.operands[1]))
    labels = _CONV_LABELS.search(instr.attrs)  # e.g. 0fb_0io->bf0: rhs output features at "o"
    rhs_dims = rhs[0][1] if rhs else ()
    o = labels.group(1).find("o") if labels else -1
    out_features = rhs_dims[o] if 0 <= o < len(rhs_dims) else (instr.shape or (1,))[-1]
    k = math.prod(rhs_dims) / max(out_features, 1) if rhs else 1
    taps = _window_taps(instr, dims, labels)
    if taps is not None:  # a padded window: only the taps over the input multiply
      return 2.0 * out * k * taps, dtype, "highest" in instr.attrs
  return 2.0 * out * k, dtype, "highest" in instr.attrs


def _window_taps(instr: hlo.Instr, lhs_dims, labels) -> Optional[float]:
  """The fraction of a convolution's window taps, over all output positions, that land on an
  input element rather than on padding or on the holes of a dilated input: XLA:TPU writes some
  projections as a window of 8 over a dimension of 1 padded 7 on each side, and batched
  products as windows over the batch dimensions with a dilated input, where one tap in 8 or
  in 128 multiplies. None when the window has none of these (every tap counts)."""
  window = _WINDOW.search(instr.attrs)
  lhs_labels = _CONV_LHS.search(instr.attrs)
  if window is None or labels is None or lhs_labels is None:
    return None
  fields = dict(f.split("=", 1) for f in window.group(1).split() if "=" in f)
  if not any(k in fields for k in ("pad", "stride", "lhs_dilate", "rhs_dilate")):
    return None
  sizes = [int(x) for x in fields.get("size", "").split("x") if x]
  rank = len(sizes)
  per_dim = lambda key, default: (
    [int(x) for x in fields[key].split("x")] if key in fields else [default] * rank
  )
  strides, lhs_d, rhs_d = per_dim("stride", 1), per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
  pads = (
    [tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x")]
    if "pad" in fields
    else [(0, 0)] * rank
  )
  fraction = 1.0
  for d in range(rank):
    n = lhs_dims[lhs_labels.group(1).index(str(d))]
    w, st, dl, dr, (lo, hi) = sizes[d], strides[d], lhs_d[d], rhs_d[d], pads[d]
    span = (n - 1) * dl + 1  # the dilated input
    positions = (span + lo + hi - ((w - 1) * dr + 1)) // st + 1
    if positions <= 0 or positions * w > 1 << 22:
      return None
    hits = sum(
      1
      for o in range(positions)
      for t in range(w)
      if 0 <= o * st + t * dr - lo < span and (o * st + t * dr - lo) % dl == 0
    )
    fraction *= hits / (positions * w)
  return fraction


def _custom_call_flops(module: hlo.Module, instr: hlo.Instr, path: str, hints: Hints):
  """(FLOPs, operand type, category) of a custom call: cuBLAS GEMM, cuDNN attention, Pallas."""
  target = _TARGET.search(instr.attrs)
  target = target.group(1) if target else ""
  ops = [hlo.arrays(t) for t in _operand_types(module, instr)]
  ops = [a[0] for a in ops if a]
  if "cublas" in target and ops:
    dtype, dims = ops[0]
    m = _CUBLAS_CONTRACT.search(instr.attrs)
    k = math.prod(dims[int(c.strip('" '))] for c in m.group(1).split(",") if c.strip()) if m else 1
    out = hlo.arrays(instr.type)
    return 2.0 * math.prod(out[0][1]) * k if out else 0.0, dtype, "gemm"
  if "cudnn$fmha" in target and len(ops) >= 2:
    (dtype, q), (_, k) = ops[0], ops[1]
    b, t, h, d = q if len(q) == 4 else (1, 1, 1, 1)
    s = k[1] if len(k) == 4 else t
    causal = 0.5 if _CAUSAL.search(instr.attrs) else 1.0
    products = 5 if "Backward" in target else 2
    return 2.0 * products * b * h * t * s * d * causal, dtype, "attention"
  if "triton" in target and any(k in path for k in PALLAS_ROWS_TIMES_WEIGHT) and ops:
    weight = max(ops, key=lambda a: math.prod(a[1]))
    return 2.0 * ops[0][1][0] * math.prod(weight[1]), weight[0], "gemm"
  if "triton" in target:
    kernel = next((k for k in PALLAS_PRODUCTS if k in path), None)
    keys = Hints.lookup(hints.keys_per_query, path)
    q = next((a for a in ops if len(a[1]) == 4), None)
    if kernel and keys is not None and q is not None:
      b, t, h, d = q[1]
      return 2.0 * PALLAS_PRODUCTS[kernel] * b * t * h * d * keys, q[0], "attention"
    return 0.0, "", "attention" if kernel else "elementwise"
  return 0.0, "", "elementwise"


def _body_flops(module: hlo.Module, computation: str, hints: Hints, seen=None):
  """(FLOPs, dot operand type, HIGHEST) of everything a fusion body computes."""
  seen = set() if seen is None else seen
  flops, dtype, highest = 0.0, "", False
  if computation in seen:
    return flops, dtype, highest
  seen.add(computation)
  for instr in module.computations.get(computation, []):
    if instr.op in ("dot", "convolution"):
      f, dt, hi = _dot_flops(module, instr)
    elif instr.op == "custom-call":
      f, dt, _ = _custom_call_flops(module, instr, instr.op_name, hints)
      hi = False
    elif instr.op == "reduce" and instr.op_name.endswith("dot_general") and instr.operands:
      # a matrix-vector product XLA writes as multiply + reduce: one multiply-add per element
      f = 2.0 * math.prod(hlo.arrays(module.type_of(instr.operands[0]))[0][1])
      dt, hi = hlo.arrays(module.type_of(instr.operands[0]))[0][0], False
    elif instr.called:
      f, dt, hi = 0.0, "", False
      for c in instr.called:
        cf, cdt, chi = _body_flops(module, c, hints, seen)
        f, dt, hi = f + cf, dt or cdt, hi or chi
    else:
      continue
    flops, dtype, highest = flops + f, dtype or dt, highest or hi
  return flops, dtype, highest


def _users(instrs: Sequence[hlo.Instr]) -> Dict[str, List[hlo.Instr]]:
  out: Dict[str, List[hlo.Instr]] = collections.defaultdict(list)
  for i in instrs:
    for o in i.operands:
      out[o].append(i)
  return out


def _read_of(module: hlo.Module, name: str, users, full: float, depth: int = 0) -> float:
  """Bytes a fusion body reads of value ``name`` (``full`` bytes): the slices when every use
  slices it (also inside a nested fusion that takes it), nothing when it is only the buffer of
  an in-place update, else all of it."""
  uses = users.get(name, [])
  if not uses or depth > 8:
    return full
  total = 0.0
  for u in uses:
    if u.op in SLICING and u.operands and u.operands[0] == name:
      total += hlo.nbytes(u.type)
    elif u.op in IN_PLACE and u.operands and u.operands[0] == name:
      continue
    elif u.op in TRANSPARENT:
      total += _read_of(module, u.name, users, full, depth + 1)
    elif u.op == "fusion" and u.called:
      total += _nested_read(module, u, name, full, depth + 1)
    else:
      return full
  return min(total, full)


def _nested_read(module: hlo.Module, fusion: hlo.Instr, name: str, full: float, depth: int):
  """Bytes nested ``fusion`` (inside a fusion body) reads of its operand ``name``: what its
  body reads of each parameter that ``name`` is passed as."""
  body = module.computations.get(fusion.called[0], [])
  params = _parameters(body)
  users = _users(body)
  total = 0.0
  for idx, operand in enumerate(fusion.operands):
    if operand == name:
      total += _read_of(module, params[idx], users, full, depth) if idx in params else full
  return total


def _parameters(instrs: Sequence[hlo.Instr]) -> Dict[int, str]:
  """Parameter number -> instruction name of a computation's parameters."""
  return {int(i.args): i.name for i in instrs if i.op == "parameter" and i.args.strip().isdigit()}


def _written(module: hlo.Module, root: Optional[hlo.Instr], full: float) -> float:
  """Bytes a fusion writes: an in-place update writes its update, a tuple each element."""
  if root is None:
    return full
  if root.op in IN_PLACE and len(root.operands) > 1:
    return hlo.nbytes(module.type_of(root.operands[IN_PLACE[root.op]]))
  if root.op == "tuple":
    return sum(
      _written(module, module.by_name.get(o), hlo.nbytes(module.type_of(o))) for o in root.operands
    )
  if root.op in TRANSPARENT and root.operands:
    inner = module.by_name.get(root.operands[0])
    return _written(module, inner, full) if inner is not None else full
  return full


def _fusion_bytes(module: hlo.Module, instr: hlo.Instr) -> float:
  body = instr.called[0] if instr.called else ""
  instrs = module.computations.get(body, [])
  params = _parameters(instrs)
  users = _users(instrs)
  read = 0.0
  for idx, operand in enumerate(instr.operands):
    full = hlo.nbytes(module.type_of(operand))
    read += _read_of(module, params[idx], users, full) if idx in params else full
  return read + _written(module, module.root(body), hlo.nbytes(instr.type))


def _group_size(instr: hlo.Instr, default: int) -> int:
  m = _GROUPS.search(instr.attrs)
  if m:
    return max(len([x for x in m.group(1).split(",") if x]), 1)
  m = _IOTA_GROUPS.search(instr.attrs)
  return int(m.group(2)) if m else default


def _category(instr: hlo.Instr, path: str, flops: float) -> str:
  if any(s in path for s in ATTENTION_SCOPES) and "_proj" not in path:
    return "attention"
  if flops > 0:
    return "gemm"
  return "copy" if instr.op == "copy" else "elementwise"


def kernel_cost(module: hlo.Module, name: str, gpu: Gpu, hints: Hints, n_devices: int = 1):
  """The cost of the kernel that runs HLO instruction ``name`` (None when it is not in the
  module: a thunk XLA added, priced by its launch alone)."""
  instr = module.by_name.get(name)
  if instr is None:
    return None
  path = instr.op_name
  flops, dtype, highest = 0.0, "", False
  category = None
  if instr.op in COLLECTIVES:
    n = _group_size(instr, n_devices)
    nbytes = max([hlo.nbytes(instr.type)] + [hlo.nbytes(t) for t in _operand_types(module, instr)])
    factor = COLLECTIVES[instr.op]
    moved = nbytes * (1.0 if factor is None else factor * (n - 1) / n)
    s = moved / gpu.link_bytes_per_s
    return KernelCost(name, "collective", 0.0, moved, 0.0, s, s)
  if instr.op == "fusion":
    flops, dtype, highest = (
      _body_flops(module, instr.called[0], hints) if instr.called else (0, "", False)
    )
    nbytes = _fusion_bytes(module, instr)
  elif instr.op == "custom-call":
    flops, dtype, category = _custom_call_flops(module, instr, path, hints)
    out = hlo.arrays(instr.type)
    if len(out) > 1 and out[-1][0] in ("u8", "s8"):  # (results..., workspace): scratch
      out = out[:-1]
    written = sum(hlo.itemsize(dt) * math.prod(dims) for dt, dims in out)
    # an operand passed twice (two views of one weight) is read once; a kernel that updates
    # operands in place (output_to_operand_aliasing) reads and writes its other operands, the
    # update, not the buffers it updates
    aliased = _ALIASED.findall(instr.attrs.split("output_to_operand_aliasing=", 1)[-1])
    aliased = {int(i) for i in aliased} if "output_to_operand_aliasing=" in instr.attrs else set()
    unique = dict.fromkeys(o for i, o in enumerate(instr.operands) if i not in aliased)
    read = sum(hlo.nbytes(module.type_of(o)) for o in unique)
    nbytes = 2 * read if aliased else read + written
    if aliased and any(k in path for k in PALLAS_READS_UPDATED):
      # its other operands, the buffers it updates (the size of their outputs: read once,
      # written in part) and its other outputs
      nbytes, category = read + written, "attention"
  elif instr.op in ("dot", "convolution"):
    flops, dtype, highest = _dot_flops(module, instr)
    nbytes = sum(hlo.nbytes(t) for t in _operand_types(module, instr)) + hlo.nbytes(instr.type)
  elif instr.op == "copy":
    nbytes = 2.0 * hlo.nbytes(instr.type)
  else:
    nbytes = sum(hlo.nbytes(t) for t in _operand_types(module, instr)) + hlo.nbytes(instr.type)
  peak = gpu.dot_peak(dtype or "bf16", highest)
  compute_s = flops / (peak * gpu.dot_efficiency)
  memory_s = nbytes / (gpu.memory_bytes_per_s * gpu.memory_efficiency)
  floor_s = max(flops / peak, nbytes / gpu.memory_bytes_per_s)
  return KernelCost(
    name, category or _category(instr, path, flops), flops, nbytes, compute_s, memory_s, floor_s
  )


@dataclasses.dataclass
class Tally:
  """What a walk adds up: per kernel (name -> [runs, cost]), launches, syncs, unknown loops."""

  kernels: Dict[str, list] = dataclasses.field(default_factory=dict)
  launches_s: float = 0.0
  launches: float = 0.0
  syncs: float = 0.0
  unknown_loops: int = 0

  def device_s(self) -> float:
    return sum(r * max(c.compute_s, c.memory_s) for r, c in self.kernels.values())

  def time_s(self) -> float:
    return self.device_s() + self.launches_s

  def add(self, other: "Tally", times: float = 1.0):
    for k, (r, c) in other.kernels.items():
      self.kernels.setdefault(k, [0.0, c])[0] += r * times
    self.launches_s += other.launches_s * times
    self.launches += other.launches * times
    self.syncs += other.syncs * times
    self.unknown_loops += other.unknown_loops


class Walker:
  """Walks a thunk tree and prices each kernel once (``kernel_cost``, cached by name)."""

  def __init__(self, module, gpu: Gpu, hints=Hints(), launch=Launch(), n_devices=1):
    self.module, self.gpu, self.hints, self.launch = module, gpu, hints, launch
    self.n_devices = n_devices
    self._costs: Dict[str, Optional[KernelCost]] = {}

  def cost(self, name: str) -> Optional[KernelCost]:
    if name not in self._costs:
      self._costs[name] = kernel_cost(self.module, name, self.gpu, self.hints, self.n_devices)
    return self._costs[name]

  def _trips(self, loop: thunks.Thunk, tally: Tally) -> float:
    instr = self.module.by_name.get(loop.hlo)
    if instr is not None and instr.trip_count is not None:
      return float(instr.trip_count)
    hinted = Hints.lookup(self.hints.trips, instr.op_name) if instr is not None else None
    if hinted is not None:
      return float(hinted)
    tally.unknown_loops += 1
    return 1.0

  def walk(self, t: thunks.Thunk, in_graph: bool = False, branch: str = "max") -> Tally:
    tally = Tally()
    if t.kind == "kCommandBuffer":
      if not in_graph:
        tally.launches_s += self.launch.host_s
        tally.launches += 1
      for kids in t.children.values():
        for c in kids:
          tally.add(self.walk(c, True, branch))
      return tally
    if t.kind == "kWhile":
      trips = self._trips(t, tally)
      once = Tally()
      for label in ("condition", "body"):
        for c in t.children.get(label, []):
          once.add(self.walk(c, in_graph, branch))
      if not in_graph:
        once.launches_s += self.launch.sync_s
        once.syncs += 1
      tally.add(once, trips)
      return tally
    if t.kind == "kConditional":
      runs = [self.walk_all(kids, in_graph, branch) for kids in t.children.values()]
      if runs:
        pick = max if branch == "max" else min
        tally.add(pick(runs, key=Tally.time_s))
      if not in_graph:
        tally.launches_s += self.launch.sync_s
        tally.syncs += 1
      return tally
    if t.children:
      for kids in t.children.values():
        tally.add(self.walk_all(kids, in_graph, branch))
      return tally
    if any(s in t.kind for s in _NO_WORK):
      return tally
    cost = self.cost(t.hlo) if t.hlo else None
    if cost is not None:
      tally.kernels.setdefault(t.hlo, [0.0, cost])[0] += 1
    tally.launches_s += self.launch.graph_s if in_graph else self.launch.host_s
    tally.launches += 1
    return tally

  def walk_all(self, kids, in_graph=False, branch="max") -> Tally:
    tally = Tally()
    for c in kids:
      tally.add(self.walk(c, in_graph, branch))
    return tally


def summary(tally: Tally, gpu: Gpu, top: int = 15) -> dict:
  """JSON-ready: estimated seconds, the roofline floor, FLOPs, bytes, the split by category
  (``CATEGORIES``; launch overhead as its own) and the ``top`` most expensive kernels."""
  split = dict.fromkeys(CATEGORIES, 0.0)
  rows = []
  flops = nbytes = floor = 0.0
  for name, (runs, c) in tally.kernels.items():
    t = runs * max(c.compute_s, c.memory_s)
    split[c.category] += t
    flops += runs * c.flops
    nbytes += runs * c.bytes
    floor += runs * c.floor_s
    rows.append((t, name, runs, c))
  split["launch"] = tally.launches_s
  rows.sort(key=lambda r: -r[0])
  total = tally.time_s()
  return dict(
    step_s=total,
    floor_s=floor,
    device_s=tally.device_s(),
    launch_s=tally.launches_s,
    launches=round(tally.launches, 1),
    host_syncs=round(tally.syncs, 1),
    unknown_loops=tally.unknown_loops,
    flops=flops,
    bytes=nbytes,
    split_s=split,
    top_kernels=[
      dict(
        name=name,
        category=c.category,
        runs=round(runs, 2),
        total_s=t,
        flops=c.flops,
        bytes=c.bytes,
        bound="compute" if c.compute_s > c.memory_s else "memory",
        share=t / total if total else 0.0,
      )
      for t, name, runs, c in rows[:top]
    ],
    gpu=gpu.name,
  )


def program(hlo_text: str, thunk_text: str, metadata_text: str, gpu: Gpu, **kw):
  """(module, root thunk, Walker) of one compiled program: what ``estimate`` walks."""
  module = hlo.parse(hlo_text)
  root = thunks.parse(thunk_text, thunks.parse_metadata(metadata_text))
  return module, root, Walker(module, gpu, **kw)


def estimate(hlo_text: str, thunk_text: str, metadata_text: str, gpu: Gpu, top=15, **kw) -> dict:
  """``summary`` of one run of the whole program (conditionals at their costliest branch)."""
  _, root, walker = program(hlo_text, thunk_text, metadata_text, gpu, **kw)
  return summary(walker.walk(root), gpu, top)


def decode_steps(hlo_text: str, thunk_text: str, metadata_text: str, gpu: Gpu, top=15, **kw):
  """(idle step, LM step) summaries of one step of the decode loop (the while loop that runs
  the most kernels: its condition and body once), the conditionals at their cheapest branch
  (no group closes: the latent LM does not run) and at their costliest (it runs)."""
  _, root, walker = program(hlo_text, thunk_text, metadata_text, gpu, **kw)
  loop, in_graph = thunks.decode_loop(root)
  out = []
  for branch in ("min", "max"):
    tally = Tally()
    for label in ("condition", "body"):
      tally.add(walker.walk_all(loop.children.get(label, []), in_graph, branch))
    if not in_graph:
      tally.launches_s += walker.launch.sync_s
      tally.syncs += 1
    out.append(summary(tally, gpu, top))
  return tuple(out)
