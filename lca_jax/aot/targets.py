"""GPU and TPU targets for compiling without one: names, target configs and abstract devices.

XLA compiles for a CUDA GPU on a host that has none ("deviceless" compilation) from a
``GpuTargetConfigProto``, the description of the device: the files in ``targets/`` (openxla's
specs of the H100 SXM, H200 and B200). ``devices("h100", 8)`` gives eight abstract GPUs of
that kind; a mesh over them and ``jax.jit(f).lower(abstract args).compile()`` build the real
GPU executable. It needs the CUDA plugin of the installed jax (``jax-cuda12-plugin`` and
``jax-cuda12-pjrt``, ``make gpu-aot``) and no driver.

TPU targets (``TpuTarget``: v5e, v5p, v6e) are slices of chips described by libtpu, the TPU
compiler that ``jax[tpu]`` installs (``make tpu-aot``): ``v5p:8`` is eight chips (a 2x2x2
slice), ``v5p:2x2x2`` names the topology itself, ``v5p:8*2`` is two slices of eight chips each
(linked by the data-center network: ``devices`` numbers them by ``slice_index``). One or two
chips are the first of a one-host slice (2x2 / 2x2x1). Each chip is one device (v5p's two
TensorCores run as one, megacore).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
import re
import sys
from importlib import resources

import jax
from jax.experimental import topologies

from lca_jax.errors import LcaError
from lca_jax.perf import hardware

TARGETS = ("h100", "h200", "b200")
PLUGIN_MODULE = "jax_plugins.xla_cuda12"
TPU_TARGETS = ("v5e", "v5p", "v6e")
TPU_MODULE = "libtpu"
TPU_DIMS = {"v5e": 2, "v5p": 3, "v6e": 2}  # dimensions of the chips' torus / mesh


class AotError(LcaError, ValueError):
  """A deviceless compile that cannot be made: unknown target, no CUDA plugin, bad count."""


@dataclasses.dataclass(frozen=True)
class Target:
  name: str  # one of TARGETS
  n_devices: int

  @property
  def config_text(self) -> str:
    return _config_text(self.name)

  @property
  def device_name(self) -> str:
    return re.search(r'^\s*name: "([^"]+)"', self.config_text, re.M).group(1)

  @property
  def memory_bytes(self) -> int:
    """The device's memory (``device_memory_size`` of its target config)."""
    return int(re.search(r"device_memory_size: (\d+)", self.config_text).group(1))

  platform = "gpu"
  unit = "GPU"

  def one(self) -> "Target":
    """One device of this kind (what the decode programs run on)."""
    return Target(self.name, 1)

  def __str__(self):
    return f"{self.name}:{self.n_devices}"


@dataclasses.dataclass(frozen=True)
class TpuTarget:
  """``chips`` TPU chips of kind ``name`` per slice, in ``topology`` (e.g. "2x2x2"; for one or
  two chips the one-host topology they are taken from), ``slices`` slices."""

  name: str  # one of TPU_TARGETS
  chips: int
  topology: str
  slices: int = 1

  platform = "tpu"
  unit = "chip"

  @property
  def n_devices(self) -> int:
    return self.chips * self.slices

  @property
  def chip(self) -> hardware.Tpu:
    return hardware.tpu(self.name)

  @property
  def device_name(self) -> str:
    return self.chip.device_kind

  @property
  def memory_bytes(self) -> int:
    """HBM per chip (the datasheet's, ``perf.hardware``)."""
    return int(self.chip.hbm_bytes)

  def one(self) -> "TpuTarget":
    return TpuTarget(self.name, 1, self.topology if self.chips == 1 else _host(self.name))

  def __str__(self):
    where = f"{self.chips}" if self.chips < 4 else self.topology
    return f"{self.name}:{where}" + (f"*{self.slices}" if self.slices > 1 else "")


def _host(name: str) -> str:
  return "x".join(["2", "2", "1"][: TPU_DIMS[name]])


def _topology(name: str, chips: int) -> str:
  """The slice of ``chips`` chips (a power of two >= 4): each doubling doubles the smallest
  dimension, the last of them on a 2D mesh (2x4), the first in 3D (2x2x1 -> 2x2x2 -> 4x2x2)."""
  dims = [1] * TPU_DIMS[name]
  order = range(len(dims) - 1, -1, -1) if len(dims) == 2 else range(len(dims))
  while math.prod(dims) < chips:
    i = min(order, key=lambda j: dims[j])
    dims[i] *= 2
  return "x".join(map(str, dims))


def _parse_tpu(spec: str, name: str, rest: str) -> TpuTarget:
  where, _, slices = rest.partition("*")
  if slices and (not slices.isdigit() or int(slices) < 1):
    raise AotError(f"slice count in {spec!r} must be a positive integer (NAME:CHIPS*SLICES)")
  n_slices = int(slices) if slices else 1
  if not where:
    return TpuTarget(name, 1, _host(name), n_slices)
  if re.fullmatch(r"\d+(x\d+)+", where):
    dims = [int(d) for d in where.split("x")]
    if len(dims) != TPU_DIMS[name] or min(dims) < 1:
      shape = "x".join(["A"] * TPU_DIMS[name])
      raise AotError(
        f"a {name} topology has {TPU_DIMS[name]} dimensions ({name}:{shape}), got {spec!r}"
      )
    return TpuTarget(name, math.prod(dims), where, n_slices)
  if not where.isdigit() or int(where) < 1:
    raise AotError(
      f"chip count in {spec!r} must be a positive integer or a topology (v5p:8, v5p:2x2x2)"
    )
  chips = int(where)
  if chips <= 2:
    return TpuTarget(name, chips, _host(name), n_slices)
  if chips & (chips - 1):
    raise AotError(
      f"{spec!r}: a slice of {chips} chips has no standard topology; give it (e.g. {name}:"
      f"{'x'.join(['2'] * TPU_DIMS[name])}) or a power of two"
    )
  return TpuTarget(name, chips, _topology(name, chips), n_slices)


def parse(spec: str):
  """``"h100"`` / ``"h100:8"`` -> Target (one device when no count is given); ``"v5p"``,
  ``"v5p:8"``, ``"v5p:2x2x2"``, ``"v5p:8*2"`` -> TpuTarget."""
  name, _, count = str(spec).strip().lower().partition(":")
  if name in TPU_TARGETS:
    return _parse_tpu(spec, name, count)
  if name not in TARGETS:
    raise AotError(
      f"unknown target {spec!r}; choose a GPU ({', '.join(TARGETS)}; NAME[:N]) or a TPU "
      f"({', '.join(TPU_TARGETS)}; NAME[:N | :TOPOLOGY][*SLICES])"
    )
  if not count:
    return Target(name, 1)
  if not count.isdigit() or int(count) < 1:
    raise AotError(f"GPU count in {spec!r} must be a positive integer (NAME[:N], e.g. h100:8)")
  return Target(name, int(count))


@functools.lru_cache(maxsize=None)
def _config_text(name: str) -> str:
  return resources.files("lca_jax.aot").joinpath("targets", f"{name}.txtpb").read_text()


def plugin_available() -> bool:
  """Whether jax's CUDA plugin (the compiler for GPU targets) is installed."""
  try:
    return importlib.util.find_spec(PLUGIN_MODULE) is not None
  except ModuleNotFoundError:
    return False


def tpu_compiler_available() -> bool:
  """Whether libtpu (the compiler for TPU targets, ``jax[tpu]``) is installed."""
  try:
    return importlib.util.find_spec(TPU_MODULE) is not None
  except ModuleNotFoundError:
    return False


def require_compiler(target) -> None:
  """An ``AotError`` saying how to get the compiler ``target`` needs, when it is missing."""
  if target.platform == "gpu":
    require_plugin()
  elif not tpu_compiler_available():
    raise AotError(
      "compiling for a TPU needs libtpu, which this Python lacks: run `make tpu-aot` (a "
      f'separate .venv-tpu) or pip install "jax[tpu]=={jax.__version__}"'
    )


def require_plugin() -> None:
  if not plugin_available():
    raise AotError(
      "compiling for a GPU needs jax's CUDA plugin, which this Python lacks: run `make gpu-aot` "
      f"(a separate .venv-cuda) or pip install jax-cuda12-plugin=={jax.__version__} "
      f"jax-cuda12-pjrt=={jax.__version__}"
    )


@functools.lru_cache(maxsize=None)
def devices(target) -> tuple:
  """``target.n_devices`` abstract devices of ``target``'s kind: GPUs on one host, TPU chips of
  its slices."""
  if target.platform == "tpu":
    return _tpu_devices(target)
  require_plugin()
  try:
    topo = topologies.get_topology_desc(
      platform="cuda", target_config=target.config_text, topology=f"1x1x{target.n_devices}"
    )
  except Exception as e:  # noqa: BLE001 - the plugin reports through XlaRuntimeError
    raise AotError(f"the CUDA plugin cannot describe {target}: {str(e).splitlines()[0]}") from None
  return tuple(topo.devices)


def _tpu_devices(target: TpuTarget) -> tuple:
  require_compiler(target)
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server to ask on this host
  # no TPU to guard: processes that compile side by side need not take libtpu's lockfile
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  kw = dict(num_slices=target.slices) if target.slices > 1 else {}
  try:
    with quiet_stderr():  # libtpu's start-up warnings about the host it is not on
      topo = topologies.get_topology_desc(
        topology_name=f"{target.name}:{target.topology}", platform="tpu", **kw
      )
  except Exception as e:  # noqa: BLE001 - libtpu reports through JaxRuntimeError
    raise AotError(f"libtpu cannot describe {target}: {str(e).splitlines()[0]}") from None
  devs = sorted(topo.devices, key=lambda d: (getattr(d, "slice_index", 0) or 0, d.id))
  per_slice = len(devs) // target.slices
  return tuple(
    d for s in range(target.slices) for d in devs[s * per_slice : s * per_slice + target.chips]
  )


@contextlib.contextmanager
def quiet_stderr():
  """Send what native code writes to the process's stderr to /dev/null inside the block."""
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    with open(os.devnull, "w") as null:
      os.dup2(null.fileno(), 2)
      yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)
