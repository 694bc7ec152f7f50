"""Greedy multi-byte decoding of ``torch_model.TorchHierarchicalLM`` over its hierarchical caches.

The paper's two modes with the model's own multi-byte head (LCA-MBP, or MLP-MBP heads), one
step drafting ``n`` bytes per row: the next byte from the next-byte (NT) head, then n - 1
candidates (LCA-MBP: its logits at the last byte, then at n - 2 copies appended after it;
MLP-MBP: heads 1..n-1).

  * ``threshold``: candidates are accepted left to right while their softmax probability is at
    least ``tau``; only the accepted bytes are fed.
  * ``verify``: all n bytes are fed in one block and the NT head's argmax at each of them checks
    the next candidate; the leading matches are kept (``HierCache.rollback``), so the output
    equals next-byte greedy decoding.

Rows advance independently; a row stops at eos or after ``max_new_bytes``. It imports only
torch and ``torch_incremental``, so it is copied into a transformers export.
"""

import torch

from .torch_incremental import HierCache

__all__ = ["MODES", "multi_byte_generate"]

MODES = ("threshold", "verify")


def _leading(ok_BN):
  return ok_BN.long().cumprod(1).sum(1)


def _at(x_BK, idx_B):
  """x[b, idx[b]] for x [B, K, ...]."""
  return x_BK[torch.arange(x_BK.shape[0], device=x_BK.device), idx_B]


class _Heads:
  """The logits a step drafts from: NT and the multi-byte head at each row's last byte."""

  def __init__(self, model, out, idx_B):
    self.lca = model.has_lca_mbp
    self.nt = _at(out["ntp_logits"], idx_B)
    self.mbp = _at(out["mbp_logits"], idx_B) if self.lca else None
    self.mlp = None if self.lca else out["mlp_mbp_logits"][torch.arange(idx_B.numel()), :, idx_B]

  def keep(self, new, has_B):
    """Rows that fed no byte keep their logits."""
    for name in ("nt", "mbp", "mlp"):
      old, nw = getattr(self, name), getattr(new, name)
      if old is not None:
        setattr(self, name, torch.where(has_B.view(-1, *([1] * (old.dim() - 1))), nw, old))


def _draft(heads, cache, n):
  """Drafted bytes [B, n] and the softmax probability of each candidate [B, n-1]."""
  if heads.lca:
    cand = heads.mbp[:, None]
    if n > 2:
      cand = torch.cat([cand, cache.mbp_copies(n - 2).float()], 1)
  else:
    cand = heads.mlp[:, : n - 1]
  cand = cand.float()
  tc = cand.argmax(-1)
  pc = torch.softmax(cand, -1).gather(-1, tc[..., None])[..., 0]
  return torch.cat([heads.nt.argmax(-1)[:, None], tc], 1), pc


@torch.no_grad()
def multi_byte_generate(
  model, input_ids, attention_mask=None, mode="verify", n=3, tau=0.9, max_new_bytes=256, eos_id=1
):
  """Continue each row of ``input_ids`` [B, P] (left-padded where ``attention_mask`` has
  zeros). Returns (generated [B, G] with -1 past each row's end, steps taken)."""
  if mode not in MODES:
    raise ValueError(f"unknown multi-byte mode {mode!r}; choose one of {', '.join(MODES)}")
  if not (model.has_lca_mbp or hasattr(model, "mlp_mbp")):
    raise ValueError("multi-byte decoding needs a multi-byte head (LCA-MBP or MLP-MBP)")
  most = model.cfg.get("mlp_mbp_heads", 0) + 1 if not model.has_lca_mbp else None
  if not isinstance(n, int) or n < 2 or (most is not None and n > most):
    raise ValueError(f"n (bytes drafted per step) must be an integer in [2, {most or 'inf'}]")
  if attention_mask is not None and not bool(attention_mask[:, -1].bool().all()):
    raise ValueError("multi-byte generate needs left padding (tokenizer padding_side='left')")
  b = input_ids.shape[0]
  dev = input_ids.device
  cache = HierCache(model, b)
  out = cache.extend(input_ids, attention_mask, with_mbp=True)
  last = torch.full((b,), input_ids.shape[1] - 1, dtype=torch.long, device=dev)
  heads = _Heads(model, out, last)
  gen = torch.full((b, max_new_bytes + n), -1, dtype=torch.long, device=dev)
  count = torch.zeros(b, dtype=torch.long, device=dev)
  done = torch.zeros(b, dtype=torch.bool, device=dev)
  steps = 0
  j = torch.arange(n, device=dev)[None]
  while not bool(done.all()):
    d, pc = _draft(heads, cache, n)
    if mode == "threshold":
      a = 1 + _leading(pc >= tau)
    else:
      out = cache.extend(d, None, with_mbp=True)
      a = 1 + _leading(d[:, 1:] == out["ntp_logits"][:, : n - 1].argmax(-1))
    a = torch.where(done, torch.zeros_like(a), a)
    is_eos = (d == eos_id) & (j < a[:, None])
    hit = is_eos.any(1)
    a = torch.where(hit, is_eos.long().argmax(1) + 1, a)
    a = torch.minimum(a, max_new_bytes - count)
    if mode == "threshold":
      out = cache.extend(d, j < a[:, None], with_mbp=True)
    else:
      cache.rollback(a)
    heads.keep(_Heads(model, out, (a - 1).clamp_min(0)), a > 0)
    rows = torch.arange(b, device=dev)[:, None]
    cols = count[:, None] + j
    gen[rows, cols] = torch.where(j < a[:, None], d, gen[rows, cols])
    count = count + a
    done = done | hit | (count >= max_new_bytes)
    steps += 1
  return gen[:, : int(count.max())], steps
