"""Compact PyTorch reference for the upstream checkpoint layout (inference only).

Loads a directory holding ``config.json`` + ``model.safetensors`` in the layout of the paper's
PyTorch code (FxTTransformerLM) by the SAME state-dict names (``load_state_dict(strict=True)``)
and computes next-byte (NT) logits, LCA-MBP logits and inference boundaries, following
docs/design.md §1, §2 and §7.2. It imports only torch, safetensors, json and math, so it can
serve as an independent check of the JAX model and of the exporter.

    model = load_torch_model("path/to/dir")
    out = model.forward(ids)            # ids: LongTensor [B, T]
    out["ntp_logits"]      # [B, T, V]  row t predicts x_{t+1}
    out["mbp_logits"]      # [B, T, V]  row t predicts x_{t+2}; None without an LCA-MBP stage
    out["boundaries"]      # [B, T] int64, 1 = byte t closes its group; None for a flat model
    out["mlp_mbp_logits"]  # [B, k, T, V], head i predicts x_{t+2+i}; only with MLP-MBP heads

Upstream layout (docs/design.md §7.2):
    token_embedding.weight [V, d]; head.weight [V, d] (untied; if ``lm_tie_weights`` and the key
    is absent, the embedding is used); norm.weight [d]; null_group [1, 1, d];
    rotary_embd.inv_freq [head_dim / 2];
    blocks.{stage}.{layer}.{attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj,
        mlp.gate_proj, mlp.up_proj, mlp.down_proj}.weight   (torch Linear, [out, in], no biases)
    blocks.{stage}.{layer}.{norm1, norm2}.weight
    stages: 0 encoder, 1 LM module, 2 NT decoder, 3 LCA-MBP head (present iff mbp > 0)
    script_to_bp_layers.<script>.boundary_predictor.{0,2}.{weight, bias}
        (script = first key of config "all_script_ids_dict"; Linear(d, inter) -> act -> Linear(inter, 1))
    config "model_config" = "[enc, (lm,), dec, mbp]". A flat model is "[n, (0,), 0, 0]" with
    "boundaries_type": "none" and a single stage 0 (no null_group, no predictor).

Extras that upstream lacks (documented here so the JAX exporter writes exactly this):

(a) MLP-MBP (Medusa-style heads). Config field ``"mlp_mbp_heads": k`` (default 0). Keys, for
    i = 0..k-1:
        mlp_mbp.{i}.norm.weight [d]
        mlp_mbp.{i}.fc1.weight  [inner, d]
        mlp_mbp.{i}.fc2.weight  [d, inner]
    where inner = config ``"mlp_mbp_inner"`` (default ``lm_inter_dim``).
    Head i reads the final hidden state h of the NT trunk (the NT decoder, stage 2; stage 0 for a
    flat model) BEFORE the final norm: h_i = h + fc2(silu(fc1(RMSNorm_i(h)))), then the shared
    final ``norm`` and ``head``; logits row t predicts x_{t+2+i} (the NT head predicts x_{t+1}).
    RMSNorm_i uses the same eps as every other norm.

(b) SpaceByte boundaries. Config ``"boundaries_type": "spacebyte"`` with
    ``"spacebyte_max_group": m`` (int). No boundary-predictor weights. Boundaries come from the
    input ids: a byte is space-like unless it is an ASCII letter or digit or a UTF-8
    continuation byte (0x80-0xBF); specials (id < 3 or id >= 259) are space-like. Byte t closes
    its group (b_t = 1) when it is space-like and byte t-1 is not (byte 0 has no predecessor,
    which counts as not space-like), or when its group has reached m bytes (the group length
    counts from the byte after the previous boundary, forced or not).

(c) ``"bp_inter_dim"`` (default ``lm_inter_dim``): hidden width of the boundary predictor, written
    only when it differs from ``lm_inter_dim``.
"""

import json
import math

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

__all__ = ["TorchHierarchicalLM", "load_torch_model", "spacebyte_boundaries"]


# ----------------------------------------------------------------------------- layers


class RMSNorm(torch.nn.Module):
  def __init__(self, d, eps):
    super().__init__()
    self.weight = torch.nn.Parameter(torch.ones(d))
    self.eps = eps

  def forward(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _linear(n_in, n_out, bias=False):
  return torch.nn.Linear(n_in, n_out, bias=bias)


class Attention(torch.nn.Module):
  def __init__(self, d, n_heads, n_kv_heads):
    super().__init__()
    assert d % n_heads == 0 and n_heads % n_kv_heads == 0
    self.h, self.kv, self.hd = n_heads, n_kv_heads, d // n_heads
    self.q_proj = _linear(d, d)
    self.k_proj = _linear(d, self.hd * n_kv_heads)
    self.v_proj = _linear(d, self.hd * n_kv_heads)
    self.out_proj = _linear(d, d)

  def qkv(self, x, cos, sin):
    """Queries [B,h,T,hd], keys and values [B,kv,T,hd] of x [B,T,d], RoPE applied (cos/sin
    [T,hd] or [B,1,T,hd])."""
    B, T, _ = x.shape
    q = self.q_proj(x).view(B, T, self.h, self.hd).transpose(1, 2)
    k = self.k_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
    v = self.v_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
    return _rope(q, cos, sin), _rope(k, cos, sin), v

  def mix(self, q, k, v, allowed):
    """Attention of q [B,h,Tq,hd] over k, v [B,kv,Tk,hd]; allowed: bool [Tq,Tk] or [B,Tq,Tk]."""
    B, _, Tq, _ = q.shape
    rep = self.h // self.kv  # query head h reads kv head h // rep
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
    mask = allowed if allowed.dim() == 2 else allowed[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    y = torch.softmax(s, dim=-1) @ v
    return self.out_proj(y.transpose(1, 2).reshape(B, Tq, self.h * self.hd))

  def forward(self, x, cos, sin, allowed):
    """x [B,T,d]; cos/sin [T,hd]; allowed: bool [T,T] or [B,T,T] (query, key)."""
    return self.mix(*self.qkv(x, cos, sin), allowed)


class MLP(torch.nn.Module):
  def __init__(self, d, inter):
    super().__init__()
    self.gate_proj, self.up_proj, self.down_proj = (
      _linear(d, inter),
      _linear(d, inter),
      _linear(inter, d),
    )

  def forward(self, x):
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(torch.nn.Module):
  def __init__(self, c):
    super().__init__()
    d, eps = c["lm_hidden_dim"], c["lm_rms_eps"]
    self.attn = Attention(d, c["lm_n_heads"], c["lm_n_kv_heads"])
    self.mlp = MLP(d, c["lm_inter_dim"])
    self.norm1, self.norm2 = RMSNorm(d, eps), RMSNorm(d, eps)

  def forward(self, x, cos, sin, allowed, kv=None):
    """``kv``: a cache hook, ``kv(k, v)`` stores the new keys and values and returns every key
    and value the queries attend (``allowed`` then indexes those)."""
    q, k, v = self.attn.qkv(self.norm1(x), cos, sin)
    if kv is not None:
      k, v = kv(k, v)
    x = x + self.attn.mix(q, k, v, allowed)
    return x + self.mlp(self.norm2(x))


class Rotary(torch.nn.Module):
  """RoPE tables; inv_freq comes from the checkpoint (rotary_embd.inv_freq)."""

  def __init__(self, c):
    super().__init__()
    hd = c["lm_hidden_dim"] // c["lm_n_heads"]
    inv = 1.0 / (c["lm_re_base"] ** (torch.arange(0, hd, 2).float() / hd))
    self.register_buffer("inv_freq", inv)
    self.max_pos = c.get("lm_max_position_embeddings", 4096)
    self.scale = c.get("lm_attn_scaling", 1.0)

  def forward(self, n):
    inv = self.inv_freq
    if n > self.max_pos:  # upstream's linear stretch past max positions
      inv = inv / (n / self.max_pos)
    return self._tables(torch.arange(n, device=inv.device).float()[:, None] * inv.float()[None])

  def at(self, pos):
    """cos/sin [..., T, hd] at integer positions ``pos`` [..., T] (incremental decoding)."""
    return self._tables(pos.float()[..., None] * self.inv_freq.float())

  def _tables(self, f):
    emb = torch.cat([f, f], dim=-1)
    return emb.cos() * self.scale, emb.sin() * self.scale


def _rope(x, cos, sin):
  x1, x2 = x.chunk(2, dim=-1)
  cos, sin = cos.to(x.dtype), sin.to(x.dtype)
  return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class BoundaryPredictor(torch.nn.Module):
  def __init__(self, d, inter, act):
    super().__init__()
    acts = {"gelu": torch.nn.GELU(), "relu": torch.nn.ReLU(), "silu": torch.nn.SiLU()}
    self.boundary_predictor = torch.nn.Sequential(
      _linear(d, inter, True), acts[act], _linear(inter, 1, True)
    )

  def forward(self, h):  # [B,T,d] -> int64 [B,T]
    return (torch.sigmoid(self.boundary_predictor(h).squeeze(-1)) > 0.5).long()


class MLPHead(torch.nn.Module):  # extra (a): residual MLP-MBP head
  def __init__(self, c):
    super().__init__()
    d, inter = c["lm_hidden_dim"], int(c.get("mlp_mbp_inner", c["lm_inter_dim"]))
    self.norm = RMSNorm(d, c["lm_rms_eps"])
    self.fc1, self.fc2 = _linear(d, inter), _linear(inter, d)

  def forward(self, h):
    return h + self.fc2(F.silu(self.fc1(self.norm(h))))


# ----------------------------------------------------------------------------- extra (b)


def space_like(ids):
  """The SpaceByte rule's space-like bytes of ids [...] (bool)."""
  ids = ids.long()
  raw = ids - 3
  alnum = ((raw >= 48) & (raw <= 57)) | ((raw >= 65) & (raw <= 90)) | ((raw >= 97) & (raw <= 122))
  cont = (raw >= 0x80) & (raw <= 0xBF)
  special = (ids < 3) | (ids >= 259)
  return special | ~(alnum | cont)


def spacebyte_boundaries(ids, max_group):
  """SpaceByte rule on byte ids [B,T] -> int64 [B,T] (1 = byte closes its group)."""
  ids = ids.long()
  space = space_like(ids)
  prev = F.pad(space[:, :-1], (1, 0), value=False)  # byte 0: predecessor counts as not space-like
  rule = space & ~prev
  b = torch.zeros_like(ids)
  length = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
  for t in range(ids.shape[1]):  # sequential: forced closes reset the count
    length = length + 1
    close = rule[:, t] | (length >= max_group)
    b[:, t] = close.long()
    length = torch.where(close, torch.zeros_like(length), length)
  return b


# ----------------------------------------------------------------------------- model


def _lca_allowed(g):
  """LCA mask from group ids g [B,T]: j == i, or g_j == g_i - 1, or (g_j == g_i and j < i)."""
  T = g.shape[1]
  i = torch.arange(T, device=g.device)
  gi, gj = g[:, :, None], g[:, None, :]
  same_or_prev = (gj == gi - 1) | ((gj == gi) & (i[None, :] < i[:, None]))
  return same_or_prev | torch.eye(T, dtype=torch.bool, device=g.device)


class TorchHierarchicalLM(torch.nn.Module):
  def __init__(self, cfg):
    super().__init__()
    self.cfg = c = dict(cfg)
    d, V = c["lm_hidden_dim"], c["lm_vocab_size"]
    enc, (lm,), dec, mbp = eval(c["model_config"], {"__builtins__": {}})
    self.flat = lm == 0 and dec == 0
    self.boundaries_type = c.get("boundaries_type", "none")
    self.token_embedding = torch.nn.Embedding(V, d)
    self.head = _linear(d, V)
    self.norm = RMSNorm(d, c["lm_rms_eps"])
    self.rotary_embd = Rotary(c)
    stack = lambda n: torch.nn.ModuleList([Block(c) for _ in range(n)])
    if self.flat:
      assert self.boundaries_type == "none" and mbp == 0, (
        "flat model: [n, (0,), 0, 0], boundaries 'none'"
      )
      self.blocks = torch.nn.ModuleList([stack(enc)])
    else:
      self.null_group = torch.nn.Parameter(torch.zeros(1, 1, d))
      self.blocks = torch.nn.ModuleList(
        [stack(enc), stack(lm), stack(dec)] + ([stack(mbp)] if mbp else [])
      )
      if self.boundaries_type == "spacebyte":
        self.spacebyte_max_group = int(c["spacebyte_max_group"])
      else:
        assert self.boundaries_type in ("gumbel", "unigram", "entropy", "fixed"), (
          self.boundaries_type
        )
        scripts = list(c["all_script_ids_dict"])[: c.get("num_predictors", 1)]
        self.script_to_bp_layers = torch.nn.ModuleDict(
          {
            s: BoundaryPredictor(
              d, int(c.get("bp_inter_dim", c["lm_inter_dim"])), c.get("activation_function", "gelu")
            )
            for s in scripts
          }
        )
    k = int(c.get("mlp_mbp_heads", 0))
    if k:
      self.mlp_mbp = torch.nn.ModuleList([MLPHead(c) for _ in range(k)])

  def _stack(self, stage, x, allowed):
    cos, sin = self.rotary_embd(x.shape[1])
    for blk in self.blocks[stage]:
      x = blk(x, cos, sin, allowed)
    return x

  def _logits(self, h):
    return self.head(self.norm(h))

  def _boundaries(self, ids, h_e):
    if self.boundaries_type == "spacebyte":
      return spacebyte_boundaries(ids, self.spacebyte_max_group)
    bp = next(iter(self.script_to_bp_layers.values()))  # upstream uses the first predictor
    return bp(h_e)

  @property
  def has_lca_mbp(self):
    return not self.flat and len(self.blocks) > 3

  @torch.no_grad()
  def forward(self, ids, with_mbp=True):
    """The outputs listed in the module docstring; without ``with_mbp`` the multi-byte heads
    are not computed (their entries are None / absent)."""
    ids = ids.long()
    B, T = ids.shape
    x = self.token_embedding(ids)
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    out = {"mbp_logits": None, "boundaries": None}
    if self.flat:
      h = self._stack(0, x, causal)
    else:
      h_e = self._stack(0, x, causal)  # encoder
      b = self._boundaries(ids, h_e)  # [B,T], 1 closes group
      cb = b.cumsum(1)  # u_t = cumsum(b)_t
      g = cb - b  # group id
      n_closed = cb[:, -1]
      K = int(n_closed.max())
      # downsample: s_0 = null, s_{k+1} = mean of h_e over closed group k (open group dropped)
      closed = g < n_closed[:, None]
      idx = torch.where(closed, g + 1, torch.zeros_like(g))
      w = closed.to(h_e.dtype)
      sums = h_e.new_zeros(B, K + 1, h_e.shape[-1]).scatter_add_(
        1, idx[..., None].expand_as(h_e), h_e * w[..., None]
      )
      cnt = h_e.new_zeros(B, K + 1).scatter_add_(1, idx, w)
      s = sums / cnt.clamp_min(1.0)[..., None]
      s[:, 0] = self.null_group.reshape(-1)
      # LM module over [s_0..s_K]
      z = self._stack(1, s, torch.ones(K + 1, K + 1, dtype=torch.bool, device=ids.device).tril())
      up = lambda t: torch.gather(t, 1, cb[..., None].expand(B, T, t.shape[-1]))
      z_up = up(z)
      h = self._stack(2, z_up + h_e, causal)  # NT decoder
      if with_mbp and self.has_lca_mbp:  # LCA-MBP head
        m = self._stack(3, z_up + up(s), _lca_allowed(g))
        out["mbp_logits"] = self._logits(m)
      out["boundaries"] = b
    out["ntp_logits"] = self._logits(h)
    if with_mbp and hasattr(self, "mlp_mbp"):
      out["mlp_mbp_logits"] = torch.stack([self._logits(head(h)) for head in self.mlp_mbp], dim=1)
    return out


def load_torch_model(path, device="cpu"):
  """Load ``path/config.json`` + ``path/model.safetensors`` (strict names) -> TorchHierarchicalLM."""
  with open(f"{path}/config.json") as f:
    cfg = json.load(f)
  model = TorchHierarchicalLM(cfg)
  sd = load_file(f"{path}/model.safetensors")
  if cfg.get("lm_tie_weights") and "head.weight" not in sd:
    sd["head.weight"] = sd["token_embedding.weight"]
  model.load_state_dict(sd, strict=True)
  return model.to(device).eval()
