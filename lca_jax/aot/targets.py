"""GPU targets for compiling without a GPU: names, target configs and abstract devices.

XLA compiles for a CUDA GPU on a host that has none ("deviceless" compilation) from a
``GpuTargetConfigProto``, the description of the device: the files in ``targets/`` (openxla's
specs of the H100 SXM, H200 and B200). ``devices("h100", 8)`` gives eight abstract GPUs of
that kind; a mesh over them and ``jax.jit(f).lower(abstract args).compile()`` build the real
GPU executable. It needs the CUDA plugin of the installed jax (``jax-cuda12-plugin`` and
``jax-cuda12-pjrt``, ``make gpu-aot``) and no driver.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
from importlib import resources

import jax
from jax.experimental import topologies

from lca_jax.errors import LcaError

TARGETS = ("h100", "h200", "b200")
PLUGIN_MODULE = "jax_plugins.xla_cuda12"


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

  def __str__(self):
    return f"{self.name}:{self.n_devices}"


def parse(spec: str) -> Target:
  """``"h100"`` or ``"h100:8"`` -> Target (one device when no count is given)."""
  name, _, count = str(spec).strip().lower().partition(":")
  if name not in TARGETS:
    raise AotError(f"unknown GPU target {spec!r}; choose one of {', '.join(TARGETS)} (NAME[:N])")
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


def require_plugin() -> None:
  if not plugin_available():
    raise AotError(
      "compiling for a GPU needs jax's CUDA plugin, which this Python lacks: run `make gpu-aot` "
      f"(a separate .venv-cuda) or pip install jax-cuda12-plugin=={jax.__version__} "
      f"jax-cuda12-pjrt=={jax.__version__}"
    )


@functools.lru_cache(maxsize=None)
def devices(target: Target) -> tuple:
  """``target.n_devices`` abstract GPUs of ``target``'s kind (one host)."""
  require_plugin()
  try:
    topo = topologies.get_topology_desc(
      platform="cuda", target_config=target.config_text, topology=f"1x1x{target.n_devices}"
    )
  except Exception as e:  # noqa: BLE001 - the plugin reports through XlaRuntimeError
    raise AotError(f"the CUDA plugin cannot describe {target}: {str(e).splitlines()[0]}") from None
  return tuple(topo.devices)
