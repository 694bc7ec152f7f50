"""Peak rates of the GPU targets and the launch constants of the time estimate.

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
