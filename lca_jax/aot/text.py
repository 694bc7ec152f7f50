"""Reports of ``lca_jax.aot.check`` as the lines ``lca-train --aot`` prints."""

from __future__ import annotations

from typing import List


def _counts(d: dict) -> str:
  return ", ".join(f"{k} {v}" for k, v in d.items() if k != "total") or "none"


def header(r: dict) -> str:
  mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
  return (
    f"{r['target']} ({r['device']}, {r['memory']['device_gb']:.1f} GB each): mesh {mesh}; "
    f"micro-batch {r['micro_batch']} rows ({r['micro_batch_per_device']} per {_unit(r)}) x "
    f"{r['accum']} accumulated, T {r['seq_len']}, attention {_attention(r)}, "
    f"{r['dtype']}, remat {'on' if r['remat'] else 'off'}"
  )


def _attention(r: dict) -> str:
  """The attention the program runs, "pallas (auto)" when the config left it to the platform."""
  auto = r.get("attention_requested") == "auto"
  return f"{r['attention_impl']} (auto)" if auto else r["attention_impl"]


def setting(r: dict) -> str:
  """' (16 rows per GPU, remat)': a train or eval step's rows per device and remat, so the
  settings a fit search compiles one after another tell apart; '' for other programs."""
  if "micro_batch_per_device" not in r:
    return ""
  n, remat = r["micro_batch_per_device"], ", remat" if r.get("remat") else ""
  return f" ({n} row{'' if n == 1 else 's'} per {_unit(r)}{remat})"


def _unit(r: dict) -> str:
  return r.get("unit", "GPU")


def program_lines(r: dict) -> List[str]:
  m = r["memory"]
  gemms = (
    f"{r['gemm_fusions']['total']} Triton GEMM fusions, {r['gemm_fusions']['distinct']} distinct "
    "(each autotuned when a GPU compiles); "
    if _unit(r) == "GPU"
    else ""
  )
  lines = [
    f"{r['program']}: {m['total_gb']:.2f} GB per {_unit(r)}: {m['verdict']}"
    + (f" ({m['margin_gb']:.2f} GB free)" if m["fits"] else ""),
    f"  parameters + optimizer state {m['state_gb']:.2f} GB, temporaries {m['temp_gb']:.2f} GB, "
    f"arguments {m['argument_gb']:.2f} GB, outputs {m['output_gb']:.2f} GB "
    f"({m['alias_gb']:.2f} GB of them in donated arguments)",
    f"  compiled in {r['compile_s']:.1f} s (traced in {r['lower_s']:.1f} s); "
    f"{r['fusions']['total']} fusions ({_counts(r['fusions'])}); {gemms}{r['while_loops']} loops",
    f"  custom calls: {_counts(r['custom_calls'])}",
  ]
  lines += estimate_lines(r.get("estimate"))
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


def _ms(s: float) -> str:
  if s >= 1.0:
    return f"{s:.3g} s"
  return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def estimate_lines(e) -> List[str]:
  """The time estimate (``check.estimate_program``) in a few lines; none without one."""
  if not e:
    return []
  c = e["constants"]
  if "launch_graph_us" in c:
    how = (
      f"(lca_jax.perf: kernels at {c['dot_efficiency']:.0%} of {c['peak_bf16_tflops']:.0f} "
      f"TFLOP/s and {c['memory_efficiency']:.0%} of {c['memory_tb_s']:.2f} TB/s, "
      f"{c['launch_graph_us']:g} us per kernel in a CUDA graph, {c['launch_host_us']:g} us "
      "launched by the host)"
    )
  else:
    how = (
      f"({e['source']}"
      + (f", as {e['why']}" if e.get("why") else "")
      + f": ops at {c['dot_efficiency']:.0%} of {c['peak_bf16_tflops']:.0f} TFLOP/s and "
      f"{c['memory_efficiency']:.0%} of {c['memory_tb_s']:.2f} TB/s, {c['op_us']:g} us per op)"
    )
  if "mfu" in e:
    split = ", ".join(f"{k} {_ms(v)}" for k, v in e["split_s"].items() if v)
    lines = [
      f"  estimated step {_ms(e['step_s'])}: {e['bytes_per_s']:,.0f} bytes/s, MFU "
      f"{e['mfu']:.1%} (roofline floor {_ms(e['floor_s'])}, MFU {e['floor_mfu']:.1%}) {how}",
      f"  where the time goes: {split}",
    ]
    if e["unknown_loops"]:
      lines.append(f"  {e['unknown_loops']} loops of unknown trip count counted once")
    top = "; ".join(
      f"{k['name']} ({k['category']}, {k['runs']:g}x, {_ms(k['total_s'])})"
      for k in e["top_kernels"][:5]
    )
    return lines + [f"  costliest kernels: {top}"]
  idle, lm = e["idle_step"], e["lm_step"]
  ops = "launches" if "launch_graph_us" in c else "ops"
  return [
    f"  estimated step {_ms(idle['step_s'])} idle ({idle['launches']:g} {ops}), "
    f"{_ms(lm['step_s'])} when the latent LM runs ({lm['launches']:g}); at "
    f"{e['bytes_per_group']:.3g} bytes per group and {e['accepted_per_step']:g} bytes per row "
    f"per step: {e['bytes_per_s']:,.0f} bytes/s; memory floor {e['floor_bytes_per_s']:,.0f} "
    f"bytes/s (estimate / floor {e['estimate_over_floor']:.2f}) {how}"
  ]
