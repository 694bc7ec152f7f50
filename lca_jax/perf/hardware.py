"""Peak rates of the GPU and TPU targets and the launch constants of the time estimate.

Datasheet figures (dense, no sparsity), per GPU:

* H100 SXM5 80 GB: NVIDIA H100 Tensor Core GPU datasheet: BF16/FP16 989 TFLOP/s, TF32 495,
  FP32 67, FP8 1979; HBM3 3.35 TB/s; NVLink 4 900 GB/s (both directions together).
* H200 SXM 141 GB: NVIDIA H200 Tensor Core GPU datasheet: the H100's compute (989 / 495 / 67 /
  1979); HBM3e 4.8 TB/s; NVLink 900 GB/s.
* B200 (HGX B200, 1000 W): NVIDIA HGX B200 datasheet: BF16 2.25 PFLOP/s, TF32 1.1 PFLOP/s,
  FP32 75 TFLOP/s, FP8 4.5 PFLOP/s; HBM3e 8 TB/s; NVLink 5 1.8 TB/s.

A collective moves data at half the NVLink figure (one direction). The achievable fractions
(``dot_efficiency``, ``memory_efficiency``) and the launch constants (``Launch``) are guesses,
not measurements: a lent GPU's ``tools/gpu_check.sh`` run prints the estimate next to what it
measures, which is how they are calibrated (docs/performance.md).
"""

from __future__ import annotations

import dataclasses

T = 1e12


@dataclasses.dataclass(frozen=True)
class Gpu:
  name: str
  bf16_flops: float  # dense tensor-core FLOP/s for bf16 / fp16 operands
  tf32_flops: float  # float32 dots at XLA's default precision (TF32 tensor cores)
  fp32_flops: float  # float32 dots at HIGHEST precision (CUDA cores)
  fp8_flops: float
  memory_bytes_per_s: float  # HBM bandwidth
  link_bytes_per_s: float  # NVLink, one direction (half the datasheet's bidirectional figure)
  source: str
  # fractions of the peaks a well-shaped kernel reaches (guesses until calibrated)
  dot_efficiency: float = 0.75
  memory_efficiency: float = 0.85

  def dot_peak(self, dtype: str, highest: bool = False) -> float:
    """Peak FLOP/s of a dot whose operands are ``dtype`` (an HLO element type)."""
    if dtype.startswith("f8"):
      return self.fp8_flops
    if dtype == "f32":
      return self.fp32_flops if highest else self.tf32_flops
    if dtype == "f64":
      return self.fp32_flops / 2
    return self.bf16_flops


GPUS = {
  "h100": Gpu(
    "H100 SXM5 80GB",
    989 * T,
    495 * T,
    67 * T,
    1979 * T,
    3.35e12,
    450e9,
    "NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
  ),
  "h200": Gpu(
    "H200 SXM 141GB",
    989 * T,
    495 * T,
    67 * T,
    1979 * T,
    4.8e12,
    450e9,
    "NVIDIA H200 Tensor Core GPU datasheet (SXM)",
  ),
  "b200": Gpu(
    "B200 (HGX, 1000 W)",
    2250 * T,
    1100 * T,
    75 * T,
    4500 * T,
    8.0e12,
    900e9,
    "NVIDIA HGX B200 datasheet (per GPU)",
  ),
}


@dataclasses.dataclass(frozen=True)
class Launch:
  """Fixed costs of running a kernel, in seconds (guesses until a lent GPU calibrates them).

  ``graph_s``: a kernel node inside a CUDA graph (one kernel's launch latency and the gap to
  the next, what a small kernel costs whatever it computes); ``host_s``: a kernel the host
  launches itself (XLA's thunk executor, one launch call each); ``sync_s``: a host read of a
  device value (a loop predicate or a conditional's branch index outside a graph)."""

  graph_s: float = 1.5e-6
  host_s: float = 4.0e-6
  sync_s: float = 20e-6


def gpu(name: str) -> Gpu:
  return GPUS[name]


@dataclasses.dataclass(frozen=True)
class Tpu(Gpu):
  """A TPU chip in the same terms (``perf.tpu`` prices its programs with ``estimate``'s kernel
  costs). A float32 dot at XLA's default precision runs as one bf16 pass on the MXU
  (``tf32_flops`` = the bf16 peak), at HIGHEST as six (``fp32_flops``); the v5 and v6e MXUs
  take no fp8 operands of their own (``fp8_flops`` = the bf16 peak). ``link_bytes_per_s``: half
  of the chip's ICI bandwidth (one direction), ``hbm_bytes``: its memory."""

  hbm_bytes: float = 0.0
  device_kind: str = ""  # jax's ``device_kind`` of the chip


def _tpu(name, kind, tflops, hbm_gb, hbm_tb_s, ici_gbit_s, source) -> Tpu:
  return Tpu(
    name,
    tflops * T,
    tflops * T,
    tflops * T / 6,
    tflops * T,
    hbm_tb_s * 1e12,
    ici_gbit_s / 8 * 1e9 / 2,
    source,
    hbm_bytes=hbm_gb * 1e9,
    device_kind=kind,
  )


# Google Cloud TPU system architecture pages (per chip, bf16 dense): v5e 197 TFLOP/s, 16 GB HBM2
# at 819 GB/s, ICI 1600 Gbit/s; v5p 459 TFLOP/s, 95 GB HBM2e at 2765 GB/s, ICI 4800 Gbit/s;
# v6e (Trillium) 918 TFLOP/s, 32 GB HBM at 1640 GB/s, ICI 3584 Gbit/s.
TPUS = {
  "v5e": _tpu("TPU v5e", "TPU v5 lite", 197, 16, 0.819, 1600, "Cloud TPU v5e documentation"),
  "v5p": _tpu("TPU v5p", "TPU v5", 459, 95, 2.765, 4800, "Cloud TPU v5p documentation"),
  "v6e": _tpu("TPU v6e", "TPU v6 lite", 918, 32, 1.64, 3584, "Cloud TPU v6e documentation"),
}


def tpu(name: str) -> Tpu:
  return TPUS[name]
