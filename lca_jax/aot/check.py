"""Compile programs for a GPU target without a GPU and report what each needs.

``check(program, target)`` compiles one ``programs.Program`` (XLA logs "Performing a deviceless
compilation") and returns the report of ``report``: memory against the device's, compile
seconds, fusions, GEMM fusions, custom calls, large buffers and, for a decode program, the
kernels and host work of one decode step (read from the thunk sequence XLA dumps while it
compiles). ``train_reports(config, target)`` checks what ``lca-train`` would run;
``decode_reports`` the decode programs of ``generate``.

Each report has an ``estimate`` (``lca_jax.perf``): the program's time priced kernel by kernel
from the optimized HLO and the thunk sequence. Train and eval steps: ``step_s``, bytes/s,
``mfu`` (useful FLOPs of the step, ``perf.workload``, over the estimated time x the dense bf16
peak x GPUs), the split by kind and the most expensive kernels. Decode programs: the idle step
(no group closes) and the LM step, and ``bytes_per_s`` at ``Workload.bytes_per_group`` and
``Workload.accepted`` beside the memory floor (``floor_bytes_per_s``).

Limits: no GEMM autotuning happens without a GPU (the Triton GEMM tiles are XLA's defaults; on a
GPU each distinct GEMM fusion is autotuned at compile time, so ``gemm_fusions.distinct`` is the
autotuning work), compile seconds are a lower bound of a GPU host's, and ``cost_analysis`` is
empty (hence the estimate of ``lca_jax.perf``).
"""

from __future__ import annotations

import gc
import math
import tempfile
import time
from typing import Optional

import jax

from lca_jax import backend, xla_options
from lca_jax.aot import programs, report, targets, tpu_check
from lca_jax.aot.rates import Workload, decode_estimate, train_estimate
from lca_jax.model.config import ModelConfig
from lca_jax.perf import estimate, hardware, thunks, workload

FALLBACK = {"xla_gpu_enable_triton_gemm": False}  # GEMMs through cuBLAS


def compile_with_dump(lowered, options: dict):
  """(compiled, seconds, thunk sequence text, thunk metadata text) with ``options`` and a dump
  of the thunk sequence (XLA writes it, with each kernel's PTX, into a temporary folder)."""
  with tempfile.TemporaryDirectory(prefix="lca_aot_") as d:
    opts = dict(options, xla_dump_to=d, xla_gpu_dump_llvmir=False, xla_dump_hlo_as_text=False)
    t0 = time.perf_counter()
    with backend.target("gpu"):
      compiled = lowered.compile(compiler_options=opts)
    seconds = time.perf_counter() - t0
    seq, meta = thunks.read_dump(d)
  return compiled, seconds, seq, meta


def estimate_program(program, target, hlo_text, seq, meta, work: Workload = Workload()) -> dict:
  """The ``estimate`` of one compiled GPU program (module docstring)."""
  gpu = hardware.gpu(target.name)
  constants = dict(
    dot_efficiency=gpu.dot_efficiency,
    memory_efficiency=gpu.memory_efficiency,
    launch_graph_us=work.launch.graph_s * 1e6,
    launch_host_us=work.launch.host_s * 1e6,
    sync_us=work.launch.sync_s * 1e6,
    peak_bf16_tflops=gpu.bf16_flops / 1e12,
    memory_tb_s=gpu.memory_bytes_per_s / 1e12,
  )
  if program.decode:
    idle, lm = estimate.decode_steps(hlo_text, seq, meta, gpu, launch=work.launch)
    return decode_estimate(program, gpu, idle, lm, work, constants)
  hints = workload.train_hints(program.cfg, program.info["seq_len"], work.bytes_per_group)
  s = estimate.estimate(
    hlo_text, seq, meta, gpu, hints=hints, launch=work.launch, n_devices=target.n_devices
  )
  return train_estimate(program, target.n_devices, gpu, s, work, hints, constants)


def check(
  program: programs.Program,
  target: targets.Target,
  options=None,
  work: Workload = Workload(),
  hlo_dir: Optional[str] = None,
) -> dict:
  """The report of ``program`` compiled for ``target`` with XLA ``options`` (default: those
  the program runs with: the decode options for a decode program, none for the others), with
  the time estimate under ``work``. A TPU target's report is ``tpu_check.check``'s. With
  ``hlo_dir``, the optimized HLO is also written there (``report.save_hlo``: to estimate again
  without compiling)."""
  if target.platform == "tpu":
    return tpu_check.check(program, target, work, hlo_dir)
  if options is None:
    with backend.target("gpu"):
      options = (xla_options.decode_options() or {}) if program.decode else {}
  out = dict(program=program.name, target=str(target), device=target.device_name)
  try:
    compiled, seconds, seq, meta = compile_with_dump(program.lowered, options)
  except jax.errors.JaxRuntimeError as e:
    # XLA without autotuning can fail to tile a Triton GEMM fusion that a GPU's autotuner
    # would have tiled (or sent to cuBLAS): say so and compile with cuBLAS GEMMs instead
    out["compile_error"] = str(e).splitlines()[0][:300]
    options = dict(options, **FALLBACK)
    compiled, seconds, seq, meta = compile_with_dump(program.lowered, options)
  out.update(program.info)
  out.update(lower_s=round(program.lower_s, 2), compile_s=round(seconds, 2))
  out["memory"] = report.memory(compiled, target.memory_bytes, program.state_bytes)
  hlo_text = compiled.as_text()
  report.save_hlo(hlo_dir, out, hlo_text)
  out.update(report.hlo_summary(hlo_text, program.seq_len))
  if program.decode:
    out["step"] = report.decode_step(seq, program.bytes_per_step)
  if program.cfg is not None and seq:
    out["estimate"] = estimate_program(program, target, hlo_text, seq, meta, work)
  if options:
    out["xla_options"] = dict(options)
  return out


def train_reports(
  config,
  target: targets.Target,
  which=("train_step", "eval_step"),
  work: Workload = Workload(),
  hlo_dir: Optional[str] = None,
) -> list:
  """Reports of the train and eval steps ``lca-train`` runs for ``config`` on ``target``."""
  progs = programs.train_programs(config, targets.devices(target))
  out = [check(p, target, work=work, hlo_dir=hlo_dir) for p in progs if p.name in which]
  del progs
  _release()
  return out


def _release() -> None:
  """Drop jax's caches of the programs just compiled: a run of many paper-scale programs in one
  process (``make tpu-aot``) otherwise grows until the host runs out of memory."""
  jax.clear_caches()
  gc.collect()


def decode_reports(
  cfg: ModelConfig,
  target: targets.Target,
  cases,
  prompt_len: int = 256,
  max_bytes: int = 256,
  work: Workload = Workload(),
  hlo_dir: Optional[str] = None,
) -> list:
  """Reports of the decode programs of ``cases``: dicts of ``generate`` options with a
  ``batch`` (e.g. ``dict(batch=1, mode="verify", n=3)``), on one device of ``target``."""
  one = target.one()
  device = targets.devices(one)[0]
  out = []
  for case in cases:
    case = dict(case)
    batch = case.pop("batch")
    p = programs.decode_program(
      cfg, device, batch=batch, prompt_len=prompt_len, max_bytes=max_bytes, **case
    )
    out.append(check(p, one, work=work, hlo_dir=hlo_dir))
    del p
    _release()
  return out


def _rows_that_might_fit(report: dict) -> int:
  """Rows per device, a power of two below ``report``'s, that its temporaries (taken as
  proportional to the rows) predict would fit; 0 when ``report`` has one row."""
  m, per_device = report["memory"], report["micro_batch_per_device"]
  room = m["device_gb"] - (m["total_gb"] - m["temp_gb"])
  guess = per_device * room / m["temp_gb"] if m["temp_gb"] > 0 and room > 0 else 1
  rows = 1 << max(int(math.floor(math.log2(max(guess, 1)))), 0)
  return min(rows, per_device // 2)


def _halve_until_fit(config, target, rows: int, above: int, remat: bool, work, hlo_dir) -> list:
  """Train step reports at ``rows`` per device, halved while they do not fit and stay above
  ``above``."""
  out = []
  while rows > above:
    c = config.copy_and_resolve_references()
    c.train.micro_batch_size = rows * target.n_devices
    c.model.remat = remat
    out += train_reports(c, target, ("train_step",), work, hlo_dir)
    if out[-1]["memory"]["fits"]:
      break
    rows //= 2
  return out


def fit_search(config, target, first: dict, work: Workload = Workload(), hlo_dir=None) -> list:
  """Train step reports of the settings tried after ``first`` (``config``'s, which does not
  fit): the micro-batch its temporaries predict would fit, halved until one fits; then, when
  that is smaller than ``config``'s and ``config`` has no remat, remat from ``config``'s
  micro-batch down (predicted the same way after the first), above the rows that fit without."""
  per_device = first["micro_batch_per_device"]
  remat = bool(config.model.remat)
  out = _halve_until_fit(config, target, _rows_that_might_fit(first), 0, remat, work, hlo_dir)
  fitted = out[-1]["micro_batch_per_device"] if out and out[-1]["memory"]["fits"] else 0
  if fitted < per_device and not remat:
    with_remat = _halve_until_fit(config, target, per_device, per_device - 1, True, work, hlo_dir)
    out += with_remat
    if not with_remat[-1]["memory"]["fits"]:
      rows = _rows_that_might_fit(with_remat[-1])
      out += _halve_until_fit(config, target, rows, fitted, True, work, hlo_dir)
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
  work: Workload = Workload(),
  fit: bool = False,
  hlo_dir: Optional[str] = None,
) -> list:
  """Reports of every production program of ``config`` for each target (a GPU or TPU name): the
  train step per attention implementation and device count (``micro_per_gpu`` rows per GPU or
  TPU chip in each micro-batch), the eval step (first implementation, first count), and the
  decode programs of ``decode_cases`` (one device); with ``fit``, ``fit_search``'s reports after
  a train step that does not fit. ``log(report)`` is called after each program."""
  out = []

  def add(reports):
    for r in reports:
      out.append(r)
      if log is not None:
        log(r)

  for name in target_names:
    for impl in impls:
      for n in gpu_counts:
        target = targets.parse(f"{name}:{n}")
        c = config.copy_and_resolve_references()
        c.model.attention_impl = impl
        c.train.micro_batch_size = micro_per_gpu * target.n_devices
        first = impl == impls[0] and n == gpu_counts[0]
        which = ("train_step", "eval_step") if first else ("train_step",)
        reports = train_reports(c, target, which, work, hlo_dir)
        add(reports)
        if fit and not reports[0]["memory"]["fits"]:
          add(fit_search(c, target, reports[0], work, hlo_dir))
    cfg = ModelConfig.from_dict(config.model.to_dict())
    add(decode_reports(cfg, targets.parse(name).one(), decode_cases, work=work, hlo_dir=hlo_dir))
  return out
