"""A fixed-size batch of decode slots: prefill a request into a free slot, then decode every
slot a chunk of steps at a time (what the server's continuous batching drives,
``serve.scheduler``).

``engine`` runs a whole ``generate`` call as one ``while_loop`` over one batch; here the same
step (``step.advance``: propose, per-row cut, commit, count) runs a batch whose rows come and
go: ``admit`` prefills prompts (``incremental.prefill``) and writes their caches into rows of
the batch's caches (``Slots.st``), and ``decode`` runs up to K steps for every row at once,
recording each step's bytes. Rows are independent: each has its own byte budget, eos
handling, step counter and PRNG key (so a seeded request draws the same bytes whichever slot
and batch it lands in), temperature, top-k, top-p, tau and greedy or sampled: a greedy row in
a chunk that also samples takes the argmax of the raw logits, as a greedy program does
(``SamplingParams.greedy``), so greedy and sampled requests share a batch. What is static, and
so one batch per value: the mode and ``n`` (``GroupKey``). A chunk whose active rows are all
greedy runs the greedy program (no draws), any other the sampled one; a chunk with a row that
asked for log-probabilities (ntp only) records each committed byte's log-probability and the
``TOP_LOGPROBS`` most likely bytes of its step (of the raw logits). A prompt longer than
``CHUNKED_FROM`` bytes is prefilled ``PREFILL_PIECE`` bytes at a time (``prefill_step``, one
piece between two decode chunks, in caches of its own until it is whole), so that it delays
the running rows by one piece at a time, not by its whole prefill.

A chunk decodes only the first w slots, w the smallest of ``widths(B)`` (1, 2, 4, ..., B) that
holds every active row (the scheduler fills the lowest free slot first): one request alone
steps a batch of 1, not of B, whose caches every step would read. Likewise it reads only the
first quarter of the caches (``spans``) while every active row fits there after the chunk (the
cache fields cut to that length: a smaller cache of the same rows), so short requests on a long
context step as fast as on a short one. Shapes are fixed: B slots, a cache of ``length`` bytes
for every row, prompts padded to a power-of-two bucket; so after one compile per (bucket, rows)
for ``admit`` and one per (width, span, program) for ``decode``, no request compiles anything.

Shapes: B slots, w decoded slots, L cache bytes, P padded prompt, K steps per chunk, W bytes fed
per step, T the ``TOP_LOGPROBS`` alternatives.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lca_jax import vocab
from lca_jax.decode import weights
from lca_jax.decode.executables import ExecutableCache
from lca_jax.decode.policies import POLICIES, Ctx, LoopState, Plan
from lca_jax.decode.request import seed_key_words
from lca_jax.decode.sampling import SamplingParams
from lca_jax.decode.step import advance
from lca_jax.model import incremental
from lca_jax.model.incremental import DecodeState
from lca_jax.model.kv_cache import KVCache

MIN_BUCKET = 16  # the shortest padded prompt
ADMIT_ROWS = (1, 4)  # prompts one prefill takes (padded with dropped rows)
CHUNKED_FROM = 256  # longer prompts prefill a piece at a time, between decode chunks
PREFILL_PIECE = 64  # bytes of such a prompt one piece feeds
SPAN_FROM = 256  # caches of this many slots or more may be read a quarter at a time
TOP_LOGPROBS = 20  # most likely bytes a log-probability chunk records per step


class GroupKey(NamedTuple):
  """What a batch's programs are compiled for: rows of one batch share these."""

  mode: str
  n: int  # bytes proposed per step (1 in ntp)


@flax.struct.dataclass
class Slots:
  """The device state of B slots. A free slot is ``done``; its caches are left as they were."""

  st: DecodeState
  pending: jax.Array  # [B] int32 byte forced as the next step's first byte, -1 = none
  done: jax.Array  # [B] bool
  gen: jax.Array  # [B] int32 bytes generated
  budget: jax.Array  # [B] int32 bytes the row may generate
  ignore_eos: jax.Array  # [B] bool
  step: jax.Array  # [B] int32 steps the row has taken (its PRNG stream position)
  key: jax.Array  # [B, 2] uint32 the row's PRNG key
  tau: jax.Array  # [B] float32
  temperature: jax.Array  # [B] float32 (> 0; unused when greedy)
  greedy: jax.Array  # [B] bool the row decodes greedily
  top_k: jax.Array  # [B] int32
  top_p: jax.Array  # [B] float32
  n_cand: jax.Array  # [B] int32 candidates proposed
  n_acc: jax.Array  # [B] int32 candidates accepted


class RowParams(NamedTuple):
  """One request's decoding parameters (host values)."""

  budget: int
  ignore_eos: bool = False
  seed: int = 0
  tau: float = 0.9
  temperature: float = 0.0  # 0: greedy
  top_k: int = 0
  top_p: float = 1.0
  logprobs: bool = False  # record each byte's log-probability (ntp only)


class Chunk(NamedTuple):
  """What one ``decode`` call committed, on the host, for the first w slots (the others were
  not decoded)."""

  d_KwW: np.ndarray  # bytes fed at each step
  a_Kw: np.ndarray  # bytes each row committed at each step (the first a of d)
  done_w: np.ndarray
  n_cand_w: np.ndarray
  n_acc_w: np.ndarray
  steps: int  # steps run (K, or fewer when every row finished)
  # with a row that asked for them (else None): the log-probability of each step's byte
  # [K, w] and the step's TOP_LOGPROBS most likely bytes [K, w, T] (ids, log-probabilities)
  lp_Kw: Optional[np.ndarray] = None
  top_ids_KwT: Optional[np.ndarray] = None
  top_lp_KwT: Optional[np.ndarray] = None

  @property
  def width(self) -> int:
    return self.a_Kw.shape[1]


def widths(batch: int) -> tuple:
  """The slot counts a chunk may decode: powers of 2 below ``batch``, then ``batch``."""
  out, w = [], 1
  while w < batch:
    out.append(w)
    w *= 2
  return tuple(out) + (batch,)


def spans(length: int) -> tuple:
  """The cache lengths a chunk may read: a quarter of ``length`` (a multiple of 8) for caches
  of at least ``SPAN_FROM`` slots, then all of them."""
  if length < SPAN_FROM:
    return (length,)
  return (-(-length // 32) * 8, length)


# the byte-indexed fields of a DecodeState (axis of L) and the latent-slot ones (axis of S =
# L + 1); each kv cache is a KVCache (k [B, KV, L, E], v [B, KV, E, L])
_BYTE_AXES = dict(ids=1, b=1, g=1)
_SLOT_AXES = dict(z=1, s=1)
_KV_BYTES = ("enc", "dec", "mbp")


def _span_view(st: DecodeState, n: int, fn) -> DecodeState:
  """``st`` with ``fn(x, axis, size)`` applied to every byte-indexed field (size n) and every
  latent-slot one (size n + 1)."""
  new = {k: fn(getattr(st, k), a, n) for k, a in _BYTE_AXES.items()}
  new.update({k: fn(getattr(st, k), a, n + 1) for k, a in _SLOT_AXES.items()})
  kv = lambda caches, m: tuple(KVCache(fn(k, 2, m), fn(v, 3, m)) for k, v in caches)
  new.update({k: kv(getattr(st, k), n) for k in _KV_BYTES})
  new["lm"] = kv(st.lm, n + 1)
  return st.replace(**new)


def buckets(context: int) -> tuple:
  """Padded prompt lengths: powers of two from ``MIN_BUCKET`` up to the first that holds a
  prompt of ``context - 1`` bytes."""
  out, p = [], MIN_BUCKET
  while True:
    out.append(p)
    if p >= context - 1:
      return tuple(out)
    p *= 2


def bucket_of(n: int, context: int) -> int:
  """The padded length of an ``n``-byte prompt."""
  return next(b for b in buckets(context) if b >= n)


class SlotBatch:
  """B slots of one ``GroupKey`` on one model, with a context of ``context`` bytes (prompt +
  generation per row; at most the model's ``max_seq_len``). ``on_compile(group, name,
  seconds)`` is called after each program it compiles."""

  def __init__(
    self,
    model,
    group: GroupKey,
    batch: int,
    context: int,
    on_compile=None,
    chunked_from: int = CHUNKED_FROM,
    piece: int = PREFILL_PIECE,
  ):
    self.model, self.group, self.batch, self.context = model, group, batch, context
    self.chunked_from, self.piece = chunked_from, piece
    cfg = model.cfg
    policy = POLICIES[group.mode]
    source = ("mlp" if cfg.n_mlp_mbp else "lca") if policy.multi_byte else ""
    # the greedy and the sampled program (capacity is unused here: budgets are per row)
    self.plans = {g: Plan(group.mode, group.n, g, False, context, source) for g in (True, False)}
    self.plan = self.plans[True]
    self.length = max(buckets(context)[-1], context) + 2 * self.plan.width + 1
    self.on_compile = on_compile
    n_programs = len(buckets(context)) * len(ADMIT_ROWS) + 4 * len(widths(batch)) * 2 + 4
    self._exe = ExecutableCache(capacity=n_programs)
    self.params = weights.for_model(model, self.plan)
    self.slots = self._empty()
    self._lengths = np.zeros((batch,), np.int64)  # each slot's committed bytes (host copy)
    self._greedy = np.ones((batch,), bool)  # each slot's request is greedy (host copy)
    self._logprobs = np.zeros((batch,), bool)  # ... asked for log-probabilities
    # slot -> [caches of its prompt so far (1 row; None before the first piece), prompt ids,
    # bytes fed, RowParams]: long prompts being prefilled a piece at a time, FIFO
    self._staged = {}

  # ---- programs ----------------------------------------------------------------------------
  def _compiled(self, name, fn, args, donate=()):
    report = None
    if self.on_compile is not None:
      report = lambda seconds: self.on_compile(self.group, name, seconds)
    return self._exe.jit(name, fn, args, donate, report).exe

  def _weights(self, params):
    return weights.in_program(self.plan, params, self.model.cfg.dtype)

  def _empty(self) -> Slots:
    cfg, plan, b = self.model.cfg, self.plan, self.batch

    def build(params):
      st = incremental.init_state(
        cfg, self._weights(params), b, self.length, plan.policy.target_mbp, plan.copies_in_extend
      )
      zi, zf = jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.float32)
      return Slots(
        st=st,
        pending=jnp.full((b,), -1, jnp.int32),
        done=jnp.ones((b,), bool),
        gen=zi,
        budget=zi,
        ignore_eos=jnp.zeros((b,), bool),
        step=zi,
        key=jnp.zeros((b, 2), jnp.uint32),
        tau=zf,
        temperature=zf + 1.0,
        greedy=jnp.ones((b,), bool),
        top_k=zi,
        top_p=zf + 1.0,
        n_cand=zi,
        n_acc=zi,
      )

    return jax.jit(build)(self.params)

  def _admit_fn(self, params, s: Slots, idx_m, prompt_mP, plen_m, rows):
    cfg, plan = self.model.cfg, self.plan
    st_m = incremental.prefill(
      cfg,
      self._weights(params),
      prompt_mP,
      plen_m,
      self.length,
      plan.policy.target_mbp,
      plan.copies_in_extend,
    )
    return self._place_fn(s, idx_m, st_m, rows)

  def _piece_fn(self, params, st, piece_1W, k_1):
    """The caches of one prompt after one more piece (``st`` None: its first piece)."""
    cfg, plan = self.model.cfg, self.plan
    p = self._weights(params)
    fresh = st is None
    if fresh:
      st = incremental.init_state(
        cfg, p, 1, self.length, plan.policy.target_mbp, plan.copies_in_extend
      )
    with_mbp, copies = plan.policy.target_mbp, plan.copies_in_extend
    return incremental.extend(cfg, p, st, piece_1W, k_1, with_mbp, copies, True, fresh)[0]

  def _place_fn(self, s: Slots, idx_m, st_m, rows):
    """``s`` with the prefilled caches ``st_m`` and the parameters ``rows`` in slots
    ``idx_m``."""
    # rows of idx B (padding) fall outside the batch and are dropped
    at = lambda x, v: x.at[idx_m].set(jnp.asarray(v).astype(x.dtype), mode="drop")
    st = jax.tree_util.tree_map(at, s.st, st_m)
    budget, ignore_eos, key, tau, temperature, top_k, top_p = rows
    return s.replace(
      st=st,
      pending=at(s.pending, -1),
      done=at(s.done, False),
      gen=at(s.gen, 0),
      budget=at(s.budget, budget),
      ignore_eos=at(s.ignore_eos, ignore_eos),
      step=at(s.step, 0),
      key=at(s.key, key),
      tau=at(s.tau, tau),
      temperature=at(s.temperature, jnp.maximum(temperature, 1e-6)),
      greedy=at(s.greedy, temperature == 0),
      top_k=at(s.top_k, top_k),
      top_p=at(s.top_p, top_p),
      n_cand=at(s.n_cand, 0),
      n_acc=at(s.n_acc, 0),
    )

  def _decode_fn(self, k_steps, width, span, greedy, top, params, s_all: Slots, active_w):
    """Up to ``k_steps`` steps of the first ``width`` slots over the first ``span`` bytes of
    their caches; ``greedy``: the greedy program (every active row greedy); ``top``: record
    log-probabilities and the ``top`` most likely bytes of each step (0: none)."""
    plan = self.plans[greedy]
    w = plan.width
    s = jax.tree_util.tree_map(lambda x: x[:width], s_all)  # the first ``width`` slots
    if span < self.length:  # ... and the first ``span`` bytes of their caches
      cut = lambda x, axis, n: jax.lax.slice_in_dim(x, 0, n, axis=axis)
      s = s.replace(st=_span_view(s.st, span, cut))
    s = s.replace(done=s.done | ~active_w)
    sp = SamplingParams(s.temperature, s.top_k, s.top_p, None if greedy else s.greedy)
    ctx = Ctx(self.model.cfg, None, self._weights(params), None, plan, s.tau[:, None], s.budget, sp)
    t = max(top, 1)
    out0 = (
      jnp.zeros((k_steps, width, w), jnp.int32),
      jnp.zeros((k_steps, width), jnp.int32),
      jnp.zeros((k_steps, width), jnp.float32),
      jnp.zeros((k_steps, width, t), jnp.int32),
      jnp.zeros((k_steps, width, t), jnp.float32),
    )

    def body(c):
      i, s, out = c
      if greedy:  # no draw: one unused key for the batch
        k_draft = k_acc = jax.random.PRNGKey(0)
      else:
        ks = jax.vmap(lambda k, t: jax.random.split(jax.random.fold_in(k, t)))(s.key, s.step)
        k_draft, k_acc = ks[:, 0], ks[:, 1]
      loop = LoopState(
        st=s.st,
        dst=None,
        keys=None,
        pending=s.pending,
        done=s.done,
        gen=s.gen,
        step=i,
        per_step=None,
        n_cand=s.n_cand,
        n_acc=s.n_acc,
        closed0=None,
      )
      raw = jax.nn.log_softmax(s.st.last_nt.astype(jnp.float32), axis=-1) if top else None
      nxt, prop, a = advance(ctx, loop, k_draft, k_acc, s.ignore_eos)
      step = (prop.d_BK, a)
      if top:  # ntp: one byte per step, drawn from ``last_nt``
        lp = jnp.take_along_axis(raw, prop.d_BK[:, :1], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(raw, top)
        step += (lp, top_ids.astype(jnp.int32), top_lp)
      out = tuple(o.at[i].set(v) for o, v in zip(out, step)) + out[len(step) :]
      s = s.replace(
        st=nxt.st,
        pending=nxt.pending,
        done=nxt.done,
        gen=nxt.gen,
        step=s.step + (~s.done).astype(jnp.int32),
        n_cand=nxt.n_cand,
        n_acc=nxt.n_acc,
      )
      return i + 1, s, out

    cond = lambda c: (c[0] < k_steps) & jnp.any(~c[1].done)
    i, s, out = jax.lax.while_loop(cond, body, (jnp.int32(0), s, out0))
    put = lambda full, part: jax.lax.dynamic_update_slice(full, part, (0,) * full.ndim)
    s_all = jax.tree_util.tree_map(put, s_all, s)
    return s_all, (out, s.done, s.n_cand, s.n_acc, i)

  # ---- host API ----------------------------------------------------------------------------
  def admit(self, i: int, prompt_ids: np.ndarray, row: RowParams):
    """Prefill ``prompt_ids`` (1 <= size < context) into slot ``i`` (a free one)."""
    self.admit_many([(i, prompt_ids, row)])

  def admit_many(self, entries):
    """Prefill each ``(slot, prompt_ids, RowParams)`` of ``entries`` into its (free) slot: the
    prompts of one bucket ``ADMIT_ROWS`` at a time (one prefill of several rows costs little
    more than one of a row). A prompt longer than ``chunked_from`` bytes is only staged: it
    is fed a piece at a time by ``prefill_step``, and its slot decodes once it is in."""
    by_bucket = {}
    for e in entries:
      if e[1].size > self.chunked_from:
        self._note(*e)
        self._staged[e[0]] = [None, e[1], 0, e[2]]
        continue
      by_bucket.setdefault(bucket_of(int(e[1].size), self.context), []).append(e)
    for bucket, todo in sorted(by_bucket.items()):
      m = ADMIT_ROWS[-1] if len(todo) > 1 else 1
      for k in range(0, len(todo), m):
        self._admit_rows(bucket, m, todo[k : k + m])

  def _admit_rows(self, bucket: int, m: int, entries):
    prompt = np.zeros((m, bucket), np.int32)
    prompt[:, 0] = vocab.BYTE_OFFSET  # padding rows: a one-byte prompt, dropped
    plen = np.ones((m,), np.int32)
    idx = np.full((m,), self.batch, np.int32)
    rows = [RowParams(1)] * m
    for r, (i, ids, row) in enumerate(entries):
      prompt[r, : ids.size] = ids
      plen[r], idx[r], rows[r] = ids.size, i, row
      self._note(i, ids, row)
    args = (self.params, self.slots, idx, prompt, plen, self._row_values(rows))
    exe = self._compiled(("admit", bucket, m), self._admit_fn, args, donate=(1,))
    self.slots = exe(*args)

  def _note(self, i: int, ids: np.ndarray, row: RowParams):
    self._lengths[i] = ids.size
    self._greedy[i] = row.temperature == 0
    self._logprobs[i] = row.logprobs

  @staticmethod
  def _row_values(rows):
    return (
      np.array([x.budget for x in rows], np.int32),
      np.array([x.ignore_eos for x in rows], bool),
      np.stack([seed_key_words(x.seed) for x in rows]),
      np.array([x.tau for x in rows], np.float32),
      np.array([x.temperature for x in rows], np.float32),
      np.array([x.top_k for x in rows], np.int32),
      np.array([x.top_p for x in rows], np.float32),
    )

  @property
  def staged(self) -> frozenset:
    """The slots whose prompts are still being prefilled (not decoded yet)."""
    return frozenset(self._staged)

  def discard(self, i: int):
    """Forget slot ``i``'s staged prompt (its request went away)."""
    self._staged.pop(i, None)

  def prefill_step(self) -> Optional[int]:
    """Feed one piece (``piece`` bytes) of the first staged prompt; its slot when that prompt
    is now wholly in (the slot decodes from the next chunk), else None."""
    if not self._staged:
      return None
    i = next(iter(self._staged))
    entry = self._staged[i]
    st, ids, pos, row = entry
    n = min(self.piece, ids.size - pos)
    buf = np.full((1, self.piece), vocab.BYTE_OFFSET, np.int32)
    buf[0, :n] = ids[pos : pos + n]
    k = np.array([n], np.int32)
    if st is None:
      fn = lambda params, piece, k: self._piece_fn(params, None, piece, k)
      st = self._compiled(("piece", True), fn, (self.params, buf, k))(self.params, buf, k)
    else:
      args = (self.params, st, buf, k)
      st = self._compiled(("piece", False), self._piece_fn, args, donate=(1,))(*args)
    entry[0], entry[2] = st, pos + n
    if entry[2] < ids.size:
      return None
    del self._staged[i]
    args = (self.slots, np.array([i], np.int32), st, self._row_values([row]))
    self.slots = self._compiled(("place",), self._place_fn, args, donate=(0,))(*args)
    return i

  def decode(
    self,
    k_steps: int,
    active_B: np.ndarray,
    width: int = 0,
    span: int = 0,
    greedy: Optional[bool] = None,
    logprobs: Optional[bool] = None,
  ) -> Chunk:
    """Up to ``k_steps`` steps of every active slot (``active_B``; the others stop at once),
    decoding the first ``width`` slots (one of ``widths``) over the first ``span`` bytes of
    their caches (one of ``spans``); 0: the least that holds them. ``greedy`` (the greedy
    program) and ``logprobs`` (record log-probabilities): None, from the active rows."""
    active_B = np.asarray(active_B, bool)
    if not width:
      last = int(np.flatnonzero(active_B)[-1]) + 1 if active_B.any() else 1
      width = next(w for w in widths(self.batch) if w >= last)
    if not span:  # the least cache that holds every active row after the chunk's steps
      w = self.plan.width
      need = int(np.max(self._lengths[active_B], initial=0)) + k_steps * w + 2 * w + 1
      span = next(n for n in spans(self.length) if n >= need)
    if greedy is None:
      greedy = bool(np.all(self._greedy[active_B]))
    if logprobs is None:
      logprobs = bool(np.any(self._logprobs[active_B]))
    if logprobs and self.group.mode != "ntp":
      raise ValueError("log-probabilities are recorded in ntp mode only")
    top = TOP_LOGPROBS if logprobs else 0
    args = (self.params, self.slots, active_B[:width])
    fn = lambda *a: self._decode_fn(k_steps, width, span, greedy, top, *a)
    exe = self._compiled(("decode", k_steps, width, span, greedy, top), fn, args, donate=(1,))
    self.slots, out = exe(*args)
    (d, a, lp, top_ids, top_lp), done, n_cand, n_acc, steps = jax.device_get(out)
    self._lengths[:width] += a.sum(axis=0)
    if not top:
      lp = top_ids = top_lp = None
    return Chunk(d, a, done, n_cand, n_acc, int(steps), lp, top_ids, top_lp)

  def warm(self, k_steps: int, sampled: bool = True):
    """Compile ``admit`` for every prompt bucket and ``decode`` for every width and span, the
    greedy program and (``sampled``) the sampled one (nothing is decoded: the admitted rows
    are never activated)."""
    for b in buckets(self.context):
      if b > bucket_of(min(self.chunked_from, self.context - 1), self.context):
        break  # longer prompts are fed in pieces
      ids = np.full((min(b, self.context - 1),), vocab.BYTE_OFFSET, np.int32)
      for m in ADMIT_ROWS:
        self._admit_rows(b, m, [(0, ids, RowParams(1))])
    if self.context - 1 > self.chunked_from:  # the pieces' programs
      ids = np.full((self.piece + 1,), vocab.BYTE_OFFSET, np.int32)
      self._staged[0] = [None, ids, 0, RowParams(1)]
      while self.prefill_step() is None:
        pass
    for greedy in (True, False) if sampled else (True,):
      for w in widths(self.batch):
        for n in spans(self.length):
          self.decode(k_steps, np.zeros((self.batch,), bool), w, n, greedy, False)

  @property
  def compiled(self) -> int:
    return self._exe.built
