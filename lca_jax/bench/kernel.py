"""LCA attention implementations timed side by side: forward and forward+backward times,
TFLOP/s by two pair counts, speedups of the fastest Pallas configuration, and the errors of
the kernel and of the blockwise path against the dense-masked reference.

FLOP conventions: forward = 4 * H * D * pairs (QK^T and PV), forward+backward = 3.5x forward
(FlashAttention convention). ``tflops_unmasked`` counts only the (query, key) pairs each
method's mask allows (LCA pairs, or T(T+1)/2 per row for causal); ``tflops_dense_equiv``
counts all T*T pairs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lca_jax.bench.timing import median_ms
from lca_jax.kernels import lca_attention, lca_key_start
from lca_jax.model.attention import blockwise_attention
from lca_jax.model.config import ModelConfig

IMPLS = ("pallas", "xla_dense", "xla_blockwise", "sdpa_causal")


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


def build_impls(impls, seg, doc, docs_per_row=1, pallas_blocks="32x32", interpret=False, **launch):
  """Name -> attention fn(q, k, v) for the implementations named in ``impls`` (comma
  separated; ``pallas``: one per ``BQxBK`` of ``pallas_blocks``, with the ``num_warps`` /
  ``num_stages`` of ``launch``)."""
  docs = doc if docs_per_row > 1 else None
  lca = functools.partial(lca_attention, segment_ids=seg, doc_ids=docs)
  tile = ModelConfig()
  out = {}
  for name in impls.split(","):
    if name == "pallas":
      for blocks in pallas_blocks.split(","):
        bq, bk = map(int, blocks.split("x"))
        out[f"pallas_{bq}x{bk}"] = functools.partial(
          lca, impl="pallas", interpret=interpret, block_q=bq, block_k=bk, **launch
        )
    elif name == "xla_dense":
      out[name] = functools.partial(lca, impl="xla")
    elif name == "xla_blockwise":
      out[name] = functools.partial(
        blockwise_attention,
        lo_BT=lca_key_start(seg, docs),
        block_q=tile.lca_block_q,
        block_k=tile.lca_block_q + tile.lca_lookback,
      )
    elif name == "sdpa_causal":
      out[name] = functools.partial(
        jax.nn.dot_product_attention, is_causal=True, implementation=sdpa_implementation()
      )
    else:
      raise ValueError(f"unknown impl {name!r} (one of {', '.join(IMPLS)})")
  return out


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


def _tflops(flops, ms):
  return flops / (ms * 1e-3) / 1e12


def run(
  *,
  batch,
  seq,
  heads,
  kv_heads,
  head_dim,
  dtype="bfloat16",
  max_group=40,
  docs_per_row=1,
  impls=",".join(IMPLS),
  pallas_blocks="32x32",
  num_warps=None,
  num_stages=2,
  iters=20,
  warmup=3,
  seed=0,
  interpret=False,
) -> dict:
  """The benchmark's JSON object: every implementation of ``impls`` on random q, k, v of
  [batch, seq, heads (kv_heads), head_dim] and random groups of up to ``max_group`` bytes;
  an implementation that fails is recorded as ``{"error": ...}`` and the others go on."""
  rng = np.random.default_rng(seed)
  B, T, H, KV, D = batch, seq, heads, kv_heads, head_dim
  dt = jnp.dtype(dtype)
  draw = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dt)
  q, k, v, do = draw(B, T, H, D), draw(B, T, KV, D), draw(B, T, KV, D), draw(B, T, H, D)
  seg, doc = make_ids(rng, B, T, max_group, docs_per_row)

  k_start = lca_key_start(seg, doc if docs_per_row > 1 else None)
  lca_pairs = int(jnp.sum(jnp.maximum(jnp.arange(T) - k_start + 1, 0)))
  causal_pairs = B * T * (T + 1) // 2
  dense_pairs = B * T * T
  flops_fwd = lambda pairs: 4.0 * H * D * pairs

  report = {
    "device": str(jax.devices()[0].device_kind),
    "backend": jax.default_backend(),
    "jax": jax.__version__,
    "interpret": interpret,
    "shape": {"B": B, "T": T, "H": H, "KV": KV, "D": D, "dtype": dtype},
    "pallas_launch": {"num_warps": num_warps, "num_stages": num_stages},
    "lca": {
      "max_group": max_group,
      "docs_per_row": docs_per_row,
      "mean_keys_per_query": lca_pairs / (B * T),
      "density_vs_dense": lca_pairs / dense_pairs,
    },
    "results": {},
  }
  fns = build_impls(
    impls,
    seg,
    doc,
    docs_per_row,
    pallas_blocks,
    interpret,
    num_warps=num_warps,
    num_stages=num_stages,
  )
  outputs = {}
  for name, attn in fns.items():
    pairs = causal_pairs if name == "sdpa_causal" else lca_pairs
    try:
      fwd, fwd_bwd = fwd_and_fwd_bwd(attn)
      outputs[name] = fwd(q, k, v)
      fwd_ms = median_ms(fwd, (q, k, v), iters, warmup)
      fwd_bwd_ms = median_ms(fwd_bwd, (q, k, v, do), iters, warmup)
    except Exception as e:  # keep benchmarking the other implementations
      report["results"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
      continue
    report["results"][name] = {
      "fwd_ms": fwd_ms,
      "fwd_bwd_ms": fwd_bwd_ms,
      "fwd_tflops_unmasked": _tflops(flops_fwd(pairs), fwd_ms),
      "fwd_bwd_tflops_unmasked": _tflops(3.5 * flops_fwd(pairs), fwd_bwd_ms),
      "fwd_tflops_dense_equiv": _tflops(flops_fwd(dense_pairs), fwd_ms),
      "fwd_bwd_tflops_dense_equiv": _tflops(3.5 * flops_fwd(dense_pairs), fwd_bwd_ms),
    }
    if name == "sdpa_causal":
      report["results"][name]["implementation"] = sdpa_implementation() or "xla"
  add_comparisons(report, outputs)
  return report
