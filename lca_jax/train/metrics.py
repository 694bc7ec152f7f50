"""Training metrics: JSON lines, TensorBoard scalars, a tqdm progress bar, and the FLOP count
behind MFU.

Files written in the work directory (process 0 only):
  metrics.jsonl   one line per logged train step: step, loss, bpb_ntp, bpb_mbp, bp_loss,
                  bytes_per_latent, overflow, lr, grad_norm, bytes_per_s, step_time, mfu,
                  skipped_records
                  (metrics averaged over the steps since the previous line; lr at ``step``;
                  null where the model has no such quantity, or MFU with an unknown peak;
                  skipped_records: bad records (bad JSON, non-string or empty text, ...)
                  process 0's data pipeline has skipped so far, an integer kept across
                  resumes)
  eval.jsonl      one line per evaluation: step, bpb_ntp, bpb_mbp, bp_loss, bytes_per_latent,
                  overflow, bytes (number of scored next-byte targets)
  tb/             TensorBoard event files: train/<name> and eval/<name> for all of the above

FLOPs and MFU
-------------
``train_flops_per_step`` counts model FLOPs of one optimizer step (forward + backward = 3x
the forward's 2 FLOPs per multiply-add), stage by stage, PaLM-style (Chowdhery et al. 2022,
App. B), with N_s the parameter count of stage s and L_s its number of layers:

    6 * N_s * tokens_s                         every matmul parameter (embedding lookup: 0)
  + 12 * L_s * d_model * ctx_s * tokens_s      attention scores and values (QK^T, PV)

  stage                               tokens_s                ctx_s
  encoder, NT decoder, LCA-MBP head   B*T bytes               T
  latent LM module                    B*(1 + T/bpl) latents   1 + T/bpl
  boundary predictor                  B*T                     -
  final norm + unembedding            B*T per head output     -  (NT, LCA-MBP, each MLP head)
  MLP-MBP heads                       B*T                     -

``bpl`` is the measured bytes per latent of the step (falling back to the static capacity
when unknown), so the latent stack is counted by the groups it really needs, not by the padded
capacity S it executes. ctx = T (not T/2) for causal attention follows PaLM; for the LCA head
it matches the dense XLA implementation, while the Pallas kernel skips most of that work.

  MFU = train_flops_per_step / step_time / (n_devices * peak_flops_per_device)

with the dense bf16 peak of the device kind (table below; ``train.peak_tflops`` overrides it,
e.g. for CPUs, where MFU is otherwise null). The same bf16 peak is used for float32 runs.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Optional

import jax
from tqdm.auto import tqdm

from lca_jax.model.config import ModelConfig
from lca_jax.train.errors import MetricsWriteError

# Dense bf16 peak FLOP/s per device, matched against ``device.device_kind`` (lower case).
PEAK_FLOPS = (
  ("h200", 989e12),
  ("h100", 989e12),
  ("gh200", 989e12),
  ("b200", 2250e12),
  ("a100", 312e12),
  ("a10", 125e12),
  ("l40", 181e12),
  ("l4", 121e12),
  ("v100", 125e12),
  ("tpu v6", 918e12),
  ("tpu v5p", 459e12),
  ("tpu v5 lite", 197e12),
  ("tpu v5e", 197e12),
  ("tpu v5", 459e12),
  ("tpu v4", 275e12),
  ("tpu v3", 123e12),
)

TRAIN_KEYS = (
  "loss",
  "bpb_ntp",
  "bpb_mbp",
  "bp_loss",
  "bytes_per_latent",
  "overflow",
  "lr",
  "grad_norm",
  "bytes_per_s",
  "step_time",
  "mfu",
  "skipped_records",
)


def peak_flops_per_device(device=None, override_tflops: float = 0.0) -> Optional[float]:
  if override_tflops and override_tflops > 0:
    return float(override_tflops) * 1e12
  device = device or jax.devices()[0]
  kind = getattr(device, "device_kind", "").lower()
  for key, val in PEAK_FLOPS:
    if key in kind:
      return val
  return None


def _count(tree) -> int:
  return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


def train_flops_per_step(
  cfg: ModelConfig, params, rows: int, seq_len: int, bytes_per_latent: Optional[float] = None
) -> float:
  """Model FLOPs of one optimizer step over ``rows`` sequences of ``seq_len`` bytes (see the
  module docstring). ``params``: the (possibly abstract) unboxed parameter tree."""
  bt = float(rows) * seq_len
  d = cfg.d_model
  flops = 0.0

  def stack(name, n_layers, tokens, ctx):
    nonlocal flops
    if name in params:
      flops += 6.0 * _count(params[name]) * tokens + 12.0 * n_layers * d * ctx * tokens

  stack("encoder", cfg.n_enc, bt, seq_len)
  head_uses = 1
  if cfg.hierarchical:
    if bytes_per_latent and bytes_per_latent > 0 and math.isfinite(bytes_per_latent):
      lat = 1.0 + seq_len / bytes_per_latent
    else:
      lat = float(cfg.latent_capacity(seq_len))
    stack("lm", cfg.n_lm, rows * lat, lat)
    stack("decoder", cfg.n_dec, bt, seq_len)
    if cfg.n_mbp:
      stack("mbp", cfg.n_mbp, bt, seq_len)
      head_uses += 1
    if "boundary_predictor" in params:
      flops += 6.0 * _count(params["boundary_predictor"]) * bt
    for i in range(cfg.n_mlp_mbp):
      flops += 6.0 * _count(params[f"mlp_mbp_{i}"]) * bt
    head_uses += cfg.n_mlp_mbp
  flops += 6.0 * _count(params["head"]) * bt * head_uses
  return flops


def _clean(v):
  if v is None:
    return None
  if isinstance(v, int) and not isinstance(v, bool):  # counts stay integers
    return v
  v = float(v)
  return v if math.isfinite(v) else None


def _drop_after(path: str, step: int) -> None:
  if not os.path.isfile(path):
    return
  with open(path, encoding="utf-8") as f:
    lines = f.readlines()
  keep = []
  for line in lines:
    try:
      if int(json.loads(line)["step"]) <= step:
        keep.append(line)
    except (ValueError, KeyError, TypeError):
      continue
  if len(keep) != len(lines):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(keep)
    os.replace(tmp, path)


class MetricsWriter:
  """metrics.jsonl / eval.jsonl / TensorBoard; a no-op on processes other than 0."""

  def __init__(self, workdir: str, tensorboard: bool = True, start_step: int = 0):
    """``start_step``: the step the run (re)starts from; lines and TensorBoard events logged
    after it by an earlier, interrupted run are dropped, so a resumed run has no duplicates."""
    self.active = jax.process_index() == 0
    self.train_path = os.path.join(workdir, "metrics.jsonl")
    self.eval_path = os.path.join(workdir, "eval.jsonl")
    self.tb = None
    if not self.active:
      return
    for path in (self.train_path, self.eval_path):
      _drop_after(path, start_step)
    if tensorboard:
      try:
        # lazy: tensorboardX is optional (the train extra) and takes seconds to import
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top

        self.tb = SummaryWriter(
          os.path.join(workdir, "tb"), purge_step=start_step + 1 if start_step else None
        )
      except ImportError:
        self.tb = None

  def _append(self, path, record):
    line = json.dumps(record, allow_nan=False) + "\n"  # strict JSON: _clean made NaN None
    try:
      with open(path, "a", encoding="utf-8") as f:
        f.write(line)
    except OSError as e:  # disk full, unwritable: a torn last line is dropped on resume
      raise MetricsWriteError(
        f"cannot append step {record['step']} to {path}: {e.strerror or e}"
      ) from None

  def write_train(self, step: int, values: dict):
    if not self.active:
      return
    record = {"step": int(step)}
    record.update({k: _clean(values.get(k)) for k in TRAIN_KEYS})
    self._append(self.train_path, record)
    if self.tb is not None:
      for k, v in values.items():
        if _clean(v) is not None:
          self.tb.add_scalar(f"train/{k}", float(v), step)

  def write_eval(self, step: int, values: dict):
    if not self.active:
      return
    record = {"step": int(step)}
    record.update({k: _clean(v) for k, v in values.items()})
    self._append(self.eval_path, record)
    if self.tb is not None:
      for k, v in values.items():
        if _clean(v) is not None:
          self.tb.add_scalar(f"eval/{k}", float(v), step)

  def flush(self):
    if self.tb is not None:
      self.tb.flush()

  def close(self):
    if self.tb is not None:
      self.tb.close()
      self.tb = None


class Progress:
  """tqdm bar over optimizer steps (ETA from its rate) when ``enabled`` and stderr is a
  terminal (a batch job's log would fill with its carriage returns); else silent, and
  ``write`` prints lines."""

  def __init__(self, total: int, initial: int, enabled: bool):
    self.bar = None
    if enabled and jax.process_index() == 0 and sys.stderr.isatty():
      self.bar = tqdm(
        total=total,
        initial=initial,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
        smoothing=0.1,
      )

  @property
  def has_bar(self) -> bool:
    return self.bar is not None

  def update(self, n: int = 1, **postfix):
    if self.bar is not None:
      if postfix:
        self.bar.set_postfix(
          {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()},
          refresh=False,
        )
      self.bar.update(n)

  def write(self, msg: str):
    if self.bar is not None:
      self.bar.write(msg)
    elif jax.process_index() == 0:
      print(msg, file=sys.stderr, flush=True)

  def close(self):
    if self.bar is not None:
      self.bar.close()
      self.bar = None
