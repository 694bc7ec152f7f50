"""The platform choices of ``lca_jax.backend``: each answers for the platform being traced for
(jax's default backend, or a ``backend.target`` block, as every test here names), and the
model makes each choice by asking it (Pallas interpret mode, blockwise loop nests,
matrix-vector products over a cache, latent LM widths of a long decode block, [out, in] decode
weights, dense products and norms over merged rows, RoPE through a product)."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from lca_jax import backend
from lca_jax.model import hierarchical, incremental, layers
from lca_jax.model.hierarchical import ByteLM, init_params


def _choices() -> dict:
  return dict(
    interpret=backend.pallas_interpret(),
    threads=backend.attention_threads(),
    matvec=[backend.matvec_cache_products(c, 8) for c in (1, 2, 8, 9)],
    widths=backend.several_lm_widths(),
    row_major=backend.row_major_kernels(),
    merged_rows=[backend.merged_rows(n) for n in (13, 16)],
    rope_product=backend.rope_by_product(),
  )


def test_cpu_choices():
  with backend.target("cpu"):
    got = _choices()
  assert got == dict(
    interpret=True,
    threads=os.cpu_count() or 1,
    matvec=[False, True, True, False],
    widths=True,
    row_major=False,
    merged_rows=[True, True],
    rope_product=False,
  )


@pytest.mark.parametrize("name", ["gpu", "tpu"])
def test_accelerator_choices(name):
  with backend.target(name):
    got = _choices()
  assert got == dict(
    interpret=False,
    threads=1,
    matvec=[False] * 4,
    widths=False,
    row_major=name == "gpu",
    merged_rows=[name == "gpu", True],
    rope_product=name == "tpu",
  )
  with backend.target("cpu"):
    with backend.target(name):
      pass
    assert _choices()["interpret"]  # a block's end restores the answers of the one around it


def test_lm_widths_of_a_named_platform():
  """``several_lm_widths`` of a named platform ignores the target in force."""
  with backend.target("gpu"):
    assert backend.several_lm_widths("cpu") and not backend.several_lm_widths()
  assert not backend.several_lm_widths("gpu")
  assert incremental.lm_widths(96, "cpu") == (24, 48, 96)
  assert incremental.lm_widths(96, "gpu") == (96,)


def test_model_asks_for_pallas_interpret_and_attention_threads():
  """The Pallas kernel's interpret mode, and the blockwise loop nests of a config that leaves
  them to the platform (``attn_parallel`` 0; the blockwise path named: "auto" is the kernel on
  a GPU)."""
  cfg = tiny_config("lca_mbp", attn_parallel=0, attention_impl="xla")
  ids = jnp.zeros((1, 8), jnp.int32)
  kernel = lambda: hierarchical._pallas_kernel(ids, ids)  # pylint: disable=protected-access
  doc = jnp.ones((1, 8), jnp.int32)
  attend = lambda: ByteLM(cfg)._attend(None, doc, "causal")  # pylint: disable=protected-access
  with backend.target("cpu"):
    assert kernel().keywords["interpret"] and attend()[1].keywords["parallel"] == (
      os.cpu_count() or 1
    )
  with backend.target("gpu"):
    assert not kernel().keywords["interpret"] and attend()[1].keywords["parallel"] == 1


def _count(jaxpr, name: str) -> int:
  """Equations of primitive ``name`` in ``jaxpr`` and its sub-jaxprs."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == name
    for v in eqn.params.values():
      for sub in v if isinstance(v, tuple) else (v,):
        sub = getattr(sub, "jaxpr", None)
        if sub is not None:
          n += _count(getattr(sub, "jaxpr", sub), name)
  return n


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_cached_attention_products_follow_the_target(name):
  """Two query columns per (row, kv head): one matrix-vector dot per column for each of the
  two products over the cache on the CPU, one batched dot each on a GPU (+ 2 over the new
  keys either way)."""
  rng = np.random.default_rng(0)
  b, t, kv, g, e, s = 2, 1, 2, 2, 8, 12
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, kn, vn, kc, vc = (
    f(b, t, kv * g, e),
    f(b, kv, t, e),
    f(b, kv, e, t),
    f(b, kv, s, e),
    f(b, kv, e, s),
  )
  mask, start = jnp.ones((b, t, s), bool), jnp.array([0, 3])
  fresh = lambda *a: layers.cached_attention(*a)  # a function jax has not traced yet
  with backend.target(name):
    jaxpr = jax.make_jaxpr(fresh)(q, kn, vn, (kc, vc), mask, start).jaxpr
  assert _count(jaxpr, "dot_general") == (6 if name == "cpu" else 4)


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_long_block_lm_widths_follow_the_target(name):
  """A block of 64 bytes runs the latent LM in one ``lax.switch`` branch per width (+ the
  branch where no group closes): K/4, K/2 and K on the CPU, K alone on a GPU."""
  cfg = tiny_config("fxt")
  params = nn.unbox(init_params(cfg, jax.random.PRNGKey(0)))
  k = incremental.LM_WIDTHS_FROM

  def step(p):
    st = incremental.init_state(cfg, p, 1, 2 * k, False)
    return incremental.extend(cfg, p, st, jnp.zeros((1, k), jnp.int32), jnp.array([k]), False)

  with backend.target(name):
    jaxpr = jax.make_jaxpr(step)(params).jaxpr
  branches = [len(e.params["branches"]) for e in jaxpr.eqns if e.primitive.name == "cond"]
  assert max(branches) == (4 if name == "cpu" else 2), branches


def test_auto_attention_is_the_platform_s_kernel_and_an_explicit_choice_wins():
  assert tiny_config("lca_mbp").attention_impl == "auto"  # the default
  assert backend.attention_impl() == backend.attention_impl("auto") == "xla"  # this CPU host
  assert backend.attention_label("auto") == "xla (auto)" and backend.attention_label("xla") == "xla"
  for name in ("gpu", "tpu"):
    with backend.target(name):
      assert backend.attention_impl("auto") == "pallas"
      assert backend.attention_label("auto") == "pallas (auto)"
      for explicit in ("xla", "pallas", "dense"):
        assert backend.attention_impl(explicit) == explicit
    assert backend.attention_impl("auto", name) == "pallas"
  with backend.target("gpu"):
    assert backend.attention_impl("auto", "cpu") == "xla"  # a named platform over the target
  with backend.target("cpu"):
    assert backend.attention_impl("auto") == "xla"


@pytest.mark.parametrize(
  "name, impl, pallas",
  [("cpu", "auto", False), ("gpu", "auto", True), ("tpu", "auto", True), ("gpu", "xla", False)],
)
def test_the_model_traces_the_attention_auto_resolves_to(monkeypatch, name, impl, pallas):
  calls = []
  real = hierarchical._pallas_kernel

  def spy(group_BT, doc_BT):
    calls.append(backend.tpu_attention_kernel())
    return real(group_BT, doc_BT)

  monkeypatch.setattr(hierarchical, "_pallas_kernel", spy)
  cfg = tiny_config("lca_mbp", attention_impl=impl)
  ids = jnp.zeros((1, 64), jnp.int32)
  with backend.target(name):
    params = jax.eval_shape(lambda: nn.unbox(init_params(cfg, jax.random.PRNGKey(0), 64)))
    calls.clear()  # the forward's own calls
    jax.eval_shape(lambda p: ByteLM(cfg).apply({"params": p}, ids), params)
  assert bool(calls) == pallas
  assert all(c == (name == "tpu") for c in calls)  # the Mosaic kernel on TPUs only
