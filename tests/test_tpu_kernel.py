"""The LCA attention kernels for TPUs (lca_jax/kernels/tpu_attention.py).

Against the dense reference in Pallas' TPU interpret mode on the CPU (forward and gradients on
packed, ragged and GQA inputs); the block bounds that skip masked blocks; the choice through
lca_jax.backend; and, with libtpu (`make tpu-aot`), the kernels compiled for v5e / v5p / v6e
without a TPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lca_jax import backend
from lca_jax.aot import targets
from lca_jax.kernels import tpu_attention
from lca_jax.kernels.lca_attention import query_block_key_bounds
from lca_jax.kernels.reference import lca_attention_reference, lca_key_start
from lca_jax.model import hierarchical

needs_libtpu = pytest.mark.skipif(
  not targets.tpu_compiler_available(), reason="libtpu is not installed (make tpu-aot runs these)"
)


def _inputs(B, T, H, KV, D, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, D)), dtype) for n in (H, KV, KV))
  seg = jnp.asarray(np.cumsum(rng.random((B, T)) < 0.3, axis=1), jnp.int32)
  # packed: two documents per row; ragged: the last row ends in padding (doc id 0)
  doc = np.where(np.arange(T) < (3 * T) // 4, 1, 2)[None].repeat(B, 0)
  doc[-1, T - T // 8 :] = 0
  return q, k, v, seg, jnp.asarray(doc, jnp.int32)


def _close(a, b, rel):
  scale = float(jnp.max(jnp.abs(b))) or 1.0
  assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) <= rel * scale


def test_forward_and_gradients_match_the_reference_in_tpu_interpret_mode():
  B, T, H, KV, D = 2, 200, 4, 2, 16  # GQA 2 query heads per kv head, T padded to 256
  q, k, v, seg, doc = _inputs(B, T, H, KV, D)
  kernel = functools.partial(
    tpu_attention.lca_attention_tpu, segment_ids=seg, doc_ids=doc, interpret=pltpu.InterpretParams()
  )
  reference = functools.partial(lca_attention_reference, segment_ids=seg, doc_ids=doc)
  out = kernel(q, k, v)
  _close(out, reference(q, k, v), 1e-5)
  assert float(jnp.max(jnp.abs(out[-1, T - T // 8 :]))) == 0.0  # padding rows output zeros
  w = jnp.cos(jnp.arange(D, dtype=jnp.float32))
  loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) * w)
  got = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(got, want):
    _close(a, b, 1e-5)


def test_bf16_and_a_causal_row_match_the_reference():
  B, T, H, KV, D = 1, 256, 2, 1, 32
  q, k, v, _, _ = _inputs(B, T, H, KV, D, jnp.bfloat16, seed=1)
  causal = jnp.zeros((B, T), jnp.int32)  # one group: the LCA mask is causal
  out = tpu_attention.lca_attention_tpu(q, k, v, causal, interpret=True)
  assert out.dtype == jnp.bfloat16
  _close(out, lca_attention_reference(q, k, v, causal), 2e-2)


def test_query_blocks_visit_only_the_key_blocks_their_groups_reach():
  # short groups over 1024 bytes: a query block reaches at most its own and the previous
  # key block, the blocks the kernel's loops visit
  rng = np.random.default_rng(2)
  seg = jnp.asarray(np.cumsum(rng.random((1, 1024)) < 0.3, axis=1), jnp.int32)
  lo, hi = query_block_key_bounds(lca_key_start(seg), 128, 128)
  visited = np.asarray(hi - lo)
  assert visited.max() <= 2 and visited.sum() < 8 * 8 // 2
  # a second document starting at 512 is never visited by the first's key blocks
  doc = jnp.asarray(np.where(np.arange(1024) < 512, 1, 2)[None], jnp.int32)
  lo, _ = query_block_key_bounds(lca_key_start(seg, doc), 128, 128)
  assert int(lo[0, 4]) == 4


def test_bad_blocks_and_shapes_are_value_errors():
  q, k, v, seg, _ = _inputs(1, 16, 3, 2, 8)
  with pytest.raises(ValueError, match="multiple of 128"):
    tpu_attention.lca_attention_tpu(q, k[:, :, :1], v[:, :, :1], seg, block=64)
  with pytest.raises(ValueError, match="kv heads"):
    tpu_attention.lca_attention_tpu(q, k, v, seg)


def test_the_backend_picks_the_mosaic_kernel_for_tpus_only():
  seg = doc = jnp.zeros((1, 4), jnp.int32)
  with backend.target("tpu"):
    assert backend.tpu_attention_kernel()
    assert hierarchical._pallas_kernel(seg, doc).func is tpu_attention.lca_attention_tpu  # pylint: disable=protected-access
  for name in ("cpu", "gpu"):
    with backend.target(name):
      assert not backend.tpu_attention_kernel()
      assert hierarchical._pallas_kernel(seg, doc).func is not tpu_attention.lca_attention_tpu  # pylint: disable=protected-access


@needs_libtpu
@pytest.mark.parametrize("name", ["v5e", "v5p", "v6e"])
def test_forward_and_backward_compile_for_tpus_without_one(name):
  dev = targets.devices(targets.parse(name))[0]
  mesh = Mesh(np.array([dev]), ("x",))
  sh = NamedSharding(mesh, P())

  def loss(q, k, v, seg):
    return jnp.sum(tpu_attention.lca_attention_tpu(q, k, v, seg).astype(jnp.float32))

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), in_shardings=(sh,) * 4)
  a = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  with jax.set_mesh(mesh):  # the kernels lower for the mesh's TPU kind
    lowered = f.lower(
      a(2, 256, 4, 128), a(2, 256, 2, 128), a(2, 256, 2, 128), a(2, 256, dt=jnp.int32)
    )
  text = lowered.compile().as_text()
  assert text.count('custom_call_target="tpu_custom_call"') == 3  # forward, dq, dk/dv


def test_under_a_mesh_the_kernel_runs_per_device_over_every_axis():
  B, T, H, KV, D = 2, 128, 2, 2, 8
  q, k, v, seg, doc = _inputs(B, T, H, KV, D, seed=3)
  mesh = jax.make_mesh((1, 2, 1), ("data", "fsdp", "tensor"), devices=jax.devices()[:2])
  f = jax.jit(
    lambda q, k, v: tpu_attention.lca_attention_tpu(q, k, v, seg, doc_ids=doc, interpret=True)
  )
  with jax.set_mesh(mesh):
    _close(f(q, k, v), lca_attention_reference(q, k, v, seg, doc), 1e-5)
    assert "shard_map" in str(jax.make_jaxpr(f)(q, k, v))
  odd = jax.make_mesh((2, 1, 1), ("data", "fsdp", "tensor"), devices=jax.devices()[:2])
  with jax.set_mesh(odd), pytest.raises(ValueError, match="split"):
    tpu_attention.lca_attention_tpu(q[:1], k[:1], v[:1], seg[:1], interpret=True)
