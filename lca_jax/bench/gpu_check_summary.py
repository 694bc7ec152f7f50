"""The closing summary of ``tools/gpu_check.sh``: one line per benchmark part with what it
measured and, beside it, ``lca_jax.perf``'s estimate of the same program for the same GPU.

The estimates come from the script's last two parts: ``estimate_programs.out`` (the JSON of
``tools/gpu_aot.py``: train step per attention implementation and micro-batch, decode programs
per mode, batch and n) and ``estimate_kernels.out`` (``tools/bench_kernel.py --aot``). A decode
estimate is re-weighted to the measured share of steps that run the latent LM and the measured
bytes per step, so measured and estimated ms/step and bytes/s describe the same steps. Parts
whose programs differ from the estimated ones (fused decode kernels off, a host-driven decode
loop, unrolled layer stacks) are printed without an estimate, saying why.

    python -m lca_jax.bench.gpu_check_summary OUT_DIR
"""

from __future__ import annotations

import glob
import json
import os
import sys

# benchmark parts whose programs are not the ones estimate_programs compiles
NOT_ESTIMATED = {
  "bench_decode_xla": "fused decode kernels off; the estimate has them on",
  "bench_decode_host_loop": "host-driven loop; the estimate assumes one CUDA graph",
  "bench_train_unrolled": "unrolled stacks; the estimate is of the scanned step",
}


def _load(path: str):
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _ratio(measured, estimated) -> str:
  if not measured or not estimated:
    return ""
  return f", measured/estimate {measured / estimated:.2f}"


def _kernel_lines(name: str, d: dict, est: dict | None) -> list[str]:
  r = d["results"]
  e = (est or {}).get("results", {})
  parts = []
  for k in (d["best_pallas"], "xla_dense", "sdpa_causal"):
    if k not in r:
      continue
    text = f"{k} {r[k]['fwd_ms']:.3g}/{r[k]['fwd_bwd_ms']:.3g}"
    if "fwd_est_ms" in e.get(k, {}):
      text += f" (est {e[k]['fwd_est_ms']:.3g}/{e[k]['fwd_bwd_est_ms']:.3g})"
    parts.append(text)
  return [f"{name}: fwd/fwd+bwd ms: {', '.join(parts)}"]


def _train_estimate(d: dict, programs: list[dict]) -> str:
  for p in programs:
    if (
      p.get("program") == "train_step"
      and p.get("attention_impl") == d.get("attention_impl")
      and p.get("micro_batch") == d.get("micro_batch")
      and "step_s" in p.get("estimate", {})
    ):
      e = p["estimate"]
      return (
        f"; estimate step {e['step_s']:.3f} s, MFU {e['mfu']:.3f}"
        f"{_ratio(d.get('step_time_s'), e['step_s'])}"
      )
  return "; no estimate at this micro-batch"


def _train_line(name: str, d: dict, programs: list[dict] | None) -> str:
  mfu = d.get("mfu")
  line = (
    f"{name}: {d['attention_impl']} micro-batch {d['micro_batch']}:"
    f" step {d['step_time_s']:.3f} s, {d['bytes_per_s']:.0f} bytes/s,"
    f" MFU {mfu if mfu is None else round(mfu, 3)}, compile {d['cost']['compile_s']} s"
  )
  if name in NOT_ESTIMATED:
    return line + f"; no estimate ({NOT_ESTIMATED[name]})"
  return line + ("" if programs is None else _train_estimate(d, programs))


def _decode_program(key: str, n, programs: list[dict]) -> dict | None:
  """The estimated decode program of a bench_decode row (``ntp_b1``, ``threshold_tau0_b32``)."""
  mode, _, batch = key.rpartition("_b")
  mode = mode.split("_")[0]
  for p in programs:
    e = p.get("estimate", {})
    if (
      p.get("program", "").startswith("decode_")
      and p.get("mode") == mode
      and str(p.get("batch")) == batch
      and (mode == "ntp" or p.get("n") == n)
      and "idle_step" in e
    ):
      return p
  return None


def _decode_estimate(r: dict, p: dict) -> str:
  """Estimated ms/step and bytes/s at the row's measured LM share and bytes per step."""
  e = p["estimate"]
  f = r.get("lm_fraction") if r.get("lm_fraction") is not None else e["lm_fraction"]
  step_s = (1 - f) * e["idle_step"]["step_s"] + f * e["lm_step"]["step_s"]
  floor_s = (1 - f) * e["idle_step"]["floor_s"] + f * e["lm_step"]["floor_s"]
  bps = r["bytes_per_step"] * p["batch"] / step_s if r.get("bytes_per_step") else None
  text = f"; estimate {step_s * 1e3:.3g} ms/step (floor {floor_s * 1e3:.3g})"
  if bps:
    text += f", {bps:.0f} bytes/s"
  return text + _ratio(r.get("ms_per_step"), step_s * 1e3)


def _decode_lines(name: str, d: dict, programs: list[dict] | None) -> list[str]:
  lines = []
  for k, r in d["results"].items():
    line = (
      f"{name}: {k}: {r['bytes_per_s']} bytes/s, {r.get('ms_per_step')} ms/step"
      f" (bound {r.get('bound_ms_per_step')}), compile {r.get('compile_s')} s"
    )
    if name in NOT_ESTIMATED:
      line += f"; no estimate ({NOT_ESTIMATED[name]})"
    elif programs is not None:
      p = _decode_program(k, d.get("n"), programs)
      line += _decode_estimate(r, p) if p else "; no estimate of this program"
    lines.append(line)
  return lines


def summary_lines(out_dir: str) -> list[str]:
  """One line per figure of every benchmark part in ``out_dir`` that printed its JSON."""
  est_programs = _load(os.path.join(out_dir, "estimate_programs.out"))
  programs = (est_programs or {}).get("programs")
  est_kernels = _load(os.path.join(out_dir, "estimate_kernels.out"))
  lines = []
  for path in sorted(glob.glob(os.path.join(out_dir, "bench_*.out"))):
    name = os.path.basename(path)[: -len(".out")]
    d = _load(path)
    if not isinstance(d, dict):
      continue
    if "results" in d and "best_pallas" in d:
      lines += _kernel_lines(name, d, est_kernels)
    elif "step_time_s" in d:
      lines.append(_train_line(name, d, programs))
    elif "results" in d:
      lines += _decode_lines(name, d, programs)
  if programs is None:
    lines.append("estimates: none (estimate_programs did not print its JSON)")
  return lines


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1 or not os.path.isdir(argv[0]):
    print("usage: python -m lca_jax.bench.gpu_check_summary OUT_DIR (a directory)", file=sys.stderr)
    return 2
  for line in summary_lines(argv[0]):
    print(line)
  return 0


if __name__ == "__main__":
  sys.exit(main())
