"""Cached (incremental) inference of ``torch_model.TorchHierarchicalLM``: the hierarchical caches.

The same stages as ``TorchHierarchicalLM.forward``, fed a block of new bytes per call and
keeping what later bytes read:

  * byte-level KV caches of the encoder, the next-byte decoder and the LCA-MBP head, one column
    per byte fed; every row of the batch writes the same columns, a column a row did not use
    (left padding, a rejected draft) is marked invalid and never attended;
  * the latent KV cache of the LM module, one slot per closed group (slot 0 the null group) at
    a per-row offset, and the LM outputs ``z`` and pooled inputs ``s`` of every slot;
  * the open group's pooled sum and byte count (float32), and the SpaceByte rule's state.

Every stack is causal in byte (or group) order, so a block's queries attend the cached columns
plus the block's own, under the same masks as the full forward (the LCA-MBP head: keys of the
query's group and the one before). The LCA-MBP head runs only when its logits are asked for; it
then first catches up on the columns fed without it (their inputs are kept per column).
``rollback`` keeps the first ``a`` bytes of the last block (speculative decoding).

    cache = HierCache(model, batch)
    out = cache.extend(ids_BK, valid_BK)          # {"ntp_logits": [B,K,V], ...}
    out = cache.extend(next_B[:, None], None)     # one byte per row

It imports only torch and ``torch_model``, so it is copied into a transformers export.
"""

import torch

from .torch_model import space_like

__all__ = ["HierCache"]


def _grow(t, dim, n):
  """``t`` with its size along ``dim`` at least ``n`` (doubling), new entries zero."""
  if t.shape[dim] >= n:
    return t
  shape = list(t.shape)
  shape[dim] = max(n, 2 * shape[dim])
  out = t.new_zeros(shape)
  out.narrow(dim, 0, t.shape[dim]).copy_(t)
  return out


def _read(x_BSD, u_BK):
  """x[b, u[b, k]] for every k: [B, K, D]."""
  return x_BSD.gather(1, u_BK[..., None].expand(-1, -1, x_BSD.shape[-1]))


class _Undo:
  """What ``rollback`` needs of the last ``extend``: the state before it (taken here) and
  per-byte values (``run``, set by ``extend``)."""

  def __init__(self, cache, c0, valid_BK):
    self.c0, self.valid_BK = c0, valid_BK
    self.pos, self.n_lat = cache.pos, cache.n_lat
    self.open_sum, self.open_cnt = cache.open_sum, cache.open_cnt
    self.prev_space = cache.prev_space
    # per byte: open sum / count and prev_space after it, latent slots through it
    self.run = None


class HierCache:
  """Per-row decode state of ``model`` (a ``TorchHierarchicalLM``) for ``batch`` rows."""

  def __init__(self, model, batch, capacity=64):
    self.model = model
    p = model.token_embedding.weight
    dev, dt = p.device, p.dtype
    self.dtype = dt
    c = model.cfg
    d = c["lm_hidden_dim"]
    kvh, hd = c["lm_n_kv_heads"], d // c["lm_n_heads"]
    self.batch, self.ncol = batch, 0
    byte_kv = lambda n: [[p.new_zeros(batch, kvh, capacity, hd) for _ in "kv"] for _ in range(n)]
    self.byte = {"enc": byte_kv(len(model.blocks[0]))}
    self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=dev)
    self.pos = torch.zeros(batch, dtype=torch.long, device=dev)  # next byte's position
    self.mbp_done = 0  # columns the LCA-MBP cache holds
    self.n_lat = torch.ones(batch, dtype=torch.long, device=dev)  # latent slots (null + closed)
    self.open_sum = torch.zeros(batch, d, dtype=torch.float32, device=dev)
    self.open_cnt = torch.zeros(batch, dtype=torch.float32, device=dev)
    self.prev_space = torch.zeros(batch, dtype=torch.bool, device=dev)
    self.undo = None
    if model.flat:
      return
    self.byte["dec"] = byte_kv(len(model.blocks[2]))
    if model.has_lca_mbp:
      self.byte["mbp"] = byte_kv(len(model.blocks[3]))
      self.gcol = torch.zeros(batch, capacity, dtype=torch.long, device=dev)  # group of a column
      self.pcol = torch.zeros(batch, capacity, dtype=torch.long, device=dev)  # its position
      self.mcol = p.new_zeros(batch, capacity, d)  # its LCA-MBP input z_up + s_up
    # latent slots, [B, S, kv, hd]: rows write at their own offsets
    self.lat = [[p.new_zeros(batch, capacity, kvh, hd) for _ in "kv"] for _ in model.blocks[1]]
    self.z = p.new_zeros(batch, capacity, d)
    self.s = p.new_zeros(batch, capacity, d)
    null = model.null_group.reshape(1, 1, d).expand(batch, 1, d).to(dt)
    zero = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    self.z[:, :1] = self._latent(null, zero)
    self.s[:, :1] = null

  # ------------------------------------------------------------------------- bookkeeping

  def _ensure_cols(self, n):
    for caches in self.byte.values():
      for kv in caches:
        kv[0], kv[1] = _grow(kv[0], 2, n), _grow(kv[1], 2, n)
    self.valid = _grow(self.valid, 1, n)
    if "mbp" in self.byte:
      self.gcol, self.pcol, self.mcol = (_grow(t, 1, n) for t in (self.gcol, self.pcol, self.mcol))

  def _ensure_slots(self, n):
    for kv in self.lat:
      kv[0], kv[1] = _grow(kv[0], 1, n), _grow(kv[1], 1, n)
    self.z, self.s = _grow(self.z, 1, n), _grow(self.s, 1, n)

  def reorder_cache(self, idx):
    """Keep rows ``idx``, in that order (beam search)."""
    sel = lambda t: t.index_select(0, idx.to(t.device))
    for caches in self.byte.values():
      for kv in caches:
        kv[0], kv[1] = sel(kv[0]), sel(kv[1])
    for name in ("valid", "pos", "n_lat", "open_sum", "open_cnt", "prev_space"):
      setattr(self, name, sel(getattr(self, name)))
    for name in ("gcol", "pcol", "mcol", "z", "s"):
      if hasattr(self, name):
        setattr(self, name, sel(getattr(self, name)))
    for kv in getattr(self, "lat", []):
      kv[0], kv[1] = sel(kv[0]), sel(kv[1])
    self.batch = int(idx.numel())
    self.undo = None

  # ------------------------------------------------------------------------- stacks

  def _byte_stack(self, stage, name, x, pos_BK, allowed, c0):
    """Stack ``stage`` over new columns c0.. (keys: columns 0..c0+K-1 of cache ``name``)."""
    cos, sin = self.model.rotary_embd.at(pos_BK[:, None])
    k_new = x.shape[1]

    def hook(kv):
      def store(k, v):
        kv[0][:, :, c0 : c0 + k_new] = k
        kv[1][:, :, c0 : c0 + k_new] = v
        return kv[0][:, :, : c0 + k_new], kv[1][:, :, : c0 + k_new]

      return store

    for blk, kv in zip(self.model.blocks[stage], self.byte[name]):
      x = blk(x, cos, sin, allowed, hook(kv))
    return x

  def _latent(self, x_BMD, slot_BM):
    """The LM module over new latent slots ``slot_BM`` (per-row offsets, consecutive)."""
    m = x_BMD.shape[1]
    top = int(slot_BM.max()) + 1
    self._ensure_slots(top)
    cos, sin = self.model.rotary_embd.at(slot_BM[:, None])
    keys = torch.arange(top, device=slot_BM.device)
    allowed = keys[None, None, :] <= slot_BM[:, :, None]
    rows = torch.arange(x_BMD.shape[0], device=slot_BM.device)[:, None].expand(-1, m)

    def hook(kv):
      def store(k, v):
        kv[0][rows, slot_BM] = k.transpose(1, 2)
        kv[1][rows, slot_BM] = v.transpose(1, 2)
        return kv[0][:, :top].transpose(1, 2), kv[1][:, :top].transpose(1, 2)

      return store

    x = x_BMD
    for blk, kv in zip(self.model.blocks[1], self.lat):
      x = blk(x, cos, sin, allowed, hook(kv))
    return x

  def _causal(self, c0, k_new, extra=None):
    """allowed [B, K, c0+K]: valid columns up to the query's, the query's own always."""
    cols = torch.arange(c0 + k_new, device=self.valid.device)
    q = c0 + torch.arange(k_new, device=self.valid.device)
    ok = self.valid[:, None, : c0 + k_new] & (cols[None, None, :] <= q[None, :, None])
    if extra is not None:
      ok = ok & extra
    return ok | (cols[None, None, :] == q[None, :, None])

  # ------------------------------------------------------------------------- boundaries

  def _closes(self, ids_BK, valid_BK, h_BKD):
    """Hard closes [B,K] bool, the pooled mean of each closed group [B,K,D] and per-byte running
    state (open sum / count after the byte, prev_space after it)."""
    m = self.model
    b, k = ids_BK.shape
    if m.boundaries_type == "spacebyte":
      space = space_like(ids_BK)
    else:
      bp = next(iter(m.script_to_bp_layers.values()))
      pred = bp(h_BKD).bool()
    hf = h_BKD.float()
    osum, ocnt, prev = self.open_sum, self.open_cnt, self.prev_space
    closes, pooled, r_sum, r_cnt, r_prev = [], [], [], [], []
    for t in range(k):
      v = valid_BK[:, t]
      if m.boundaries_type == "spacebyte":
        c = (space[:, t] & ~prev) | (ocnt + 1 >= m.spacebyte_max_group)
        prev = torch.where(v, space[:, t], prev)
      else:
        c = pred[:, t]
      c = c & v
      osum = osum + hf[:, t] * v[:, None]
      ocnt = ocnt + v.float()
      pooled.append((osum / ocnt.clamp_min(1.0)[:, None]).to(self.dtype))
      osum = torch.where(c[:, None], torch.zeros_like(osum), osum)
      ocnt = torch.where(c, torch.zeros_like(ocnt), ocnt)
      closes.append(c)
      r_sum.append(osum)
      r_cnt.append(ocnt)
      r_prev.append(prev)
    run = dict(
      open_sum=torch.stack(r_sum, 1), open_cnt=torch.stack(r_cnt, 1), prev=torch.stack(r_prev, 1)
    )
    return torch.stack(closes, 1), torch.stack(pooled, 1), run

  # ------------------------------------------------------------------------- extend

  @torch.no_grad()
  def extend(self, ids_BK, valid_BK=None, with_mbp=False):
    """Feed ids [B,K] (``valid_BK``: which are real, default all; a row's invalid bytes are
    skipped, e.g. left padding). Returns ``ntp_logits`` [B,K,V] and, with ``with_mbp``,
    ``mbp_logits`` [B,K,V] (LCA-MBP: row t predicts x_{t+2}) and/or ``mlp_mbp_logits``
    [B,k,K,V]. Logits at invalid bytes are meaningless."""
    m = self.model
    ids_BK = ids_BK.long()
    b, k = ids_BK.shape
    dev = ids_BK.device
    valid_BK = torch.ones_like(ids_BK, dtype=torch.bool) if valid_BK is None else valid_BK.bool()
    c0 = self.ncol
    self.undo = _Undo(self, c0, valid_BK)  # the state fields are replaced, never updated in place
    self._ensure_cols(c0 + k)
    self.valid[:, c0 : c0 + k] = valid_BK
    pos_BK = (self.pos[:, None] + valid_BK.long().cumsum(1) - 1).clamp_min(0)
    allowed = self._causal(c0, k)
    x = m.token_embedding(ids_BK)
    h_e = self._byte_stack(0, "enc", x, pos_BK, allowed, c0)
    out = {}
    if m.flat:
      h = h_e
      run = None
    else:
      closes, pooled, run = self._closes(ids_BK, valid_BK, h_e)
      cum = closes.long().cumsum(1)
      n_new = int(cum[:, -1].max())
      if n_new:
        rows, cols = closes.nonzero(as_tuple=True)
        s_new = pooled.new_zeros(b, n_new, pooled.shape[-1])
        s_new[rows, cum[rows, cols] - 1] = pooled[rows, cols]
        slots = self.n_lat[:, None] + torch.arange(n_new, device=dev)[None]
        z_new = self._latent(s_new, slots)
        r = torch.arange(b, device=dev)[:, None]
        self.z[r, slots] = z_new
        self.s[r, slots] = s_new
      u = self.n_lat[:, None] - 1 + cum  # latent slot each byte reads
      g = u - closes.long()  # group of each byte
      z_up = _read(self.z, u)
      h = self._byte_stack(2, "dec", z_up + h_e, pos_BK, allowed, c0)
      if m.has_lca_mbp:
        self.gcol[:, c0 : c0 + k] = g
        self.pcol[:, c0 : c0 + k] = pos_BK
        self.mcol[:, c0 : c0 + k] = z_up + _read(self.s, u)
      run["n_lat"] = u + 1
      self.n_lat = self.n_lat + cum[:, -1]
      self.open_sum, self.open_cnt = run["open_sum"][:, -1], run["open_cnt"][:, -1]
      self.prev_space = run["prev"][:, -1]
      self.undo.run = run
    self.pos = self.pos + valid_BK.long().sum(1)
    self.ncol = c0 + k
    out["ntp_logits"] = m._logits(h)
    if with_mbp:
      if m.has_lca_mbp:
        start, logits = self._lca_mbp()
        out["mbp_logits"] = logits[:, c0 - start :]
      if hasattr(m, "mlp_mbp"):
        out["mlp_mbp_logits"] = torch.stack([m._logits(hd(h)) for hd in m.mlp_mbp], dim=1)
    return out

  def _lca_mbp(self):
    """Run the LCA-MBP head over the columns it has not seen: the first of them and their
    logits [B, new, V]."""
    c0, c1 = self.mbp_done, self.ncol
    g = self.gcol[:, :c1]
    same = (g[:, None, :] == g[:, c0:c1, None]) | (g[:, None, :] == g[:, c0:c1, None] - 1)
    allowed = self._causal(c0, c1 - c0, same)
    h = self._byte_stack(3, "mbp", self.mcol[:, c0:c1], self.pcol[:, c0:c1], allowed, c0)
    self.mbp_done = c1
    return c0, self.model._logits(h)

  @torch.no_grad()
  def mbp_copies(self, n):
    """LCA-MBP logits [B, n, V] at n copies appended after each row's last byte t (input m_t,
    group: the closed groups through t, positions t+1..): candidates for x_{t+3}, ... Nothing
    is kept."""
    if self.mbp_done < self.ncol:
      self._lca_mbp()
    c0 = self.ncol
    self._ensure_cols(c0 + n)
    u = (self.n_lat - 1)[:, None]  # the slot the last byte reads, the copies' group
    m_last = _read(self.z, u) + _read(self.s, u)
    grp = u.expand(-1, n)
    pos = self.pos[:, None] + torch.arange(n, device=self.pos.device)[None]
    valid0 = self.valid[:, c0 : c0 + n].clone()
    self.valid[:, c0 : c0 + n] = True
    g = torch.cat([self.gcol[:, :c0], grp], 1)
    same = (g[:, None, :] == grp[:, :, None]) | (g[:, None, :] == grp[:, :, None] - 1)
    allowed = self._causal(c0, n, same)
    h = self._byte_stack(3, "mbp", m_last.expand(-1, n, -1), pos, allowed, c0)
    self.valid[:, c0 : c0 + n] = valid0
    return self.model._logits(h)

  def rollback(self, keep_B):
    """Keep only the first ``keep_B`` real bytes of the last ``extend`` per row."""
    u = self.undo
    keep_B = keep_B.to(self.pos.device).long()
    rank = u.valid_BK.long().cumsum(1)
    drop = u.valid_BK & (rank > keep_B[:, None])
    k = u.valid_BK.shape[1]
    self.valid[:, u.c0 : u.c0 + k] &= ~drop
    self.pos = u.pos + keep_B
    if u.run is None:
      return
    # the column of each row's last kept byte (or none)
    col = (
      torch.where(u.valid_BK & (rank == keep_B[:, None]), torch.arange(k, device=rank.device), k)
      .min(1)
      .values
    )
    has = col < k
    at = col.clamp_max(k - 1)
    pick = lambda t, old: torch.where(
      has.view(-1, *([1] * (old.dim() - 1))),
      t[torch.arange(t.shape[0], device=at.device), at],
      old,
    )
    self.n_lat = pick(u.run["n_lat"], u.n_lat)
    self.open_sum = pick(u.run["open_sum"], u.open_sum)
    self.open_cnt = pick(u.run["open_cnt"], u.open_cnt)
    self.prev_space = pick(u.run["prev"], u.prev_space)
