"""The model family in one module: flat LlamaByte, SpaceByte, FxT, MLP-MBP and LCA-MBP.

``ByteLM(cfg)`` is a pure linen module; the variant is a matter of ``ModelConfig`` fields.
Inputs are ids [B,T] plus optional doc ids (0 = padding; all ones for ``concat`` packing) and
positions (restarting per document for ``segmented`` packing). The stages are exposed as
methods (``encode``, ``decide``, ``latent``, ``next_byte``, ``lca_head``, ``stack_step``,
``logits``); ``__call__`` is the full forward used in training and evaluation, and
``model/incremental.py`` runs the same stages over KV caches for decoding.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from lca_jax import backend
from lca_jax.kernels import decode_fused, lca_attention
from lca_jax.kernels.tpu_attention import lca_attention_tpu
from lca_jax.model import boundaries as bnd
from lca_jax.model import masks, pooling
from lca_jax.model.attention import blockwise_attention
from lca_jax.model.config import ModelConfig
from lca_jax.model.layers import RMSNorm, Stack, dense, stored_weight


class MLPHead(nn.Module):
  """Medusa-style residual head: h + fc2(silu(fc1(norm(h))))."""

  d_inner: int
  eps: float
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, h):
    y = RMSNorm(self.eps, name="norm")(h)
    y = dense(self.d_inner, "fc1", ("embed", "mlp"), self.dtype)(y)
    return h + dense(h.shape[-1], "fc2", ("mlp", "embed"), self.dtype)(nn.silu(y))


def _pallas_kernel(group_BT, doc_BT):
  if backend.tpu_attention_kernel():
    return functools.partial(lca_attention_tpu, segment_ids=group_BT, doc_ids=doc_BT)
  interpret = backend.pallas_interpret()
  return functools.partial(
    lca_attention, segment_ids=group_BT, doc_ids=doc_BT, impl="pallas", interpret=interpret
  )


class ByteLM(nn.Module):
  cfg: ModelConfig

  def setup(self):
    c = self.cfg
    dt = jnp.dtype(c.dtype)
    stack = lambda n: Stack(
      n,
      n_heads=c.n_heads,
      n_kv_heads=c.n_kv_heads,
      d_inner=c.d_inner,
      rope_base=c.rope_base,
      eps=c.rms_eps,
      dtype=dt,
      dropout=c.dropout,
      remat=c.remat,
      scan=c.scans(n),
      rope_len=c.max_seq_len,
    )
    self.token_embedding = nn.Embed(
      c.vocab_size,
      c.d_model,
      dtype=dt,
      embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
    )
    self.encoder = stack(c.n_enc)
    self.norm = RMSNorm(c.rms_eps)
    self.head = dense(c.vocab_size, "head", ("embed", "vocab"), dt)
    if c.hierarchical:
      if c.boundaries == "learned":
        self.boundary_predictor = bnd.BoundaryPredictor(c.bp_hidden)
      self.null_group = self.param(
        "null_group",
        nn.with_logical_partitioning(nn.initializers.normal(1.0), ("embed",)),
        (c.d_model,),
      )
      self.lm = stack(c.n_lm)
      self.decoder = stack(c.n_dec)
      if c.n_mbp:
        self.mbp = stack(c.n_mbp)
      self.mlp_heads = [
        MLPHead(c.mlp_hidden, c.rms_eps, dt, name=f"mlp_mbp_{i}") for i in range(c.n_mlp_mbp)
      ]

  # ---- stages -------------------------------------------------------------------------------
  def _attend(self, group_BT, doc_BT, kind):
    """(mask, kernel) for a self-attention stack: blockwise (xla), dense mask or Pallas."""
    c = self.cfg
    impl = backend.attention_impl(c.attention_impl)
    if impl == "pallas":
      g = group_BT if kind == "lca" else jnp.zeros_like(doc_BT)
      return None, _pallas_kernel(g, doc_BT)
    if impl == "dense":
      if kind == "lca":
        return masks.lca_mask(group_BT, doc_BT), None
      return masks.causal_mask(doc_BT), None
    if kind == "lca":
      lo = masks.lca_key_start(group_BT, doc_BT)
      bq, bk = c.lca_block_q, c.lca_block_q + c.lca_lookback
    else:
      lo = masks.causal_key_start(doc_BT)
      bq, bk = c.causal_blocks(lo.shape[1])
    parallel = c.attn_parallel or backend.attention_threads()
    return None, functools.partial(
      blockwise_attention, lo_BT=lo, block_q=bq, block_k=bk, parallel=parallel
    )

  def embed(self, ids_BT):
    return self.token_embedding(ids_BT)

  def encode(self, ids_BT, doc_BT, pos_BT, deterministic=True):
    mask, kernel = self._attend(None, doc_BT, "causal")
    h, _ = self.encoder(
      self.embed(ids_BT), pos_BT, mask, kernel=kernel, deterministic=deterministic
    )
    return h

  def boundary_logits(self, h_BTD):
    return self.boundary_predictor(h_BTD)

  def decide(self, ids_BT, h_BTD, doc_BT, train: bool):
    """Boundaries (straight-through values in training) and their hard 0/1 version."""
    c = self.cfg
    nxt = jnp.concatenate([doc_BT[:, 1:], doc_BT[:, -1:]], axis=1)
    forced = (nxt != doc_BT) & (doc_BT != 0)  # a document's last byte closes its group
    if c.boundaries == "spacebyte":
      b = bnd.spacebyte_boundaries(ids_BT, c.spacebyte_max_group, forced, doc_BT)
    else:
      logits = self.boundary_logits(h_BTD)
      if train:
        b = bnd.gumbel_boundaries(logits, self.make_rng("gumbel"), c.bp_temp)
      else:
        b = bnd.hard_boundaries(logits)
      b = jnp.where(forced, 1.0, b)
    b = b * (doc_BT != 0)
    return b, jax.lax.stop_gradient(b)

  def latent(self, s_BSD, plan: pooling.LatentPlan, deterministic=True):
    mask, kernel = self._attend(None, plan.slot_doc_BS, "causal")
    z, _ = self.lm(s_BSD, plan.slot_pos_BS, mask, kernel=kernel, deterministic=deterministic)
    return z

  def next_byte(self, x_BTD, doc_BT, pos_BT, deterministic=True):
    mask, kernel = self._attend(None, doc_BT, "causal")
    h, _ = self.decoder(x_BTD, pos_BT, mask, kernel=kernel, deterministic=deterministic)
    return h

  def lca_head(self, m_BTD, group_BT, doc_BT, pos_BT, deterministic=True):
    mask, kernel = self._attend(group_BT, doc_BT, "lca")
    h, _ = self.mbp(m_BTD, pos_BT, mask, kernel=kernel, deterministic=deterministic)
    return h

  def stack_step(self, which: str, x_BTD, pos_BT, mask_BTS, caches, access, rows_BR=None):
    """Run stack ``which`` ('encoder', 'lm', 'decoder', 'mbp') over its per-layer KV caches
    (decoding) as the ``kv_cache.CacheAccess`` ``access`` says, optionally keeping only some
    positions' outputs (``rows_BR``; see ``Stack``)."""
    return getattr(self, which)(
      x_BTD, pos_BT, mask_BTS, caches=caches, access=access, rows_BR=rows_BR
    )

  def mlp_head(self, i, h_BTD):
    return self.mlp_heads[i](h_BTD)

  def logits(self, h_BTD):
    """Shared final norm + unembedding, float32, real vocabulary only."""
    out = self.head(self.norm(h_BTD)).astype(jnp.float32)
    return out[..., : self.cfg.n_tokens]

  def decode_logits(self, h_BTD):
    """``logits`` of a decode step: with the fused decode kernels (``backend``) and at most
    ``decode_fused.MAX_ROWS`` rows, the final norm and the unembedding in one kernel
    (``decode_fused.norm_matvec``, the same numerics)."""
    d = h_BTD.shape[-1]
    rows = h_BTD.size // d
    p = nn.unbox(self.variables.get("params", {}))
    head = stored_weight(p.get("head", {}), "kernel")
    fused = backend.fused_decode_kernels() and rows <= decode_fused.MAX_ROWS
    if not fused or head is None or "norm" not in p:
      return self.logits(h_BTD)
    w, in_out = head
    y = decode_fused.norm_matvec(
      h_BTD.reshape(rows, d),
      p["norm"]["scale"],
      w,
      eps=self.cfg.rms_eps,
      dtype=self.cfg.dtype,
      in_out=in_out,
      interpret=backend.pallas_interpret(),
    )
    return y.astype(jnp.float32).reshape(h_BTD.shape[:-1] + (-1,))[..., : self.cfg.n_tokens]

  # ---- full forward -------------------------------------------------------------------------
  def __call__(self, ids_BT, doc_BT=None, pos_BT=None, *, train: bool = False):
    c = self.cfg
    b_, t_ = ids_BT.shape
    if doc_BT is None:
      doc_BT = jnp.ones_like(ids_BT)
    if pos_BT is None:
      pos_BT = jnp.broadcast_to(jnp.arange(t_, dtype=jnp.int32), (b_, t_))
    det = not train
    h = self.encode(ids_BT, doc_BT, pos_BT, det)
    out = {"ntp_logits": None, "mbp_logits": None, "mlp_mbp_logits": None}
    if not c.hierarchical:
      out["ntp_logits"] = self.logits(h)
      return out
    b_st, b_hard = self.decide(ids_BT, h, doc_BT, train)
    plan = pooling.plan_latents(b_hard, doc_BT, c.latent_capacity(t_))
    s = pooling.downsample(h, b_st, plan, self.null_group)
    z = self.latent(s, plan, det)
    z_up = pooling.upsample(z, plan)
    h_nt = self.next_byte(z_up + h, doc_BT, pos_BT, det)
    out["ntp_logits"] = self.logits(h_nt)
    if c.n_mbp:
      m = z_up + pooling.upsample(s, plan)
      out["mbp_logits"] = self.logits(self.lca_head(m, plan.group_BT, doc_BT, pos_BT, det))
    if c.n_mlp_mbp:
      out["mlp_mbp_logits"] = jnp.stack(
        [self.logits(self.mlp_head(i, h_nt)) for i in range(c.n_mlp_mbp)], axis=1
      )
    out.update(
      boundaries=b_hard,
      boundaries_st=b_st,
      n_closed=plan.n_closed_B,
      overflow=plan.overflow_B,
      group_ids=plan.group_BT,
    )
    return out


def init_params(cfg: ModelConfig, rng, seq_len: int = 16, batch: int = 1):
  """Parameters (boxed with logical axis names) of ``ByteLM(cfg)``."""
  model = ByteLM(cfg)
  ids = jnp.zeros((batch, seq_len), jnp.int32)
  init = jax.jit(lambda r: model.init({"params": r, "gumbel": r, "dropout": r}, ids, train=False))
  return init(rng)["params"]


def count_params(params) -> int:
  return int(sum(x.size for x in jax.tree_util.tree_leaves(nn.unbox(params))))
