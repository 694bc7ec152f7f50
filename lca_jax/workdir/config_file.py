"""``WORKDIR/train_config.json``: the model and run config a work directory was made with.

The file holds ``{"model": ModelConfig fields, "config": the full run config}``.
``write_run_config`` writes it atomically (process 0: a training run when it starts, and
``lca_jax.workdir.write``); ``read_run_config`` reads it back, and ``lca_jax.train.run_config``
checks a resume against it. A damaged or hand-edited file is a ``RunConfigError`` naming it.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import jax

from lca_jax.model.config import ConfigError, ModelConfig

CONFIG_FILE = "train_config.json"


class RunConfigError(ConfigError):
  """A run config value that no run can use (unknown data format, negative steps, ...)."""


def read_run_config(workdir: str) -> Optional[dict]:
  """A work directory's saved run config, checked; None when it has none. A damaged or
  hand-edited file (not JSON, no ``model`` object, ``config`` not an object of sections, a
  model that cannot be built) is a ``RunConfigError`` naming the file, not a traceback where
  it is read."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
    raise RunConfigError(f"{path}: damaged run config, not valid JSON ({e})") from None
  if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
    raise RunConfigError(f'{path}: damaged run config, no "model" object')
  run = saved.get("config", {})
  if not isinstance(run, dict) or not all(isinstance(v, dict) for v in run.values()):
    raise RunConfigError(f'{path}: damaged run config, "config" is not an object of sections')
  try:
    ModelConfig.from_dict(saved["model"])
  except ConfigError as e:
    raise RunConfigError(f"{path}: {e}") from None
  return saved


def trained_seq_len(path: str) -> Optional[int]:
  """The length a work directory trained at: ``data.seq_len`` of its saved run config (the
  one owner of "the trained length"); None for another layout (the paper's config.json +
  model.safetensors) or a saved config without it."""
  saved = read_run_config(path) if os.path.isdir(path) else None
  data = ((saved or {}).get("config") or {}).get("data") or {}
  n = data.get("seq_len")
  return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def write_run_config(workdir: str, config: dict, model_cfg: ModelConfig) -> None:
  """Write ``workdir``'s run config (``config``: the run config as a dict of sections) and
  model atomically; only process 0 writes."""
  if jax.process_index() != 0:
    return
  path = os.path.join(workdir, CONFIG_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({"model": model_cfg.to_dict(), "config": config}, f, indent=2, sort_keys=True)
  os.replace(tmp, path)
