"""What ran a benchmark: the CPU, the Python and jax versions, the devices, host memory."""

from __future__ import annotations

import os
import platform

import jax
import jaxlib

from lca_jax import hostmem


def cpu_model() -> str:
  """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      for line in f:
        if line.lower().startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def device_kind() -> str:
  """The first jax device's kind (its name where it has none)."""
  dev = jax.devices()[0]
  return str(getattr(dev, "device_kind", dev))


def jax_info() -> dict:
  """jax's backend, first device and version."""
  return dict(backend=jax.default_backend(), device=device_kind(), jax=jax.__version__)


def machine_info(torch=None, torch_device: str | None = None) -> dict:
  """The host (CPU, cores, platform, Python), jax and its devices, host memory settings
  (``hostmem.describe``), and with ``torch`` (the module) its version, device and threads."""
  info = dict(
    cpu_model=cpu_model(),
    cores=os.cpu_count(),
    platform=platform.platform(),
    python=platform.python_version(),
    jax=jax.__version__,
    jaxlib=getattr(jaxlib, "__version__", None),
  )
  if torch is not None:
    info["torch"] = torch.__version__
  info.update(
    jax_backend=jax.default_backend(),
    jax_device_kind=jax.devices()[0].device_kind,
    jax_devices=len(jax.devices()),
  )
  if torch is not None:
    info.update(torch_device=torch_device, torch_threads=torch.get_num_threads())
  info.update(hostmem.describe())
  if torch is not None and torch_device == "cuda":
    info["torch_cuda_device"] = torch.cuda.get_device_name(0)
  return info
