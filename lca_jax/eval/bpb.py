"""Bits per byte of every head, bytes per latent and boundary statistics on held-out batches.

``evaluate_bpb(model, batches)`` runs one jitted inference forward per batch (deterministic
boundaries, as at decoding time) and accumulates per-target cross-entropy *sums* and target
counts, so the result is the mean over all targets of the run, not a mean of batch means.
Targets follow ``lca_jax.model.loss``: x_{t+k} counts when it lies in byte t's document (and,
with a ``loss_mask``, when the mask marks it).  NT predicts x_{t+1}, the LCA-MBP head x_{t+2},
MLP-MBP head k x_{t+1+k}.
"""

from __future__ import annotations

import functools
import time
from typing import Dict, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from lca_jax.model.hierarchical import ByteLM
from lca_jax.model.loss import LN2, shifted_targets

PERCENTILES = (10, 50, 90, 99)


@functools.lru_cache(maxsize=8)
def _sums_fn(cfg):
  """One jitted forward + CE sums per model config (reused across calls and batches; the last
  few configs only: each jit keeps its executables, see ``decode.executables.ExecutableCache``)."""
  module = ByteLM(cfg)
  return jax.jit(lambda params, batch: _sums(module, params, batch))


def _sums(module, params, batch):
  ids = batch["ids"]
  doc = batch["segment_ids"]
  out = module.apply({"params": params}, ids, doc, batch["positions"], train=False)
  lmask = batch.get("loss_mask")
  res = {}

  def ce_sum(logits, k):
    tgt, valid = shifted_targets(ids, doc, k, lmask)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tgt)
    return jnp.sum(ce * valid), jnp.sum(valid).astype(jnp.float32)

  res["ntp"] = ce_sum(out["ntp_logits"], 1)
  if out.get("mbp_logits") is not None:
    res["mbp"] = ce_sum(out["mbp_logits"], 2)
  if out.get("mlp_mbp_logits") is not None:
    for i in range(out["mlp_mbp_logits"].shape[1]):
      res[f"mlp_mbp_{i + 1}"] = ce_sum(out["mlp_mbp_logits"][:, i], 2 + i)
  if out.get("boundaries") is not None:
    res["boundaries"] = out["boundaries"].astype(jnp.int32)
    res["overflow"] = jnp.sum(out["overflow"]).astype(jnp.float32)
  return res


def group_lengths(boundaries_BT: np.ndarray, doc_BT: np.ndarray) -> np.ndarray:
  """Lengths (bytes) of every closed group: a group runs from the byte after the previous
  closing byte of its document (or the document's first byte) to its closing byte."""
  out = []
  for b_row, d_row in zip(np.asarray(boundaries_BT), np.asarray(doc_BT)):
    real = d_row != 0
    if not real.any():
      continue
    # document starts: first real byte and every change of doc id
    start = real & np.concatenate([[True], d_row[1:] != d_row[:-1]])
    close = (b_row > 0) & real
    idx = np.nonzero(start | close)[0]
    prev = -1
    for i in idx:
      if start[i]:
        prev = i - 1
      if close[i]:
        out.append(i - prev)
        prev = i
  return np.asarray(out, np.int64)


class _Accumulator:
  def __init__(self):
    self.ce: Dict[str, float] = {}
    self.n: Dict[str, float] = {}
    self.lengths = np.zeros(1, np.int64)  # histogram of group lengths
    self.real = 0
    self.overflow = 0.0
    self.batches = 0

  def add(self, res, batch):
    self.batches += 1
    for k, v in res.items():
      if k in ("boundaries", "overflow"):
        continue
      self.ce[k] = self.ce.get(k, 0.0) + float(v[0])
      self.n[k] = self.n.get(k, 0.0) + float(v[1])
    if "boundaries" in res:
      self.real += int(np.sum(np.asarray(batch["segment_ids"]) != 0))
      self.overflow += float(res["overflow"])
      h = np.bincount(group_lengths(res["boundaries"], batch["segment_ids"]))
      if len(h) > len(self.lengths):
        h, self.lengths = self.lengths, h
      self.lengths[: len(h)] += h

  def result(self) -> dict:
    out = {"batches": self.batches}
    for k in self.ce:
      n = self.n[k]
      out[f"bpb_{k}"] = self.ce[k] / n / LN2 if n else float("nan")
      out[f"targets_{k}"] = int(n)
    mlp = [k for k in self.ce if k.startswith("mlp_mbp_")]
    if mlp:
      out["bpb_mlp_mbp_mean"] = float(np.mean([out[f"bpb_{k}"] for k in mlp]))
    n_groups = int(self.lengths.sum())
    if self.real:
      out["bytes"] = self.real
      out["latents"] = n_groups
      out["boundary_rate"] = n_groups / self.real
      out["bytes_per_latent"] = self.real / n_groups if n_groups else float("inf")
      out["overflow"] = self.overflow
      if n_groups:
        lens = np.arange(len(self.lengths))
        out["group_len_mean"] = float(np.sum(lens * self.lengths) / n_groups)
        cdf = np.cumsum(self.lengths) / n_groups
        for p in PERCENTILES:
          out[f"group_len_p{p}"] = int(np.searchsorted(cdf, p / 100.0 - 1e-12))
        out["group_len_max"] = int(lens[self.lengths > 0].max())
    return out


def evaluate_bpb(
  model, batches: Iterable[dict], max_batches: Optional[int] = None, progress: bool = False
) -> dict:
  """Bits per byte of the NT head (``bpb_ntp``), the LCA-MBP head (``bpb_mbp``) or each MLP-MBP
  head (``bpb_mlp_mbp_k``, and their mean), with target counts; for hierarchical models also
  ``bytes_per_latent``, ``boundary_rate`` (closed groups / real bytes), ``group_len_mean`` /
  ``_p10/_p50/_p90/_p99/_max`` over closed groups and ``overflow`` (groups past the latent
  capacity).  ``batches``: dicts with ``ids``, ``segment_ids``, ``positions`` [B, T] and
  optionally ``loss_mask``; when it is a pipeline (``lca_jax.data``: it has ``stats``), also
  ``skipped_records`` (bad records the pipeline skipped) and ``skipped`` (their count by
  reason)."""
  fn = _sums_fn(model.cfg)
  acc = _Accumulator()
  t0 = time.perf_counter()
  it = batches
  if progress:
    it = tqdm(batches, total=max_batches, desc="bpb", unit="batch")
  for i, batch in enumerate(it):
    if max_batches is not None and i >= max_batches:
      break
    keys = ("ids", "segment_ids", "positions", "loss_mask")
    b = {k: jnp.asarray(np.asarray(batch[k]), jnp.int32) for k in keys if k in batch}
    if "segment_ids" not in b:
      b["segment_ids"] = jnp.ones_like(b["ids"])
    if "positions" not in b:
      b["positions"] = jnp.broadcast_to(
        jnp.arange(b["ids"].shape[1], dtype=jnp.int32), b["ids"].shape
      )
    res = jax.device_get(fn(model.params, b))
    acc.add(res, {"segment_ids": np.asarray(b["segment_ids"])})
  out = acc.result()
  out["elapsed_s"] = time.perf_counter() - t0
  stats = getattr(batches, "stats", None)
  if stats is not None:
    out["skipped_records"] = int(stats.skipped_records)
    out["skipped"] = {k: int(v) for k, v in sorted(stats.skipped.items())}
  return out
