"""A fixed-size batch of decode slots: prefill one request into a free slot, then decode every
slot a chunk of steps at a time (the server's continuous batching, ``serve.scheduler``).

The decode engine (``decode.engine``) runs a whole ``generate`` call as one ``while_loop`` over
one batch; here the same pieces run a batch whose rows come and go: ``admit`` prefills one
prompt (``incremental.prefill``) and writes its caches into row ``i`` of the batch's caches
(``Slots.st``), and ``decode`` runs up to K steps of the mode's policy (``decode.policies``:
``propose`` / ``commit``) for every row at once, recording each step's bytes. Rows are
independent: each has its own byte budget, eos handling, step counter and PRNG key (so a
seeded request draws the same bytes whichever slot and batch it lands in), temperature,
top-k, top-p and tau. What is static, and so one batch per value: the mode, ``n`` and greedy
or sampled (``GroupKey``). A chunk decodes only the first w slots, w the smallest of
``widths(B)`` (1, 2, 4, ..., B) that holds every active row (the scheduler fills the lowest
free slot first): one request alone steps a batch of 1, not of B, whose caches every step
would read. Likewise it reads only the first quarter of the caches (``spans``) while every
active row fits there after the chunk (the cache fields cut to that length: a smaller cache of
the same rows), so short requests on a long context step as fast as on a short one. Shapes are
fixed: B slots, a cache of ``length`` bytes for every row, prompts padded to a power-of-two
bucket; so after one compile per (group, bucket, rows) for ``admit`` and one per (group, width,
span) for ``decode``, no request compiles anything.

Shapes: B slots, w decoded slots, L cache bytes, P padded prompt, K steps per chunk, W bytes fed
per step.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lca_jax import vocab
from lca_jax.decode import engine
from lca_jax.decode.policies import POLICIES, Ctx, LoopState, Plan
from lca_jax.decode.sampling import SamplingParams
from lca_jax.model import incremental
from lca_jax.model.incremental import DecodeState
from lca_jax.model.kv_cache import KVCache

MIN_BUCKET = 16  # the shortest padded prompt
ADMIT_ROWS = (1, 4)  # prompts one prefill takes (padded with dropped rows)
SPAN_FROM = 256  # caches of this many slots or more may be read a quarter at a time


class GroupKey(NamedTuple):
  """What a batch's programs are compiled for: rows of one batch share these."""

  mode: str
  n: int  # bytes proposed per step (1 in ntp)
  greedy: bool


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
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0


class Chunk(NamedTuple):
  """What one ``decode`` call committed, on the host, for the first w slots (the others were
  not decoded)."""

  d_KwW: np.ndarray  # bytes fed at each step
  a_Kw: np.ndarray  # bytes each row committed at each step (the first a of d)
  done_w: np.ndarray
  n_cand_w: np.ndarray
  n_acc_w: np.ndarray
  steps: int  # steps run (K, or fewer when every row finished)

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


def _cut(d_BW, a_B, s: Slots):
  """Each row's accepted bytes cut at eos (unless the row ignores it) and at its budget (the
  engine's ``_finalize`` with per-row eos handling and budgets)."""
  a = jnp.where(s.done, 0, a_B)
  is_eos = (d_BW == vocab.EOS_ID) & (jnp.arange(d_BW.shape[1])[None] < a[:, None])
  is_eos = is_eos & ~s.ignore_eos[:, None]
  hit = jnp.any(is_eos, axis=1)
  a = jnp.where(hit, jnp.argmax(is_eos, axis=1) + 1, a)
  a = jnp.minimum(a, s.budget - s.gen)
  return a, s.done | hit | (s.gen + a >= s.budget)


class SlotBatch:
  """B slots of one ``GroupKey`` on one model, with a context of ``context`` bytes (prompt +
  generation per row; at most the model's ``max_seq_len``)."""

  def __init__(self, model, group: GroupKey, batch: int, context: int, on_compile=None):
    self.model, self.group, self.batch, self.context = model, group, batch, context
    cfg = model.cfg
    policy = POLICIES[group.mode]
    source = ("mlp" if cfg.n_mlp_mbp else "lca") if policy.multi_byte else ""
    # capacity is unused here (no per-step arrays; budgets are per row)
    self.plan = Plan(group.mode, group.n, group.greedy, False, context, source)
    self.length = max(buckets(context)[-1], context) + 2 * self.plan.width + 1
    self.on_compile = on_compile
    self._exe = {}
    self.params = engine._params_of(model, self.plan)  # pylint: disable=protected-access
    self.slots = self._empty()
    self._lengths = np.zeros((batch,), np.int64)  # each slot's committed bytes (host copy)

  # ---- programs ----------------------------------------------------------------------------
  def _compiled(self, name, fn, args, donate=()):
    if name not in self._exe:
      t0 = time.perf_counter()
      lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
      self._exe[name] = engine.compile_lowered(lowered)
      if self.on_compile is not None:
        self.on_compile(self.group, name, time.perf_counter() - t0)
    return self._exe[name]

  def _ctx(self, params, s: Slots) -> Ctx:
    cfg = self.model.cfg
    p = engine._decode_params(self.plan, params, cfg.dtype)  # pylint: disable=protected-access
    sp = SamplingParams(s.temperature, s.top_k, s.top_p)
    return Ctx(cfg, None, p, None, self.plan, s.tau[:, None], s.budget, sp)

  def _empty(self) -> Slots:
    cfg, plan, b = self.model.cfg, self.plan, self.batch

    def build(params):
      p = engine._decode_params(plan, params, cfg.dtype)  # pylint: disable=protected-access
      st = incremental.init_state(
        cfg, p, b, self.length, plan.policy.target_mbp, plan.copies_in_extend
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
        top_k=zi,
        top_p=zf + 1.0,
        n_cand=zi,
        n_acc=zi,
      )

    return jax.jit(build)(self.params)

  def _admit_fn(self, params, s: Slots, idx_m, prompt_mP, plen_m, rows):
    cfg, plan = self.model.cfg, self.plan
    p = engine._decode_params(plan, params, cfg.dtype)  # pylint: disable=protected-access
    st_m = incremental.prefill(
      cfg, p, prompt_mP, plen_m, self.length, plan.policy.target_mbp, plan.copies_in_extend
    )
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
      top_k=at(s.top_k, top_k),
      top_p=at(s.top_p, top_p),
      n_cand=at(s.n_cand, 0),
      n_acc=at(s.n_acc, 0),
    )

  def _decode_fn(self, k_steps, width, span, params, s_all: Slots, active_w):
    plan = self.plan
    policy = plan.policy
    w = plan.width
    s = jax.tree_util.tree_map(lambda x: x[:width], s_all)  # the first ``width`` slots
    if span < self.length:  # ... and the first ``span`` bytes of their caches
      cut = lambda x, axis, n: jax.lax.slice_in_dim(x, 0, n, axis=axis)
      s = s.replace(st=_span_view(s.st, span, cut))
    s = s.replace(done=s.done | ~active_w)
    ctx = self._ctx(params, s)
    d0 = jnp.zeros((k_steps, width, w), jnp.int32)
    a0 = jnp.zeros((k_steps, width), jnp.int32)

    def body(c):
      i, s, d_KwW, a_Kw = c
      if plan.greedy:  # no draw: one unused key for the batch
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
      prop = policy.propose(ctx, loop, k_draft, k_acc)
      a, done = _cut(prop.d_BK, prop.a_B, s)
      nxt = policy.commit(ctx, loop, prop, a, done)
      acc = jnp.maximum(a - policy.head_bytes, 0)
      s = s.replace(
        st=nxt.st,
        pending=nxt.pending,
        done=done,
        gen=s.gen + a,
        step=s.step + (~s.done).astype(jnp.int32),
        n_cand=s.n_cand + prop.n_cand_B,
        n_acc=s.n_acc + jnp.where(prop.n_cand_B > 0, acc, 0),
      )
      return i + 1, s, d_KwW.at[i].set(prop.d_BK), a_Kw.at[i].set(a)

    cond = lambda c: (c[0] < k_steps) & jnp.any(~c[1].done)
    i, s, d_KwW, a_Kw = jax.lax.while_loop(cond, body, (jnp.int32(0), s, d0, a0))
    put = lambda full, part: jax.lax.dynamic_update_slice(full, part, (0,) * full.ndim)
    s_all = jax.tree_util.tree_map(put, s_all, s)
    return s_all, (d_KwW, a_Kw, s.done, s.n_cand, s.n_acc, i)

  # ---- host API ----------------------------------------------------------------------------
  def admit(self, i: int, prompt_ids: np.ndarray, row: RowParams):
    """Prefill ``prompt_ids`` (1 <= size < context) into slot ``i`` (a free one)."""
    self.admit_many([(i, prompt_ids, row)])

  def admit_many(self, entries):
    """Prefill each ``(slot, prompt_ids, RowParams)`` of ``entries`` into its (free) slot: the
    prompts of one bucket ``ADMIT_ROWS`` at a time (one prefill of several rows costs little
    more than one of a row)."""
    by_bucket = {}
    for e in entries:
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
      self._lengths[i] = ids.size
    seeds = [int(x.seed) & (2**64 - 1) for x in rows]  # a PRNG key takes any 64-bit integer
    vals = (
      np.array([x.budget for x in rows], np.int32),
      np.array([x.ignore_eos for x in rows], bool),
      np.array([[v >> 32, v & 0xFFFFFFFF] for v in seeds], np.uint32),
      np.array([x.tau for x in rows], np.float32),
      np.array([x.temperature for x in rows], np.float32),
      np.array([x.top_k for x in rows], np.int32),
      np.array([x.top_p for x in rows], np.float32),
    )
    args = (self.params, self.slots, idx, prompt, plen, vals)
    exe = self._compiled(("admit", bucket, m), self._admit_fn, args, donate=(1,))
    self.slots = exe(*args)

  def decode(self, k_steps: int, active_B: np.ndarray, width: int = 0, span: int = 0) -> Chunk:
    """Up to ``k_steps`` steps of every active slot (``active_B``; the others stop at once),
    decoding the first ``width`` slots (one of ``widths``) over the first ``span`` bytes of
    their caches (one of ``spans``); 0: the least that holds them."""
    active_B = np.asarray(active_B, bool)
    if not width:
      last = int(np.flatnonzero(active_B)[-1]) + 1 if active_B.any() else 1
      width = next(w for w in widths(self.batch) if w >= last)
    if not span:  # the least cache that holds every active row after the chunk's steps
      w = self.plan.width
      need = int(np.max(self._lengths[active_B], initial=0)) + k_steps * w + 2 * w + 1
      span = next(n for n in spans(self.length) if n >= need)
    args = (self.params, self.slots, active_B[:width])
    fn = lambda *a: self._decode_fn(k_steps, width, span, *a)
    exe = self._compiled(("decode", k_steps, width, span), fn, args, donate=(1,))
    self.slots, out = exe(*args)
    d, a, done, n_cand, n_acc, steps = jax.device_get(out)
    self._lengths[:width] += a.sum(axis=0)
    return Chunk(d, a, done, n_cand, n_acc, int(steps))

  def warm(self, k_steps: int):
    """Compile ``admit`` for every prompt bucket and ``decode`` for every width and span
    (nothing is decoded: the admitted rows are never activated)."""
    for b in buckets(self.context):
      ids = np.full((min(b, self.context - 1),), vocab.BYTE_OFFSET, np.int32)
      for m in ADMIT_ROWS:
        self._admit_rows(b, m, [(0, ids, RowParams(1))])
    for w in widths(self.batch):
      for n in spans(self.length):
        self.decode(k_steps, np.zeros((self.batch,), bool), w, n)

  @property
  def compiled(self) -> int:
    return len(self._exe)
