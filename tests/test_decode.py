"""The decode engine against the uncached full forward (never against itself)."""

import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
import functools
import json
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_rel, random_params, run_cli_process, tiny_config

import lca_jax
from lca_jax import backend, vocab
from lca_jax.api import Model
from lca_jax.decode import engine, executables, policies, sampling
from lca_jax.model import incremental, layers, masks, pooling
from lca_jax.model.config import ModelConfig
from lca_jax.model.hierarchical import ByteLM, init_params

REF = os.path.join(os.path.dirname(__file__), "data", "reference")
TINY = dict(
  d_model=32,
  d_inner=64,
  n_heads=2,
  n_kv_heads=1,
  vocab_size=261,
  n_enc=1,
  n_lm=1,
  n_dec=1,
  n_mbp=2,
  max_seq_len=512,
)
VARIANTS = {
  "lca": dict(),
  "mlp": dict(n_mbp=0, n_mlp_mbp=3),
  "spacebyte": dict(n_mbp=0, boundaries="spacebyte", spacebyte_max_group=4),
  "fxt": dict(n_mbp=0),
  "flat": dict(kind="flat", n_lm=0, n_dec=0, n_mbp=0, n_enc=2),
}


def scale_params(params, factor):
  """Bigger weights: peaked distributions and boundary logits away from 0."""
  return jax.tree_util.tree_map(lambda x: x * factor, params)


@functools.lru_cache(maxsize=None)
def tiny_model(name, seed=0, factor=8.0, bp_bias=0.0):
  cfg = ModelConfig(**{**TINY, **VARIANTS[name]})
  params = jax.tree_util.tree_map(
    jnp.asarray,
    scale_params(lca_jax.api.nn.unbox(init_params(cfg, jax.random.PRNGKey(seed))), factor),
  )
  if cfg.hierarchical and cfg.boundaries == "learned":
    # bias the predictor so that ~1/3 of bytes close a group (several closes per step happen)
    params["boundary_predictor"]["fc2"]["bias"] = (
      params["boundary_predictor"]["fc2"]["bias"] + bp_bias
    )
  return Model(cfg, params, source=name)


def random_ids(rng, t):
  return rng.integers(3, 259, size=t).astype(np.int32)


# ---- reference vectors of the paper's code -------------------------------------------------
@pytest.mark.parametrize("case", ["lca_small", "lca_gqa", "fxt_small"])
def test_reference_decoding_vectors(case):
  m = lca_jax.load(os.path.join(REF, case))
  d = np.load(os.path.join(REF, case, "vectors.npz"))
  for i in range(2):
    prompt = d[f"input_{i}"][:24]
    r = m.generate(prompt, mode="ntp", max_bytes=32, ignore_eos=True)
    np.testing.assert_array_equal(r.ids[0], d[f"greedy_ntp_{i}"])
    if case == "fxt_small":
      continue
    r = m.generate(prompt, mode="threshold", tau=0.0, n=4, max_bytes=32, ignore_eos=True)
    np.testing.assert_array_equal(r.ids[0], d[f"threshold_tau0.0_n4_{i}"])
    assert r.accepted_per_step[0] == d[f"threshold_tau0.0_n4_{i}_per_step"].tolist()
    if case == "lca_small":
      r = m.generate(prompt, mode="threshold", tau=0.5, n=3, max_bytes=32, ignore_eos=True)
      np.testing.assert_array_equal(r.ids[0], d[f"threshold_tau0.5_n3_{i}"])
      assert r.accepted_per_step[0] == d[f"threshold_tau0.5_n3_{i}_per_step"].tolist()
      r = m.generate(prompt, mode="verify", n=4, max_bytes=32, ignore_eos=True)
      np.testing.assert_array_equal(r.ids[0], d[f"greedy_ntp_{i}"])


# ---- cache parity, step by step ------------------------------------------------------------
def full_reference(model, ids_BT, n_copies):
  """Uncached forward on the whole sequence plus LCA-MBP logits at n_copies appended copies of
  the last byte (docs/design.md §6.2), written from the model's stage methods, not from the
  cache code."""
  cfg = model.cfg
  out = model.forward(np.asarray(ids_BT))
  if not cfg.has_lca or n_copies == 0:
    return out, None
  return out, jax.jit(functools.partial(_copies_reference, model, n_copies))(ids_BT)


def _copies_reference(model, n_copies, ids_BT):
  cfg, mod = model.cfg, ByteLM(model.cfg)
  ap = lambda method, *a: mod.apply({"params": model.params}, *a, method=method)
  b, t = ids_BT.shape
  doc = jnp.ones_like(ids_BT)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  h = ap(ByteLM.encode, ids_BT, doc, pos)
  bst, bh = mod.apply({"params": model.params}, ids_BT, h, doc, False, method=ByteLM.decide)
  plan = pooling.plan_latents(bh, doc, cfg.latent_capacity(t))
  s = pooling.downsample(h, bst, plan, model.params["null_group"])
  z = ap(ByteLM.latent, s, plan)
  m = pooling.upsample(z, plan) + pooling.upsample(s, plan)
  u_last = plan.group_BT[:, -1] + bh[:, -1].astype(jnp.int32)
  m_ext = jnp.concatenate([m, jnp.repeat(m[:, -1:], n_copies, axis=1)], axis=1)
  g_ext = jnp.concatenate([plan.group_BT, jnp.repeat(u_last[:, None], n_copies, axis=1)], axis=1)
  pos_ext = jnp.broadcast_to(jnp.arange(t + n_copies), (b, t + n_copies))
  h2 = ap(ByteLM.lca_head, m_ext, g_ext, jnp.ones_like(g_ext), pos_ext)
  return ap(ByteLM.logits, h2)[:, t:]


@pytest.mark.parametrize("name", ["lca", "lca_window", "mlp", "spacebyte", "flat"])
def test_cache_parity_per_step(name, monkeypatch):
  """Feed chunks of 1..9 bytes (ragged across rows) through the caches; every head's logits
  and every boundary equal the full forward, including chunks that close several groups.
  ``lca_window``: the LCA-MBP head attends a 13-slot window of its cache whenever the keys of
  a step fit (some steps fit, some fall back to the whole cache: both asserted).

  Weights x4, not x8: x8 (activations ~200) amplifies float32 rounding so much that the two
  summation orders differ by up to 1.5e-4 of the logits' scale depending on the CPU; x4 keeps
  them ~1e-6 apart, so the tolerance relative to the logits' scale holds on any CPU. Without a
  bias ~1/4 of the bytes close a group (the boundary logits are >= 1e-2 from 0)."""
  window = name == "lca_window"
  if window:
    name = "lca"
    monkeypatch.setattr(incremental, "MBP_WINDOW", 13)
  model = tiny_model(name, factor=4.0)
  cfg = model.cfg
  rng = np.random.default_rng(1)
  b, t = 2, 40
  ids = np.stack([random_ids(rng, t) for _ in range(b)])
  c = 3 if cfg.has_lca else 0  # threshold mode's copies computed inside extend
  st = jax.jit(lambda: incremental.init_state(cfg, model.params, b, 64, True, c))()
  ext = jax.jit(lambda st, x, k: incremental.extend(cfg, model.params, st, x, k, True, c))
  cop = jax.jit(lambda st: incremental.mbp_copies(cfg, model.params, st, 3))
  pos = np.zeros(b, int)
  chunks = [[5, 3], [1, 4], [3, 1], [9, 2], [2, 9], [4, 4], [1, 7]]
  # by causality the full forward over the whole rows gives every prefix's logits
  ref = model.forward(ids)
  saw_multi_close = False
  fits_seen = set()
  for step, ks in enumerate(chunks):
    x = np.zeros((b, 9), np.int32)  # one shape for every chunk: one compilation
    for r in range(b):
      x[r, : ks[r]] = ids[r, pos[r] : pos[r] + ks[r]]
    old_closed = np.asarray(st.n_closed)
    st, out = ext(st, jnp.asarray(x), jnp.asarray(ks, jnp.int32))
    new_pos = pos + ks
    for r in range(b):
      sl, rows = slice(0, ks[r]), slice(pos[r], new_pos[r])
      assert_close_rel(out["nt_logits"][r, sl], ref["ntp_logits"][r, rows])
      if cfg.has_lca:
        assert_close_rel(out["mbp_logits"][r, sl], ref["mbp_logits"][r, rows])
      if cfg.n_mlp_mbp:
        assert_close_rel(out["mlp_logits"][r, :, sl], ref["mlp_mbp_logits"][r, :, rows])
      if cfg.hierarchical:
        np.testing.assert_array_equal(
          np.asarray(st.b[r, : new_pos[r]]), ref["boundaries"][r, : new_pos[r]]
        )
        saw_multi_close |= int(st.n_closed[r]) - int(old_closed[r]) >= 2
    if window:  # did every row's keys (group before the first new byte on) fit 13 slots?
      g = np.cumsum(ref["boundaries"], axis=1) - ref["boundaries"]
      first = [np.argmax(g[r] >= g[r, pos[r]] - 1) for r in range(b)]
      fits_seen.add(all(pos[r] + x.shape[1] + c - first[r] <= 13 for r in range(b)))
    pos = new_pos
    if cfg.has_lca and step == 4:  # appended copies: against a forward that ends at t
      copies = cop(st)
      for r in range(b):
        _, ref_copies = full_reference(model, jnp.asarray(ids[r : r + 1, : pos[r]]), 3)
        assert_close_rel(copies[r], ref_copies[0])
        assert_close_rel(st.last_copies[r], ref_copies[0])
  if cfg.hierarchical:
    assert saw_multi_close
  if window:
    assert fits_seen == {True, False}


@pytest.mark.parametrize("name", ["lca", "spacebyte"])
def test_a_long_block_runs_the_lm_over_its_groups_only(name):
  """A large block (a prefill) runs the latent LM over the first c of its K slots, c the
  smallest of ``lm_widths`` holding every row's new groups: ragged rows whose close counts
  pick each width give the full forward's logits and boundaries, and the caches it leaves
  decode the next bytes like the full forward."""
  rng = np.random.default_rng(4)
  b, k, t = 2, 96, 104
  widths = incremental.lm_widths(k)
  short = incremental.LM_WIDTHS_FROM - 1
  assert widths == (24, 48, k) and incremental.lm_widths(short) == (short,)
  assert incremental.lm_widths(k, "gpu") == (k,)  # one LM to compile on an accelerator
  ids = np.stack([random_ids(rng, t) for _ in range(b)])
  if name == "spacebyte":  # closes follow spaces: few in row 0, one every other byte in row 1
    ids[0, 40:48] = vocab.encode(" ")[0]
    ids[1, 1:k:2] = vocab.encode(" ")[0]
  biases = (0.0, 0.1, 6.0) if name == "lca" else (0.0,)  # n_new 23, 42, 96 in one row
  picked = set()
  cfg = tiny_model(name).cfg
  ext = jax.jit(lambda p, st, x, ks: incremental.extend(cfg, p, st, x, ks, True))
  ks = jnp.asarray([k, k - 30], jnp.int32)  # ragged: row 1 feeds 66 bytes
  x = jnp.asarray(np.where(np.arange(k)[None] < np.asarray(ks)[:, None], ids[:, :k], 0))
  for bias in biases:
    model = tiny_model(name, factor=4.0, bp_bias=bias)
    ref = model.forward(ids)
    st = incremental.init_state(cfg, model.params, b, 128, True)
    st, out = ext(model.params, st, x, ks)
    n_new = int(np.max(np.asarray(st.n_closed)))
    picked.add(0 if n_new == 0 else next(c for c in widths if c >= n_new))
    for r in range(b):
      n = int(ks[r])
      assert_close_rel(out["nt_logits"][r, :n], ref["ntp_logits"][r, :n])
      if cfg.has_lca:
        assert_close_rel(out["mbp_logits"][r, :n], ref["mbp_logits"][r, :n])
      np.testing.assert_array_equal(np.asarray(st.b[r, :n]), ref["boundaries"][r, :n])
    # the next bytes read the LM cache the long block wrote
    nxt = np.stack([ids[r, int(ks[r]) : int(ks[r]) + 8] for r in range(b)])
    st, out = ext(model.params, st, jnp.asarray(nxt), jnp.asarray([8, 8], jnp.int32))
    for r in range(b):
      rows = slice(int(ks[r]), int(ks[r]) + 8)
      assert_close_rel(out["nt_logits"][r], ref["ntp_logits"][r, rows])
      if cfg.has_lca:
        assert_close_rel(out["mbp_logits"][r], ref["mbp_logits"][r, rows])
  assert picked == (set(widths) if name == "lca" else {48}), picked


def test_steps_read_only_the_lm_cache_slots_that_hold_groups():
  """A step over a long LM cache (S >= ``LM_READS_FROM`` slots) reads only its first S/4 or
  S/2 slots when they hold every row's earlier groups (``lm_reads``): ragged rows whose group
  counts pick each width give the full forward's logits and boundaries, block after block."""
  rng = np.random.default_rng(7)
  length, t, b = 300, 260, 2
  model = tiny_model("lca", factor=4.0, bp_bias=6.0)  # nearly every byte closes a group
  cfg, params = model.cfg, model.params
  reads = incremental.lm_reads(cfg, b, length + 1)
  assert reads == (80, 152, None)
  assert incremental.lm_reads(cfg, b, incremental.LM_READS_FROM - 1) == (None,)
  # a 60M-shaped LM (d 512, 8 heads): its 385-slot cache weighs in a step at batch 32 only
  big = ModelConfig(d_model=512, d_inner=2048, n_heads=8, n_kv_heads=8)
  assert (
    incremental.lm_reads(big, 1, 385) == (None,) and len(incremental.lm_reads(big, 32, 385)) == 3
  )
  ids = np.stack([random_ids(rng, t) for _ in range(b)])
  ref = model.forward(ids)
  ext = jax.jit(lambda st, x, ks: incremental.extend(cfg, params, st, x, ks, True))
  st = incremental.prefill(
    cfg, params, jnp.asarray(ids[:, :40]), jnp.asarray([40, 40]), length, True
  )
  done = np.array([40, 40])
  picked = set()
  while done.min() < t:
    ks = np.minimum([8, 5], t - done)  # row 1 advances slower: its groups lag row 0's
    x = np.zeros((b, 8), np.int32)
    for r in range(b):
      x[r, : ks[r]] = ids[r, done[r] : done[r] + ks[r]]
    first = int(np.max(np.asarray(st.n_closed))) + 1
    picked.add(next((w for w in reads[:-1] if w >= first), None))
    st, out = ext(st, jnp.asarray(x), jnp.asarray(ks, jnp.int32))
    for r in range(b):
      rows = slice(done[r], done[r] + ks[r])
      assert_close_rel(out["nt_logits"][r, : ks[r]], ref["ntp_logits"][r, rows])
      assert_close_rel(out["mbp_logits"][r, : ks[r]], ref["mbp_logits"][r, rows])
      np.testing.assert_array_equal(np.asarray(st.b[r, rows]), ref["boundaries"][r, rows])
    done = done + ks
  assert picked == set(reads), picked


@pytest.mark.parametrize("name", ["lca", "mlp", "spacebyte", "flat"])
def test_a_fresh_prefill_equals_one_over_the_whole_caches(name):
  """``prefill`` feeds the prompts as a ``fresh`` block (attention reads none of the empty
  caches' slots, the LM's null slot only): ragged prompts leave the state an ``extend`` over
  the whole (masked) caches leaves, its last logits are the full forward's, and the next
  bytes decode the same from both."""
  model = tiny_model(name, factor=4.0, bp_bias=1.0)
  cfg, params = model.cfg, model.params
  rng = np.random.default_rng(5)
  b, k, cap = 2, 24, 48
  ids = np.stack([random_ids(rng, k + 6) for _ in range(b)])
  plen = np.array([k, k - 7], np.int32)
  x = jnp.asarray(np.where(np.arange(k)[None] < plen[:, None], ids[:, :k], 0))
  c = 2 if cfg.has_lca else 0
  fresh = jax.jit(lambda x, p: incremental.prefill(cfg, params, x, p, cap, True, c))(x, plen)

  def whole(x, p):
    st = incremental.init_state(cfg, params, b, cap, True, c)
    return incremental.extend(cfg, params, st, x, p, True, c, last_only=True)[0]

  ref_st = jax.jit(whole)(x, plen)
  ref = model.forward(ids)
  for f in ("length", "n_closed", "b", "g"):
    np.testing.assert_array_equal(np.asarray(getattr(fresh, f)), np.asarray(getattr(ref_st, f)))
  for f in ("last_nt", "last_mbp", "last_mlp", "last_copies", "z", "open_sum"):
    assert_close_rel(getattr(fresh, f), getattr(ref_st, f), err_msg=f)
  for r in range(b):
    assert_close_rel(fresh.last_nt[r], ref["ntp_logits"][r, plen[r] - 1])
  ext = jax.jit(lambda st, x, n: incremental.extend(cfg, params, st, x, n, True, c))
  nxt = jnp.asarray(np.stack([ids[r, plen[r] : plen[r] + 6] for r in range(b)]))
  six = jnp.full((b,), 6, jnp.int32)
  (_, got), (_, want) = ext(fresh, nxt, six), ext(ref_st, nxt, six)
  for key in want:
    assert_close_rel(got[key], want[key], err_msg=key)
  for r in range(b):
    assert_close_rel(got["nt_logits"][r], ref["ntp_logits"][r, plen[r] : plen[r] + 6])


def test_rollback_equals_shorter_extend():
  model = tiny_model("lca", bp_bias=2.0)
  cfg = model.cfg
  rng = np.random.default_rng(2)
  ids = random_ids(rng, 30)[None]
  ext = jax.jit(lambda st, x, k: incremental.extend(cfg, model.params, st, x, k, True))
  st0 = jax.jit(lambda: incremental.init_state(cfg, model.params, 1, 48, True))()
  pad = lambda a: jnp.asarray(np.pad(a, ((0, 0), (0, 20 - a.shape[1]))))
  st0, _ = ext(st0, pad(ids[:, :20]), jnp.array([20]))
  long, out = ext(st0, pad(ids[:, 20:26]), jnp.array([6]))
  rolled = jax.jit(incremental.rollback)(long, st0, out, jnp.array([3]))
  short, _ = ext(st0, pad(ids[:, 20:23]), jnp.array([3]))
  for f in ("length", "n_closed", "open_cnt", "open_sum", "last_nt", "last_mbp"):
    assert_close_rel(getattr(rolled, f), getattr(short, f), err_msg=f)
  # and decoding continues identically from both
  nxt = pad(ids[:, 23:27])
  _, oa = ext(rolled, nxt, jnp.array([4]))
  _, ob = ext(short, nxt, jnp.array([4]))
  assert_close_rel(oa["mbp_logits"], ob["mbp_logits"])
  assert_close_rel(oa["nt_logits"], ob["nt_logits"])


def _dots(fn, *args):
  return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


def test_fused_projections_equal_separate_dots():
  """A block over a KV cache with the fused decode kernels (``layers.fuse_decode_params``: one
  q/k/v dot, one gate/up dot) gives the separate dots' output and cache entries, with 3 dots
  fewer; without a cache (training) the fused kernels are ignored."""
  rng = np.random.default_rng(11)
  b, t, s, d = 2, 3, 10, 32
  blk = layers.Block(n_heads=4, n_kv_heads=2, d_inner=48, rope_base=10000.0)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  x, cache = f(b, t, d), (f(b, 2, s, 8), f(b, 2, 8, s))
  pos = jnp.asarray([[4, 5, 6], [0, 1, 2]], jnp.int32)
  kw = dict(mask=masks.cache_causal_mask(pos, s), cache=cache, write_B=pos[:, 0])
  params = blk.init(jax.random.PRNGKey(0), x, pos, **kw)["params"]
  params = jax.tree.map(lambda w: w + f(*w.shape), nn.unbox(params))  # no zero or unit weights
  fused = layers.fuse_decode_params(params)
  assert set(fused["attn"]) - set(params["attn"]) == {layers.QKV_KERNEL}
  assert set(fused["mlp"]) - set(params["mlp"]) == {layers.GATE_UP_KERNEL}
  step = lambda p: blk.apply({"params": p}, x, pos, **kw)
  (out, kv), (ref, ref_kv) = step(fused), step(params)
  assert_close_rel(out, ref, 1e-5)
  for a, r in zip(kv, ref_kv):
    assert_close_rel(a, r, 1e-5)
  assert _dots(step, fused) == _dots(step, params) - 3
  train = lambda p: blk.apply({"params": p}, x, pos, kw["mask"][..., :t])[0]
  assert _dots(train, fused) == _dots(train, params)
  assert_close_rel(train(fused), train(params), 0.0)


def test_extend_with_fused_params_equals_separate_dots():
  """Every stack of the incremental forward (encoder, latent LM, decoder, LCA-MBP head with
  appended copies) gives the same logits and caches with the fused decode kernels."""
  model = tiny_model("lca", factor=4.0, bp_bias=2.0)
  cfg = model.cfg
  ids = np.stack([random_ids(np.random.default_rng(12), 24) for _ in range(2)])
  fused = layers.fuse_decode_params(model.params)

  @jax.jit
  def run(p):
    st = incremental.init_state(cfg, p, 2, 32, True, 3)
    st, _ = incremental.extend(cfg, p, st, jnp.asarray(ids[:, :16]), jnp.array([16, 11]), True, 3)
    return incremental.extend(cfg, p, st, jnp.asarray(ids[:, 16:]), jnp.array([5, 8]), True, 3)

  (st, out), (ref_st, ref_out) = run(fused), run(model.params)
  assert int(jnp.sum(ref_st.n_closed)) > 0  # the latent LM ran
  for key in ("nt_logits", "mbp_logits"):
    assert_close_rel(out[key], ref_out[key], 1e-5, err_msg=key)
  for f in ("last_nt", "last_mbp", "last_copies", "z", "enc", "lm", "dec", "mbp"):
    for a, r in zip(jax.tree.leaves(getattr(st, f)), jax.tree.leaves(getattr(ref_st, f))):
      assert_close_rel(a, r, 1e-5, err_msg=f)


def _keys(tree) -> set:
  return {
    getattr(k, "key", None)
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    for k in path
  }


def test_out_in_kernels_decode_like_in_out_ones(monkeypatch):
  """Decode weights stored [out, in] (``layers.transpose_kernels``, the GPU layout) give the
  [in, out] layout's logits and caches in every stack, and ``generate`` the same bytes (the
  engine keeps one executable per layout); ``decode_weights`` leaves its own result as it is."""
  model = tiny_model("lca", factor=4.0, bp_bias=2.0)
  cfg = model.cfg
  ids = np.stack([random_ids(np.random.default_rng(13), 24) for _ in range(2)])
  plain = layers.decode_weights(model.params, cfg.dtype, True, transpose=False)
  oi = layers.decode_weights(model.params, cfg.dtype, True, transpose=True)
  names = _keys(oi)
  assert "kernel" not in names and {"kernel_oi", "qkv_kernel", "gate_up_kernel"} <= names
  again = layers.decode_weights(oi, cfg.dtype, True, transpose=True)
  assert jax.tree_util.tree_structure(again) == jax.tree_util.tree_structure(oi)

  @jax.jit
  def run(p):
    st = incremental.init_state(cfg, p, 2, 32, True, 3)
    st, _ = incremental.extend(cfg, p, st, jnp.asarray(ids[:, :16]), jnp.array([16, 11]), True, 3)
    return incremental.extend(cfg, p, st, jnp.asarray(ids[:, 16:]), jnp.array([5, 8]), True, 3)

  (st, out), (ref_st, ref_out) = run(oi), run(plain)
  assert int(jnp.sum(ref_st.n_closed)) > 0  # the latent LM ran
  for key in ("nt_logits", "mbp_logits"):
    assert_close_rel(out[key], ref_out[key], 1e-5, err_msg=key)
  for f in ("z", "enc", "lm", "dec", "mbp"):
    for a, r in zip(jax.tree.leaves(getattr(st, f)), jax.tree.leaves(getattr(ref_st, f))):
      assert_close_rel(a, r, 1e-5, err_msg=f)
  kw = dict(mode="threshold", n=3, tau=0.3, max_bytes=24, ignore_eos=True)
  ref = model.generate([5, 6, 7, 8, 9], **kw).ids[0].tolist()
  monkeypatch.setattr(backend, "row_major_kernels", lambda: True)
  fresh = Model(cfg, model.params)
  assert "kernel" not in _keys(fresh.decode_params())
  assert fresh.generate([5, 6, 7, 8, 9], **kw).ids[0].tolist() == ref


@pytest.mark.parametrize("mode", ["ntp", "threshold", "verify"])
def test_a_remat_model_decodes_like_the_plain_one(mode):
  """``model.remat`` (a training memory setting, kept in a checkpoint's config) changes nothing
  in decoding: the same bytes (it used to fail tracing: remat blocks wrote their caches inside
  the latent LM's lax.cond)."""
  model = tiny_model("lca", factor=4.0, bp_bias=2.0)
  remat = Model(dataclasses.replace(model.cfg, remat=True), model.params)
  kw = dict(mode=mode, n=3, tau=0.3, max_bytes=24, temperature=0.0, ignore_eos=True)
  prompt = [5, 6, 7, 8, 9]
  assert (
    remat.generate(prompt, **kw).ids[0].tolist() == model.generate(prompt, **kw).ids[0].tolist()
  )


def test_model_keeps_its_fused_decode_params_until_params_change():
  """``Model.decode_params`` builds the fused tree once (a generate call copies no weight) and
  builds it anew when ``params`` is replaced; decoding with it equals the separate dots."""
  model = tiny_model("lca", factor=4.0, bp_bias=2.0)
  first = model.decode_params()
  assert model.decode_params() is first
  for name, scope in (("q_proj", layers.QKV_KERNEL), ("gate_proj", layers.GATE_UP_KERNEL)):
    found = [
      path
      for path, _ in jax.tree_util.tree_flatten_with_path(first)[0]
      if any(getattr(k, "key", None) == scope for k in path)
    ]
    assert found, (name, scope)
  again = layers.fuse_decode_params(first)  # idempotent on a fused tree
  assert jax.tree.structure(again) == jax.tree.structure(first)
  kw = dict(mode="ntp", max_bytes=12, temperature=0.0, ignore_eos=True)
  ids = lambda m: engine.generate(m, [5, 6, 7, 8], **kw).ids[0].tolist()
  fused = ids(model)
  model.params = jax.tree.map(lambda w: w * 1.0, model.params)  # a new object, same values
  assert model.decode_params() is not first
  assert ids(model) == fused
  # a model object without decode_params: fused inside the call, same bytes
  assert ids(types.SimpleNamespace(cfg=model.cfg, params=model.params)) == fused


# ---- modes ---------------------------------------------------------------------------------
def greedy_reference(model, prompt, steps, width=48):
  """Greedy next-byte decoding by rerunning the full forward every byte. The sequence sits in a
  fixed-size zero-padded buffer (one compilation): by causality padding after the last byte
  changes nothing before it."""
  buf = np.zeros((1, width), np.int32)
  buf[0, : len(prompt)] = prompt
  for t in range(len(prompt), len(prompt) + steps):
    buf[0, t] = int(np.argmax(model.forward(buf)["ntp_logits"][0, t - 1]))
  return buf[0, len(prompt) : len(prompt) + steps]


def test_ragged_batch_threshold_and_verify():
  model = tiny_model("lca", bp_bias=2.0)
  rng = np.random.default_rng(3)
  prompts = [random_ids(rng, t) for t in (5, 17, 11)]
  for mode in ("threshold", "verify"):
    batch = model.generate(prompts, mode=mode, tau=0.3, n=4, max_bytes=12, ignore_eos=True)
    for i, p in enumerate(prompts):
      alone = model.generate([p], mode=mode, tau=0.3, n=4, max_bytes=12, ignore_eos=True)
      np.testing.assert_array_equal(batch.ids[i], alone.ids[0])
      assert batch.accepted_per_step[i] == alone.accepted_per_step[0]
    if mode == "verify":
      for i, p in enumerate(prompts):
        np.testing.assert_array_equal(batch.ids[i], greedy_reference(model, p, 12))
  assert engine.compiled_count() > 0


def test_mlp_mbp_verify_equals_greedy_and_no_retrace():
  model = tiny_model("mlp")
  rng = np.random.default_rng(4)
  p = random_ids(rng, 9)
  r = model.generate(p, mode="verify", n=3, max_bytes=10, ignore_eos=True)
  np.testing.assert_array_equal(r.ids[0], greedy_reference(model, p, 10))
  before = engine.compiled_count()
  r2 = model.generate(
    random_ids(rng, 12), mode="verify", n=3, max_bytes=10, ignore_eos=True, seed=5
  )
  assert engine.compiled_count() == before  # same shapes: no new compilation
  assert len(r2.ids[0]) == 10


def test_drafter_output_equals_verifier():
  drafter = tiny_model("lca", seed=1, bp_bias=2.0)
  verifier = tiny_model("fxt", seed=2, bp_bias=2.0)
  rng = np.random.default_rng(5)
  prompts = [random_ids(rng, 7), random_ids(rng, 13)]
  r = verifier.generate(
    prompts, mode="drafter", drafter=drafter, n=3, max_bytes=10, ignore_eos=True
  )
  for i, p in enumerate(prompts):
    np.testing.assert_array_equal(r.ids[i], greedy_reference(verifier, p, 10))


def test_eos_stops_and_budget():
  model = tiny_model("lca")
  params = jax.tree_util.tree_map(lambda x: x, model.params)
  params["head"]["kernel"] = params["head"]["kernel"].at[:, vocab.EOS_ID].add(50.0)
  eos_model = Model(model.cfg, params)
  r = eos_model.generate(["abc", "hello"], mode="threshold", n=3, max_bytes=8)
  assert all(x.tolist() == [vocab.EOS_ID] for x in r.ids)
  r = model.generate("abc", mode="ntp", max_bytes=5, ignore_eos=True)
  assert len(r.ids[0]) == 5


@pytest.mark.parametrize("mode,temperature", [("ntp", 0.0), ("threshold", 0.0), ("verify", 0.8)])
def test_budgets_that_round_alike_share_one_executable(mode, temperature):
  """``max_bytes`` is an argument of the executable (``budget_pad_to`` rounds the room it is
  built for): one compile serves budgets 3, 11 and 16 of a 16-byte room, each call stops at
  its own budget, and its bytes are those of a call compiled for exactly that budget (sampling
  too: a step's PRNG keys do not depend on the room)."""
  model = tiny_model("lca", bp_bias=2.0)
  rng = np.random.default_rng(9)
  prompts = [random_ids(rng, 6), random_ids(rng, 14)]
  kw = dict(mode=mode, n=3, tau=0.5, temperature=temperature, seed=3, ignore_eos=True)
  model.generate(prompts, max_bytes=16, budget_pad_to=16, **kw)
  before = engine.compiled_count()
  shared = {m: model.generate(prompts, max_bytes=m, budget_pad_to=16, **kw) for m in (3, 11, 16)}
  assert engine.compiled_count() == before  # one room, one executable
  for m, r in shared.items():
    exact = model.generate(prompts, max_bytes=m, **kw)  # its own program (room m)
    assert r.budget == m and r.stop_reasons == ["max_bytes"] * 2
    for got, want in zip(r.ids, exact.ids):
      np.testing.assert_array_equal(got, want)
      assert len(got) == m
  with pytest.raises(engine.DecodeError, match="budget_pad_to must be >= 1"):
    model.generate(prompts, max_bytes=4, budget_pad_to=0, **kw)


def _weight_casts(model, prompts, **kw):
  """float32 -> bfloat16 converts of a weight's shape in the (unoptimized) decode program."""
  req = engine._request(model, prompts, **kw)  # pylint: disable=protected-access
  run = lambda *a: engine._run(req.cfgs, req.plan, req.length, None, *a)  # pylint: disable=protected-access
  text = jax.jit(run).lower(*req.args).as_text()
  shapes = {
    "x".join(map(str, x.shape)) for x in jax.tree_util.tree_leaves(model.params) if x.ndim == 2
  }
  casts = re.findall(
    r"stablehlo\.convert %\S+ : \(tensor<(\d+x\d+)xf32>\) -> tensor<\1xbf16>", text
  )
  return [c for c in casts if c in shapes]


@pytest.mark.parametrize("name", ["lca", "mlp"])
def test_a_bfloat16_model_decodes_from_bfloat16_weights(name, monkeypatch):
  """The weights every use casts to the compute dtype reach the decode program in it (no
  float32 weight is converted inside; a step reads 2 bytes per weight), and the bytes,
  boundaries and acceptance are those of the float32 weights cast at each use."""
  base = tiny_model(name, bp_bias=2.0)
  model = Model(dataclasses.replace(base.cfg, dtype="bfloat16"), base.params)
  rng = np.random.default_rng(11)
  prompts = [random_ids(rng, 9), random_ids(rng, 15)]
  runs = [("ntp", {}), ("threshold", dict(tau=0.3)), ("verify", dict(temperature=0.7, seed=2))]
  kept = {}
  for mode, extra in runs:
    kw = dict(mode=mode, n=3, max_bytes=10, ignore_eos=True, **extra)
    assert _weight_casts(model, prompts, **kw) == [], mode
    kept[mode] = model.generate(prompts, **kw)
  monkeypatch.setattr(layers, "compute_dtype_weights", lambda params, dtype: params)
  plain = Model(model.cfg, base.params)  # its decode tree built without the cast
  for mode, extra in runs:
    kw = dict(mode=mode, n=3, max_bytes=10, ignore_eos=True, **extra)
    assert _weight_casts(plain, prompts, **kw), mode  # float32 weights converted inside
    want = plain.generate(prompts, **kw)
    got = kept[mode]
    for g, w in zip(got.ids + got.boundaries, want.ids + want.boundaries):
      np.testing.assert_array_equal(g, w)
    assert got.accepted_per_step == want.accepted_per_step, mode


def test_speculative_sampling_matches_next_byte_distribution():
  """verify mode with sampling: the (x1, x2) distribution is the NT head's (chi-square)."""
  model = tiny_model("lca", factor=3.0)
  prompt = np.array(vocab.encode("the "), np.int32)
  rows = 1024
  r = model.generate(
    [prompt] * rows,
    mode="verify",
    n=3,
    max_bytes=2,
    temperature=1.0,
    top_k=3,
    seed=11,
    ignore_eos=True,
  )
  pairs = np.array([x[:2] for x in r.ids])
  sp = sampling.SamplingParams(jnp.float32(1.0), jnp.int32(3), jnp.float32(1.0))
  p1 = np.exp(np.asarray(sampling.log_probs(model.forward(prompt)["ntp_logits"][-1], sp)))
  expected, observed = [], []
  for a in np.nonzero(p1 > 0)[0]:
    p2 = np.exp(
      np.asarray(
        sampling.log_probs(
          model.forward(np.append(prompt, a).astype(np.int32))["ntp_logits"][-1], sp
        )
      )
    )
    for b in np.nonzero(p2 > 0)[0]:
      expected.append(rows * p1[a] * p2[b])
      observed.append(np.sum((pairs[:, 0] == a) & (pairs[:, 1] == b)))
  expected, observed = np.array(expected), np.array(observed)
  assert observed.sum() == rows  # nothing outside the support
  chi2 = np.sum((observed - expected) ** 2 / expected)
  from scipy import stats  # pylint: disable=g-import-not-at-top

  assert stats.chi2.sf(chi2, len(expected) - 1) > 1e-3, (observed, expected)
  assert r.acceptance_rate > 0


class _AlwaysPair(policies.Policy):
  """A toy mode: the next byte and the first MBP candidate, both always accepted."""

  name = "toy_pair"
  target_mbp = True

  def propose(self, ctx, loop, k_draft, k_acc):
    d, _, _, _ = policies.draft(
      ctx.cfg, ctx.params, loop.st, ctx.plan, k_draft, ctx.sp, loop.pending
    )
    two = jnp.full_like(loop.pending, 2)
    return policies.Proposal(d, two, jnp.where(loop.done, 0, 1), jnp.full_like(two, -1))

  def commit(self, ctx, loop, prop, a_B, done_B):
    st, _ = incremental.extend(ctx.cfg, ctx.params, loop.st, prop.d_BK, a_B, True, last_only=True)
    return loop.replace(st=st)


def test_a_registered_policy_runs_in_the_unchanged_loop():
  """A new mode is one registered class: generate accepts it, the loop (eos / budget cut,
  counters) is the engine's; it decodes what threshold at tau 0 decodes."""
  model = tiny_model("lca")
  with pytest.raises(engine.DecodeError, match="unknown mode 'toy_pair'"):
    model.generate("ab", mode="toy_pair", n=2)
  policies.register(_AlwaysPair())
  try:
    r = model.generate(["ab", "xyz"], mode="toy_pair", n=2, max_bytes=9, ignore_eos=True)
    ref = model.generate(
      ["ab", "xyz"], mode="threshold", tau=0.0, n=2, max_bytes=9, ignore_eos=True
    )
    for got, want in zip(r.ids, ref.ids):
      np.testing.assert_array_equal(got, want)
    assert r.accepted_per_step == [[2, 2, 2, 2, 1]] * 2
    assert r.acceptance_rate == ref.acceptance_rate == 0.8  # the budget cuts the last pair
  finally:
    policies.POLICIES.pop("toy_pair")


@pytest.mark.slow
def test_sample_json_records_hold_each_prompts_own_figures(tmp_path):
  """lca-sample --json: a record's acceptance_rate is its own prompt's (a prompt that accepts
  no candidate has 0 beside one that does), bytes_per_s its bytes / the batch's wall-clock;
  the batch's figures are named batch_*."""
  from lca_jax.interop import upstream  # pylint: disable=g-import-not-at-top

  cfg = tiny_config("lca_mbp", n_mbp=1, max_seq_len=128)
  ckpt = str(tmp_path / "ckpt")
  upstream.write_dir(ckpt, random_params(cfg), cfg)
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("The quick brown fox\naaaa\n0123456789\nhello world\n")
  p = run_cli_process(
    "lca_jax.cli.sample",
    *("--checkpoint", ckpt, "--prompt-file", str(prompts), "--mode", "threshold"),
    *("--tau", "0.05", "--n", "3", "--max-bytes", "24", "--ignore-eos", "--json"),
  )
  assert p.returncode == 0, p.stderr
  recs = [json.loads(line) for line in p.stdout.splitlines()]
  assert len(recs) == 4
  for r in recs:
    steps = r["accepted_per_step"]
    assert r["acceptance_rate"] == pytest.approx((sum(steps) - len(steps)) / (2 * len(steps)))
    assert r["bytes_per_s"] == pytest.approx(len(r["ids"]) / r["batch_elapsed_s"])
  rates = [r["acceptance_rate"] for r in recs]
  assert 0.0 in rates and max(rates) > 0  # the rows differ: a batch-wide figure cannot be right
  assert recs[0]["batch_acceptance_rate"] == pytest.approx(
    sum(sum(r["accepted_per_step"]) - len(r["accepted_per_step"]) for r in recs)
    / sum(2 * len(r["accepted_per_step"]) for r in recs)
  )
  assert sum(r["bytes_per_s"] for r in recs) == pytest.approx(recs[0]["batch_bytes_per_s"])


def test_clear_errors():
  lca, fxt = tiny_model("lca"), tiny_model("fxt")
  with pytest.raises(engine.DecodeError, match="n must be >= 2"):
    lca.generate("ab", mode="threshold", n=1)
  with pytest.raises(engine.DecodeError, match="multi-byte head"):
    fxt.generate("ab", mode="threshold", n=3)
  with pytest.raises(engine.DecodeError, match="longer than the model context"):
    lca.generate("x" * 600, mode="ntp")
  with pytest.raises(engine.DecodeError, match="unknown mode"):
    lca.generate("ab", mode="beam")
  with pytest.raises(engine.DecodeError, match="drafter"):
    fxt.generate("ab", mode="drafter")


def test_executable_cache_is_bounded_lru():
  """The engine keeps at most ``capacity`` executables (each holds ~900 memory mappings of JIT
  code, out of vm.max_map_count); the least recently used goes first, and ``built`` counts
  every compilation, so compiled_count() still tells a caller that a call compiled."""
  cache = executables.ExecutableCache(capacity=2)
  built = []

  def get(sig):
    return cache.get(sig, lambda: built.append(sig) or f"exe-{sig}")

  assert get("a") == "exe-a" and get("b") == "exe-b" and get("a") == "exe-a"
  assert built == ["a", "b"] and len(cache) == 2 and cache.built == 2
  get("c")  # evicts b, the least recently used
  assert len(cache) == 2 and cache.built == 3
  get("a")
  get("b")  # compiled again
  assert built == ["a", "b", "c", "b"] and cache.built == 4 and len(cache) == 2
  cache.clear()
  assert len(cache) == 0 and cache.built == 4
