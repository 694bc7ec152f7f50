"""Where a compiled program's time goes on XLA:CPU, from the XLA profiler's per-op events.

XLA:CPU names each op's profiler event after the HLO instruction it runs, so the events of a
traced call can be matched to the instructions of the executable's optimized HLO
(``compiled.as_text()``) and summed by what those instructions are. Times are thread time:
ops run side by side on the executor's threads, so a sum may exceed the wall time it took.
Other backends name their events after kernels; there the functions here find nothing.
An op's event spans its whole run, including any wait for the thread pool it splits its work
over: with two CPU devices competing for two cores, a library fusion (YNNPACK) can look slower
than it computes. Not always: a large share for the RMSNorms' reductions (YNNPACK reduce
fusions) on a one-row step is real, since YNNPACK reduces an array whose leading axis is 1 an
order of magnitude slower than the same data without it, which ``model/rows.py`` avoids
(docs/design.md §5.3).

* ``trace_thread_ns(run, names)``: run ``run()`` under ``jax.profiler`` and sum the events
  whose name is in ``names`` (nanoseconds per name);
* ``train_op_table(hlo_text)``: every instruction of a train step -> (kind, part, stage),
  read from its opcode and the source name XLA keeps in its metadata;
* ``summarize(ns, table, steps)``: thread seconds per step in all and by each of those.

The forward / backward split is not given, because the source names do not tell it reliably:
split by name ("transpose(" marks the backward), a train step comes out with less "backward"
than "forward" time, though its backward does about twice the forward's work.

``tools/bench_train.py --profile`` and ``tools/bench_decode.py --profile`` report them.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
from typing import Any, Callable, Collection, Dict, NamedTuple

import jax

from lca_jax.perf import hlo_stats

COLLECTIVES = frozenset(
  {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"}
)
_KIND = re.compile(r"kind=(k\w+)")
_SOURCE = re.compile(r'op_name="([^"]*)"')
_PROJ = re.compile(r"/(q|k|v|kv|qkv|out)_proj\b")
# the model's stacks, by the module path in the source name (lca_jax.model.hierarchical)
STAGES = (
  ("encoder", "/encoder/"),
  ("latent_lm", "/lm/"),
  ("decoder", "/decoder/"),
  ("mbp_head", "/mbp/"),
)


def _control_kind(op: str) -> str:
  """The kind of a control-flow op (hlo_stats.CONTROL_OPS): a while loop is a 'loop'."""
  return "loop" if op == "while" else op


# the kinds ``_kind`` gives control flow, whose events span their ops
CONTROL_KINDS = frozenset(map(_control_kind, hlo_stats.CONTROL_OPS))


class Op(NamedTuple):
  kind: str  # dot | fusion_<xla kind> | collective | copy | loop | <opcode>
  part: str  # attention_loops | attention_proj | mlp | norm | heads | embedding | boundaries
  # | optimizer | other
  stage: str  # encoder | latent_lm | decoder | mbp_head | other


def trace_thread_ns(run: Callable[[], Any], names: Collection[str]):
  """(``run()``'s result, Counter: event name -> summed duration in ns) for the events of
  ``names`` recorded while ``run()`` ran under the XLA profiler."""
  ns = collections.Counter()
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    try:
      result = run()
    finally:
      jax.profiler.stop_trace()
    traces = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))
    data = jax.profiler.ProfileData.from_file(traces[-1])
  for plane in data.planes:
    for line in plane.lines:
      for ev in line.events:
        if ev.name in names:
          ns[ev.name] += ev.duration_ns
  return result, ns


def _kind(instr: str, op: str) -> str:
  if op == "fusion":
    m = _KIND.search(instr)
    return "fusion_" + (m.group(1)[1:].lower() if m else "other")
  if re.sub(r"-(start|done)$", "", op) in COLLECTIVES:
    return "collective"
  if op in hlo_stats.CONTROL_OPS:
    return _control_kind(op)
  return op


def _part(source: str) -> str:
  if _PROJ.search(source):
    return "attention_proj"
  if "/attn" in source:
    return "attention_loops"
  for part, keys in (
    ("mlp", ("/mlp",)),
    ("norm", ("norm",)),
    ("heads", ("/head", "logits")),
    ("embedding", ("embedding",)),
    ("boundaries", ("boundary",)),
    ("optimizer", ("optax", "adam", "clip", "apply_updates", "scale_by")),
  ):
    if any(k in source for k in keys):
      return part
  return "other"


def train_op_table(hlo_text: str) -> Dict[str, Op]:
  """Instruction name (without %) -> ``Op`` for every instruction of every computation of a
  train step's optimized HLO, free ops (parameters, tuples, constants, bitcasts) left out.

  Some ops carry no source name (XLA drops it from some fusions it builds, e.g. the tile
  products inside the attention loops of a tensor-split step): inside a loop body or branch
  they take the part and stage most of their computation's named ops have; in the entry
  computation, which holds every part, or with no named op beside them, 'other'."""
  table, unnamed = {}, []
  comps = hlo_stats.computations(hlo_text)
  entry = comps.get("ENTRY")
  for key, instrs in comps.items():
    if key == "ENTRY":  # the entry computation is also under its own name
      continue
    named = collections.Counter() if instrs is not entry else None
    for instr in instrs:
      op = hlo_stats.op_name(instr)
      if not op or op in hlo_stats.FREE_OPS:
        continue
      name = hlo_stats.instr_name(instr)
      m = _SOURCE.search(instr)
      if m is None:
        unnamed.append((name, _kind(instr, op), named))
        continue
      source = m.group(1)
      where = (_part(source), next((s for s, key in STAGES if key in source), "other"))
      if named is not None:
        named[where] += 1
      table[name] = Op(_kind(instr, op), *where)
  for name, kind, named in unnamed:
    table[name] = Op(kind, *(named.most_common(1)[0][0] if named else ("other", "other")))
  return table


def summarize(ns: Dict[str, int], table: Dict[str, Op], steps: int) -> dict:
  """Thread seconds per step of the ops in ``table``: in all and by kind, part and stage.
  Loops are left out of every sum (their events span their body's ops, counted themselves)
  and given apart, as ``loop_s_per_step``: that minus their body's ops is loop control."""
  steps = max(int(steps), 1)
  per = lambda c: {k: round(v / steps / 1e9, 4) for k, v in c.most_common()}
  by = {f: collections.Counter() for f in Op._fields}
  loops = 0
  for name, t in ns.items():
    op = table[name]
    if op.kind == "loop":
      loops += t
    if op.kind in CONTROL_KINDS:  # control flow: events span their ops
      continue
    for f in Op._fields:
      by[f][getattr(op, f)] += t
  return dict(
    steps=steps,
    thread_s_per_step=round(sum(by["kind"].values()) / steps / 1e9, 4),
    loop_s_per_step=round(loops / steps / 1e9, 4),
    by_kind=per(by["kind"]),
    by_part=per(by["part"]),
    by_stage=per(by["stage"]),
  )
