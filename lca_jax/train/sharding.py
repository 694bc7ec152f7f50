"""Device mesh, logical axis rules and shardings (docs/design.md §5.3).

Mesh axes ('data', 'fsdp', 'tensor'); ``config.mesh`` gives their sizes, one of them may be -1
(= all devices not used by the others). Parameters carry logical axis names (model/layers.py);
``LOGICAL_RULES`` maps them to mesh axes:

    batch -> ('data', 'fsdp')     activations and input batches
    embed -> 'fsdp'               parameters (ZeRO-3 style); on activations 'fsdp' is already
                                  taken by 'batch', so flax leaves 'embed' unsharded there
    heads, kv, mlp, vocab -> 'tensor'
    length, norm -> None

Axes are Auto (jax.make_mesh defaults to Explicit in current jax, which linen's logical
partitioning does not support). Tracing must happen inside ``mesh_context(mesh)`` so the
model's ``with_logical_constraint`` calls see the mesh and the rules.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lca_jax.errors import LcaError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

LOGICAL_RULES = (
  ("batch", ("data", "fsdp")),
  ("embed", "fsdp"),
  ("heads", "tensor"),
  ("kv", "tensor"),
  ("mlp", "tensor"),
  ("vocab", "tensor"),
  ("length", None),
  ("norm", None),
)


class MeshError(LcaError, ValueError):
  """A mesh or batch layout that the devices cannot realise."""


def mesh_shape(mesh_cfg, n_devices: int) -> tuple[int, int, int]:
  """Resolve ``{'data': -1, 'fsdp': 2, 'tensor': 1}`` (-1 = the rest) against ``n_devices``."""
  sizes = [int(mesh_cfg[a]) for a in AXES]
  free = [i for i, s in enumerate(sizes) if s == -1]
  if len(free) > 1:
    raise MeshError(f"mesh: at most one axis may be -1, got {dict(zip(AXES, sizes))}")
  if any(s == 0 or s < -1 for s in sizes):
    raise MeshError(f"mesh: axis sizes must be positive or -1, got {dict(zip(AXES, sizes))}")
  fixed = math.prod(s for s in sizes if s != -1)
  if free:
    if n_devices % fixed:
      raise MeshError(
        f"mesh: {n_devices} devices cannot be split with "
        f"{dict(zip(AXES, sizes))} (fixed axes use {fixed})"
      )
    sizes[free[0]] = n_devices // fixed
  if math.prod(sizes) != n_devices:
    raise MeshError(
      f"mesh: {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices, have {n_devices}"
    )
  return tuple(sizes)


def cpu_device_count(mesh_cfg, cores: Optional[int] = None) -> int:
  """Devices a CPU-only host is split into (``mesh.cpu_devices``; 0 = auto).

  Each device runs its own stream of XLA:CPU thunks on the shared thread pool. One stream
  leaves a core idle whenever it runs a sequential part (a blockwise-attention loop nest, a
  chain of small ops); two keep both busy. Auto = 2 on a host with >= 2 cores, else 1; the rows
  of a step are data-parallel over them when they divide, else the devices split the heads and
  the MLP (``cpu_mesh``); docs/performance.md has the step times. Accelerator backends ignore
  it."""
  n = int(mesh_cfg.get("cpu_devices", 0) or 0) if hasattr(mesh_cfg, "get") else 0
  if n < 0:
    raise MeshError(f"mesh.cpu_devices must be >= 0 (0 = auto), got {n}")
  if n:
    return n
  cores = (os.cpu_count() or 1) if cores is None else cores
  return 2 if cores >= 2 else 1


def cpu_mesh(mesh_cfg, micro_rows: int, n_devices: int):
  """The mesh config for a CPU host split into ``n_devices`` by ``mesh.cpu_devices``.

  Unchanged when the rows of a micro-batch divide over the devices (data-parallel) or when the
  config sets its own layout (any of data, fsdp, tensor off its default -1, 1, 1). Otherwise the
  devices the rows cannot use go to 'tensor' (heads, kv heads, MLP and vocabulary split; a
  dimension the axis does not divide stays replicated): one row of 4096 bytes runs as two
  half-width streams instead of one stream and an idle core. Returns a dict (a copy)."""
  sizes = tuple(int(mesh_cfg.get(a, d)) for a, d in zip(AXES, (-1, 1, 1)))
  data_par = math.gcd(n_devices, max(int(micro_rows), 1))
  out = dict(mesh_cfg.items())
  if sizes != (-1, 1, 1) or data_par == n_devices:
    return out
  out["tensor"] = n_devices // data_par
  return out


def use_cpu_devices(n: int) -> int:
  """Ask jax for ``n`` CPU devices (``jax_num_cpu_devices``) before its backends start.

  Returns the count jax will give: ``XLA_FLAGS=--xla_force_host_platform_device_count``
  (tests, users) takes precedence, and once a backend has started the count is fixed. 0 where
  jax runs without its CPU backend (``JAX_PLATFORMS=cuda``, say)."""
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    try:
      jax.config.update("jax_num_cpu_devices", int(n))
    except RuntimeError:  # backends already initialised
      pass
  try:
    return len(jax.devices("cpu"))
  except RuntimeError:  # no CPU backend in JAX_PLATFORMS
    return 0


def make_mesh(
  mesh_cfg, devices: Optional[Sequence[Any]] = None, micro_rows: Optional[int] = None
) -> jax.sharding.Mesh:
  """The mesh of ``mesh_cfg`` over ``devices`` (default: all). Given ``micro_rows``, a
  single-process CPU host split by ``mesh.cpu_devices`` (as many devices as the split asks
  for) is laid out by ``cpu_mesh``."""
  devices = list(devices) if devices is not None else jax.devices()
  if micro_rows is not None and is_cpu_split(mesh_cfg, devices):
    mesh_cfg = cpu_mesh(mesh_cfg, micro_rows, len(devices))
  shape = mesh_shape(mesh_cfg, len(devices))
  types = (jax.sharding.AxisType.Auto,) * len(AXES)
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  if slices > 1:  # TPU multislice: 'data' spans the slices (DCN), the rest stays in a slice
    if shape[0] % slices:
      raise MeshError(f"mesh: data={shape[0]} must be a multiple of the {slices} TPU slices")
    ici = (shape[0] // slices,) + tuple(shape[1:])
    grid = mesh_utils.create_hybrid_device_mesh(ici, (slices, 1, 1), devices)
    return jax.sharding.Mesh(grid, AXES, axis_types=types)
  return jax.make_mesh(shape, AXES, axis_types=types, devices=devices)


def is_cpu_split(mesh_cfg, devices) -> bool:
  """Whether ``devices`` are a single-process CPU host split by ``mesh.cpu_devices`` (as many
  as the split asks for; a count forced by XLA_FLAGS is not)."""
  return (
    len(devices) > 1
    and jax.process_count() == 1
    and all(d.platform == "cpu" for d in devices)
    and len(devices) == cpu_device_count(mesh_cfg)
  )


def batch_shards(mesh) -> int:
  """Number of ways the batch dimension is split."""
  return mesh.shape["data"] * mesh.shape["fsdp"]


@contextlib.contextmanager
def mesh_context(mesh):
  """Mesh + logical rules in scope (for tracing jitted functions that use the model)."""
  if hasattr(jax, "set_mesh"):
    mesh_cm = jax.set_mesh(mesh)
  elif hasattr(jax.sharding, "use_mesh"):
    mesh_cm = jax.sharding.use_mesh(mesh)
  else:  # pragma: no cover - very old jax
    raise RuntimeError("this jax has neither jax.set_mesh nor jax.sharding.use_mesh")
  with mesh_cm, nn.logical_axis_rules(LOGICAL_RULES):
    yield


def _fit(spec: P, shape, mesh) -> P:
  """Drop mesh axes from dimensions they do not divide (those stay replicated)."""
  out = []
  for i, ax in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
    if ax is None:
      out.append(None)
      continue
    names = ax if isinstance(ax, tuple) else (ax,)
    keep = []
    size = shape[i]
    for n in names:
      if size % mesh.shape[n] == 0:
        keep.append(n)
        size //= mesh.shape[n]
    out.append(None if not keep else (keep[0] if len(keep) == 1 else tuple(keep)))
  return P(*out)


def shardings_from_logical(logical_specs, abstract_tree, mesh):
  """NamedShardings for a tree of logical PartitionSpecs (``nn.get_partition_spec`` output)
  whose leaves line up with ``abstract_tree`` (arrays / ShapeDtypeStructs)."""
  mesh_specs = nn.logical_to_mesh(logical_specs, LOGICAL_RULES)
  is_spec = lambda x: isinstance(x, P) or x is None
  flat_specs, treedef = jax.tree_util.tree_flatten(mesh_specs, is_leaf=is_spec)
  flat_abs = treedef.flatten_up_to(abstract_tree)
  out = [
    NamedSharding(mesh, _fit(s if s is not None else P(), a.shape, mesh))
    for s, a in zip(flat_specs, flat_abs)
  ]
  return jax.tree_util.tree_unflatten(treedef, out)


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh, accum_axis: bool = True) -> NamedSharding:
  """[accum, rows, T] (or [rows, T]) with rows split over ('data', 'fsdp')."""
  return NamedSharding(mesh, P(None, BATCH_AXES) if accum_axis else P(BATCH_AXES))


def put_batch(host_batch: dict, sharding: NamedSharding, global_rows_axis: int) -> dict:
  """Assemble a global batch from this process's rows (multi-host safe).

  ``host_batch`` arrays hold this process's share of axis ``global_rows_axis``.
  """
  n = jax.process_count()
  out = {}
  for k, v in host_batch.items():
    shape = list(v.shape)
    shape[global_rows_axis] *= n
    out[k] = jax.make_array_from_process_local_data(sharding, v, tuple(shape))
  return out
