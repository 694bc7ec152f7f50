"""Decoding modes as policies over the incremental forward (docs/design.md §6.3).

A policy says, for one step of the decode loop (``engine``), what to draft and feed
(``propose``: the bytes of the step and how many of them each row accepts) and how to commit
what was accepted (``commit``: the caches after the step, a byte forced on the next step). The
loop around it (keys, the eos / byte-budget cut, streaming, counters, the ``while_loop``) is the
same for every mode, so adding a mode is one ``register(Policy subclass())`` here or in user
code: ``generate(mode=name)`` then accepts it.

  * ``ntp``: one byte per step from the next-byte head.
  * ``threshold``: next byte from the NT head, then MBP candidates accepted left to right while
    their probability is >= tau (n bytes proposed per step, n chosen at call time).
  * ``verify``: the MBP head drafts, the NT head verifies in one extend of n bytes; greedy output
    equals ``ntp`` exactly; with sampling, speculative sampling keeps the NT distribution.
  * ``drafter``: a second model verifies what this (LCA-MBP or MLP-MBP) model drafts; the output
    equals the verifier's own decoding.
MLP-MBP models draft from their MLP heads in every multi-byte mode. Rows of a batch advance
independently (ragged prompts, per-row acceptance, per-row stop at eos or the byte budget).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, NamedTuple, Optional

import flax.struct
import jax
import jax.numpy as jnp

from lca_jax.decode.sampling import (
  SamplingParams,
  choose,
  log_probs,
  row_greedy,
  speculative_accept,
  split2,
)
from lca_jax.model import incremental
from lca_jax.model.config import ModelConfig
from lca_jax.model.incremental import DecodeState


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about a decode call (one compilation per Plan and shape)."""

  mode: str
  n: int  # bytes proposed per step (1 in ntp)
  greedy: bool
  ignore_eos: bool
  # bytes the program has room for (its step bound, per-step arrays and PRNG keys); each call
  # passes its own byte budget (<= capacity) as a traced argument (``Ctx.budget``), so calls
  # whose budgets round to the same capacity share one executable (``budget_pad_to``)
  capacity: int
  source: str  # where candidates come from: "lca", "mlp" or "" (ntp)
  stream: bool = False  # call the host sink with each step's committed bytes
  # decode with fused q/k/v and gate/up kernels (``layers.fuse_decode_params``); False only
  # to measure or test against the separate dots
  fuse_projections: bool = True

  @property
  def policy(self) -> "Policy":
    return POLICIES[self.mode]

  @property
  def max_steps(self) -> int:
    return 2 * self.capacity + 2

  @property
  def copies_in_extend(self) -> int:
    return self.policy.copies_in_extend(self)

  @property
  def width(self) -> int:  # bytes fed per step
    return self.n


@dataclasses.dataclass(frozen=True)
class Ctx:
  """What a step sees besides the loop state: the target model (and drafter), the plan and
  the traced decoding parameters."""

  cfg: ModelConfig
  dcfg: Optional[ModelConfig]
  params: Any
  dparams: Any
  plan: Plan
  tau: jax.Array
  budget: jax.Array  # [] int32 bytes each row may generate in this call (<= plan.capacity)
  sp: SamplingParams


@flax.struct.dataclass
class LoopState:
  """The decode loop's carry. B rows, M = ``plan.max_steps``."""

  st: DecodeState  # the target model's caches
  dst: Optional[DecodeState]  # the drafter's caches (drafter mode), else None
  keys: jax.Array  # [M, 2, 2] uint32: each step's (draft, accept) PRNG keys
  pending: jax.Array  # [B] int32 byte forced as the next step's first byte, -1 = none
  done: jax.Array  # [B] bool: the row stopped (eos or budget)
  gen: jax.Array  # [B] int32 bytes generated
  step: jax.Array  # [] int32 steps taken
  per_step: jax.Array  # [M, B] int32 bytes committed at each step
  n_cand: jax.Array  # [B] int32 candidates proposed
  n_acc: jax.Array  # [B] int32 candidates accepted
  closed0: jax.Array  # [B] int32 closed groups after the prompt


class Proposal(NamedTuple):
  """One step's bytes and acceptance, before the loop cuts them at eos and the budget."""

  d_BK: jax.Array  # [B, width] bytes fed (drafted) this step
  a_B: jax.Array  # [B] leading bytes each row accepts
  n_cand_B: jax.Array  # [B] candidates this step proposed (for the acceptance rate)
  pending_B: jax.Array  # [B] byte forced next step (-1 none), before the stop cut
  fed: Any = None  # what ``commit`` needs (e.g. the extended caches to roll back)


def leading(ok_BN):
  """Length of each row's leading run of True."""
  return jnp.sum(jnp.cumprod(ok_BN.astype(jnp.int32), axis=-1), axis=-1)


def draft(cfg: ModelConfig, params, st: DecodeState, plan: Plan, key, sp, pending):
  """n drafted bytes [B, n] from a model's state: the next byte (or the pending one) then
  n - 1 candidates of its multi-byte head; their probabilities and draft log-probs [B, n, V]
  and whether the first byte was forced. ``key``: one, or one per row ([B, 2])."""
  k1, k2 = split2(key)
  t1, p1, l1 = choose(st.last_nt, k1, sp, plan.greedy)
  forced = pending >= 0
  t1 = jnp.where(forced, pending, t1)
  if plan.n == 1:
    return t1[:, None], p1[:, None], l1[:, None], forced
  if plan.source == "mlp":
    cand = st.last_mlp[:, : plan.n - 1]
  else:
    cand = st.last_mbp[:, None]
    if plan.n > 2:  # threshold mode computed the copies during the last extend
      copies = (
        st.last_copies
        if plan.copies_in_extend
        else incremental.mbp_copies(cfg, params, st, plan.n - 2)
      )
      cand = jnp.concatenate([cand, copies], axis=1)
  tc, pc, lc = choose(cand, k2, sp, plan.greedy)
  return (
    jnp.concatenate([t1[:, None], tc], 1),
    jnp.concatenate([p1[:, None], pc], 1),
    jnp.concatenate([l1[:, None], lc], 1),
    forced,
  )


class Policy:
  """A decoding mode. Subclasses set ``name`` and implement ``propose`` / ``commit``."""

  name: str = ""
  multi_byte: bool = True  # needs n >= 2 and a model (or drafter) with a multi-byte head
  uses_drafter: bool = False  # candidates come from a second model
  target_mbp: bool = False  # the target model's caches also run its multi-byte head
  uses_tau: bool = False  # the acceptance threshold tau matters (a sweep varies it)
  # leading bytes of a step that come from the model's own next-byte head, not candidates: a
  # step that commits c bytes accepted c - head_bytes candidates, at most n - head_bytes
  head_bytes: int = 1

  def copies_in_extend(self, plan: Plan) -> int:
    """LCA-MBP copies each extend computes along for the next step's draft."""
    return 0

  def init(self, ctx: Ctx, loop: LoopState, prompt_BP, plen_B) -> LoopState:
    """Extra state after the target's prefill (e.g. the drafter's caches)."""
    return loop

  def propose(self, ctx: Ctx, loop: LoopState, k_draft, k_acc) -> Proposal:
    raise NotImplementedError

  def commit(self, ctx: Ctx, loop: LoopState, prop: Proposal, a_B, done_B) -> LoopState:
    """The loop with ``st`` / ``dst`` / ``pending`` after the step (``a_B`` bytes committed)."""
    raise NotImplementedError


POLICIES: Dict[str, Policy] = {}


def register(policy: Policy) -> Policy:
  """Make ``policy`` available as ``generate(mode=policy.name)``."""
  if not policy.name:
    raise ValueError("a decoding policy needs a name")
  POLICIES[policy.name] = policy
  return policy


def _idle(loop: LoopState, n):
  """n candidates per step for rows still running."""
  return jnp.where(loop.done, 0, n)


class NextByte(Policy):
  name = "ntp"
  multi_byte = False

  def propose(self, ctx, loop, k_draft, k_acc):
    d, _, _, _ = draft(ctx.cfg, ctx.params, loop.st, ctx.plan, k_draft, ctx.sp, loop.pending)
    ones = jnp.ones_like(loop.pending)
    return Proposal(d, ones, jnp.zeros_like(ones), jnp.full_like(ones, -1))

  def commit(self, ctx, loop, prop, a_B, done_B):
    st, _ = incremental.extend(
      ctx.cfg,
      ctx.params,
      loop.st,
      prop.d_BK,
      a_B,
      self.target_mbp,
      ctx.plan.copies_in_extend,
      last_only=True,
    )
    return loop.replace(st=st, pending=prop.pending_B)


class Threshold(NextByte):
  """Never rolls back: the extend feeds only the accepted bytes and also reads the next step's
  copies."""

  name = "threshold"
  multi_byte = True
  target_mbp = True
  uses_tau = True

  def copies_in_extend(self, plan):
    return plan.n - 2 if plan.source == "lca" else 0

  def propose(self, ctx, loop, k_draft, k_acc):
    d, p, _, _ = draft(ctx.cfg, ctx.params, loop.st, ctx.plan, k_draft, ctx.sp, loop.pending)
    a = 1 + leading(p[:, 1:] >= ctx.tau)
    return Proposal(d, a, _idle(loop, ctx.plan.n - 1), jnp.full_like(loop.pending, -1))


class Verify(Policy):
  name = "verify"
  target_mbp = True

  def propose(self, ctx, loop, k_draft, k_acc):
    plan = ctx.plan
    d, _, lq, _ = draft(ctx.cfg, ctx.params, loop.st, plan, k_draft, ctx.sp, loop.pending)
    full = jnp.full_like(loop.pending, plan.n)
    st_x, out = incremental.extend(ctx.cfg, ctx.params, loop.st, d, full, True)
    check = out["nt_logits"][:, : plan.n - 1]  # position t+1+i predicts d_{i+2}
    pending = jnp.full_like(loop.pending, -1)
    a = 1 + leading(d[:, 1:] == jnp.argmax(check, axis=-1))
    if not plan.greedy:  # speculative sampling, except in the rows that decode greedily
      n_acc, repl = speculative_accept(d[:, 1:], lq[:, 1:], log_probs(check, ctx.sp), k_acc)
      g = row_greedy(ctx.sp, a.shape)
      a = jnp.where(g, a, 1 + n_acc)
      pending = jnp.where(~g & (n_acc < plan.n - 1), repl, -1)
    return Proposal(d, a, _idle(loop, plan.n - 1), pending, (st_x, out))

  def commit(self, ctx, loop, prop, a_B, done_B):
    st_x, out = prop.fed
    st = incremental.rollback(st_x, loop.st, out, a_B)
    pending = jnp.where(done_B, -1, prop.pending_B)
    return loop.replace(st=st, pending=pending)


class Drafter(Policy):
  name = "drafter"
  uses_drafter = True
  head_bytes = 0  # every byte the drafter drafts is a candidate the target checks

  def init(self, ctx, loop, prompt_BP, plen_B):
    length = loop.st.ids.shape[1]
    dst = incremental.prefill(ctx.dcfg, ctx.dparams, prompt_BP, plen_B, length, True)
    return loop.replace(dst=dst)

  def propose(self, ctx, loop, k_draft, k_acc):
    plan, st = ctx.plan, loop.st
    d, _, lq, forced = draft(ctx.dcfg, ctx.dparams, loop.dst, plan, k_draft, ctx.sp, loop.pending)
    width = plan.n
    full = jnp.full_like(loop.pending, width)
    st_x, out = incremental.extend(ctx.cfg, ctx.params, st, d, full, False)
    target = jnp.concatenate([st.last_nt[:, None], out["nt_logits"]], axis=1)  # [B, n+1, V]
    best = jnp.argmax(target, axis=-1).astype(jnp.int32)
    a = leading(d == best[:, :width])
    bonus = jnp.take_along_axis(best, a[:, None], 1)[:, 0]
    if not plan.greedy:  # speculative sampling, except in the rows that decode greedily
      lp = log_probs(target, ctx.sp)
      lq = lq.at[:, 0].set(jnp.where(forced[:, None], lp[:, 0], lq[:, 0]))
      a_s, repl = speculative_accept(d, lq, lp[:, :width], k_acc)
      tail = jax.random.categorical(jax.random.fold_in(k_acc, 1), lp[:, width]).astype(jnp.int32)
      g = row_greedy(ctx.sp, a.shape)
      bonus = jnp.where(g, bonus, jnp.where(a_s < width, repl, tail))
      a = jnp.where(g, a, a_s)
    return Proposal(d, a, _idle(loop, width), bonus, (st_x, out))

  def commit(self, ctx, loop, prop, a_B, done_B):
    st_x, out = prop.fed
    st = incremental.rollback(st_x, loop.st, out, a_B)
    dst, _ = incremental.extend(
      ctx.dcfg, ctx.dparams, loop.dst, prop.d_BK, a_B, True, last_only=True
    )
    pending = jnp.where(done_B, -1, prop.pending_B)
    return loop.replace(st=st, dst=dst, pending=pending)


register(NextByte())
register(Threshold())
register(Verify())
register(Drafter())
