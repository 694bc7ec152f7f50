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

and prints one JSON object with times (ms), TFLOP/s and ratios (``lca_jax/bench/kernel.py``
says how FLOPs are counted).

Default shapes: B=8, T=4096, H=KV=8, D=128, bf16 (needs a GPU). ``--small``
uses tiny shapes and Pallas interpret mode so the script runs on CPU as a
smoke test (the numbers are then meaningless).

``--aot h200`` (or h100, b200) times nothing: it compiles the same programs for that GPU on this
host, without one (jax's CUDA plugin, ``make gpu-aot``), and prints the estimated times of
``lca_jax.perf`` (``lca_jax/bench/kernel_estimate.py``), to set beside a measurement.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # lca_jax from this checkout, installed or not
  sys.path.insert(0, ROOT)

if "--aot" in sys.argv:  # compile for a GPU target: no GPU client, whatever the host has
  from lca_jax import aot  # noqa: E402  pylint: disable=g-import-not-at-top

  aot.import_jax_for_gpu_targets()
from lca_jax.bench import args as args_lib  # noqa: E402
from lca_jax.bench import kernel, report  # noqa: E402
from lca_jax.errors import LcaError  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
  p = args_lib.one_line_parser("bench_kernel.py", description=__doc__.split("\n\n")[0])
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
  p.add_argument("--impls", default=",".join(kernel.IMPLS))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--aot", default="", help="estimate for this GPU (h100, h200, b200), no run")
  args = p.parse_args(argv)
  unknown = [s for s in args.impls.split(",") if s not in kernel.IMPLS]
  if unknown or not args.impls:
    p.error(
      f"--impls: unknown {', '.join(unknown) or '(empty)'} (one of {', '.join(kernel.IMPLS)})"
    )
  for blocks in args.pallas_blocks.split(","):
    if not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", blocks):
      p.error(f"--pallas-blocks: {blocks!r} is not BLOCK_QxBLOCK_K (e.g. 32x32)")
  if args.small:
    args.batch, args.seq, args.heads, args.kv_heads, args.head_dim = 2, 96, 4, 2, 32
    args.iters, args.warmup = 2, 1
  args.kv_heads = args.kv_heads or args.heads
  return args


def main(argv=None) -> dict:
  a = parse_args(argv)
  problem = dict(
    batch=a.batch,
    seq=a.seq,
    heads=a.heads,
    kv_heads=a.kv_heads,
    head_dim=a.head_dim,
    dtype=a.dtype,
    max_group=a.max_group,
    docs_per_row=a.docs_per_row,
    impls=a.impls,
    pallas_blocks=a.pallas_blocks,
    seed=a.seed,
  )
  if a.aot:
    from lca_jax.bench import kernel_estimate  # pylint: disable=g-import-not-at-top

    try:
      out = kernel_estimate.run(a.aot, **problem)
    except LcaError as e:  # an unknown target, a GPU plugin missing
      print(f"bench_kernel.py: error: {e}", file=sys.stderr)
      sys.exit(2)
    return report.print_json(out, indent=2)
  out = kernel.run(
    **problem,
    num_warps=a.num_warps,
    num_stages=a.num_stages,
    iters=a.iters,
    warmup=a.warmup,
    interpret=a.small,
  )
  return report.print_json(out, indent=2)


if __name__ == "__main__":
  main()
