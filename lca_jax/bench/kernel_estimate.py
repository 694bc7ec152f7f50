"""The LCA attention implementations of ``bench.kernel`` compiled for a GPU without one, with
the estimated time of each (``lca_jax.perf``) in place of a measurement.

Same inputs as ``kernel.run`` (random groups of up to ``max_group`` bytes, seed ``seed``); the
Pallas kernels are priced at the keys they visit under that mask (``Hints.keys_per_query``
from ``query_block_key_bounds`` of the drawn groups and the block sizes), cuDNN's causal
attention at half the square. Needs jax's CUDA plugin (``make gpu-aot``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from lca_jax import backend
from lca_jax.aot import check, targets
from lca_jax.bench.kernel import IMPLS, build_impls, fwd_and_fwd_bwd, make_ids
from lca_jax.kernels import lca_key_start
from lca_jax.perf import estimate, hardware, workload


def run(
  target: str,
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
  seed=0,
) -> dict:
  """JSON: per implementation the estimated forward and forward+backward ms (``fwd_est_ms``,
  ``fwd_bwd_est_ms``), their roofline floors, FLOPs, bytes and launches; or an error."""
  tgt = targets.parse(target)
  if tgt.platform != "gpu":
    raise targets.AotError(
      f"the kernel estimate is for GPUs ({', '.join(targets.TARGETS)}), not {target!r}"
    )
  gpu = hardware.gpu(tgt.name)
  sharding = SingleDeviceSharding(targets.devices(targets.Target(tgt.name, 1))[0])
  rng = np.random.default_rng(seed)
  dt = jnp.dtype(dtype)
  B, T, H, KV, D = batch, seq, heads, kv_heads, head_dim
  a = lambda *s: jax.ShapeDtypeStruct(s, dt, sharding=sharding)
  q, k, v, do = a(B, T, H, D), a(B, T, KV, D), a(B, T, KV, D), a(B, T, H, D)
  seg, doc = make_ids(rng, B, T, max_group, docs_per_row)
  k_start = lca_key_start(seg, doc if docs_per_row > 1 else None)
  out = dict(target=str(tgt), gpu=gpu.name, shape=dict(B=B, T=T, H=H, KV=KV, D=D, dtype=dtype))
  results = {}
  with backend.target("gpu"):
    fns = build_impls(impls, seg, doc, docs_per_row, pallas_blocks, False)
  if "sdpa_causal" in fns:  # what a GPU runs (cuDNN), not the XLA fallback of a CPU host
    fns["sdpa_causal"] = functools.partial(
      jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"
    )
  for name, attn in fns.items():
    hints = estimate.Hints()
    if name.startswith("pallas_"):
      bq, bk = map(int, name.split("_")[1].split("x"))
      hints = estimate.Hints(
        keys_per_query=(("lca_attention", workload.pallas_keys_per_query(k_start, bq, bk)),)
      )
    row = {}
    try:
      fwd, fwd_bwd = fwd_and_fwd_bwd(attn)
      for key, fn, args in (("fwd", fwd, (q, k, v)), ("fwd_bwd", fwd_bwd, (q, k, v, do))):
        with backend.target("gpu"), backend.lowering_device(sharding):
          lowered = fn.lower(*args)
        compiled, _, seq_text, meta = check.compile_with_dump(lowered, {})
        s = estimate.estimate(compiled.as_text(), seq_text, meta, gpu, hints=hints)
        row.update(
          {
            f"{key}_est_ms": s["step_s"] * 1e3,
            f"{key}_floor_ms": s["floor_s"] * 1e3,
            f"{key}_flops": s["flops"],
            f"{key}_bytes": s["bytes"],
            f"{key}_launches": s["launches"],
          }
        )
    except Exception as e:  # noqa: BLE001 - keep estimating the other implementations
      row = {"error": f"{type(e).__name__}: {e}"[:300]}
    results[name] = row
  out["results"] = results
  return out
