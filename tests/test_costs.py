"""The cost model behind tools/bench_train.py (lca_jax/perf/costs.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from lca_jax.model import masks
from lca_jax.model.attention import LOOPS_PER_BLOCK, blockwise_attention
from lca_jax.model.config import ConfigError
from lca_jax.model.hierarchical import ByteLM
from lca_jax.model.loss import compute_loss
from lca_jax.param_tree import abstract_params
from lca_jax.perf import costs


def _n(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


def test_useful_flops_closed_form_flat():
  """Flat model, one document per row: 6 N T + 12 L d T(T+1)/2 per row, plus the head."""
  cfg = tiny_config("llamabyte")
  rows, t = 2, 64
  params = abstract_params(cfg)
  doc, _, plan = costs.regular_layout(cfg, rows, t)
  got = costs.useful_flops(cfg, params, doc, plan)
  enc = 6 * _n(params["encoder"]) * rows * t + 12 * cfg.n_enc * cfg.d_model * rows * t * (t + 1) / 2
  assert got["encoder"] == pytest.approx(enc)
  assert got["head"] == pytest.approx(6 * _n(params["head"]) * rows * t)
  assert got["total"] == pytest.approx(enc + got["head"])


def test_latent_stack_counts_real_slots_and_capacity_is_reported():
  cfg = tiny_config("lca_mbp", max_latent_ratio=0.0)
  doc, _, plan = costs.regular_layout(cfg, 1, 300, group_len=3.0)
  assert int(jnp.sum(plan.slot_doc_BS != 0)) == 1 + 100  # null slot + one per group
  assert plan.null_BS.shape[1] == cfg.latent_capacity(300) > 101


def test_tile_flops_match_xla_on_one_tile():
  """With T = one block XLA counts the whole attention, once per tile loop of the block
  (``LOOPS_PER_BLOCK``: masked, unmasked, masked): our per-tile matmul FLOPs (forward QK, PV;
  backward QK, dV, dP, dQ, dK) are what it counts per loop, up to the elementwise work."""
  b, t, h, e = 2, 32, 4, 16
  q = jnp.ones((b, t, h, e), jnp.float32)
  lo = masks.causal_key_start(jnp.ones((b, t), jnp.int32))
  f = lambda q: jnp.sum(blockwise_attention(q, q, q, lo, block_q=t, block_k=t))
  xla = costs.xla_flops(jax.jit(jax.grad(f)).lower(q).compile())
  ours = 2.0 * b * h * t * t * e * 7 * LOOPS_PER_BLOCK
  assert ours <= xla <= 1.5 * ours


def test_loop_correction_counts_every_tile():
  cfg = tiny_config("llamabyte", attn_block_q=16, attn_block_k=16)
  doc, _, plan = costs.regular_layout(cfg, 1, 64)
  params = abstract_params(cfg)
  corr = costs.loop_correction(cfg, params, doc, plan)
  assert corr["tiles"] == {"encoder": 10}  # 4 query blocks: 1 + 2 + 3 + 4 tiles
  per_tile = 2.0 * cfg.n_heads * 16 * 16 * cfg.head_dim * 7
  # XLA saw LOOPS_PER_BLOCK tiles of the call (one per tile loop), 10 ran
  assert corr["flops"] == pytest.approx(cfg.n_enc * (10 - LOOPS_PER_BLOCK) * per_tile)
  assert costs.loop_correction(cfg.replace(attention_impl="dense"), params, doc, plan) == {
    "tiles": {},
    "flops": 0.0,
  }


@pytest.mark.parametrize("remat", [False, True])
def test_executed_flops_of_scanned_layers_match_the_unrolled_program(remat):
  """XLA's analysis sees one layer of a scanned stack; XLA's count plus ``loop_correction`` is
  the unrolled program's (XLA counts every layer there) up to the other layers' elementwise
  work, which the correction leaves out (a few %): every stack scanned, remat or not."""
  rows, t = 2, 128

  def executed(scan):  # scan_min_layers
    cfg = tiny_config(
      "lca_mbp", n_enc=2, n_lm=3, n_dec=2, n_mbp=2, d_model=64, remat=remat, scan_min_layers=scan
    )
    params = abstract_params(cfg)
    model = ByteLM(cfg)

    def loss(p, ids, doc, pos):
      rngs = {"gumbel": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
      out = model.apply({"params": p}, ids, doc, pos, train=True, rngs=rngs)
      batch = {"ids": ids, "segment_ids": doc, "positions": pos}
      return compute_loss(cfg, out, batch, jnp.ones(3))[0]

    ids = jax.ShapeDtypeStruct((rows, t), jnp.int32)
    xla = costs.xla_flops(jax.jit(jax.grad(loss)).lower(params, ids, ids, ids).compile())
    doc, _, plan = costs.regular_layout(cfg, rows, t)
    return xla, xla + costs.loop_correction(cfg, params, doc, plan)["flops"]

  (xla_u, unrolled), (xla_s, scanned) = executed(0), executed(2)
  assert xla_s < 0.6 * xla_u  # the analysis does see one layer per stack only
  assert 0.95 * unrolled <= scanned <= unrolled


def test_buffers_skip_dense_layer_activations_only():
  hlo = "\n".join(
    [
      '  %a = f32[4096,4096]{1,0} dot(%x, %w), metadata={op_name="jit(step)/ByteLM.encode/'
      'encoder/layer_0/mlp/gate_proj/dot_general"}',
      '  %b = f32[1,4,4096,4096]{3,2,1,0} dot(%q, %k), metadata={op_name="jit(step)/ByteLM.encode/'
      'encoder/layer_0/attn/dot_general"}',
      '  %c = f32[4096,4096]{0,1} copy(%a)',  # no metadata: takes its operand's (an MLP)
      '  %d = f32[8,4096]{1,0} add(%y, %z), metadata={op_name="jit(step)/x"}',
    ]
  )
  got = costs.buffers(hlo, 4096)
  assert list(got["t_by_t_buffers"]) == ["f32[1,4,4096,4096]"]
  assert got["largest_buffer"] == "f32[1,4,4096,4096]"
  assert got["largest_buffer_bytes"] == 4 * 4 * 4096 * 4096


def test_causal_blocks_auto_by_length_and_costs_follow_it():
  """0 (auto) gives 64 below CAUSAL_BLOCK_LONG_FROM tokens and 128 from there on; set sizes win;
  the cost model counts the tiles of the blocks the model runs (a stack of 2048 tokens, one
  document: 16 query blocks of 128 visit 1 + ... + 16 tiles)."""
  cfg = tiny_config("llamabyte")
  assert (cfg.attn_block_q, cfg.attn_block_k) == (0, 0)
  assert cfg.causal_blocks(2047) == (64, 64)
  assert cfg.causal_blocks(2048) == (128, 128)
  assert cfg.replace(attn_block_q=32).causal_blocks(4096) == (32, 128)
  with pytest.raises(ConfigError, match="attn_block_k must be an integer >= 0, got -1"):
    cfg.replace(attn_block_k=-1)
  doc, _, plan = costs.regular_layout(cfg, 1, 2048)
  assert costs.loop_correction(cfg, abstract_params(cfg), doc, plan)["tiles"] == {
    "encoder": 16 * 17 // 2
  }


def test_t_by_t_check_flags_a_width_equal_to_t():
  """A listed buffer is ambiguous only when T is also a parameter dimension, or a device's
  share of one (an MLP activation [T, d_inner / 2] under a tensor split of 2 at T = d_inner / 2)."""
  params = {"w": jax.ShapeDtypeStruct((64, 256), jnp.float32)}
  listed = {"f32[1,128,128]": ["broadcast.1"]}
  assert costs.t_by_t_check({}, params, 64) == "exact"
  assert costs.t_by_t_check(listed, params, 128) == "exact"
  assert costs.t_by_t_check(listed, params, 256).startswith("ambiguous")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tensor",))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tensor"))
  sharded = {"w": jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=split)}
  assert costs.t_by_t_check(listed, sharded, 128).startswith("ambiguous")
