"""What one training micro-batch costs: useful vs executed FLOPs, attention tiles, buffers.

Used by ``tools/bench_train.py``; nothing here runs a step (shapes, schedules and XLA's own
analysis of the compiled step only), so it works for paper-scale configs on a small machine.

Useful FLOPs (what the work needs; forward + backward = 3x the forward's 2 FLOPs per
multiply-add):

    6 * N_s * tokens_s                        every matmul parameter of stage s
  + 12 * L_s * H * E * sum_i keys_s(i)        attention QK^T and PV over the keys each query
                                              may see: i - lo_i + 1 (model/masks.py)

with tokens = the real bytes for the byte stages (encoder, boundary predictor, NT decoder,
LCA-MBP head, unembedding once per head output) and the real latent slots (one null slot per
document + one per closed group) for the latent LM; sum_i keys is i + 1 within a document for
the causal stacks and ~1.5 groups for the LCA head. Padded vocabulary rows count as parameters.

Executed FLOPs: XLA's ``cost_analysis()`` of the compiled step, which counts the body of every
while loop once. The blockwise attention (``model/attention.py``) runs its tiles in loops, so
``loop_correction`` adds, per attention call, (tiles - 1) x the matmul FLOPs of one
tile (forward QK^T, PV; backward QK^T, dV, dP, dQ, dK; remat repeats the forward), with the
tile count from the same schedule the step computes; and a stack whose layers run as one scan
(``ModelConfig.scans``) is counted as one layer, so the others' dense products and tiles are
added. The latent LM is executed over its capacity S (``ModelConfig.latent_capacity``), not
over the real slots: that is where a capacity above the real compression shows up.

The group layout of a batch is only known inside the step (learned boundaries); these
estimates use a regular layout: concat packing (one document per row) and groups of
``group_len`` bytes (default 1 / bp_prior, the rate the boundary loss trains towards).
"""

from __future__ import annotations

import math
import re
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from lca_jax import backend
from lca_jax.model import masks, pooling
from lca_jax.model.attention import LOOPS_PER_BLOCK, tiles_visited
from lca_jax.model.config import ModelConfig
from lca_jax.model.hierarchical import count_params

_DTYPE_BYTES = {
  "f64": 8,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "s8": 1,
  "u8": 1,
  "pred": 1,
  "s64": 8,
  "u64": 8,
}
_SHAPE = re.compile(r"\b(f64|f32|s32|u32|bf16|f16|s16|u16|s8|u8|pred|s64|u64)\[([0-9,]*)\]")


def regular_layout(cfg: ModelConfig, rows: int, seq_len: int, group_len: Optional[float] = None):
  """Doc ids, hard boundaries and the latent plan of rows of groups of ``group_len`` bytes."""
  g = group_len or (1.0 / cfg.bp_prior if cfg.bp_prior > 0 else 3.0)
  pos = np.arange(seq_len)
  closes = (np.floor((pos + 1) / g) > np.floor(pos / g)) | (pos == seq_len - 1)
  b_BT = jnp.asarray(np.broadcast_to(closes, (rows, seq_len)).astype(np.float32))
  doc_BT = jnp.ones((rows, seq_len), jnp.int32)
  plan = pooling.plan_latents(b_BT, doc_BT, cfg.latent_capacity(seq_len))
  return doc_BT, b_BT, plan


def _keys(lo_BT) -> float:
  """sum over queries of the number of keys they may see (i - lo_i + 1, 0 for padding)."""
  i = jnp.arange(lo_BT.shape[1])
  return float(jnp.sum(jnp.maximum(i - lo_BT + 1, 0)))


def attention_stacks(cfg: ModelConfig, doc_BT, plan):
  """(name, layers, lo [B, T_s], block_q, block_k) of every self-attention stack."""
  causal = masks.causal_key_start(doc_BT)
  stack = lambda name, n, lo: (name, n, lo, *cfg.causal_blocks(lo.shape[1]))
  out = [stack("encoder", cfg.n_enc, causal)]
  if cfg.hierarchical:
    out.append(stack("lm", cfg.n_lm, masks.causal_key_start(plan.slot_doc_BS)))
    out.append(stack("decoder", cfg.n_dec, causal))
    if cfg.n_mbp:
      out.append(
        (
          "mbp",
          cfg.n_mbp,
          masks.lca_key_start(plan.group_BT, doc_BT),
          cfg.lca_block_q,
          cfg.lca_block_q + cfg.lca_lookback,
        )
      )
  return out


def useful_flops(cfg: ModelConfig, params, doc_BT, plan) -> dict:
  """Useful FLOPs of one micro-batch, by stage (see the module docstring)."""
  rows, seq_len = doc_BT.shape
  real_bytes = float(jnp.sum(doc_BT != 0))
  real_slots = float(jnp.sum(plan.slot_doc_BS != 0)) if cfg.hierarchical else 0.0
  he = cfg.n_heads * cfg.head_dim
  out = {}
  for name, layers, lo, _, _ in attention_stacks(cfg, doc_BT, plan):
    tokens = real_slots if name == "lm" else real_bytes
    out[name] = 6.0 * count_params(params[name]) * tokens + 12.0 * layers * he * _keys(lo)
  head_uses = 1 + (1 if cfg.has_lca else 0) + cfg.n_mlp_mbp
  out["head"] = 6.0 * count_params(params["head"]) * real_bytes * head_uses
  for name in params:
    if name == "boundary_predictor" or name.startswith("mlp_mbp_"):
      out[name] = 6.0 * count_params(params[name]) * real_bytes
  out["total"] = sum(out.values())
  return out


def loop_correction(cfg: ModelConfig, params, doc_BT, plan) -> dict:
  """Tiles each attention call executes and the FLOPs XLA's cost analysis does not see, since
  it counts a loop's body once: in each tile loop one tile, ``LOOPS_PER_BLOCK`` per query-block
  nest, whatever ran (the correction is negative when fewer tiles ran); in a stack whose
  layers run as one scan (``ModelConfig.scans``), one layer, so the other layers' dense products
  (2 FLOPs per multiply-add forward, 4 backward, 2 more under remat, over every position the
  stack runs: the latent LM's capacity) and their tile loops are added."""
  rows = doc_BT.shape[0]
  fwd_passes = 2 if cfg.remat else 1
  tiles, flops = {}, 0.0
  for name, layers, lo, bq, bk in attention_stacks(cfg, doc_BT, plan):
    scanned = layers - 1 if cfg.scans(layers) else 0
    dense = (2.0 * fwd_passes + 4.0) * count_params(params[name]) / layers
    flops += scanned * dense * rows * lo.shape[1]
    if backend.attention_impl(cfg.attention_impl) != "xla":
      continue
    bq, bk = min(bq, lo.shape[1]), min(bk, lo.shape[1])
    n = int(tiles_visited(lo, bq, bk))
    tiles[name] = n
    per_tile = 2.0 * rows * cfg.n_heads * bq * bk * cfg.head_dim * (2 * fwd_passes + 5)
    counted = LOOPS_PER_BLOCK * (layers - scanned)  # tiles XLA's analysis sees in this stack
    flops += (layers * n - counted) * per_tile
  return {"tiles": tiles, "flops": flops}


# Dense layers whose activations are [tokens, width]: when a width equals T (the paper's
# d_inner 4096 at T 4096) such an array is not an attention buffer.
_FEATURE_SCOPE = re.compile(
  r"/(mlp|boundary_predictor|mlp_mbp_\d+|head|[qkv]_proj|out_proj|"
  r"gate_proj|up_proj|down_proj|fc1|fc2)(/|\")"
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')


_CALLS = re.compile(r"(?:calls|body|condition|to_apply)=%([\w.\-]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")


_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_OPERAND = re.compile(r"%([\w.\-]+)")


def _op_names(lines):
  """The op_name of every HLO line. A line without one takes its operands' (copies, bitcasts
  XLA adds), and a computation's lines without one take that of the instruction calling it."""
  own, operands = {}, {}
  for line in lines:
    instr = _INSTR.match(line)
    if instr:
      name = _OP_NAME.search(line)
      own[instr.group(1)] = name.group(1) if name else ""
      operands[instr.group(1)] = _OPERAND.findall(line[instr.end() :].split("metadata=")[0])
  for _ in range(8):  # propagate along operand chains without metadata
    for instr, name in own.items():
      if not name:
        own[instr] = next((own[o] for o in operands[instr] if own.get(o)), "")
  caller = {}
  for line in lines:
    instr = _INSTR.match(line)
    if instr and own.get(instr.group(1)):
      for comp in _CALLS.findall(line):
        caller.setdefault(comp, own[instr.group(1)])
  out, current = [], ""
  for line in lines:
    head = _COMPUTATION.match(line)
    if head and line.rstrip().endswith("{"):
      current = caller.get(head.group(1), "")
    instr = _INSTR.match(line)
    out.append((own.get(instr.group(1)) if instr else "") or current)
  return out


def buffers(hlo_text: str, seq_len: int) -> dict:
  """The largest array in an HLO text, and every array with two dimensions >= seq_len outside
  the dense layers' [tokens, width] activations (``_FEATURE_SCOPE``), with the ops making it."""
  largest, largest_bytes, square = "", 0, {}
  lines = hlo_text.splitlines()
  for line, name in zip(lines, _op_names(lines)):
    feature = bool(_FEATURE_SCOPE.search(name + '"'))
    for dt, dims in _SHAPE.findall(line):
      sizes = [int(x) for x in dims.split(",")] if dims else []
      nbytes = _DTYPE_BYTES[dt] * math.prod(sizes)
      if nbytes > largest_bytes:
        largest, largest_bytes = f"{dt}[{dims}]", nbytes
      if not feature and sum(s >= seq_len for s in sizes) >= 2:
        square.setdefault(f"{dt}[{dims}]", set()).add(name or "?")
  return {
    "largest_buffer": largest,
    "largest_buffer_bytes": largest_bytes,
    "t_by_t_buffers": {k: sorted(v)[:3] for k, v in sorted(square.items())},
  }


def t_by_t_check(t_by_t_buffers: dict, params, seq_len: int) -> str:
  """How far the T x T list of ``buffers`` can be trusted: an activation [tokens, width] whose
  width equals T (d_model, d_inner, or one device's share of it under a tensor split: any
  dimension of a parameter or of its per-device shard) looks like T x T outside the dense
  layers' scopes. "exact" when nothing is listed or T is no such dimension."""
  widths = set()
  for x in jax.tree_util.tree_leaves(params):
    widths.update(x.shape)
    sharding = getattr(x, "sharding", None)
    if sharding is not None:
      widths.update(sharding.shard_shape(x.shape))
  if t_by_t_buffers and seq_len in widths:
    return f"ambiguous: T = {seq_len} is also a parameter dimension (a width)"
  return "exact"


def xla_flops(compiled) -> float:
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):  # older jax: one dict per computation
    ca = ca[0] if ca else {}
  return float(ca.get("flops", 0.0))
