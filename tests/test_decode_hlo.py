"""The compiled decode step: no copies of cache-sized buffers, and the cached attention it uses
equals the plain masked attention over the written cache."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_rel

from lca_jax.api import Model
from lca_jax.decode import engine
from lca_jax.model import layers, masks
from lca_jax.model.config import ModelConfig
from lca_jax.model.hierarchical import init_params
from lca_jax.model.layers import cached_attention, masked_attention, write_kv
from lca_jax.perf import bounds, hlo_stats

TINY = dict(d_model=32, d_inner=64, n_heads=2, n_kv_heads=1, n_enc=1, n_lm=1, n_dec=1)


def _count_primitive(jaxpr, name: str) -> int:
  """Equations of primitive ``name`` in ``jaxpr`` and the jaxprs it calls (each call counted)."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == name
    for v in eqn.params.values():
      sub = getattr(v, "jaxpr", None)
      if sub is not None:
        n += _count_primitive(getattr(sub, "jaxpr", sub), name)
  return n


@pytest.mark.parametrize("matvec", [False, True])
@pytest.mark.parametrize("t,kv,groups", [(1, 2, 1), (1, 2, 2), (3, 2, 1), (3, 2, 2), (5, 1, 4)])
def test_cached_attention_equals_masked_attention_on_written_cache(
  t, kv, groups, matvec, monkeypatch
):
  """Both forms of the products over the cache: batched, and (on CPU, several columns per row
  and kv head) one matrix-vector dot per query head and query, batched over rows and kv heads."""
  monkeypatch.setattr(layers, "MATVEC_CACHE_COLUMNS", 10**6 if matvec else 0)
  rng = np.random.default_rng(t)
  b, e, s = 3, 8, 12
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, kc, vc, kn, vn = (
    f(b, t, kv * groups, e),
    f(b, kv, s, e),
    f(b, kv, e, s),
    f(b, kv, t, e),
    f(b, kv, e, t),
  )
  mask = jnp.asarray(rng.random((b, t, s)) < 0.6).at[:, :, -1].set(False)
  mask = mask.at[0].set(False)  # a row with no allowed key gives zeros
  start = jnp.array([0, s - t, 4])  # ragged starts, one at the very end
  out = cached_attention(q, kn, vn, (kc, vc), mask, start)
  if jax.default_backend() == "cpu":
    fresh = lambda *a: cached_attention(*a)  # not a function jax has traced (traces are cached)
    n_dots = _count_primitive(
      jax.make_jaxpr(fresh)(q, kn, vn, (kc, vc), mask, start).jaxpr, "dot_general"
    )
    columns = groups * t
    assert n_dots == (2 * columns + 2 if matvec and columns > 1 else 4), n_dots
  k2, v2 = write_kv((kc, vc), (kn, vn), start)
  ref = masked_attention(q, k2, v2.transpose(0, 1, 3, 2), mask, head_major=True)
  assert_close_rel(out, ref, 1e-5)
  assert not np.any(np.asarray(out[0]))


@pytest.mark.parametrize("matvec", [False, True])
@pytest.mark.parametrize("old_slots", [0, 1, 5])
def test_cached_attention_reads_only_the_old_slots_it_is_given(old_slots, matvec, monkeypatch):
  """With ``old_slots`` n only the cache's first n slots are read (the slots past them are NaN
  here: a read would make the output NaN) and the result is the attention over the whole
  written cache when the mask allows no other earlier key."""
  monkeypatch.setattr(layers, "MATVEC_CACHE_COLUMNS", 10**6 if matvec else 0)
  rng = np.random.default_rng(old_slots)
  b, t, kv, groups, e, s = 2, 3, 1, 2, 8, 12
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, kn, vn = f(b, t, kv * groups, e), f(b, kv, t, e), f(b, kv, e, t)
  kc = f(b, kv, s, e).at[:, :, old_slots:].set(jnp.nan)
  vc = f(b, kv, e, s).at[..., old_slots:].set(jnp.nan)
  start = jnp.array([old_slots, old_slots + 2])  # the new keys follow the old ones (or a gap)
  slot = jnp.arange(s)[None, None]
  written = (slot >= start[:, None, None]) & (slot < start[:, None, None] + t)
  mask = (jnp.asarray(rng.random((b, t, s)) < 0.7) & (slot < old_slots)) | written
  out = cached_attention(q, kn, vn, (kc, vc), mask, start, old_slots)
  k2, v2 = write_kv((kc, vc), (kn, vn), start)
  clean = lambda a: jnp.nan_to_num(a, nan=0.0)  # the reference reads every slot
  ref = masked_attention(q, clean(k2), clean(v2).transpose(0, 1, 3, 2), mask, head_major=True)
  assert np.all(np.isfinite(np.asarray(out)))
  assert_close_rel(out, ref, 1e-5)
  whole = cached_attention(q, kn, vn, (kc, vc), mask, start)
  assert not np.all(np.isfinite(np.asarray(whole)))  # the NaN slots are there to be read


@pytest.mark.parametrize("rows", [[[3], [0], [1]], [[3, 4], [0, 4], [2, 2]]])
def test_stack_rows_equal_the_full_stack_at_those_rows(rows):
  """A stack over a cache that keeps only some positions after its last layer (``rows_BR``:
  the last byte of a multi-byte step, + the MBP copies) gives those positions' outputs of the
  full stack, and writes the same keys and values at every position."""
  rng = np.random.default_rng(0)
  b, t, d, s, kv, e = 3, 5, 32, 16, 1, 16
  stack = layers.Stack(n_layers=2, n_heads=2, n_kv_heads=kv, d_inner=64, rope_base=10000.0)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  x = f(b, t, d)
  start = jnp.array([0, 4, s - t])  # ragged, one at the very end
  pos = start[:, None] + jnp.arange(t)[None]
  mask = masks.cache_causal_mask(pos, s) & jnp.asarray(rng.random((b, t, s)) < 0.8)
  mask = mask | (jnp.arange(s)[None, None] == pos[..., None])  # every query sees itself
  caches = [(f(b, kv, s, e), f(b, kv, e, s)) for _ in range(2)]
  kw = dict(caches=caches, write_B=start)
  params = stack.init(jax.random.PRNGKey(1), x, pos, mask, **kw)
  full, full_caches = stack.apply(params, x, pos, mask, **kw)
  rows_BR = jnp.asarray(rows)
  part, part_caches = stack.apply(params, x, pos, mask, rows_BR=rows_BR, **kw)
  assert part.shape == (b, rows_BR.shape[1], d)
  assert_close_rel(part, layers.take_rows(full, rows_BR))
  for got, want in zip(jax.tree.leaves(part_caches), jax.tree.leaves(full_caches)):
    assert_close_rel(got, want)  # two programs: XLA may fuse them differently


@pytest.mark.parametrize("remat", [False, True])
def test_stack_rows_without_cache(remat):
  """Without a cache (a full forward, remat or not) ``rows_BR`` also keeps those positions of
  the full stack's output."""
  rng = np.random.default_rng(1)
  b, t, d = 2, 6, 32
  stack = layers.Stack(n_layers=2, n_heads=2, n_kv_heads=1, d_inner=64, rope_base=1e4, remat=remat)
  x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  params = stack.init(jax.random.PRNGKey(0), x, pos, mask)
  full, _ = stack.apply(params, x, pos, mask)
  rows_BR = jnp.array([[5, 0], [2, 2]])
  part, _ = stack.apply(params, x, pos, mask, rows_BR=rows_BR)
  assert_close_rel(part, layers.take_rows(full, rows_BR))


def test_step_stats_sees_a_copy_in_a_loop_that_makes_one():
  """The parser must report the cache copy XLA makes when a loop writes a buffer that an
  unordered read still needs (the bug the decode step avoids), and none once ordered."""

  def loop(ordered):
    def body(c):
      i, cache, acc = c
      s = cache @ jnp.sin(acc)
      new = jnp.cos(acc) + (0.0 * s[0] if ordered else 0.0)
      return i + 1, jax.lax.dynamic_update_slice(cache, new[None], (i, 0)), acc + s[:16]

    return lambda x: jax.lax.while_loop(lambda c: c[0] < 9, body, (jnp.int32(0), x, jnp.ones(16)))

  x = jnp.zeros((300, 16))
  size = 300 * 16 * 4
  bad = hlo_stats.step_stats(jax.jit(loop(False)).lower(x).compile().as_text(), size)
  good = hlo_stats.step_stats(jax.jit(loop(True)).lower(x).compile().as_text(), size)
  assert bad["copies"] and all(c["bytes"] == size for c in bad["copies"])
  assert not good["copies"] and good["ops"] >= 3 and good["dots"] >= 1


@pytest.mark.parametrize(
  "variant,mode,batch",
  [
    ("lca", "ntp", 1),
    ("lca", "ntp", 3),
    ("lca", "threshold", 3),
    ("lca", "verify", 3),
    ("flat", "ntp", 2),
    ("mlp", "verify", 2),
    ("spacebyte", "ntp", 2),
  ],
)
def test_decode_step_copies_no_cache(variant, mode, batch):
  over = {
    "lca": dict(n_mbp=2),
    "flat": dict(kind="flat", n_mbp=0),
    "mlp": dict(n_mbp=0, n_mlp_mbp=2),
    "spacebyte": dict(n_mbp=0, boundaries="spacebyte", spacebyte_max_group=4),
  }[variant]
  cfg = ModelConfig(**TINY, **over)
  model = Model(cfg, jax.tree.map(np.asarray, init_params(cfg, jax.random.PRNGKey(0))))
  prompts = [np.arange(3, 3 + 20 + i, dtype=np.int32) for i in range(batch)]
  kw = dict(mode=mode, n=3, tau=0.5, max_bytes=200, temperature=0.0, ignore_eos=True)
  text = engine.compiled_decode(model, prompts, **kw).as_text()
  # the smallest cache buffer: one layer's keys for every row, [B, KV, L, E], L >= max_bytes
  stats = hlo_stats.step_stats(text, bounds.min_cache_bytes(cfg, batch, 200))
  assert stats["copies"] == [], stats["copies"]
  assert stats["dots"] > 0 and stats["ops"] > stats["dots"]
  if jax.default_backend() == "cpu":  # few-row dots stay on XLA's Eigen path (engine options)
    assert "__ynn_fusion" not in text


def test_step_stats_of_a_sampled_decode_read_the_decode_loop():
  """Sampling splits its PRNG keys before the decode loop in a while loop of its own: the step
  is still the decode loop's body (the same dots as greedy decoding, more ops for the draws)."""
  cfg = ModelConfig(**TINY, n_mbp=2)
  model = Model(cfg, jax.tree.map(np.asarray, init_params(cfg, jax.random.PRNGKey(0))))
  kw = dict(mode="threshold", n=3, tau=0.5, max_bytes=50, ignore_eos=True)
  stats = {
    t: hlo_stats.step_stats(
      engine.compiled_decode(model, [np.arange(3, 23)], temperature=t, **kw).as_text()
    )
    for t in (0.0, 0.9)
  }
  assert stats[0.9]["dots"] == stats[0.0]["dots"] > 0, stats
  assert stats[0.9]["ops"] > stats[0.0]["ops"], stats


@pytest.mark.parametrize("mode,stacks", [("ntp", 3), ("threshold", 5)])
def test_decode_step_fuses_projections_without_copying_weights(mode, stacks):
  """With the fused decode kernels (``layers.fuse_decode_params``, the default), each layer a
  step runs has 3 dots fewer (q/k/v: 3 -> 1, gate/up: 2 -> 1) than with the separate dots, and
  the step concatenates no weights: the fused kernels are built before the loop (also those of
  the latent LM, whose layers run under a ``lax.cond`` that XLA does not hoist out of)."""
  cfg = ModelConfig(**TINY, n_mbp=2)  # ntp runs enc + lm + dec (1 layer each), threshold + mbp
  model = Model(cfg, jax.tree.map(np.asarray, init_params(cfg, jax.random.PRNGKey(0))))
  kw = dict(mode=mode, n=3, tau=0.5, max_bytes=200, temperature=0.0, ignore_eos=True)
  text = {
    fuse: engine.compiled_decode(model, [np.arange(3, 23)], fuse_projections=fuse, **kw).as_text()
    for fuse in (False, True)
  }
  # a model object without ``decode_params`` gets the fused kernels built inside the call
  plain = types.SimpleNamespace(cfg=cfg, params=model.params)
  text["plain"] = engine.compiled_decode(plain, [np.arange(3, 23)], **kw).as_text()
  dots = {fuse: hlo_stats.step_stats(t)["dots"] for fuse, t in text.items()}
  layers = cfg.n_enc + cfg.n_lm + cfg.n_dec + (cfg.n_mbp if mode != "ntp" else 0)
  assert layers == stacks
  assert dots[True] == dots[False] - 3 * layers, dots
  d, e = cfg.d_model, cfg.head_dim
  fused_dims = {(d, (cfg.n_heads + 2 * cfg.n_kv_heads) * e), (d, 2 * cfg.d_inner)}
  assert fused_dims == {(32, 64), (32, 128)}
  for dims in fused_dims:  # a Model's are built once, before any call; others' once per call
    assert f"f32[{dims[0]},{dims[1]}]{{1,0}} concatenate(" not in text[True]
    assert f"f32[{dims[0]},{dims[1]}]{{1,0}} concatenate(" in text["plain"]
  assert hlo_stats.step_stats(text["plain"])["dots"] == dots[True]
  in_step = {f: sorted(c["dims"] for c in hlo_stats.step_concatenates(t)) for f, t in text.items()}
  assert in_step[True] and not fused_dims & set(in_step[True]), in_step[True]
  # the fusion adds none to the step (those are RoPE's, scores'), built in the call or not
  assert in_step[True] == in_step[False] == in_step["plain"]


def test_step_concatenates_sees_a_weight_concatenate_in_a_cond_in_the_loop():
  """The helper reports a concatenate that XLA leaves in the step: one inside a ``lax.cond``
  branch of the loop body is not hoisted (why the engine fuses the weights before the loop),
  one directly in the body is."""

  def loop(in_cond):
    def run(w, x):
      def body(c):
        i, h = c
        proj = lambda h: jnp.tanh(h @ jnp.concatenate([w, 2 * w], axis=1))[:, :24]
        h = jax.lax.cond(jnp.sum(h) > 0, proj, lambda h: 0.5 * h, h) if in_cond else proj(h)
        return i + 1, h

      return jax.lax.while_loop(lambda c: c[0] < 9, body, (jnp.int32(0), x))

    return jax.jit(run).lower(jnp.ones((24, 24)), jnp.ones((1, 24))).compile().as_text()

  cat = lambda in_cond: hlo_stats.step_concatenates(loop(in_cond))
  assert {"dtype": "f32", "dims": (24, 48), "bytes": 24 * 48 * 4} in cat(True)
  assert (24, 48) not in [c["dims"] for c in cat(False)]
