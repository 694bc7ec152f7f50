"""The incremental forward: ``ByteLM``'s stages run over KV caches, K new bytes per call.

The same stages as the full forward (``ByteLM.__call__``): embedding, the encoder stack,
boundary decisions (``ByteLM.boundary_logits`` + ``boundaries.hard_boundaries``, or the
SpaceByte rule ``boundaries.spacebyte_boundaries`` continued from the committed bytes), pooling
of each group (``pooling.open_group_sums`` / ``group_mean``), the latent LM over closed groups,
upsampling, the next-byte decoder, the LCA-MBP head under ``masks.lca_mask``, and the shared
unembedding ``ByteLM.decode_logits``; every stack is ``ByteLM.stack_step`` (the same ``Stack`` with a
cache). Only the bookkeeping of a cache is written here.

Every stack is causal in byte (or latent) order with values fixed once a byte is processed,
so each keeps a plain KV cache: the encoder and next-byte decoder over bytes, the LM module
over latent slots (extended only when groups close, several per call if needed), the LCA-MBP
head over bytes (its LCA mask is a subset of the causal one). ``extend`` feeds K new bytes per
row (ragged: ``k_B`` of them are real); positions past a row's real length may hold garbage,
which is always overwritten before any query can see it (every mask also requires key <= query).
Rollback (speculative decoding) only resets per-row lengths and running sums.

Shapes: B rows, L byte slots of the cache, S = L + 1 latent slots (slot 0 = the null group),
K bytes fed per call, C appended copies, D model width, V vocabulary, KV kv heads, E head dim.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import flax.struct
import jax
import jax.numpy as jnp

from lca_jax import backend
from lca_jax.model import boundaries as bnd
from lca_jax.model import masks, pooling
from lca_jax.model.config import ModelConfig
from lca_jax.model.hierarchical import ByteLM
from lca_jax.model.kv_cache import CacheAccess, KVCache
from lca_jax.model.layers import take_rows, write_kv, write_rows


@flax.struct.dataclass
class DecodeState:
  ids: jax.Array  # [B, L] committed bytes (prompt + accepted)
  length: jax.Array  # [B] number of committed bytes
  b: jax.Array  # [B, L] hard boundary of each byte
  g: jax.Array  # [B, L] group id of each byte
  enc: Tuple  # per-layer KVCache (k [B, KV, L, E], v [B, KV, E, L])
  dec: Tuple
  mbp: Tuple
  lm: Tuple  # per-layer KVCache (k [B, KV, S, E], v [B, KV, E, S])
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
  """Per-layer zero ``KVCache``s (k [B, KV, L, E], v [B, KV, E, L]): the layouts in which a
  decode step reads both without moving them (``layers.cached_attention``); with L = K new
  slots, the entries of a ``lax.cond`` branch that computes none."""
  k = (b, cfg.n_kv_heads, length, cfg.head_dim)
  v = (b, cfg.n_kv_heads, cfg.head_dim, length)
  return tuple(KVCache(jnp.zeros(k, dtype), jnp.zeros(v, dtype)) for _ in range(n_layers))


def _pack(entries, stack: bool):
  """Per-layer cache entries as a ``lax.cond`` branch returns them: with ``stack`` one stacked
  pair (k [N, B, KV, T, E], v [N, B, KV, E, T]), else per layer."""
  return KVCache(*(jnp.stack(e) for e in zip(*entries))) if stack else tuple(entries)


def _unpack(out, stack: bool) -> tuple:
  """``_pack``'s per-layer entries."""
  return tuple(KVCache(k, v) for k, v in zip(*out)) if stack else out


def _apply(cfg, params, method, *args, **kw):
  return ByteLM(cfg).apply({"params": params}, *args, method=method, **kw)


def _stack(cfg, params, which, x, pos, mask, caches, access: CacheAccess, rows_BR=None):
  """``ByteLM.stack_step``: stack ``which`` over its caches; the per-layer results as a tuple."""
  args = (which, x, pos, mask, list(caches), access, rows_BR)
  out, new = _apply(cfg, params, ByteLM.stack_step, *args)
  return out, tuple(new)


def _write(caches, entries, write_B):
  """Store per-layer entries returned by a deferred ``_stack`` (after a ``lax.cond``)."""
  return tuple(write_kv(c, e, write_B) for c, e in zip(caches, entries))


def _take(x_BK, idx_B):
  """x[b, idx[b]] for a [B, K, ...] array."""
  return take_rows(x_BK, idx_B[:, None])[:, 0]


def _keep(has_B, new, old):
  """Rows that fed no byte keep their old value."""
  return jnp.where(has_B.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)


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
      masks.cache_causal_mask(jnp.zeros((batch, 1), jnp.int32), n_slots),
      lm,
      CacheAccess(zero, old_slots=0),
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


class _Block(NamedTuple):
  """The K bytes of one ``extend`` call: where they go and which are real."""

  ids_BK: jax.Array
  k_B: jax.Array  # real bytes per row
  pos_BK: jax.Array  # absolute byte positions (length + j)
  valid_BK: jax.Array  # j < k_B
  has_B: jax.Array  # the row feeds at least one byte (rows that feed none keep their state)
  last_B: jax.Array  # index of each row's last real byte in the block (0 if none)
  causal_BKL: jax.Array  # causal mask of the block's queries over the byte caches


def _boundaries(cfg, params, state: DecodeState, blk: _Block, h_BKD):
  """Hard closes of the block's real bytes, continuing the committed bytes' decisions."""
  if cfg.boundaries == "spacebyte":
    prev_id = _take(state.ids, jnp.maximum(state.length - 1, 0))
    prev_space = bnd.space_like(prev_id) & (state.length > 0)
    closes = bnd.spacebyte_boundaries(
      blk.ids_BK,
      cfg.spacebyte_max_group,
      prev_space_B=prev_space,
      open_len_B=state.open_cnt.astype(jnp.int32),
    )
  else:
    closes = bnd.hard_boundaries(_apply(cfg, params, ByteLM.boundary_logits, h_BKD))
  return (closes > 0) & blk.valid_BK


class _Latents(NamedTuple):
  """The latent side after a block: the new state fields and what each byte reads."""

  fields: dict  # lm, z, s, n_closed, open_sum, open_cnt, b, g
  z_up_BKD: jax.Array  # LM output each byte reads (the last closed group through it)
  s_up_BKD: jax.Array  # pooled input of that same slot
  grp_BK: jax.Array  # group id of each new byte
  out: dict  # per-position running values for ``rollback``


def _latents(
  cfg, params, state: DecodeState, blk: _Block, h_BKD, closes_BK, fresh: bool
) -> _Latents:
  """Pool the groups the block closes, run the LM over them (only when some row closed one:
  Eff-FxT) and read back the latent each byte sees. ``fresh``: see ``extend``."""
  b, k = closes_BK.shape
  prev_close = jnp.concatenate([jnp.zeros_like(closes_BK[:, :1]), closes_BK[:, :-1]], axis=1)
  hf = h_BKD.astype(jnp.float32) * blk.valid_BK[..., None]
  gsum, gcnt, seg = pooling.open_group_sums(
    prev_close, hf, blk.valid_BK.astype(jnp.float32), state.open_sum, state.open_cnt
  )
  pooled = pooling.group_mean(gsum, gcnt, h_BKD.dtype)
  # new latent slots: closing bytes, compacted in order, appended after n_closed
  cum = jnp.cumsum(closes_BK.astype(jnp.int32), axis=1)
  dest = jnp.where(closes_BK, cum - 1, k)
  new_s = jnp.zeros_like(pooled).at[jnp.arange(b)[:, None], dest].set(pooled, mode="drop")
  first_slot = state.n_closed + 1
  lm, z, s = _latent_lm(cfg, params, state, new_s, first_slot, cum[:, -1].max(), fresh)
  u = state.n_closed[:, None] + cum  # closed groups through each new byte
  grp = u - closes_BK.astype(jnp.int32)
  closed_last = _take(closes_BK, blk.last_B)
  has = blk.has_B
  fields = dict(
    lm=lm,
    z=z,
    s=s,
    n_closed=state.n_closed + cum[:, -1],
    open_sum=_keep(
      has, jnp.where(closed_last[:, None], 0.0, _take(gsum, blk.last_B)), state.open_sum
    ),
    open_cnt=_keep(has, jnp.where(closed_last, 0.0, _take(gcnt, blk.last_B)), state.open_cnt),
    b=write_rows(state.b, closes_BK.astype(jnp.int32), state.length),
    g=write_rows(state.g, grp, state.length),
  )
  read = lambda x_BSD: jnp.take_along_axis(x_BSD, u[..., None], axis=1)
  out = dict(h=hf, seg=seg, closes=closes_BK, n_closed=u)
  return _Latents(fields, read(z), read(s), grp, out)


def _latent_lm(cfg, params, state: DecodeState, new_s_BKD, first_slot_B, n_new, fresh: bool):
  """The latent LM over the block's new groups (``new_s``, compacted, written from
  ``first_slot``) when some row closed one (``n_new`` > 0): the LM caches, z and s after it.

  With the fused decode kernels (a step on a GPU) the LM runs in one branch of a ``lax.switch``
  that writes the caches, z and s in place, its attention kernel reading the cache slots up to
  the last row's first new one (``CacheAccess.read_slots``; a step of more rows than the fused
  kernels take runs XLA's layers, which read every slot); the idle branch (first) passes them
  through: XLA adds no copy, and a step where no group closes launches nothing for the LM. Otherwise each (slots run
  over, cache slots read) pair the block may need is one branch: the smallest of each that holds
  every row's new groups and every row's earlier slots (``lm_widths``, ``lm_reads``; a fresh LM
  cache holds the null group only). These branches return the new cache entries
  (``defer_write``), written after the switch (writes inside several branches made XLA copy the
  caches), zeros when no group closed (slots past n_closed are garbage until a group closes
  there): a step's few new slots as one stacked pair (the idle branch then fills two buffers,
  not two per layer), a prefill's (``LM_WIDTHS_FROM`` slots or more) per layer (a stack would
  hold them all twice at its peak)."""
  b, k = new_s_BKD.shape[:2]
  slot_pos = first_slot_B[:, None] + jnp.arange(k)[None, :]
  lm_mask = masks.cache_causal_mask(slot_pos, state.z.shape[1])
  stack = k < LM_WIDTHS_FROM

  def lm(c, caches, **access):
    x, pos, mask = (a[:, :c] for a in (new_s_BKD, slot_pos, lm_mask))
    return _stack(cfg, params, "lm", x, pos, mask, caches, CacheAccess(first_slot_B, **access))

  if stack and backend.fused_decode_kernels():

    def in_place(caches, z, s):
      old = 1 if fresh else None
      z_new, caches = lm(k, caches, read_slots=first_slot_B.max(), old_slots=old, causal=True)
      return caches, write_rows(z, z_new, first_slot_B), write_rows(s, new_s_BKD, first_slot_B)

    args = (tuple(state.lm), state.z, state.s)
    return jax.lax.switch((n_new > 0).astype(jnp.int32), [lambda *a: a, in_place], *args)

  def deferred(c, old):
    def run():
      z, kv = lm(c, state.lm, old_slots=old, defer_write=True, causal=True)
      z, kv = _pad_slots(z, kv, k)
      return z, _pack(kv, stack)

    return run

  widths = lm_widths(k, backend.platform())
  reads = (1,) if fresh else lm_reads(cfg, b, state.z.shape[1])
  i_width = jnp.sum(jnp.asarray(widths) < n_new)
  i_read = jnp.sum(jnp.asarray(reads[:-1], jnp.int32) < first_slot_B.max())
  pick = jnp.where(n_new == 0, 0, 1 + i_width * len(reads) + i_read)
  idle = lambda: (
    jnp.zeros_like(new_s_BKD),
    _pack(_kv(cfg, cfg.n_lm, b, k, new_s_BKD.dtype), stack),
  )
  z_new, lm_new = jax.lax.switch(pick, [idle] + [deferred(c, o) for c in widths for o in reads])
  z = write_rows(state.z, z_new, first_slot_B)
  s = write_rows(state.s, new_s_BKD, first_slot_B)
  return _write(state.lm, _unpack(lm_new, stack), first_slot_B), z, s


# A block of at least LM_WIDTHS_FROM bytes per row (a prefill) runs the latent LM over the
# first K/4 or K/2 of its K slots when they hold every row's new groups: a trained model closes
# about one group per 1 / bp_prior (3) bytes, and the slots past a row's groups are empty.
# Each width is one more LM to compile (docs/design.md §6.5 has the measured trade-off), so
# only on the platforms ``backend.several_lm_widths`` names.
LM_WIDTHS_FROM = 64


def lm_widths(k: int, platform: str = "cpu") -> tuple:
  """The slot counts the latent LM may run over for a block of ``k`` bytes per row on
  ``platform``, ascending (the last is k): K/4 and K/2 rounded up to a multiple of 8, for long
  blocks where ``backend.several_lm_widths(platform)``."""
  if k < LM_WIDTHS_FROM or not backend.several_lm_widths(platform):
    return (k,)
  return _quarter_half(k) + (k,)


def _quarter_half(n: int) -> tuple:
  """n/4 and n/2 rounded up to a multiple of 8, ascending, without n itself."""
  return tuple(sorted({-(-n // (8 * f)) * 8 for f in (4, 2)} - {n}))


# A step reads only the first S/4 or S/2 of the LM cache's S slots when they hold every row's
# earlier groups (a trained model fills about one slot per 3 bytes), from caches of
# LM_READS_FROM slots on whose reads are at least LM_READS_SHARE of the LM weights' (so a batch
# of rows or a long context: at batch 1 and a few hundred slots the weights decide the step,
# and the extra LM copies would only cost compile time); otherwise, or when they do not, all S.
LM_READS_FROM = 256
LM_READS_SHARE = 0.25


def lm_cache_share(cfg: ModelConfig, batch: int, slots: int) -> float:
  """Bytes of the LM's KV caches a step over ``slots`` slots reads, per byte of LM weights
  (both in the compute dtype): batch x slots x (k, v) over a layer's parameters."""
  d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
  weights = 2 * d * d + 2 * d * kv + 3 * d * cfg.d_inner  # q, o; k, v; gate, up, down
  return batch * slots * 2 * kv / weights


def lm_reads(cfg: ModelConfig, batch: int, s: int) -> tuple:
  """The LM cache slots a block may read (``cached_attention``'s ``old_slots``), ascending;
  the last is all of them (None): S/4 and S/2 rounded up to a multiple of 8, for long caches
  that weigh in a step (``LM_READS_FROM``, ``LM_READS_SHARE``)."""
  if s < LM_READS_FROM or lm_cache_share(cfg, batch, s) < LM_READS_SHARE:
    return (None,)
  return _quarter_half(s) + (None,)


def _pad_slots(z_BCD, entries, k: int):
  """The LM output and cache entries of c slots padded with zeros to k slots."""
  c = z_BCD.shape[1]
  pad = lambda x, axis: jnp.pad(x, [(0, k - c if a == axis else 0) for a in range(x.ndim)])
  return pad(z_BCD, 1), tuple(KVCache(pad(kk, 2), pad(vv, 3)) for kk, vv in entries)


def _last_rows(blk: _Block, last_only: bool):
  """The positions a stack's caller reads after its last layer: each row's last real byte
  with ``last_only`` on a block of several bytes ([B, 1]), else all (None)."""
  return blk.last_B[:, None] if last_only and blk.ids_BK.shape[1] > 1 else None


def _head_input(h_BKD, blk: _Block, last_only: bool, rows_BR):
  """The last stack's output as the heads read it: with ``last_only`` each row's last real
  byte ([B, 1, D]; already so when the stack ran with ``rows_BR``), else every position."""
  if not last_only or rows_BR is not None:
    return h_BKD
  return _take(h_BKD, blk.last_B)[:, None]


def _heads(cfg, params, h_BKD, blk: _Block, last_only: bool):
  """Logits of a head at each position ([B, K, V]; None with ``last_only``, where ``h_BKD`` is
  each row's last real byte, see ``_head_input``) and at each row's last real byte ([B, V])."""
  if last_only:
    return None, _apply(cfg, params, ByteLM.decode_logits, h_BKD)[:, 0]
  every = _apply(cfg, params, ByteLM.decode_logits, h_BKD)
  return every, _take(every, blk.last_B)


def extend(
  cfg: ModelConfig,
  params,
  state: DecodeState,
  new_ids_BK,
  k_B,
  with_mbp: bool,
  n_copies: int = 0,
  last_only: bool = False,
  fresh: bool = False,
):
  """Feed K bytes per row (the first ``k_B`` real) through every stack. Returns the new state
  and per-position outputs: logits of each head and the running values needed for rollback.

  With ``n_copies`` (LCA-MBP), the same MBP pass also reads the head at that many copies
  appended after each row's new last byte (see ``mbp_copies``) into ``state.last_copies``.
  With ``last_only`` the heads run only where the state needs them (each row's last byte and
  the copies), not at every position: for callers that never roll back (prefill, ntp,
  threshold); the per-position logits are then absent from the outputs.
  ``fresh`` (static): ``state`` is ``init_state``'s, nothing fed yet (a prefill): the byte
  caches hold no keys and the LM's only the null group, so the block's attention reads none of
  the cache slots (``layers.cached_attention``'s ``old_slots``) instead of all of them masked.
  """
  length_cap = state.ids.shape[1]
  j = jnp.arange(new_ids_BK.shape[1])[None, :]
  pos = state.length[:, None] + j
  blk = _Block(
    new_ids_BK,
    k_B,
    pos,
    j < k_B[:, None],
    k_B > 0,
    jnp.maximum(k_B - 1, 0),
    masks.cache_causal_mask(pos, length_cap),
  )
  has_new = blk.has_B
  x = _apply(cfg, params, ByteLM.embed, new_ids_BK)
  rows = _last_rows(blk, last_only)  # what the heads read of the last stack (decoder, or enc.)
  enc_rows = None if cfg.hierarchical else rows
  old = 0 if fresh else None  # byte-cache slots that can hold earlier keys

  def byte_stack(which, x_BKD, caches, rows_BR):
    access = CacheAccess(state.length, old_slots=old, causal=True)
    return _stack(cfg, params, which, x_BKD, pos, blk.causal_BKL, caches, access, rows_BR)

  h, enc = byte_stack("encoder", x, state.enc, enc_rows)
  new = dict(
    ids=write_rows(state.ids, new_ids_BK, state.length), length=state.length + k_B, enc=enc
  )
  out = {}
  if not cfg.hierarchical:
    every, last_nt = _heads(cfg, params, _head_input(h, blk, last_only, rows), blk, last_only)
    if every is not None:
      out["nt_logits"] = every
    return state.replace(**new, last_nt=_keep(has_new, last_nt, state.last_nt)), out

  lat = _latents(cfg, params, state, blk, h, _boundaries(cfg, params, state, blk, h), fresh)
  new.update(lat.fields)
  out.update(lat.out)
  x_dec = lat.z_up_BKD + h
  h_nt, new["dec"] = byte_stack("decoder", x_dec, state.dec, rows)
  h_nt = _head_input(h_nt, blk, last_only, rows)
  every, last_nt = _heads(cfg, params, h_nt, blk, last_only)
  if every is not None:
    out["nt_logits"] = every
  new["last_nt"] = _keep(has_new, last_nt, state.last_nt)
  if with_mbp and cfg.has_lca:
    new.update(_lca_step(cfg, params, state, blk, lat, new, n_copies, last_only, fresh, out))
  if with_mbp and cfg.n_mlp_mbp:
    mlp = jnp.stack(
      [
        _apply(cfg, params, ByteLM.decode_logits, _apply(cfg, params, ByteLM.mlp_head, i, h_nt))
        for i in range(cfg.n_mlp_mbp)
      ],
      axis=1,
    )  # [B, heads, K (1 with last_only), V]
    if last_only:
      last_mlp = mlp[:, :, 0]
    else:
      out["mlp_logits"] = mlp
      last_mlp = jnp.take_along_axis(mlp, blk.last_B[:, None, None, None], axis=2)[:, :, 0]
    new["last_mlp"] = _keep(has_new, last_mlp, state.last_mlp)
  return state.replace(**new), out


def prefill(
  cfg: ModelConfig,
  params,
  prompt_BP,
  plen_B,
  length: int,
  with_mbp: bool,
  n_copies: int = 0,
) -> DecodeState:
  """``init_state`` for ``length`` bytes, then the prompts (the first ``plen_B`` bytes of each
  row) fed as one ``fresh`` block; the heads run only where the state needs them."""
  st = init_state(cfg, params, prompt_BP.shape[0], length, with_mbp, n_copies)
  st, _ = extend(cfg, params, st, prompt_BP, plen_B, with_mbp, n_copies, True, True)
  return st


def _lca_step(cfg, params, state, blk: _Block, lat: _Latents, new, n_copies, last_only, fresh, out):
  """The LCA-MBP head over its cache for the block (input m = z_up + s_up), plus ``n_copies``
  copies of each row's last real byte (slots length+K.., order length+k_B..)."""
  k = blk.ids_BK.shape[1]
  length_cap = state.ids.shape[1]
  m = lat.z_up_BKD + lat.s_up_BKD
  grp, order, c = lat.grp_BK, blk.pos_BK, n_copies
  if c:
    m = jnp.concatenate([m, jnp.repeat(_take(m, blk.last_B)[:, None], c, axis=1)], axis=1)
    grp = jnp.concatenate([grp, jnp.repeat(new["n_closed"][:, None], c, axis=1)], axis=1)
    copy_ord = (state.length + blk.k_B)[:, None] + jnp.arange(c)[None]
    order = jnp.concatenate([order, copy_ord], axis=1)
  key_g = write_rows(new["g"], grp, state.length)
  key_ord = _key_order(state.length, blk.k_B, k, c, length_cap)
  rows = _last_rows(blk, last_only)
  if rows is not None and c:  # the last byte, then the copies
    rows = jnp.concatenate([rows, jnp.broadcast_to(k + jnp.arange(c), (rows.shape[0], c))], 1)
  h_m, mbp = _mbp_stack(cfg, params, state, m, grp, order, key_g, key_ord, rows, fresh)
  if last_only:  # rows: the last byte, then the copies
    if rows is None:
      h_m = jnp.concatenate([_take(h_m[:, :k], blk.last_B)[:, None], h_m[:, k:]], 1)
    logits = _apply(cfg, params, ByteLM.decode_logits, h_m)
    last_mbp, copies = logits[:, 0], logits[:, 1:]
  else:
    logits = _apply(cfg, params, ByteLM.decode_logits, h_m)
    out["mbp_logits"] = logits[:, :k]
    last_mbp, copies = _take(logits, blk.last_B), logits[:, k:]
  has = blk.has_B
  fields = dict(mbp=mbp, last_mbp=_keep(has, last_mbp, state.last_mbp))
  if c:
    fields["last_copies"] = _keep(has, copies, state.last_copies)
  return fields


def _key_order(length_B, k_B, k: int, c: int, length_cap: int):
  """Order index of every cache slot for a block of K bytes (k_B real) + C copies written at
  ``length``: real slots keep their index, the K - k_B unused slots of the block are excluded
  (order past every query), copy j (slot length+K+j) comes right after the last real byte."""
  s = jnp.arange(length_cap)[None, :]
  rel = s - length_B[:, None]
  order = jnp.where((rel >= k_B[:, None]) & (rel < k), jnp.iinfo(jnp.int32).max, s)
  return jnp.where((rel >= k) & (rel < k + c), length_B[:, None] + k_B[:, None] + rel - k, order)


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
  return _apply(cfg, params, ByteLM.decode_logits, h)


MBP_WINDOW = 128  # cache slots the LCA-MBP head attends per step when every query's keys fit
# A cache shorter than this many windows is attended whole: below it the window saves less
# than its ``lax.cond`` (a host-synchronizing branch, two copies of the stack) costs a small
# model's step (docs/design.md §6.5).
MBP_WINDOW_FROM = 4


def mbp_window(length_cap: int, n_queries: int) -> int:
  """Cache slots the LCA-MBP head attends for ``n_queries`` queries: ``MBP_WINDOW`` on a cache
  of at least ``MBP_WINDOW_FROM`` windows (when the keys fit it; the whole cache otherwise),
  else the whole cache."""
  w = MBP_WINDOW
  if length_cap < MBP_WINDOW_FROM * w or n_queries >= w:
    return length_cap
  return w


def _mbp_stack(
  cfg,
  params,
  state: DecodeState,
  m_BQD,
  grp_BQ,
  ord_BQ,
  key_g_BL,
  key_ord_BL,
  rows_BR=None,
  fresh=False,
):
  """The LCA-MBP stack over its byte cache for Q queries written at ``state.length`` (outputs
  only at ``rows_BR`` when given, see ``Stack``; ``fresh``: an empty cache, see ``extend``).

  A query's keys lie in [first byte of group g - 1, query] (docs/design.md §3.2), so the
  block needs only the slots from the first byte of group ``grp[:, 0] - 1`` to its last
  written slot. On a long cache (``mbp_window``), when that span fits ``MBP_WINDOW`` slots in
  every row, attend that window only (O(W) per step instead of O(L)); otherwise (very long
  groups) attend the whole cache. Same numbers both ways.
  """
  length_cap, q = key_g_BL.shape[1], grp_BQ.shape[1]
  length = state.length
  slot = jnp.arange(length_cap)[None, :]
  mask = lambda g_BW, ord_BW: masks.lca_mask(grp_BQ, None, g_BW, None, ord_BQ, ord_BW)
  run = lambda m, window, old=None: _stack(
    cfg,
    params,
    "mbp",
    m_BQD,
    ord_BQ,
    m,
    state.mbp,
    CacheAccess(length, window, old_slots=old, defer_write=True),
    rows_BR,
  )
  full = lambda old=None: run(mask(key_g_BL, key_ord_BL), None, old)
  w = mbp_window(length_cap, q)
  if fresh:  # nothing cached: the new keys only
    out, entries = full(0)
  elif w == length_cap:  # short caches, long blocks
    out, entries = full()
  else:
    # committed group ids are non-decreasing: the trailing bytes of groups >= first query's - 1
    lo = length - jnp.sum((slot < length[:, None]) & (state.g >= grp_BQ[:, :1] - 1), axis=1)
    start = jnp.clip(lo, 0, length_cap - w)
    win = jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, w))
    windowed = lambda: run(mask(win(key_g_BL, start), win(key_ord_BL, start)), start)
    fits = jnp.all(length + q - lo <= w)
    out, entries = jax.lax.cond(fits, windowed, full)
  return out, _write(state.mbp, entries, length)


def rollback(state: DecodeState, old: DecodeState, out: dict, a_B) -> DecodeState:
  """Keep only the first ``a_B`` bytes fed by the last ``extend`` (which started at ``old``)."""
  last = jnp.maximum(a_B - 1, 0)
  has = a_B > 0
  sel = lambda x: _take(x, last)
  keep = lambda new, prev: _keep(has, new, prev)
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
