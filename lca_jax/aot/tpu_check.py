"""Compile a program for a TPU target without a TPU and report what it needs.

``check(program, target)`` compiles one ``programs.Program`` with libtpu and returns the report
``check.check`` gives for a GPU, in the TPU's terms: memory per chip against its HBM (a TPU
process takes the whole HBM: no pool fraction, no CUDA context), compile seconds, fusions,
custom calls (Pallas kernels are ``tpu_custom_call``), loops, large buffers, and the
``estimate``: XLA's own time estimate (``optimal_seconds``) where it holds, else the per-op model
of ``perf.tpu``, with ``source`` saying which; for train and eval steps MFU (useful FLOPs / chips
/ (estimate x the chip's bf16 peak)), for decode programs the idle and LM step times and
bytes/s (``rates.decode_estimate``).
"""

from __future__ import annotations

import re
import time

import jax

from lca_jax import backend
from lca_jax.aot import rates, report
from lca_jax.perf import tpu, workload

GB = report.GB
KERNEL_BLOCK = 128  # the TPU attention kernel's blocks (kernels.tpu_attention)
# XLA:TPU refuses to compile a program whose temporaries alone exceed the HBM
_EXHAUSTED = re.compile(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


def memory(compiled, device_bytes: int, state_bytes: int) -> dict:
  """Per-chip bytes of ``compiled`` (``memory_analysis``) against the chip's HBM."""
  total, buffers = report.buffer_sizes(compiled, device_bytes, state_bytes)
  free = device_bytes - total
  return dict(
    buffers,
    fits=free >= 0,
    verdict="fits in HBM" if free >= 0 else f"does not fit by {-free / GB:.2f} GB",
    margin_gb=round(free / GB, 3),
  )


def exhausted_memory(message: str, device_bytes: int, state_bytes: int) -> dict:
  """The memory report of a program XLA:TPU would not compile for lack of HBM (its
  RESOURCE_EXHAUSTED ``message``): temporaries as the compiler counted them, arguments taken as
  the training state, and the verdict."""
  m = _EXHAUSTED.search(message)
  temp, allowed = (float(m.group(1)), float(m.group(2))) if m else (0.0, device_bytes / GB)
  state = state_bytes / GB
  return dict(
    state_gb=round(state, 3),
    temp_gb=round(temp, 3),
    total_gb=round(state + temp, 3),
    device_gb=round(device_bytes / GB, 3),
    fits=False,
    verdict=f"does not fit: XLA found temporaries of {temp:.2f} GB for {allowed:.2f} GB of HBM",
    margin_gb=round(device_bytes / GB - state - temp, 3),
  )


def estimate_program(program, target, compiled, hlo_text: str, work) -> dict:
  """The ``estimate`` of one compiled TPU program (module docstring)."""
  chip = target.chip
  constants = dict(
    dot_efficiency=chip.dot_efficiency,
    memory_efficiency=chip.memory_efficiency,
    peak_bf16_tflops=chip.bf16_flops / 1e12,
    memory_tb_s=chip.memory_bytes_per_s / 1e12,
    op_us=tpu.OP_S * 1e6,
  )
  if program.decode:
    idle, lm = tpu.decode_steps(hlo_text, chip)
    out = rates.decode_estimate(program, chip, idle, lm, work, constants)
    return dict(out, source=tpu.MODEL)
  hints = workload.train_hints(
    program.cfg, program.info["seq_len"], work.bytes_per_group, pallas_block=KERNEL_BLOCK
  )
  s = tpu.program_estimate(hlo_text, chip, hints, target.n_devices)
  chosen = tpu.step_estimate(s["step_s"], tpu.compiler_seconds(compiled), tpu.has_loops(hlo_text))
  s = dict(s, **chosen)
  if chosen["source"] == tpu.COMPILER:
    s["floor_s"] = min(s["floor_s"], chosen["step_s"])
  return rates.train_estimate(program, target.n_devices, chip, s, work, hints, constants)


def check(program, target, work, hlo_dir=None) -> dict:
  """The report of ``program`` compiled for TPU ``target`` (module docstring); with
  ``hlo_dir``, its optimized HLO written there (``report.save_hlo``). A program XLA will not
  compile for lack of HBM is reported as not fitting (``exhausted_memory``, ``compile_error``)
  with no estimate."""
  out = dict(program=program.name, target=str(target), device=target.device_name, unit="chip")
  t0 = time.perf_counter()
  out.update(program.info)
  compiled, error = None, ""
  try:
    with backend.target("tpu"):
      compiled = program.lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    error = str(e)
  out.update(lower_s=round(program.lower_s, 2), compile_s=round(time.perf_counter() - t0, 2))
  if compiled is None:
    out["compile_error"] = error.splitlines()[0][:300]
    out["memory"] = exhausted_memory(error, target.memory_bytes, program.state_bytes)
    return out
  out["memory"] = memory(compiled, target.memory_bytes, program.state_bytes)
  hlo_text = compiled.as_text()
  report.save_hlo(hlo_dir, out, hlo_text)
  out.update(report.hlo_summary(hlo_text, program.seq_len))
  if program.cfg is not None:
    out["estimate"] = estimate_program(program, target, compiled, hlo_text, work)
  return out
