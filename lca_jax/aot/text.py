"""Reports of ``lca_jax.aot.check`` as the lines ``lca-train --aot`` prints."""

from __future__ import annotations

from typing import List


def _counts(d: dict) -> str:
  return ", ".join(f"{k} {v}" for k, v in d.items() if k != "total") or "none"


def header(r: dict) -> str:
  mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
  return (
    f"{r['target']} ({r['device']}, {r['memory']['device_gb']:.1f} GB each): mesh {mesh}; "
    f"micro-batch {r['micro_batch']} rows ({r['micro_batch_per_device']} per GPU) x "
    f"{r['accum']} accumulated, T {r['seq_len']}, attention {r['attention_impl']}, "
    f"{r['dtype']}, remat {'on' if r['remat'] else 'off'}"
  )


def program_lines(r: dict) -> List[str]:
  m = r["memory"]
  lines = [
    f"{r['program']}: {m['total_gb']:.2f} GB per GPU: {m['verdict']}"
    + (f" ({m['margin_gb']:.2f} GB free)" if m["fits"] else ""),
    f"  parameters + optimizer state {m['state_gb']:.2f} GB, temporaries {m['temp_gb']:.2f} GB, "
    f"arguments {m['argument_gb']:.2f} GB, outputs {m['output_gb']:.2f} GB "
    f"({m['alias_gb']:.2f} GB of them in donated arguments)",
    f"  compiled in {r['compile_s']:.1f} s (traced in {r['lower_s']:.1f} s); "
    f"{r['fusions']['total']} fusions ({_counts(r['fusions'])}); "
    f"{r['gemm_fusions']['total']} Triton GEMM fusions, {r['gemm_fusions']['distinct']} distinct "
    f"(each autotuned when a GPU compiles); {r['while_loops']} loops",
    f"  custom calls: {_counts(r['custom_calls'])}",
  ]
  big = r["large_buffers"]
  if big:
    shown = "; ".join(
      f"{b['shape']} x{b['count']}{' in attention' if b['attention'] else ''} ({b['source']})"
      for b in big[:3]
    )
    lines.append(
      f"  buffers with two dimensions >= T: {sum(b['count'] for b in big)}, "
      f"{r['attention_buffers_TT']} in attention: {shown}"
    )
  else:
    lines.append("  buffers with two dimensions >= T: none")
  return lines
