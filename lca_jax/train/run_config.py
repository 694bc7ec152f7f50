"""The run config of an lca-train work directory: writing it, reading it, checking a resume.

``WORKDIR/train_config.json`` holds ``{"model": ModelConfig fields, "config": the full run
config}``; process 0 writes it atomically when a run starts. ``check_resume_config`` compares it
with the config of a run resuming the directory and raises ``ConfigMismatchError`` naming the
fields that differ, except those in ``RESUME_MUTABLE`` (steps, logging, checkpoint cadence,
mesh, ...), which may change between a checkpoint and the run resuming it.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import jax

from lca_jax.model.config import ModelConfig

CONFIG_FILE = "train_config.json"

# Config fields that may differ between a checkpoint and the run resuming it.
RESUME_MUTABLE = (
    "train.steps", "train.log_every", "train.eval_every", "train.eval_batches",
    "train.checkpoint_every", "train.keep_checkpoints", "train.progress_bar", "train.init_from",
    "train.micro_batch_size", "train.peak_tflops", "train.tensorboard",
    "train.async_checkpointing", "data.eval_files", "model.attention_impl", "model.remat",
    "model.max_seq_len", "model.attn_block_q", "model.attn_block_k", "model.lca_block_q",
    "model.lca_lookback",
    "mesh.data", "mesh.fsdp", "mesh.tensor",
)


class ConfigMismatchError(ValueError):
  """The run config differs from the one that wrote the checkpoint being resumed."""


def flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    key = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(flatten(v, key + "."))
    else:
      out[key] = v
  return out


def write_run_config(workdir: str, config: dict, model_cfg: ModelConfig) -> None:
  if jax.process_index() != 0:
    return
  path = os.path.join(workdir, CONFIG_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({"model": model_cfg.to_dict(), "config": config}, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def read_run_config(workdir: str) -> Optional[dict]:
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def config_diff(saved: dict, current: dict, mutable=RESUME_MUTABLE) -> list:
  """[(key, saved value, current value)] for fields that must match to resume."""
  a, b = flatten(saved), flatten(current)
  diffs = []
  for k in sorted(set(a) | set(b)):
    if k in mutable:
      continue
    va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
    if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and not isinstance(va, bool):
      if float(va) == float(vb):
        continue
    if va != vb:
      diffs.append((k, va, vb))
  return diffs


def check_resume_config(workdir: str, config: dict) -> None:
  saved = read_run_config(workdir)
  if saved is None:
    return
  old = dict(saved.get("config", {}))
  # Model fields added to ModelConfig after the checkpoint was written take their defaults.
  defaults = ModelConfig().to_dict()
  old["model"] = dict({k: v for k, v in defaults.items() if k in config.get("model", {})},
                      **old.get("model", {}))
  diffs = config_diff(old, config)
  if diffs:
    shown = "; ".join(f"{k}: checkpoint {va!r}, now {vb!r}" for k, va, vb in diffs[:12])
    more = f" (+{len(diffs) - 12} more)" if len(diffs) > 12 else ""
    raise ConfigMismatchError(
        f"the config does not match the checkpoint in {workdir}: {shown}{more}. "
        "Use the checkpoint's values, or a new --workdir (train.init_from=<workdir> starts "
        "from its params).")

