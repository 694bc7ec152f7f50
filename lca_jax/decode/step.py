"""One decode step of every row, shared by ``generate``'s loop (``engine``) and the server's
slot batch (``batch``): the mode's policy proposes bytes, each row's accepted bytes are cut at
eos and its byte budget, the policy commits them, and the row's counters advance.
"""

from __future__ import annotations

from typing import Tuple, Union

import jax
import jax.numpy as jnp

from lca_jax import vocab
from lca_jax.decode.policies import Ctx, LoopState, Proposal


def cut(d_BK, a_B, done_B, gen_B, budget, ignore_eos: Union[bool, jax.Array]):
  """Each row's accepted bytes (the first ``a_B`` of ``d_BK``) cut at eos, unless the row
  ignores it, and at its byte ``budget`` ([] or [B]); and whether the row is done after them.
  ``ignore_eos``: a Python bool for every row, or a [B] bool array (one per row)."""
  a = jnp.where(done_B, 0, a_B)
  done = done_B
  if ignore_eos is not True:
    is_eos = (d_BK == vocab.EOS_ID) & (jnp.arange(d_BK.shape[1])[None] < a[:, None])
    if ignore_eos is not False:
      is_eos = is_eos & ~ignore_eos[:, None]
    hit = jnp.any(is_eos, axis=1)
    a = jnp.where(hit, jnp.argmax(is_eos, axis=1) + 1, a)
    done = done | hit
  a = jnp.minimum(a, budget - gen_B)
  return a, done | (gen_B + a >= budget)


def advance(
  ctx: Ctx, loop: LoopState, k_draft, k_acc, ignore_eos
) -> Tuple[LoopState, Proposal, jax.Array]:
  """One step: (the loop after it, the policy's proposal, bytes each row committed [B]).
  Updates ``st`` / ``dst`` / ``pending`` (the policy), ``done``, ``gen``, ``n_cand`` and
  ``n_acc``; the caller keeps its own step counters."""
  policy = ctx.plan.policy
  prop = policy.propose(ctx, loop, k_draft, k_acc)
  a, done = cut(prop.d_BK, prop.a_B, loop.done, loop.gen, ctx.budget, ignore_eos)
  nxt = policy.commit(ctx, loop, prop, a, done)
  acc = jnp.maximum(a - policy.head_bytes, 0)  # candidates among the committed bytes
  nxt = nxt.replace(
    done=done,
    gen=loop.gen + a,
    n_cand=loop.n_cand + prop.n_cand_B,
    n_acc=loop.n_acc + jnp.where(prop.n_cand_B > 0, acc, 0),
  )
  return nxt, prop, a
