"""The Pallas LCA kernel under a multi-device mesh (lca_jax/kernels/sharded.py).

8 fake CPU devices, Pallas in interpret mode (or 8 GPUs, the kernels compiled by Triton,
float32 compared at TF32 precision; skipped with fewer devices): the ``jax.shard_map``-wrapped
call equals the unsharded XLA reference (forward and gradients), its compiled HLO gathers
nothing (the unwrapped call gathers q/k/v over the batch), and a sharded train step of a tiny
LCA-MBP with ``attention_impl="pallas"`` equals the ``"xla"`` one.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import REL_REORDER, assert_close_rel  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
from test_kernels import (  # noqa: E402
  INTERPRET,
  f32_tolerance,
  random_qkv,
  scenario_rows,
)

from lca_jax.kernels import (  # noqa: E402
  lca_attention,
  sharded,  # noqa: E402
)
from lca_jax.train import sharding as shd  # noqa: E402

B, T, D = 8, 40, 16
pytestmark = pytest.mark.skipif(
  jax.device_count() < 8, reason="needs 8 devices (fake CPU devices, or 8 GPUs)"
)
TOL = f32_tolerance(REL_REORDER, jnp.float32)


def make_mesh(data, fsdp, tensor, explicit=False):
  if explicit:  # sharding in types (jax.make_mesh's default); lca_jax.train uses Auto
    return jax.make_mesh(
      (data, fsdp, tensor), shd.AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 3
    )
  return shd.make_mesh({"data": data, "fsdp": fsdp, "tensor": tensor}, jax.devices())


def packed_batch(rng, use_docs):
  """8 rows: two draws of the four scenario rows (random groups, one segment, packed docs
  with padding)."""
  seg, doc = zip(*(scenario_rows(rng, T, restart_groups=use_docs) for _ in range(2)))
  return np.concatenate(seg), np.concatenate(doc)


def out_and_grads(q, k, v, w, seg, doc, impl, shard=True):
  """Output and (dq, dk, dv) of ``sum(w * out)``."""

  def loss(q, k, v):
    out = lca_attention(
      q, k, v, seg, doc_ids=doc, impl=impl, interpret=INTERPRET, block_q=16, block_k=16, shard=shard
    )
    return jnp.sum(w * out), out

  grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, grads


def shardings(mesh, H, KV, use_docs):
  """Input shardings as the model's activations have them: rows over (data, fsdp), heads
  over tensor where they divide."""
  b, h = sharded.kernel_partition(mesh, B, H, KV)
  e = lambda axes: None if not axes else axes
  qkv = NamedSharding(mesh, P(e(b), None, e(h), None))
  ids = NamedSharding(mesh, P(e(b), None))
  return (qkv, qkv, qkv, qkv, ids, ids if use_docs else None)


# ---- partition rules -----------------------------------------------------------------------
def test_axes_match_logical_rules():
  """The kernel's mesh axes are those the training rules give 'batch' and 'heads'/'kv'."""
  rules = dict(shd.LOGICAL_RULES)
  assert tuple(rules["batch"]) == sharded.BATCH_AXES == shd.BATCH_AXES
  assert (rules["heads"],) == (rules["kv"],) == sharded.HEAD_AXES


def test_kernel_partition():
  m = make_mesh(2, 2, 2)
  assert sharded.kernel_partition(m, 8, 4, 2) == (("data", "fsdp"), ("tensor",))
  assert sharded.kernel_partition(m, 2, 4, 1) == (("data",), ())  # kv heads do not divide
  assert sharded.kernel_partition(m, 6, 3, 3) == (("data",), ())
  m8 = make_mesh(8, 1, 1)
  assert sharded.kernel_partition(m8, 16, 4, 4) == (("data",), ())
  assert sharded.kernel_partition(m8, 4, 4, 4) == ((), ())


def test_no_wrapping_without_a_mesh():
  q = jnp.zeros((8, 16, 2, 16))
  seg = jnp.zeros((8, 16), jnp.int32)
  call = lambda q, s: lca_attention(q, q, q, s, impl="pallas", interpret=INTERPRET)
  assert sharded.active_mesh() is None
  assert "shard_map" not in str(jax.make_jaxpr(call)(q, seg))
  with jax.set_mesh(make_mesh(8, 1, 1)):
    assert sharded.active_mesh() is not None
    assert "shard_map" in str(jax.make_jaxpr(call)(q, seg))
  with jax.set_mesh(shd.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])):
    assert sharded.active_mesh() is None
    assert "shard_map" not in str(jax.make_jaxpr(call)(q, seg))


# ---- sharded kernel == unsharded XLA reference ---------------------------------------------
CASES = {
  # name: (mesh (data, fsdp, tensor), H, KV, use_docs, explicit axes)
  "d2f2t2_gqa_docs": ((2, 2, 2), 4, 2, True, False),  # rows over data x fsdp, heads over tensor
  "d2f2t2_mqa_docs": ((2, 2, 2), 4, 1, True, False),  # kv heads do not divide: replicated
  "d8_mha_nodocs": ((8, 1, 1), 2, 2, False, False),  # rows over data only, no doc ids
  "d2f2t2_gqa_explicit": ((2, 2, 2), 4, 2, True, True),  # inputs resharded into place
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_pallas_matches_reference(name):
  mesh_shape, H, KV, use_docs, explicit = CASES[name]
  rng = np.random.default_rng(sorted(CASES).index(name))
  seg, doc = packed_batch(rng, use_docs)
  doc = doc if use_docs else None
  q, k, v = random_qkv(rng, B, T, H, KV, D, jnp.float32)
  w = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
  args = (q, k, v, w, jnp.asarray(seg), None if doc is None else jnp.asarray(doc))

  ref_out, ref_grads = jax.jit(functools.partial(out_and_grads, impl="xla"))(*args)
  mesh = make_mesh(*mesh_shape, explicit=explicit)
  sh = shardings(mesh, H, KV, use_docs)
  if explicit:  # heads replicated: the wrapper reshards q, k, v over tensor and back
    sh = (NamedSharding(mesh, P(shd.BATCH_AXES)),) * 4 + sh[4:]
  placed = [x if s is None else jax.device_put(x, s) for x, s in zip(args, sh)]
  with jax.set_mesh(mesh):
    fn = jax.jit(functools.partial(out_and_grads, impl="pallas"))
    assert "shard_map" in str(jax.make_jaxpr(fn)(*placed))
    out, grads = fn(*placed)
  assert out.sharding.is_equivalent_to(placed[0].sharding, 4)  # laid out like q

  assert out.shape == q.shape and out.dtype == q.dtype
  for got, want, what in zip((out, *grads), (ref_out, *ref_grads), ("out", "dq", "dk", "dv")):
    assert_close_rel(got, want, TOL, err_msg=what)
  if use_docs:  # padding rows are exactly zero
    assert not np.asarray(out)[doc == 0].any()


# ---- compiled HLO: no gather of q/k/v over the batch ---------------------------------------
_ALL_GATHER = re.compile(r"= (\w+)\[([\d,]*)\]\S* all-gather\(.*?dimensions=\{(\d+)\}")


def batch_gathers(hlo: str):
  """All-gathers in ``hlo`` that produce a float [B, T_any, heads, D_any] array along dim 0
  (q, k, v, or their cotangents gathered over the batch axes)."""
  found = []
  for m in _ALL_GATHER.finditer(hlo):
    dtype, dims, dim = m.group(1), [int(x) for x in m.group(2).split(",") if x], m.group(3)
    if dtype.startswith(("f", "bf")) and len(dims) == 4 and dims[0] == B and dim == "0":
      found.append(m.group(0)[:120])
  return found


@pytest.mark.parametrize("mesh_shape,H,KV", [((2, 2, 2), 4, 2), ((8, 1, 1), 2, 2)])
def test_sharded_kernel_gathers_nothing(mesh_shape, H, KV):
  """No gather of q/k/v, and no collective at all: with axes of size 1 in the mesh (8, 1, 1),
  only the axes that split something are manual (a left-out axis cost an all-reduce of
  dq, dk and dv per call)."""
  mesh = make_mesh(*mesh_shape)
  sh = shardings(mesh, H, KV, use_docs=True)
  shapes = [(B, T, H, D), (B, T, KV, D), (B, T, KV, D), (B, T, H, D), (B, T), (B, T)]
  dtypes = [jnp.float32] * 4 + [jnp.int32] * 2
  specs = [jax.ShapeDtypeStruct(s, d, sharding=x) for s, d, x in zip(shapes, dtypes, sh)]
  hlo = {}
  with jax.set_mesh(mesh):
    for shard in (True, False):
      fn = jax.jit(functools.partial(out_and_grads, impl="pallas", shard=shard))
      hlo[shard] = fn.lower(*specs).compile().as_text()
  # The control: left to XLA, the kernel call gathers q, k, v over the batch axes.
  assert batch_gathers(hlo[False]), "the check found no gather even without shard_map"
  assert not batch_gathers(hlo[True]), batch_gathers(hlo[True])
  collectives = re.findall(r" (all-reduce|all-gather|all-to-all|collective-permute)\(", hlo[True])
  assert not collectives, collectives


# ---- sharded train step: pallas == xla -----------------------------------------------------
def test_sharded_train_step_pallas_matches_xla():
  from conftest import host_params  # pylint: disable=g-import-not-at-top
  from test_train import _batches, tiny_config  # pylint: disable=g-import-not-at-top

  from lca_jax.train import loop  # pylint: disable=g-import-not-at-top

  batches = [{k: np.asarray(v) for k, v in b.items()} for b in _batches(1)]
  assert batches[0]["ids"].shape == (16, 32)  # 2 micro-batches of B = 8 rows
  mesh = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
  results = {}
  for impl in ("xla", "pallas"):
    setup = loop.prepare(
      tiny_config("train.steps=10", f"model.attention_impl={impl}", *mesh), jax.devices()
    )
    state = setup.init_state()
    with shd.mesh_context(setup.mesh):
      batch = setup.device_batch(batches[0])
      step = setup.train_step
      if impl == "pallas":  # the kernel really runs per device inside the step, gathering nothing
        jaxpr = str(jax.make_jaxpr(step)(state, batch))
        c = setup.model_cfg
        layers = c.n_enc + c.n_lm + c.n_dec + c.n_mbp
        assert jaxpr.count("shard_map") == 2 * layers, "expected fwd + bwd shard_maps per layer"
        step = step.lower(state, batch).compile()
        assert not batch_gathers(step.as_text())  # micro-batch rows == B
      state, metrics = step(state, batch)
    results[impl] = (float(metrics["loss"]), host_params(state))
  assert_close_rel(results["pallas"][0], results["xla"][0], TOL)
  for x, y in zip(
    jax.tree_util.tree_leaves(results["pallas"][1]), jax.tree_util.tree_leaves(results["xla"][1])
  ):
    assert_close_rel(x, y, TOL)
