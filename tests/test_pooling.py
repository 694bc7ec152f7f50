"""O(T) down/upsampling (lca_jax.model.pooling) against the dense B x T x S formulation.

The dense reference is upstream's (docs/design.md §2.6): with c_t = cumsum(b)_t - b_t and group
columns s = 0..K-1, foo[t, s] = s - c_t, lel = 1 - foo where foo == 0 else 0, normalised over t
(+1e-9); pooled group s = sum_t lel[t, s] h_t, and the null vector goes in front. b carries the
straight-through values b = hard - stop_grad(soft) + soft, so gradients reach ``soft`` only
through c_t. Upsampling is the one-hot matrix M[t, s] = 1[s == u_t], u_t = cumsum(b)_t.

The slot layout (one null slot per document, then one slot per closed group; capacity rule) is
checked against a brute-force walk over the bytes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_rel, segmented_layout

from lca_jax.model import pooling

B, T, D = 3, 24, 5
plan_latents = jax.jit(pooling.plan_latents, static_argnums=2)


# ---------------------------------------------------------------------------- brute force plan
def brute_plan(hard, doc, n_slots):
  """Per row: pool slot per byte (-1: not pooled), read slot per byte (-1: reads zeros),
  null slots, and the number of closed / overflowed groups. Walks the bytes in order."""
  res = []
  for bh, dd in zip(hard, doc):
    n = len(bh)
    pool, read = np.full(n, -1), np.full(n, -1)
    nulls, closed, overflow = [], 0, 0
    next_slot, cur_doc, null_slot, last_slot, members = 0, None, None, None, []
    for t in range(n):
      if dd[t] == 0:  # padding: pools nothing, reads nothing
        continue
      if dd[t] != cur_doc:  # a document starts: its null slot
        cur_doc, null_slot, last_slot, members = dd[t], next_slot, next_slot, []
        nulls.append(null_slot)
        next_slot += 1
      members.append(t)
      if bh[t]:  # byte t closes its group: the group gets the next slot
        closed += 1
        if next_slot < n_slots:
          pool[members] = next_slot
        else:
          overflow += 1
        last_slot, members = next_slot, []
        next_slot += 1
      # capacity rule: a slot past the capacity is read as slot S-1 when it is in the document
      r = min(last_slot, n_slots - 1)
      read[t] = r if r >= null_slot else -1
    res.append(
      dict(
        pool=pool,
        read=read,
        nulls=[s for s in nulls if s < n_slots],
        closed=closed,
        overflow=overflow,
      )
    )
  return res


# ---------------------------------------------------------------------------- dense references
def dense_downsample_groups(h_BTD, b_BT, n_groups):
  """Upstream: [B, K, D] pooled groups 0..K-1 (no null), K = n_groups (static)."""
  c = jnp.cumsum(b_BT, axis=1) - b_BT  # [B,T]
  s = jnp.arange(n_groups, dtype=h_BTD.dtype)
  foo = s[None, None, :] - c[:, :, None]  # [B,T,S]
  lel = jnp.where(foo == 0, 1.0 - foo, 0.0)
  lel = lel / (jnp.sum(lel, axis=1, keepdims=True) + 1e-9)
  return jnp.einsum("btd,bts->bsd", h_BTD, lel)


def dense_upsample(z_BSD, read_BT):
  """One-hot [B,T,S] matrix times z; read = -1 gives a zero row."""
  onehot = (read_BT[:, :, None] == jnp.arange(z_BSD.shape[1])[None, None, :]).astype(z_BSD.dtype)
  return jnp.einsum("bts,bsd->btd", onehot, z_BSD)


# ---------------------------------------------------------------------------- inputs
def _case(packing, seed):
  rng = np.random.default_rng(seed)
  h = rng.standard_normal((B, T, D)).astype(np.float32)
  soft = rng.uniform(0.02, 0.98, (B, T)).astype(np.float32)
  soft[1, :] = np.minimum(soft[1, :], 0.4)  # row 1: no boundary at all in concat mode
  soft[2, -1] = 0.9  # row 2: the last byte closes, nothing is left open
  if packing == "concat":
    doc = np.ones((B, T), np.int32)
  else:
    lay = [segmented_layout(ls, T)[0] for ls in ((7, 9, 5), (T,), (3, 10, 11))]
    doc = np.stack(lay)
    nxt = np.concatenate([doc[:, 1:], doc[:, -1:]], 1)
    soft = np.where((nxt != doc) & (doc != 0), 0.9, soft).astype(np.float32)  # forced closes
    soft = np.where(doc == 0, 0.1, soft).astype(np.float32)
  hard = (soft > 0.5).astype(np.float32)
  return h, soft, hard, doc


def _st(soft, hard, doc):
  b = hard - jax.lax.stop_gradient(soft) + soft
  return b * (doc != 0)


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize(
  "packing,n_slots", [("concat", T + 1), ("concat", 6), ("segmented", T + 1), ("segmented", 7)]
)
def test_plan_matches_brute_force(packing, n_slots):
  _, _, hard, doc = _case(packing, 0)
  plan = jax.tree_util.tree_map(np.asarray, plan_latents(hard, doc, n_slots))
  for r, want in enumerate(brute_plan(hard.astype(bool), doc, n_slots)):
    got_pool = np.where(plan.pool_BT[r], plan.slot_BT[r], -1)
    np.testing.assert_array_equal(got_pool, want["pool"], err_msg=f"row {r} pool slots")
    np.testing.assert_array_equal(
      np.where(plan.read_ok_BT[r], plan.read_BT[r], -1), want["read"], err_msg=f"row {r} read slots"
    )
    assert sorted(np.nonzero(plan.null_BS[r])[0].tolist()) == want["nulls"]
    assert plan.n_closed_B[r] == want["closed"] and plan.overflow_B[r] == want["overflow"]
    # every used slot belongs to one document, and positions count from its null slot
    for s in range(n_slots):
      members = np.nonzero(got_pool == s)[0]
      if plan.null_BS[r, s]:
        assert members.size == 0 and plan.slot_pos_BS[r, s] == 0 and plan.slot_doc_BS[r, s] > 0
      elif members.size:
        assert set(doc[r, members]) == {plan.slot_doc_BS[r, s]}
        null = max(x for x in want["nulls"] if x < s)
        assert plan.slot_pos_BS[r, s] == s - null
      else:
        assert plan.slot_doc_BS[r, s] == 0
  if n_slots < T:
    assert plan.overflow_B.sum() > 0, "the small capacity should overflow"


@pytest.mark.parametrize(
  "packing,n_slots", [("concat", T + 1), ("segmented", T + 1), ("concat", 6), ("segmented", 7)]
)
def test_downsample_equals_dense(packing, n_slots):
  h, soft, hard, doc = _case(packing, 1)
  null = np.random.default_rng(2).standard_normal(D).astype(np.float32)
  plan = plan_latents(hard, doc, n_slots)
  pool_np = np.asarray(jnp.where(plan.pool_BT, plan.slot_BT, -1))
  group_np = np.asarray(plan.group_BT)
  null_np = np.asarray(plan.null_BS)
  # pairs (row, our slot, group id) for every pooled group; K = most groups in a row
  pairs = sorted(
    {(r, pool_np[r, t], group_np[r, t]) for r in range(B) for t in range(T) if pool_np[r, t] >= 0}
  )
  assert pairs, "no pooled group"
  rows, slots, groups = (np.array(x) for x in zip(*pairs))
  n_groups = int(hard.sum(1).max())
  ct = np.random.default_rng(3).standard_normal((len(pairs), D)).astype(np.float32)

  def ours(h_, soft_):
    s = pooling.downsample(h_, _st(soft_, hard, doc), plan, jnp.asarray(null))
    return s[rows, slots], s

  def dense(h_, soft_):
    return dense_downsample_groups(h_, _st(soft_, hard, doc), n_groups)[rows, groups]

  @jax.jit
  def run(h_, soft_):
    """Values and gradients w.r.t. h and soft of both implementations, in one compile."""
    (_, (got_, full_)), g_ours_ = jax.value_and_grad(
      lambda a, b: (jnp.sum(ours(a, b)[0] * ct), ours(a, b)), argnums=(0, 1), has_aux=True
    )(h_, soft_)
    (_, want_), g_dense_ = jax.value_and_grad(
      lambda a, b: (jnp.sum(dense(a, b) * ct), dense(a, b)), argnums=(0, 1), has_aux=True
    )(h_, soft_)
    return got_, full_, want_, g_ours_, g_dense_

  got, full, want, g_ours, g_dense = run(h, soft)
  assert_close_rel(got, want)
  # null slots hold the null vector; unused slots are zero
  full = np.asarray(full)
  np.testing.assert_array_equal(full[null_np], np.broadcast_to(null, full[null_np].shape))
  used = null_np.copy()
  used[rows, slots] = True
  assert np.all(full[~used] == 0)

  assert_close_rel(g_ours[0], g_dense[0], err_msg="d/dh")
  assert_close_rel(g_ours[1], g_dense[1], err_msg="d/dsoft")
  # the straight-through path is live: pooling sends gradient to the boundaries
  assert np.abs(np.asarray(g_ours[1])).max() > 1e-3


@pytest.mark.parametrize(
  "packing,n_slots", [("concat", T + 1), ("segmented", T + 1), ("concat", 6), ("segmented", 7)]
)
def test_upsample_equals_dense(packing, n_slots):
  _, _, hard, doc = _case(packing, 4)
  z = np.random.default_rng(5).standard_normal((B, n_slots, D)).astype(np.float32)
  plan = plan_latents(hard, doc, n_slots)
  read = np.stack([w["read"] for w in brute_plan(hard.astype(bool), doc, n_slots)])
  if packing == "concat" and n_slots > T:  # upstream's rule exactly: byte t reads z[cumsum(b)_t]
    np.testing.assert_array_equal(read, np.cumsum(hard, 1))
  ct = np.random.default_rng(6).standard_normal((B, T, D)).astype(np.float32)

  @jax.jit
  def run(z_):
    got_ = pooling.upsample(z_, plan)
    want_ = dense_upsample(z_, jnp.asarray(read))
    g_ours_ = jax.grad(lambda a: jnp.sum(pooling.upsample(a, plan) * ct))(z_)
    g_dense_ = jax.grad(lambda a: jnp.sum(dense_upsample(a, jnp.asarray(read)) * ct))(z_)
    return got_, want_, g_ours_, g_dense_

  got, want, g_ours, g_dense = run(jnp.asarray(z))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert_close_rel(g_ours, g_dense)


# ---------------------------------------------------------------------------- boundary decisions
# (they feed the pooling: the boundary loss, the inference / Gumbel decisions and the SpaceByte
# rule, on hand-computed values)
from lca_jax.model import boundaries as bnd  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.model.config import ModelConfig  # noqa: E402  pylint: disable=g-import-not-at-top

spacebyte = jax.jit(bnd.spacebyte_boundaries, static_argnums=1)


def _ids(text: bytes):
  return np.frombuffer(text, np.uint8).astype(np.int32)[None] + 3


def test_boundary_loss_hand_computed():
  b = np.array(
    [
      [1, 1, 1, 0, 0, 0],  # r = 3/4 (4 real bytes): above alpha by 0.45
      [0, 0, 0, 0, 0, 0],  # r = 0: below beta by 0.2
      [1, 0, 0, 0, 1, 1],  # r = 1/4 (padding ignored): inside [beta, alpha]
      [0, 0, 0, 0, 0, 0],
    ],
    np.float32,
  )  # all padding: r = 0
  real = np.array([[1, 1, 1, 1, 0, 0], [1] * 6, [1, 1, 1, 1, 0, 0], [0] * 6], bool)
  loss, grad = jax.jit(jax.value_and_grad(bnd.boundary_loss), static_argnums=(2, 3))(
    jnp.asarray(b), jnp.asarray(real), 0.3, 0.2
  )
  assert_close_rel(loss, (0.45 + 0.2 + 0.0 + 0.2) / 4, 1e-6)
  want = np.zeros_like(b)
  want[0, :4] = 1 / 4 / 4  # d/db of (r - alpha) / 4 rows
  want[1, :] = -1 / 6 / 4  # d/db of (beta - r) / 4 rows
  assert_close_rel(grad, want, 1e-6)
  # the paper's targets: alpha = prior = 0.333, beta = prior - 3 std = 0.264
  cfg = ModelConfig()
  assert cfg.bp_prior == pytest.approx(0.333) and cfg.bp_beta == pytest.approx(0.264)
  one_in_three = np.tile(np.array([0, 0, 1], np.float32), 10)[None]
  r_loss = jax.jit(bnd.boundary_loss, static_argnums=(2, 3))(
    jnp.asarray(one_in_three), jnp.ones((1, 30), bool), cfg.bp_prior, cfg.bp_beta
  )
  assert_close_rel(r_loss, 1 / 3 - 0.333, 1e-6, scale=1 / 3)  # just above the band (of rates ~1/3)


def test_inference_and_gumbel_decisions():
  logits = jnp.asarray([[-3.0, -1e-3, 0.0, 1e-3, 3.0, 0.3, -0.3, 1.0]])
  temp = 0.5

  @jax.jit
  def run(l, key):
    u = jax.random.uniform(key, l.shape, jnp.float32, 1e-6, 1.0 - 1e-6)
    soft = jax.nn.sigmoid((l + jnp.log(u) - jnp.log1p(-u)) / temp)
    b, vjp = jax.vjp(lambda x: bnd.gumbel_boundaries(x, key, temp), l)
    return bnd.hard_boundaries(l), soft, b, vjp(jnp.ones_like(b))[0]

  hard, soft, b, g = run(logits, jax.random.PRNGKey(0))
  np.testing.assert_array_equal(hard, [[0, 0, 0, 1, 1, 1, 0, 1]])  # sigmoid(logit) > 0.5, no noise
  np.testing.assert_array_equal(b, (soft > 0.5).astype(np.float32))  # value: the hard sample
  assert 0 < float(b.sum()) < b.size  # the noise matters: not all equal
  assert_close_rel(g, soft * (1 - soft) / temp)  # gradient: the soft sample


@pytest.mark.parametrize(
  "text,max_group,want",
  [
    # H i , _ y o u _ 2 !: a space-like byte after a non-space-like one closes
    (b"Hi, you 2!", 16, [0, 0, 1, 0, 0, 0, 0, 1, 0, 1]),
    # a run of space-like bytes closes once, at its first byte
    (b"a  b..c", 16, [0, 1, 0, 0, 1, 0, 0]),
    # UTF-8: a lead byte (0xC3) is space-like, a continuation byte (0xA9) is not
    ("aé b".encode(), 16, [0, 1, 0, 1, 0]),
    # byte 0's predecessor counts as not space-like
    (b" ab", 16, [1, 0, 0]),
    # the cap closes a group of max_group bytes; any close restarts the count
    (b"ab cdefghij", 4, [0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]),
    (b"abcdefgh", 3, [0, 0, 1, 0, 0, 1, 0, 0]),
  ],
)
def test_spacebyte_rule(text, max_group, want):
  got = spacebyte(jnp.asarray(_ids(text)), max_group)
  np.testing.assert_array_equal(np.asarray(got)[0], want)


def test_spacebyte_specials_and_forced():
  ids = jnp.asarray([[1, 3 + ord("a"), 3 + ord("b"), 0, 260, 3 + ord("c"), 3 + ord("d")]])
  # eos (1), pad (0) and <eot> (260) are space-like; pad and <eot> form one space-like run
  np.testing.assert_array_equal(spacebyte(ids, 16)[0], [1, 0, 0, 1, 0, 0, 0])
  forced = jnp.asarray([[0, 0, 0, 0, 0, 1, 0]])
  np.testing.assert_array_equal(spacebyte(ids, 16, forced)[0], [1, 0, 0, 1, 0, 1, 0])
  # a forced close restarts the length count: with max_group 3, "abcdef" forced at 'a'
  ids = jnp.asarray(_ids(b"abcdef"))
  forced = jnp.asarray([[1, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(spacebyte(ids, 3, forced)[0], [1, 0, 0, 1, 0, 0])


def test_spacebyte_document_starts():
  """With doc ids, a document's first byte has no predecessor (like byte 0 of a row): the
  decision never reads the previous document's last byte."""
  ids = jnp.asarray(_ids(b"a. c"))
  doc = jnp.asarray([[1, 1, 2, 2]])
  np.testing.assert_array_equal(spacebyte(ids, 16)[0], [0, 1, 0, 0])  # one row: '. ' is one run
  np.testing.assert_array_equal(spacebyte(ids, 16, None, doc)[0], [0, 1, 1, 0])
  ids2 = jnp.asarray(_ids(b"ab c"))  # the same document 2 after a non-space-like byte
  np.testing.assert_array_equal(spacebyte(ids2, 16, None, doc)[0, 2:], [1, 0])
