"""Compile programs for a GPU target without a GPU and report what each needs.

``check(program, target)`` compiles one ``programs.Program`` (XLA logs "Performing a deviceless
compilation") and returns the report of ``report``: memory against the device's, compile
seconds, fusions, GEMM fusions, custom calls, large buffers and, for a decode program, the
kernels and host work of one decode step (read from the thunk sequence XLA dumps while it
compiles). ``train_reports(config, target)`` checks what ``lca-train`` would run;
``decode_reports`` the decode programs of ``generate``.

Limits: no GEMM autotuning happens without a GPU (the Triton GEMM tiles are XLA's defaults; on a
GPU each distinct GEMM fusion is autotuned at compile time, so ``gemm_fusions.distinct`` is the
autotuning work), compile seconds are a lower bound of a GPU host's, and ``cost_analysis`` is
empty.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time

import jax

from lca_jax import backend, xla_options
from lca_jax.aot import programs, report, targets
from lca_jax.model.config import ModelConfig

THUNKS = "*.thunk_sequence_after_thunk_passes.txt"
FALLBACK = {"xla_gpu_enable_triton_gemm": False}  # GEMMs through cuBLAS


def _compile(lowered, options: dict):
  """(compiled, seconds, thunk sequence text or '') with ``options`` and a dump of the thunk
  sequence (XLA writes it, with each kernel's PTX, into a temporary folder)."""
  with tempfile.TemporaryDirectory(prefix="lca_aot_") as d:
    opts = dict(options, xla_dump_to=d, xla_gpu_dump_llvmir=False, xla_dump_hlo_as_text=False)
    t0 = time.perf_counter()
    with backend.target("gpu"):
      compiled = lowered.compile(compiler_options=opts)
    seconds = time.perf_counter() - t0
    found = sorted(glob.glob(os.path.join(d, THUNKS)), key=os.path.getsize)
    thunks = open(found[-1]).read() if found else ""
  return compiled, seconds, thunks


def check(program: programs.Program, target: targets.Target, options=None) -> dict:
  """The report of ``program`` compiled for ``target`` with XLA ``options`` (default: those
  the program runs with: the decode options for a decode program, none for the others)."""
  if options is None:
    with backend.target("gpu"):
      options = (xla_options.decode_options() or {}) if program.decode else {}
  out = dict(program=program.name, target=str(target), device=target.device_name)
  try:
    compiled, seconds, thunks = _compile(program.lowered, options)
  except jax.errors.JaxRuntimeError as e:
    # XLA without autotuning can fail to tile a Triton GEMM fusion that a GPU's autotuner
    # would have tiled (or sent to cuBLAS): say so and compile with cuBLAS GEMMs instead
    out["compile_error"] = str(e).splitlines()[0][:300]
    options = dict(options, **FALLBACK)
    compiled, seconds, thunks = _compile(program.lowered, options)
  out.update(program.info)
  out.update(lower_s=round(program.lower_s, 2), compile_s=round(seconds, 2))
  out["memory"] = report.memory(compiled, target.memory_bytes, program.state_bytes)
  out.update(report.hlo_summary(compiled.as_text(), program.seq_len))
  if program.decode:
    out["step"] = report.decode_step(thunks, program.bytes_per_step)
  if options:
    out["xla_options"] = dict(options)
  return out


def train_reports(config, target: targets.Target, which=("train_step", "eval_step")) -> list:
  """Reports of the train and eval steps ``lca-train`` runs for ``config`` on ``target``."""
  progs = programs.train_programs(config, targets.devices(target))
  return [check(p, target) for p in progs if p.name in which]


def decode_reports(
  cfg: ModelConfig, target: targets.Target, cases, prompt_len: int = 256, max_bytes: int = 256
) -> list:
  """Reports of the decode programs of ``cases``: dicts of ``generate`` options with a
  ``batch`` (e.g. ``dict(batch=1, mode="verify", n=3)``), on one device of ``target``."""
  device = targets.devices(targets.Target(target.name, 1))[0]
  out = []
  for case in cases:
    case = dict(case)
    batch = case.pop("batch")
    p = programs.decode_program(
      cfg, device, batch=batch, prompt_len=prompt_len, max_bytes=max_bytes, **case
    )
    out.append(check(p, targets.Target(target.name, 1)))
  return out


DECODE_CASES = (
  dict(batch=1, mode="ntp"),
  dict(batch=1, mode="threshold", tau=0.0, n=3),
  dict(batch=1, mode="verify", n=3),
  dict(batch=32, mode="ntp"),
  dict(batch=32, mode="threshold", tau=0.0, n=3),
  dict(batch=32, mode="verify", n=3),
)


def suite(
  config,
  target_names=targets.TARGETS,
  gpu_counts=(1, 8),
  impls=("xla", "pallas"),
  micro_per_gpu: int = 16,
  decode_cases=DECODE_CASES,
  log=None,
) -> list:
  """Reports of every production program of ``config`` for each target: the train step per
  attention implementation and GPU count (``micro_per_gpu`` rows per GPU in each micro-batch),
  the eval step (first implementation, one GPU), and the decode programs of ``decode_cases``.
  ``log(report)`` is called after each program."""
  out = []

  def add(reports):
    for r in reports:
      out.append(r)
      if log is not None:
        log(r)

  for name in target_names:
    for impl in impls:
      for n in gpu_counts:
        c = config.copy_and_resolve_references()
        c.model.attention_impl = impl
        c.train.micro_batch_size = micro_per_gpu * n
        first = impl == impls[0] and n == gpu_counts[0]
        which = ("train_step", "eval_step") if first else ("train_step",)
        add(train_reports(c, targets.Target(name, n), which))
    cfg = ModelConfig.from_dict(config.model.to_dict())
    add(decode_reports(cfg, targets.Target(name, 1), decode_cases))
  return out
