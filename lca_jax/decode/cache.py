"""Hierarchical KV caches and the one function that feeds bytes through them.

Every stack is causal in byte (or latent) order with values fixed once a byte is processed,
so each keeps a plain KV cache: the encoder and next-byte decoder over bytes, the LM module
over latent slots (extended only when groups close, several per call if needed), the LCA-MBP
head over bytes (its LCA mask is a subset of the causal one). ``extend`` feeds K new bytes per
row (ragged: ``k_B`` of them are real); positions past a row's real length may hold garbage,
which is always overwritten before any query can see it (every mask also requires key <= query).
Rollback (speculative modes) only resets per-row lengths and running sums.
"""

from __future__ import annotations

from typing import Tuple

import flax.struct
import jax
import jax.numpy as jnp

from lca_jax.model import boundaries as bnd
from lca_jax.model.config import ModelConfig
from lca_jax.model.hierarchical import ByteLM
from lca_jax.model.layers import write_kv, write_rows


@flax.struct.dataclass
class DecodeState:
  ids: jax.Array  # [B, L] committed bytes (prompt + accepted)
  length: jax.Array  # [B] number of committed bytes
  b: jax.Array  # [B, L] hard boundary of each byte
  g: jax.Array  # [B, L] group id of each byte
  enc: Tuple  # per-layer (k [B, KV, L, E], v [B, KV, E, L])
  dec: Tuple
  mbp: Tuple
  lm: Tuple  # per-layer (k [B, KV, S, E], v [B, KV, E, S])
  z: jax.Array  # [B, S, D] LM outputs per slot (slot 0 = null group)
  s: jax.Array  # [B, S, D] pooled inputs per slot
  n_closed: jax.Array  # [B] closed groups
  open_sum: jax.Array  # [B, D] float32 sum of h_e over the open group
  open_cnt: jax.Array  # [B] float32 bytes in the open group
  last_nt: jax.Array  # [B, V] next-byte logits at the last committed byte
  last_mbp: jax.Array  # [B, V] LCA-MBP logits at the last committed byte (or [B, 0])
  last_mlp: jax.Array  # [B, k, V] MLP-MBP logits at the last committed byte (or [B, 0, 0])
  last_copies: jax.Array  # [B, C, V] LCA-MBP logits at C copies after the last byte (or [B, 0, 0])


def _kv(cfg: ModelConfig, n_layers, b, length, dtype):
  """Per-layer zeros (k [B, KV, L, E], v [B, KV, E, L]): the layouts in which a decode step
  reads both without moving them (``layers.cached_attention``); with L = T new slots, the
  entries of a ``lax.cond`` branch that computes none."""
  k = (b, cfg.n_kv_heads, length, cfg.head_dim)
  v = (b, cfg.n_kv_heads, cfg.head_dim, length)
  return tuple((jnp.zeros(k, dtype), jnp.zeros(v, dtype)) for _ in range(n_layers))


def _apply(cfg, params, method, *args, **kw):
  return ByteLM(cfg).apply({"params": params}, *args, method=method, **kw)


def _stack(cfg, params, which, x, pos, mask, caches, write_B, window_B=None, defer=False):
  out, new = _apply(
    cfg, params, ByteLM.stack_step, which, x, pos, mask, list(caches), write_B, window_B, defer
  )
  return out, tuple(new)


def _write(caches, entries, write_B):
  """Store per-layer entries returned by a deferred ``_stack`` (after a ``lax.cond``)."""
  return tuple(write_kv(c, e, write_B) for c, e in zip(caches, entries))


def _take(x_BK, idx_B):
  """x[b, idx[b]] for a [B, K, ...] array."""
  return jnp.take_along_axis(x_BK, idx_B.reshape((-1, 1) + (1,) * (x_BK.ndim - 2)), axis=1)[:, 0]


def init_state(
  cfg: ModelConfig, params, batch: int, length: int, with_mbp: bool, n_copies: int = 0
) -> DecodeState:
  """Empty caches for ``length`` bytes; the LM module has already seen the null group.
  ``n_copies``: how many appended-copy candidates ``extend`` computes along (threshold mode)."""
  dt = jnp.dtype(cfg.dtype)
  d, v = cfg.d_model, cfg.n_tokens
  n_slots = length + 1
  z = s = jnp.zeros((batch, 0, d), dt)
  lm = mbp = dec = ()
  if cfg.hierarchical:
    lm = _kv(cfg, cfg.n_lm, batch, n_slots, dt)
    dec = _kv(cfg, cfg.n_dec, batch, length, dt)
    if with_mbp and cfg.has_lca:
      mbp = _kv(cfg, cfg.n_mbp, batch, length, dt)
    null = jnp.broadcast_to(params["null_group"].astype(dt), (batch, 1, d))
    zero = jnp.zeros((batch,), jnp.int32)
    z0, lm = _stack(
      cfg,
      params,
      "lm",
      null,
      jnp.zeros((batch, 1), jnp.int32),
      jnp.broadcast_to(jnp.arange(n_slots) == 0, (batch, 1, n_slots)),
      lm,
      zero,
    )
    z = write_rows(jnp.zeros((batch, n_slots, d), dt), z0, zero)
    s = write_rows(jnp.zeros((batch, n_slots, d), dt), null, zero)
  k_mlp = cfg.n_mlp_mbp if with_mbp else 0
  return DecodeState(
    ids=jnp.zeros((batch, length), jnp.int32),
    length=jnp.zeros((batch,), jnp.int32),
    b=jnp.zeros((batch, length), jnp.int32),
    g=jnp.zeros((batch, length), jnp.int32),
    enc=_kv(cfg, cfg.n_enc, batch, length, dt),
    dec=dec,
    mbp=mbp,
    lm=lm,
    z=z,
    s=s,
    n_closed=jnp.zeros((batch,), jnp.int32),
    open_sum=jnp.zeros((batch, d), jnp.float32),
    open_cnt=jnp.zeros((batch,), jnp.float32),
    last_nt=jnp.zeros((batch, v), jnp.float32),
    last_mbp=jnp.zeros((batch, v if (with_mbp and cfg.has_lca) else 0), jnp.float32),
    last_mlp=jnp.zeros((batch, k_mlp, v if k_mlp else 0), jnp.float32),
    last_copies=jnp.zeros((batch, n_copies, v if n_copies else 0), jnp.float32),
  )


def _group_sums(prev_close_BK, x_BKD, w_BK, carry_BD, carry_cnt_B):
  """Per-position sums over each byte's group within the block: segment s of the block starts
  after each close; segment 0 continues the open group (``carry``). Returns the group-total sum
  and count (of weights ``w``: 1 for real bytes) per position ([B, K, D], [B, K]) and the
  segment ids. O(K) segment sums."""
  b, k = prev_close_BK.shape
  seg = jnp.cumsum(prev_close_BK.astype(jnp.int32), axis=1)
  tot = jax.vmap(lambda x, s: jax.ops.segment_sum(x, s, num_segments=k))(x_BKD, seg)
  cnt = jax.vmap(lambda w, s: jax.ops.segment_sum(w, s, num_segments=k))(w_BK, seg)
  tot = tot.at[:, 0].add(carry_BD)
  cnt = cnt.at[:, 0].add(carry_cnt_B)
  return jnp.take_along_axis(tot, seg[..., None], 1), jnp.take_along_axis(cnt, seg, 1), seg


def _spacebyte_closes(cfg, state, new_ids_BK, valid_BK):
  """SpaceByte rule continued from the committed bytes (previous byte and open group length)."""
  prev_id = _take(state.ids, jnp.maximum(state.length - 1, 0))
  prev_sl = bnd._space_like(prev_id[:, None])[:, 0] & (state.length > 0)  # pylint: disable=protected-access
  sl = bnd._space_like(new_ids_BK)  # pylint: disable=protected-access

  def step(carry, inp):
    prev, glen = carry
    s_t, ok = inp
    close = ((s_t & ~prev) | (glen + 1 >= cfg.spacebyte_max_group)) & ok
    return (jnp.where(ok, s_t, prev), jnp.where(close, 0, jnp.where(ok, glen + 1, glen))), close

  init = (prev_sl, state.open_cnt.astype(jnp.int32))
  _, closes = jax.lax.scan(step, init, (sl.T, valid_BK.T))
  return closes.T


def extend(
  cfg: ModelConfig,
  params,
  state: DecodeState,
  new_ids_BK,
  k_B,
  with_mbp: bool,
  n_copies: int = 0,
  last_only: bool = False,
):
  """Feed K bytes per row (the first ``k_B`` real) through every stack. Returns the new state
  and per-position outputs: logits of each head and the running values needed for rollback.

  With ``n_copies`` (LCA-MBP), the same MBP pass also reads the head at that many copies
  appended after each row's new last byte (see ``mbp_copies``) into ``state.last_copies``.
  With ``last_only`` the heads run only where the state needs them (each row's last byte and
  the copies), not at every position: for callers that never roll back (prefill, ntp,
  threshold); the per-position logits are then absent from the outputs.
  """
  at_last = lambda x_BKD: _take(x_BKD, jnp.maximum(k_B - 1, 0))[:, None]
  b, k = new_ids_BK.shape
  length_cap = state.ids.shape[1]
  j = jnp.arange(k)[None, :]
  pos = state.length[:, None] + j
  valid = j < k_B[:, None]
  last = jnp.maximum(k_B - 1, 0)
  has_new = k_B > 0
  ids = write_rows(state.ids, new_ids_BK, state.length)
  causal = jnp.arange(length_cap)[None, None, :] <= pos[:, :, None]
  x = _apply(cfg, params, ByteLM.embed, new_ids_BK)
  h, enc = _stack(cfg, params, "encoder", x, pos, causal, state.enc, state.length)
  out = {}
  keep = lambda new, old: jnp.where(has_new.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
  if not cfg.hierarchical:
    if last_only:
      last_nt = _apply(cfg, params, ByteLM.logits, at_last(h))[:, 0]
    else:
      out["nt_logits"] = nt = _apply(cfg, params, ByteLM.logits, h)
      last_nt = _take(nt, last)
    return state.replace(
      ids=ids, length=state.length + k_B, enc=enc, last_nt=keep(last_nt, state.last_nt)
    ), out

  # boundaries and the running sums of the open group
  if cfg.boundaries == "spacebyte":
    closes = _spacebyte_closes(cfg, state, new_ids_BK, valid)
  else:
    closes = bnd.hard_boundaries(_apply(cfg, params, ByteLM.boundary_logits, h)) > 0
  closes = closes & valid
  prev_close = jnp.concatenate([jnp.zeros_like(closes[:, :1]), closes[:, :-1]], axis=1)
  hf = h.astype(jnp.float32) * valid[..., None]
  gsum, gcnt, seg = _group_sums(
    prev_close, hf, valid.astype(jnp.float32), state.open_sum, state.open_cnt
  )
  pooled = (gsum / (gcnt[..., None] + 1e-9)).astype(h.dtype)

  # new latent slots: closing bytes, compacted in order, appended after n_closed
  cum = jnp.cumsum(closes.astype(jnp.int32), axis=1)
  dest = jnp.where(closes, cum - 1, k)
  new_s = jnp.zeros_like(pooled).at[jnp.arange(b)[:, None], dest].set(pooled, mode="drop")
  n_slots = state.z.shape[1]
  slot_pos = state.n_closed[:, None] + 1 + j
  lm_mask = jnp.arange(n_slots)[None, None, :] <= slot_pos[:, :, None]
  # The LM module runs only when some row closed a group (Eff-FxT). Its cache is written after
  # the cond (zeros when it did not run: slots past n_closed are garbage until a group closes).
  z_new, lm_new = jax.lax.cond(
    jnp.any(closes),
    lambda: _stack(
      cfg, params, "lm", new_s, slot_pos, lm_mask, state.lm, state.n_closed + 1, defer=True
    ),
    lambda: (jnp.zeros_like(new_s), _kv(cfg, cfg.n_lm, b, k, new_s.dtype)),
  )
  lm = _write(state.lm, lm_new, state.n_closed + 1)
  z = write_rows(state.z, z_new, state.n_closed + 1)
  s = write_rows(state.s, new_s, state.n_closed + 1)

  u = state.n_closed[:, None] + cum  # closed groups through each new byte
  grp = u - closes.astype(jnp.int32)
  g = write_rows(state.g, grp, state.length)
  bb = write_rows(state.b, closes.astype(jnp.int32), state.length)
  z_up = jnp.take_along_axis(z, u[..., None], axis=1)
  h_nt, dec = _stack(cfg, params, "decoder", z_up + h, pos, causal, state.dec, state.length)
  out.update(h=hf, seg=seg, closes=closes, n_closed=u)
  if last_only:
    last_nt = _apply(cfg, params, ByteLM.logits, at_last(h_nt))[:, 0]
  else:
    out["nt_logits"] = nt = _apply(cfg, params, ByteLM.logits, h_nt)
    last_nt = _take(nt, last)
  new = dict(
    ids=ids,
    length=state.length + k_B,
    b=bb,
    g=g,
    enc=enc,
    dec=dec,
    lm=lm,
    z=z,
    s=s,
    n_closed=state.n_closed + cum[:, -1],
  )
  closed_last = _take(closes, last)
  new["open_sum"] = keep(jnp.where(closed_last[:, None], 0.0, _take(gsum, last)), state.open_sum)
  new["open_cnt"] = keep(jnp.where(closed_last, 0.0, _take(gcnt, last)), state.open_cnt)
  new["last_nt"] = keep(last_nt, state.last_nt)
  if with_mbp and cfg.has_lca:
    m = z_up + jnp.take_along_axis(s, u[..., None], axis=1)
    order = pos
    c = n_copies
    if c:  # copies of the last real byte ride along: slots length+K.., order length+k_B..
      u_last = state.n_closed + cum[:, -1]
      m = jnp.concatenate([m, jnp.repeat(_take(m, last)[:, None], c, axis=1)], axis=1)
      grp = jnp.concatenate([grp, jnp.repeat(u_last[:, None], c, axis=1)], axis=1)
      order = jnp.concatenate([pos, (state.length + k_B)[:, None] + jnp.arange(c)[None]], 1)
    key_g = write_rows(g, grp, state.length)
    h_m, mbp = _mbp_stack(
      cfg, params, state, m, grp, order, key_g, _key_order(state.length, k_B, k, c, length_cap)
    )
    if last_only:  # row: the last byte, then the copies
      mbp_logits = _apply(
        cfg, params, ByteLM.logits, jnp.concatenate([at_last(h_m[:, :k]), h_m[:, k:]], 1)
      )
      last_mbp, copies = mbp_logits[:, 0], mbp_logits[:, 1:]
    else:
      mbp_logits = _apply(cfg, params, ByteLM.logits, h_m)
      out["mbp_logits"] = mbp_logits[:, :k]
      last_mbp, copies = _take(mbp_logits, last), mbp_logits[:, k:]
    new.update(mbp=mbp, last_mbp=keep(last_mbp, state.last_mbp))
    if c:
      new["last_copies"] = keep(copies, state.last_copies)
  if with_mbp and cfg.n_mlp_mbp:
    src = at_last(h_nt) if last_only else h_nt
    mlp = jnp.stack(
      [
        _apply(cfg, params, ByteLM.logits, _apply(cfg, params, ByteLM.mlp_head, i, src))
        for i in range(cfg.n_mlp_mbp)
      ],
      axis=1,
    )  # [B, k, K (1 with last_only), V]
    if last_only:
      last_mlp = mlp[:, :, 0]
    else:
      out["mlp_logits"] = mlp
      last_mlp = jnp.take_along_axis(mlp, last[:, None, None, None], axis=2)[:, :, 0]
    new["last_mlp"] = keep(last_mlp, state.last_mlp)
  return state.replace(**new), out


def _key_order(length_B, k_B, k: int, c: int, length_cap: int):
  """Order index of every cache slot for a block of K bytes (k_B real) + C copies written at
  ``length``: real slots keep their index, the K - k_B unused slots of the block are excluded
  (order past every query), copy j (slot length+K+j) comes right after the last real byte."""
  s = jnp.arange(length_cap)[None, :]
  rel = s - length_B[:, None]
  order = jnp.where((rel >= k_B[:, None]) & (rel < k), jnp.iinfo(jnp.int32).max, s)
  return jnp.where((rel >= k) & (rel < k + c), length_B[:, None] + k_B[:, None] + rel - k, order)


def _lca_cache_mask(g_BL, grp_BQ, ord_BQ, ord_BL):
  """LCA mask of Q queries (groups grp, order ord) against the byte cache (groups g, order)."""
  gi, gj = grp_BQ[:, :, None], g_BL[:, None, :]
  i, j = ord_BQ[:, :, None], ord_BL[:, None, :]
  return (j <= i) & ((j == i) | (gj == gi - 1) | ((gj == gi) & (j < i)))


def mbp_copies(cfg: ModelConfig, params, state: DecodeState, n_copies: int):
  """LCA-MBP logits at ``n_copies`` copies appended after the last byte t (boundary 0, input
  m_t, RoPE positions t+1..): candidates for x_{t+3}, ... The cache update is discarded."""
  b = state.length.shape[0]
  length_cap = state.ids.shape[1]
  u = state.n_closed  # the copies sit in group u (after t if b_t = 1, else t's group)
  m = (_take(state.z, u) + _take(state.s, u))[:, None, :]
  m = jnp.broadcast_to(m, (b, n_copies, m.shape[-1]))
  pos = state.length[:, None] + jnp.arange(n_copies)[None, :]
  grp = jnp.broadcast_to(u[:, None], (b, n_copies))
  g = write_rows(state.g, grp, state.length)
  h, _ = _mbp_stack(
    cfg, params, state, m, grp, pos, g, jnp.broadcast_to(jnp.arange(length_cap), g.shape)
  )
  return _apply(cfg, params, ByteLM.logits, h)


MBP_WINDOW = 128  # cache slots the LCA-MBP head attends per step when every query's keys fit


def _mbp_stack(cfg, params, state: DecodeState, m_BQD, grp_BQ, ord_BQ, key_g_BL, key_ord_BL):
  """The LCA-MBP stack over its byte cache for Q queries written at ``state.length``.

  A query's keys lie in [first byte of group g - 1, query] (docs/design.md §3.2), so the
  block needs only the slots from the first byte of group ``grp[:, 0] - 1`` to its last
  written slot. When that span fits ``MBP_WINDOW`` slots in every row, attend that window only
  (O(W) per step instead of O(L)); otherwise (very long groups) attend the whole cache. Same
  numbers both ways.
  """
  length_cap, q = key_g_BL.shape[1], grp_BQ.shape[1]
  length = state.length
  slot = jnp.arange(length_cap)[None, :]
  run = lambda mask, window: _stack(
    cfg, params, "mbp", m_BQD, ord_BQ, mask, state.mbp, length, window, defer=True
  )
  full = lambda: run(_lca_cache_mask(key_g_BL, grp_BQ, ord_BQ, key_ord_BL), None)
  w = MBP_WINDOW
  if w >= length_cap or q >= w:  # short caches, prefill
    out, entries = full()
  else:
    # committed group ids are non-decreasing: the trailing bytes of groups >= first query's - 1
    lo = length - jnp.sum((slot < length[:, None]) & (state.g >= grp_BQ[:, :1] - 1), axis=1)
    start = jnp.clip(lo, 0, length_cap - w)
    win = jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, w))
    windowed = lambda: run(
      _lca_cache_mask(win(key_g_BL, start), grp_BQ, ord_BQ, win(key_ord_BL, start)), start
    )
    fits = jnp.all(length + q - lo <= w)
    out, entries = jax.lax.cond(fits, windowed, full)
  return out, _write(state.mbp, entries, length)


def rollback(state: DecodeState, old: DecodeState, out: dict, a_B) -> DecodeState:
  """Keep only the first ``a_B`` bytes fed by the last ``extend`` (which started at ``old``)."""
  last = jnp.maximum(a_B - 1, 0)
  has = a_B > 0
  sel = lambda x: _take(x, last)
  keep = lambda new, prev: jnp.where(has.reshape((-1,) + (1,) * (prev.ndim - 1)), new, prev)
  new = dict(length=old.length + a_B, last_nt=keep(sel(out["nt_logits"]), old.last_nt))
  if "seg" in out:
    # the open group after byte a-1: the bytes of its block segment up to a-1 (+ the carry)
    k = out["seg"].shape[1]
    seg_last = sel(out["seg"])
    inside = (out["seg"] == seg_last[:, None]) & (jnp.arange(k)[None] < a_B[:, None])
    carry = (seg_last == 0)[:, None]
    open_sum = jnp.sum(out["h"] * inside[..., None], axis=1) + carry * old.open_sum
    open_cnt = jnp.sum(inside, axis=1) + carry[:, 0] * old.open_cnt
    closed_last = sel(out["closes"])
    new.update(
      n_closed=keep(sel(out["n_closed"]), old.n_closed),
      open_sum=keep(jnp.where(closed_last[:, None], 0.0, open_sum), old.open_sum),
      open_cnt=keep(jnp.where(closed_last, 0.0, open_cnt), old.open_cnt),
    )
  if "mbp_logits" in out:
    new["last_mbp"] = keep(sel(out["mbp_logits"]), old.last_mbp)
  if "mlp_logits" in out:
    new["last_mlp"] = keep(
      jnp.take_along_axis(out["mlp_logits"], last[:, None, None, None], axis=2)[:, :, 0],
      old.last_mlp,
    )
  return state.replace(**new)
