#!/usr/bin/env python
"""Benchmark LCA attention: Pallas kernels vs dense-masked XLA vs blockwise XLA vs causal SDPA.

Times forward and forward+backward (vjp with a fixed cotangent) of

* ``pallas_<bq>x<bk>``: ``lca_attention(impl="pallas")`` (block-sparse Triton
  kernels), one entry per ``--pallas-blocks`` config,
* ``xla_dense``: ``lca_attention(impl="xla")`` (dense [T, T] mask, f32 softmax),
* ``xla_blockwise``: the model's ``attention_impl="xla"`` path
  (``model.attention.blockwise_attention`` over the LCA interval ``[lo_i, i]``, the
  ModelConfig's LCA tile: ``lca_block_q`` x ``lca_block_q + lca_lookback``),
* ``sdpa_causal``: ``jax.nn.dot_product_attention(is_causal=True)`` as a speed-of-light
  reference for plain causal attention: ``implementation="cudnn"`` on a GPU (an error is
  reported, not hidden, when cuDNN cannot run it), XLA's elsewhere (``"implementation"`` in
  its result says which),

and prints one JSON object with times (ms), TFLOP/s and ratios.

FLOP conventions: forward = 4 * H * D * pairs (QK^T and PV), forward+backward
= 3.5x forward (FlashAttention convention). ``tflops_unmasked`` counts only the
(query, key) pairs each method's mask allows (LCA pairs, or T(T+1)/2 per row
for causal); ``tflops_dense_equiv`` counts all T*T pairs.

Default shapes: B=8, T=4096, H=KV=8, D=128, bf16 (needs a GPU). ``--small``
uses tiny shapes and Pallas interpret mode so the script runs on CPU as a
smoke test (the numbers are then meaningless).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lca_jax.kernels import lca_attention, lca_key_start  # noqa: E402
from lca_jax.model.attention import blockwise_attention  # noqa: E402
from lca_jax.model.config import ModelConfig  # noqa: E402

IMPLS = ("pallas", "xla_dense", "xla_blockwise", "sdpa_causal")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
    "--small", action="store_true", help="tiny shapes, interpret mode (CPU smoke test)"
  )
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  p.add_argument("--max-group", type=int, default=40, help="segment lengths ~ U[1, max-group]")
  p.add_argument("--docs-per-row", type=int, default=1, help="pack this many documents per row")
  p.add_argument(
    "--pallas-blocks",
    default="32x32,64x64,128x64",
    help="comma-separated block_q x block_k configs, e.g. 32x32,64x64,128x64",
  )
  p.add_argument("--num-warps", type=int, default=None)
  p.add_argument("--num-stages", type=int, default=2)
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--impls", default="pallas,xla_dense,xla_blockwise,sdpa_causal")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.small:
    args.batch, args.seq, args.heads, args.kv_heads, args.head_dim = 2, 96, 4, 2, 32
    args.iters, args.warmup = 2, 1
  args.kv_heads = args.kv_heads or args.heads
  return args


def make_ids(rng: np.random.Generator, batch: int, seq: int, max_group: int, docs: int):
  """(segment_ids, doc_ids) int32 [B, T]: random group lengths, ``docs`` equal docs per row."""
  seg = np.zeros((batch, seq), np.int32)
  doc = np.zeros((batch, seq), np.int32)
  bounds = np.linspace(0, seq, docs + 1).astype(int)
  for b in range(batch):
    for d, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
      lengths = rng.integers(1, max_group + 1, size=hi - lo)
      seg[b, lo:hi] = np.repeat(np.arange(hi - lo), lengths)[: hi - lo]
      doc[b, lo:hi] = d + 1
  return jnp.asarray(seg), jnp.asarray(doc)


def time_fn(fn, args, iters: int, warmup: int) -> float:
  """Median wall time in ms of ``fn(*args)`` (already jitted)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


def fwd_and_fwd_bwd(attn):
  """Jitted forward and forward+backward (vjp with cotangent ``do``) of ``attn``."""
  fwd = jax.jit(attn)

  @jax.jit
  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(attn, q, k, v)
    return out, vjp(do)

  return fwd, fwd_bwd


def sdpa_implementation() -> str | None:
  """``jax.nn.dot_product_attention``'s implementation here: cuDNN on a GPU, else XLA's."""
  return "cudnn" if jax.default_backend() == "gpu" else None


def build_impls(args, seg, doc):
  """Name -> attention fn(q, k, v) for the requested implementations."""
  docs = doc if args.docs_per_row > 1 else None
  lca = functools.partial(lca_attention, segment_ids=seg, doc_ids=docs)
  tile = ModelConfig()
  impls = {}
  for name in args.impls.split(","):
    if name == "pallas":
      for blocks in args.pallas_blocks.split(","):
        bq, bk = map(int, blocks.split("x"))
        impls[f"pallas_{bq}x{bk}"] = functools.partial(
          lca,
          impl="pallas",
          interpret=args.small,
          block_q=bq,
          block_k=bk,
          num_warps=args.num_warps,
          num_stages=args.num_stages,
        )
    elif name == "xla_dense":
      impls[name] = functools.partial(lca, impl="xla")
    elif name == "xla_blockwise":
      impls[name] = functools.partial(
        blockwise_attention,
        lo_BT=lca_key_start(seg, docs),
        block_q=tile.lca_block_q,
        block_k=tile.lca_block_q + tile.lca_lookback,
      )
    elif name == "sdpa_causal":
      impls[name] = functools.partial(
        jax.nn.dot_product_attention, is_causal=True, implementation=sdpa_implementation()
      )
    else:
      raise ValueError(f"unknown impl {name!r} (one of {', '.join(IMPLS)})")
  return impls


def add_comparisons(report: dict, outputs: dict) -> None:
  """Adds speedups of the fastest Pallas config (by fwd+bwd) and the max error of it and of the
  blockwise path vs the dense-masked reference."""
  res = report["results"]
  if "xla_blockwise" in outputs and "xla_dense" in outputs:
    diff = outputs["xla_blockwise"].astype(jnp.float32) - outputs["xla_dense"].astype(jnp.float32)
    report["max_abs_diff_blockwise_vs_xla"] = float(jnp.max(jnp.abs(diff)))
  pallas = [n for n in res if n.startswith("pallas") and "fwd_ms" in res[n]]
  if not pallas:
    return
  best = min(pallas, key=lambda n: res[n]["fwd_bwd_ms"])
  report["best_pallas"] = best
  for other in ("xla_dense", "xla_blockwise", "sdpa_causal"):
    if "fwd_ms" in res.get(other, {}):
      report[f"speedup_pallas_vs_{other}"] = {
        "fwd": res[other]["fwd_ms"] / res[best]["fwd_ms"],
        "fwd_bwd": res[other]["fwd_bwd_ms"] / res[best]["fwd_bwd_ms"],
      }
  if "xla_dense" in outputs:
    diff = jnp.abs(outputs[best].astype(jnp.float32) - outputs["xla_dense"].astype(jnp.float32))
    report["max_abs_diff_pallas_vs_xla"] = float(jnp.max(diff))


def main(argv=None) -> dict:
  args = parse_args(argv)
  rng = np.random.default_rng(args.seed)
  B, T, H, KV, D = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
  dtype = jnp.dtype(args.dtype)
  draw = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype)
  q, k, v, do = draw(B, T, H, D), draw(B, T, KV, D), draw(B, T, KV, D), draw(B, T, H, D)
  seg, doc = make_ids(rng, B, T, args.max_group, args.docs_per_row)

  k_start = lca_key_start(seg, doc if args.docs_per_row > 1 else None)
  lca_pairs = int(jnp.sum(jnp.maximum(jnp.arange(T) - k_start + 1, 0)))
  causal_pairs = B * T * (T + 1) // 2
  dense_pairs = B * T * T
  flops_fwd = lambda pairs: 4.0 * H * D * pairs

  report = {
    "device": str(jax.devices()[0].device_kind),
    "backend": jax.default_backend(),
    "jax": jax.__version__,
    "interpret": args.small,
    "shape": {"B": B, "T": T, "H": H, "KV": KV, "D": D, "dtype": args.dtype},
    "pallas_launch": {"num_warps": args.num_warps, "num_stages": args.num_stages},
    "lca": {
      "max_group": args.max_group,
      "docs_per_row": args.docs_per_row,
      "mean_keys_per_query": lca_pairs / (B * T),
      "density_vs_dense": lca_pairs / dense_pairs,
    },
    "results": {},
  }
  outputs = {}
  for name, attn in build_impls(args, seg, doc).items():
    pairs = causal_pairs if name == "sdpa_causal" else lca_pairs
    try:
      fwd, fwd_bwd = fwd_and_fwd_bwd(attn)
      outputs[name] = fwd(q, k, v)
      fwd_ms = time_fn(fwd, (q, k, v), args.iters, args.warmup)
      fwd_bwd_ms = time_fn(fwd_bwd, (q, k, v, do), args.iters, args.warmup)
    except Exception as e:  # keep benchmarking the other implementations
      report["results"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
      continue
    tflops = lambda flops, ms: flops / (ms * 1e-3) / 1e12
    report["results"][name] = {
      "fwd_ms": fwd_ms,
      "fwd_bwd_ms": fwd_bwd_ms,
      "fwd_tflops_unmasked": tflops(flops_fwd(pairs), fwd_ms),
      "fwd_bwd_tflops_unmasked": tflops(3.5 * flops_fwd(pairs), fwd_bwd_ms),
      "fwd_tflops_dense_equiv": tflops(flops_fwd(dense_pairs), fwd_ms),
      "fwd_bwd_tflops_dense_equiv": tflops(3.5 * flops_fwd(dense_pairs), fwd_bwd_ms),
    }
    if name == "sdpa_causal":
      report["results"][name]["implementation"] = sdpa_implementation() or "xla"

  add_comparisons(report, outputs)
  print(json.dumps(report, indent=2))
  return report


if __name__ == "__main__":
  main()
