"""The platform a program is traced for, and every choice the model makes by platform.

A few choices in the model and the decode engine depend on the backend that runs the program,
each a function here that the model calls: Pallas kernels are interpreted on the CPU and
lowered to Triton on GPUs (``pallas_interpret``), the LCA attention kernel is the Mosaic one on
TPUs (``tpu_attention_kernel``), a model config's ``attention_impl="auto"`` is the Pallas kernel
on GPUs and TPUs and the blockwise XLA attention on the CPU (``attention_impl``), dense products and norms merge the leading axes except on
TPUs over a row count that is not a whole number of tiles (``merged_rows``), RoPE rotates
through a product on TPUs (``rope_by_product``), the blockwise attention runs one loop nest
per core on the CPU (``attention_threads``), the CPU runs a cached attention of a few columns
as matrix-vector products (``matvec_cache_products``), a long decode block runs the latent LM
at several widths on the CPU (``several_lm_widths``), GPUs decode with weights stored
[out, in] (``row_major_kernels``) through fused Pallas kernels (``fused_decode_kernels``), and the decode executables get XLA:CPU options
(``lca_jax.xla_options``). Those choices ask ``platform()``, which is ``jax.default_backend()``
unless a ``target(...)`` block says which platform the program being traced and compiled is
for: a deviceless compile for a GPU on a GPU-less host (``lca_jax.aot``) runs with jax's CPU
backend as the default and traces inside ``target("gpu")``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator, Optional

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_TARGET: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
  "lca_jax_target_platform", default=None
)
_FUSED_DECODE: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar(
  "lca_jax_fused_decode", default=None
)


def platform() -> str:
  """'cpu', 'gpu' or 'tpu': the ``target`` in force, else jax's default backend ('cuda' and
  'rocm' count as 'gpu')."""
  p = _TARGET.get() or jax.default_backend()
  return "gpu" if p in ("cuda", "rocm") else p


def is_cpu() -> bool:
  return platform() == "cpu"


def cpu_threads() -> int:
  """Cores the CPU backend runs on (1 on other platforms): independent loop nests per call."""
  return (os.cpu_count() or 1) if is_cpu() else 1


def attention_threads() -> int:
  """Independent loop nests per blockwise attention call when the model config leaves it to
  the platform (``attn_parallel`` 0): one per core on the CPU, where one nest keeps one core
  busy; 1 on accelerators."""
  return cpu_threads()


def pallas_interpret() -> bool:
  """Whether the Pallas kernels run in interpret mode (on the CPU) rather than through Triton."""
  return is_cpu()


# ModelConfig.attention_impl's default: the platform's attention (``attention_impl``)
AUTO_ATTENTION = "auto"


def attention_impl(requested: str = AUTO_ATTENTION, name: Optional[str] = None) -> str:
  """The attention implementation a model config's ``attention_impl`` runs as on platform
  ``name`` (default: ``platform()``, so a deviceless compile inside ``target("gpu")`` gets the
  GPU's): ``"auto"`` is ``"pallas"`` on GPUs (the Triton kernels) and TPUs (the Mosaic kernels,
  ``tpu_attention_kernel``) and the blockwise ``"xla"`` attention on the CPU, where the Pallas
  kernels would run interpreted; any other value (``"xla"``, ``"pallas"``, ``"dense"``) is
  returned as it is. Every reader of ``attention_impl`` that picks a path asks this."""
  if requested != AUTO_ATTENTION:
    return requested
  return "xla" if (name or platform()) == "cpu" else "pallas"


def attention_label(requested: str, name: Optional[str] = None) -> str:
  """What a run prints for its attention: the implementation ``attention_impl`` resolves to,
  with " (auto)" when the config left it to the platform: "pallas (auto)", "xla"."""
  impl = attention_impl(requested, name)
  return f"{impl} (auto)" if requested == AUTO_ATTENTION else impl


def tpu_attention_kernel() -> bool:
  """Whether ``attention_impl="pallas"`` runs the LCA attention as the Mosaic kernels of
  ``kernels.tpu_attention`` (on TPUs) rather than the Triton kernels of
  ``kernels.lca_attention`` (on GPUs; interpreted on the CPU)."""
  return platform() == "tpu"


# rows of a TPU array's tile over its second-last axis (the tile is 8 rows x 128 lanes)
TPU_TILE_ROWS = 8


def merged_rows(rows: int) -> bool:
  """Whether ``layers.Dense`` and ``layers.RMSNorm`` run on a [tokens, features] view of a
  [B, rows, features] input (``model/rows.py``, ``layers.Dense``: XLA:CPU's fusions need it)
  rather than on the input as it is: everywhere but on TPUs when ``rows`` is not a multiple of
  ``TPU_TILE_ROWS`` (the latent stack's slots). A TPU array is tiled over its last two axes,
  so merging B into such a row axis moves the data; with whole tiles the view is free and
  XLA:TPU fuses the merged form better."""
  return platform() != "tpu" or rows % TPU_TILE_ROWS == 0


def rope_by_product() -> bool:
  """Whether ``layers.rope`` rotates a bfloat16 input's halves through a product with a signed
  permutation (``layers._rope_product``, exact) rather than slices: on TPUs, where XLA fuses
  the product with the rest of RoPE."""
  return platform() == "tpu"


def row_by_row_writes() -> bool:
  """Whether ``layers.write_rows`` writes a batch's rows as one ``dynamic_update_slice`` each
  rather than as one batched write (a scatter): on TPUs, where XLA expands that scatter into a
  loop over the rows that runs several ops a row."""
  return platform() == "tpu"


def matvec_cache_products(columns: int, max_columns: int) -> bool:
  """Whether a decode step's products over a KV cache with ``columns`` query columns per
  (row, kv head) run as one matrix-vector product per column, batched over rows and kv heads,
  instead of one batched product (``layers.cache_scores`` / ``cache_values``).

  On the CPU, from 2 up to ``max_columns`` columns: XLA:CPU runs the batched product as one
  small GEMM per (row, kv head), which costs more than the matrix-vector products over the
  cache in place until the columns are many. One column is the same dot either way;
  accelerators keep the batched product."""
  return is_cpu() and 1 < columns <= max_columns


# Platforms on which a long decode block runs the latent LM at several widths.
LM_WIDTHS_BACKENDS = ("cpu",)


def several_lm_widths(name: Optional[str] = None) -> bool:
  """Whether a long decode block (a prefill) runs the latent LM over the fewest of several
  slot counts that hold its groups (``incremental.lm_widths``) on platform ``name`` (default:
  ``platform()``). Each width is one more LM to compile: worth it on the CPU, where the LM over
  a prefill's slots costs about what its compile does; on an accelerator a batch-1 prefill's
  LM is fast at any width, and compile time is what a run waits on."""
  return (name or platform()) in LM_WIDTHS_BACKENDS


def row_major_kernels() -> bool:
  """Whether decoding stores its weight matrices [out, in] (``layers.transpose_kernels``): on
  GPUs, where a one-row product against [in, out] can cost XLA two kernels and a weight-size
  temporary."""
  return platform() == "gpu"


def fused_decode_kernels() -> bool:
  """Whether a decode step runs each layer's dense parts as the fused Pallas kernels of
  ``kernels.decode_fused`` (norm + fused projection, norm + gate/up + activation, projection +
  residual) instead of XLA's several kernels each: on GPUs, where a small step is bound by
  kernel launches (``LCA_JAX_FUSED_DECODE=0`` turns them off); inside ``fused_decode(on)``
  as that says (tests run them in interpret mode on the CPU)."""
  forced = _FUSED_DECODE.get()
  if forced is not None:
    return forced
  return platform() == "gpu" and os.environ.get("LCA_JAX_FUSED_DECODE", "1") != "0"


@contextlib.contextmanager
def fused_decode(on: bool) -> Iterator[None]:
  """Trace decode steps with (``on``) or without the fused decode kernels inside the block."""
  token = _FUSED_DECODE.set(bool(on))
  try:
    yield
  finally:
    _FUSED_DECODE.reset(token)


def lowering_device(sharding):
  """A context for lowering a program for the devices of ``sharding`` on a host without them
  (a deviceless compile): jax >= 0.11 lowers Pallas Triton kernels for the GPU kind of the
  abstract mesh in force, else of the default device (this host's CPU: "No supported GPU
  devices found"); jax 0.10 falls back to sm_90 and reads neither. Only the lowering belongs
  inside: eager ops under an abstract mesh need ``lowering_platforms``."""
  device = next(iter(sharding.device_set))
  kind = jax.sharding.AbstractDevice(
    device_kind=device.device_kind,
    num_cores=getattr(device, "core_count", None),
    platform=device.platform,
  )
  mesh = jax.sharding.AbstractMesh(
    (1,), ("_device",), (jax.sharding.AxisType.Auto,), abstract_device=kind
  )
  return jax.sharding.use_abstract_mesh(mesh)


@contextlib.contextmanager
def target(name: str) -> Iterator[None]:
  """Trace and compile for ``name`` (one of ``PLATFORMS``) inside the block."""
  if name not in PLATFORMS:
    raise ValueError(f"platform must be one of {PLATFORMS}, got {name!r}")
  token = _TARGET.set(name)
  try:
    yield
  finally:
    _TARGET.reset(token)
