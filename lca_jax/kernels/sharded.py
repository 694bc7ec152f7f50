"""Run an attention call once per device under the active mesh: the Pallas LCA kernel, and
the blockwise XLA attention of ``lca_jax.model.attention`` (whose tile schedule would
otherwise be reduced over the whole batch, an all-reduce between devices).

``pallas_call`` has no SPMD sharding rule: under a multi-device mesh XLA would gather q, k, v
onto every device and run the whole problem there. ``shard_over_mesh`` instead wraps the
kernel call in ``jax.shard_map`` over the mesh set with ``jax.set_mesh`` (what
``lca_jax.train.sharding.mesh_context`` does; read here as the abstract mesh, so it is
visible while a jitted step is traced):

* batch (dim 0 of q, k, v, segment_ids, doc_ids) split over the mesh's batch axes
  (``BATCH_AXES``, the mesh axes of the logical ``batch`` axis);
* heads (dim 2 of q and of k, v) split over ``HEAD_AXES`` (those of ``heads`` / ``kv``) when
  they divide both the query and the kv head counts (so query head h and its kv head
  h // (H / KV) land on the same device);
* everything else replicated. An axis that does not divide its dimension is left out (that
  dimension is then replicated over it, as ``lca_jax.train.sharding`` does for parameters).

Every device runs the kernel (and its custom VJP) on its own rows and heads; no
communication is needed since attention never mixes rows or heads. Without a mesh, with a
single device, inside a ``shard_map`` already (manual axes) or when no axis divides
anything, the kernel is called as is. Auto axes (what lca_jax.train uses) let XLA move the
inputs into place; on Explicit axes the inputs are ``reshard``-ed to the specs first.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
from jax.sharding import PartitionSpec as P

# Mesh axes of the logical axes 'batch' and 'heads'/'kv' (lca_jax.train.sharding.LOGICAL_RULES;
# kernels depend only on jax, a test checks the two agree). Axes missing from a mesh are ignored.
BATCH_AXES = ("data", "fsdp")
HEAD_AXES = ("tensor",)


def active_mesh():
  """The mesh set by ``jax.set_mesh`` if it spans several devices and none of its axes is
  manual (i.e. not inside a ``shard_map``), else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size <= 1 or mesh.manual_axes:
    return None
  return mesh


def _dividing_axes(size: int, axes: Sequence[str], mesh) -> tuple[str, ...]:
  """The axes of ``axes`` (in order, size > 1, present in ``mesh``) that split ``size``."""
  keep = []
  for name in axes:
    n = dict(mesh.shape).get(name, 1)
    if n > 1 and size % n == 0:
      keep.append(name)
      size //= n
  return tuple(keep)


def kernel_partition(
  mesh,
  batch: int,
  n_heads: int,
  n_kv_heads: int,
  batch_axes: Sequence[str] = BATCH_AXES,
  head_axes: Sequence[str] = HEAD_AXES,
):
  """(batch mesh axes, head mesh axes) for q [B, T, H, D] and k, v [B, T, KV, D]."""
  b_axes = _dividing_axes(batch, batch_axes, mesh)
  h_axes = _dividing_axes(n_heads, head_axes, mesh)
  if _dividing_axes(n_kv_heads, head_axes, mesh) != h_axes:
    h_axes = ()
  return b_axes, h_axes


def _entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def shard_over_mesh(
  kernel: Callable,
  q,
  k,
  v,
  segment_ids,
  doc_ids: Optional[jax.Array],
  *,
  batch_axes: Sequence[str] = BATCH_AXES,
  head_axes: Sequence[str] = HEAD_AXES,
):
  """``kernel(q, k, v, segment_ids, doc_ids)``, run per device under the active mesh."""
  mesh = active_mesh()
  if mesh is None:
    return kernel(q, k, v, segment_ids, doc_ids)
  b_axes, h_axes = kernel_partition(mesh, q.shape[0], q.shape[2], k.shape[2], batch_axes, head_axes)
  if not b_axes and not h_axes:
    return kernel(q, k, v, segment_ids, doc_ids)
  qkv = P(_entry(b_axes), None, _entry(h_axes), None)
  ids = P(_entry(b_axes), None)
  if doc_ids is None:
    body = lambda q, k, v, seg: kernel(q, k, v, seg, None)
    args, in_specs = (q, k, v, segment_ids), (qkv, qkv, qkv, ids)
  else:
    body = kernel
    args, in_specs = (q, k, v, segment_ids, doc_ids), (qkv, qkv, qkv, ids, ids)
  if mesh.explicit_axes:  # sharding in types: shard_map wants the inputs laid out as in_specs
    q_spec = jax.typeof(q).sharding.spec
    args = tuple(jax.sharding.reshard(x, spec) for x, spec in zip(args, in_specs))
  # check_vma=False: pallas_call's outputs carry no varying-axes type; the legacy semantics
  # (axes a spec leaves out are replicated, their cotangents summed) keep gradients exact.
  # Only the axes that split something are manual: a left-out axis of size 1 would otherwise
  # cost an all-reduce (singleton groups, but XLA:CPU still runs it) of dq, dk, dv per call.
  out = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=in_specs,
    out_specs=qkv,
    axis_names=frozenset(b_axes + h_axes),
    check_vma=False,
  )(*args)
  if mesh.explicit_axes:  # hand the output back laid out like q
    out = jax.sharding.reshard(out, q_spec)
  return out
