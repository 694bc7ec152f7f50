"""What a compiled GPU program needs, read from XLA without running it.

``summarize(program, compiled, device_bytes)`` gives one JSON-ready dict: memory per device
(``memory_analysis``: arguments, outputs, the outputs that alias donated arguments,
temporaries) against the device's memory, the fusions XLA formed by kind, the Triton GEMM
fusions (each distinct one is autotuned when a GPU compiles the program), the custom calls by
target (cuBLAS, cuDNN, Triton kernels from Pallas), the buffers with two dimensions of at least
the sequence length, and, for a program with a decode loop, the kernels one step launches.

A kernel launch costs the GPU a few microseconds whatever it does; a decode step of K kernels
cannot run faster than K x ``LAUNCH_US``, which bounds batch-1 decoding to
``1 / (K x LAUNCH_US)`` steps per second unless the step is replayed as one CUDA graph.
"""

from __future__ import annotations

import collections
import math
import os
import re
from typing import Dict, List, Optional

from lca_jax.perf import hlo_stats, thunks

GB = 1e9
LAUNCH_US = 3.0  # per kernel launch, the order of a CUDA launch + its gap on an H100
DEFAULT_POOL = 0.75  # JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION
MAX_FRACTION = 0.95  # the most of a device a process can take (the CUDA context keeps the rest)
RUNTIME_MARGIN = 1.5e9  # bytes outside XLA's buffers: library workspaces, NCCL, context (a guess)
# ops that launch no kernel of their own: aliases, tuple plumbing, literals, control flow
# (whose bodies are counted), scheduling markers
NO_KERNEL = hlo_stats.FREE_OPS | hlo_stats.CONTROL_OPS | {"after-all", "opt-barrier", "domain"}
_FUSION_KIND = re.compile(r"\bkind=(k\w+)")
_BACKEND_KIND = re.compile(r'"kind":"(__[\w$.]+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CALLS = re.compile(r"\bcalls=(%?[\w.\-]+)")
_METADATA_OP = re.compile(r'op_name="([^"]*)"')
# name scopes of the attention code in an op's source path (model/layers.py, kernels/): a
# buffer with two dimensions >= T made there is a dense score or mask matrix
ATTENTION_SCOPES = ("attn", "lca_attention", "blockwise_attention")
_PROJECTION = re.compile(r"/\w*_proj/")  # the projections in and out of an attention


def pool_fraction(env=None) -> float:
  """The fraction of a GPU's memory JAX's allocator takes: ``XLA_PYTHON_CLIENT_MEM_FRACTION``
  (default 0.75); the whole device with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` or
  ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` (memory taken as needed)."""
  env = os.environ if env is None else env
  if (
    env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0")
    or env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "") == "platform"
  ):
    return 1.0
  try:
    return min(max(float(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_POOL)), 0.0), 1.0)
  except ValueError:
    return DEFAULT_POOL


def buffer_sizes(compiled, device_bytes: int, state_bytes: int) -> tuple:
  """(total bytes, the GB figures of every memory report) of ``compiled``'s
  ``memory_analysis``: state, arguments, outputs, aliased, temporaries, total, device."""
  m = compiled.memory_analysis()
  total = (
    m.argument_size_in_bytes
    + m.output_size_in_bytes
    - m.alias_size_in_bytes
    + m.temp_size_in_bytes
    + m.generated_code_size_in_bytes
  )
  return total, dict(
    state_gb=round(state_bytes / GB, 3),
    argument_gb=round(m.argument_size_in_bytes / GB, 3),
    output_gb=round(m.output_size_in_bytes / GB, 3),
    alias_gb=round(m.alias_size_in_bytes / GB, 3),
    temp_gb=round(m.temp_size_in_bytes / GB, 3),
    total_gb=round(total / GB, 3),
    device_gb=round(device_bytes / GB, 3),
  )


def memory(compiled, device_bytes: int, state_bytes: int, fraction: Optional[float] = None) -> dict:
  """Per-device bytes of ``compiled`` (``memory_analysis``) in GB against what the process
  gets: ``fraction`` of the device (``pool_fraction()``, JAX's default 0.75) less
  ``RUNTIME_MARGIN`` (cuBLAS / cuDNN workspaces, NCCL buffers, the CUDA context, which live
  outside XLA's buffers). ``fits``: it fits with some setting (at most ``MAX_FRACTION`` of the
  device); ``mem_fraction`` the ``XLA_PYTHON_CLIENT_MEM_FRACTION`` it needs when the pool is
  too small."""
  total, buffers = buffer_sizes(compiled, device_bytes, state_bytes)
  fraction = pool_fraction() if fraction is None else fraction
  usable = fraction * device_bytes - RUNTIME_MARGIN
  fits = total <= MAX_FRACTION * device_bytes - RUNTIME_MARGIN
  needed = None
  if total <= usable:
    verdict = f"fits in JAX's memory pool ({fraction:.0%} of the device)"
  elif fits:
    needed = math.ceil(round((total + RUNTIME_MARGIN) / device_bytes * 100, 6)) / 100
    verdict = (
      f"fits with XLA_PYTHON_CLIENT_MEM_FRACTION={needed:.2f} (the {fraction:.0%} pool is "
      f"{(total - usable) / GB:.2f} GB short)"
    )
  else:
    verdict = (
      f"does not fit by {(total - MAX_FRACTION * device_bytes + RUNTIME_MARGIN) / GB:.2f} GB"
    )
  return dict(
    buffers,
    pool_fraction=fraction,
    runtime_margin_gb=RUNTIME_MARGIN / GB,
    usable_gb=round(usable / GB, 3),
    fits=fits,
    fits_default_pool=total <= usable,
    mem_fraction=needed,
    verdict=verdict,
    margin_gb=round((usable - total) / GB, 3),
  )


def save_hlo(hlo_dir, r: dict, hlo_text: str) -> None:
  """Write ``hlo_text`` to ``hlo_dir`` (when given) as TARGET_PROGRAM[_IMPL].hlo, its path in
  ``r["hlo_file"]``."""
  if not hlo_dir:
    return
  os.makedirs(hlo_dir, exist_ok=True)
  impl = r.get("attention_impl") if r["program"] in ("train_step", "eval_step") else None
  name = "_".join(x for x in (r["target"], r["program"], impl) if x)
  path = os.path.join(hlo_dir, re.sub(r"[^\w.\-]", "_", name) + ".hlo")
  with open(path, "w") as f:
    f.write(hlo_text)
  r["hlo_file"] = path


def _fusion_bodies(comps: Dict[str, List[str]]) -> set:
  """Names of the computations that are fusion bodies (their values live in registers)."""
  out = set()
  for instrs in comps.values():
    for instr in instrs:
      if hlo_stats.op_name(instr) == "fusion":
        m = _CALLS.search(instr)
        if m:
          out.add(m.group(1))
  return out


def _body_text(comps, name: str) -> str:
  """A fusion body without instruction names, metadata and backend config: equal texts are one
  autotuning problem."""
  lines = []
  for instr in comps.get(name, []):
    rhs = instr.split(" = ", 1)[-1]
    rhs = re.sub(r",\s*(metadata|backend_config)=.*$", "", rhs)
    lines.append(re.sub(r"%[\w.\-]+", "%", rhs))
  return "\n".join(lines)


def hlo_summary(hlo_text: str, seq_len: int) -> dict:
  """Fusions, GEMM fusions, custom calls, loops and large buffers of an optimized GPU HLO.

  ``large_buffers``: every buffer with two dimensions >= ``seq_len`` (fusion outputs and other
  materialized results, not values inside a fusion), with the source it comes from;
  ``attention_buffers_TT`` counts those made inside the attention code (a dense [T, T] score or
  mask matrix). Activations whose width is >= T show up too (an MLP of width 4096 at T 4096)."""
  comps = hlo_stats.computations(hlo_text)
  bodies = _fusion_bodies(comps)
  fusion_kinds: collections.Counter = collections.Counter()
  backend_kinds: collections.Counter = collections.Counter()
  targets: collections.Counter = collections.Counter()
  gemm_bodies = set()
  loops = conditionals = 0
  large: collections.Counter = collections.Counter()
  for name, instrs in comps.items():
    if name == "ENTRY":
      continue
    top = name not in bodies
    for instr in instrs:
      op = hlo_stats.op_name(instr)
      if op == "fusion" and top:
        fusion_kinds[_FUSION_KIND.search(instr).group(1)] += 1
        bk = _BACKEND_KIND.search(instr)
        if bk:
          backend_kinds[bk.group(1)] += 1
          if "gemm" in bk.group(1):
            gemm_bodies.add(_body_text(comps, _CALLS.search(instr).group(1)))
      elif op == "custom-call":
        m = _TARGET.search(instr)
        targets[m.group(1) if m else "?"] += 1
      loops += op == "while" and top
      conditionals += op == "conditional" and top
      dims = hlo_stats.result_dims(instr)
      if top and op not in NO_KERNEL and sum(d >= seq_len for d in dims) >= 2:
        shape = hlo_stats._SHAPE.search(instr).group(0)[1:].strip()
        src = _METADATA_OP.search(instr)
        path = src.group(1) if src else ""
        attention = any(f"/{k}" in path for k in ATTENTION_SCOPES) and not _PROJECTION.search(path)
        large[(shape, op, "/".join(path.split("/")[-3:]), attention)] += 1
  return dict(
    hlo_lines=hlo_text.count("\n"),
    fusions=dict(total=sum(fusion_kinds.values()), **dict(sorted(fusion_kinds.items()))),
    fusion_backends=dict(sorted(backend_kinds.items())),
    gemm_fusions=dict(
      total=sum(v for k, v in backend_kinds.items() if "gemm" in k), distinct=len(gemm_bodies)
    ),
    custom_calls=dict(sorted(targets.items())),
    while_loops=loops,
    conditionals=conditionals,
    large_buffers=[
      dict(shape=s, op=op, source=src, attention=att, count=n)
      for (s, op, src, att), n in sorted(large.items(), key=lambda kv: -kv[1])
    ],
    attention_buffers_TT=sum(n for (_, _, _, att), n in large.items() if att),
  )


def _host_work(t: thunks.Thunk) -> tuple:
  """(launches, syncs) the host makes for one run of ``t``: a command buffer is one graph
  launch, a loop reads its predicate back after each condition (a sync), a conditional outside
  a graph reads its branch index (a sync) and runs its largest branch."""
  if t.kind == "kCommandBuffer":
    return 1, 0
  if t.kind == "kConditional":
    runs = [tuple(map(sum, zip(*map(_host_work, c)))) or (0, 0) for c in t.children.values()]
    launches, syncs = max(runs)
    return launches, syncs + 1
  if t.kind == "kWhile":
    (cl, cs), (bl, bs) = (
      tuple(map(sum, zip(*map(_host_work, t.children.get(k, []))))) or (0, 0)
      for k in ("condition", "body")
    )
    return cl + bl, cs + bs + 1
  if t.children:
    return tuple(map(sum, zip(*map(_host_work, sum(t.children.values(), []))))) or (0, 0)
  return 1, 0


def decode_step(thunk_text: str, bytes_per_step: float) -> dict:
  """What one step of the decode loop (the while loop that runs the most kernels) costs in
  launches: device kernels per step (each ~``LAUNCH_US`` when launched one by one), the host's
  launches and syncs per step (none when the whole loop is inside a command buffer: XLA runs
  it as one CUDA graph with device-side conditionals), and the bytes per second each bound
  allows at ``bytes_per_step`` bytes a step. ``kernels`` counts each conditional at its largest
  branch (a step where every group closes: the latent LM runs), ``kernels_least`` at its
  smallest (a step where none does)."""
  loop, in_graph = thunks.decode_loop(thunks.parse(thunk_text))
  body = loop.children.get("body", [])
  kernels = thunks.kernels(loop)
  launches, syncs = (0, 0) if in_graph else _host_work(loop)
  bound = lambda n: round(bytes_per_step / (n * LAUNCH_US * 1e-6), 1) if n else None
  return dict(
    kernels=kernels,
    kernels_least=thunks.kernels(loop, min),
    body_is_one_graph=len(body) == 1 and body[0].kind == "kCommandBuffer",
    loop_in_graph=in_graph,
    host_launches=launches,
    host_syncs=syncs,
    launch_us=LAUNCH_US,
    kernel_bound_bytes_per_s=bound(kernels),
    host_bound_bytes_per_s=bound(launches),
  )
