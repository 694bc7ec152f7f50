"""The run config of an lca-train work directory: checking a resume, validating it.

``WORKDIR/train_config.json`` holds ``{"model": ModelConfig fields, "config": the full run
config}``; process 0 writes it atomically when a run starts (``lca_jax.workdir.config_file``
writes and reads it). ``check_resume_config`` compares it
with the config of a run resuming the directory and raises ``ConfigMismatchError`` naming the
fields that differ, except those in ``RESUME_MUTABLE`` (steps, logging, checkpoint cadence,
mesh, ...), which may change between a checkpoint and the run resuming it.
``resume_schedule`` keeps the learning-rate schedule a resumed run was trained with when
``optim.decay_steps`` is 0 (its horizon would otherwise follow a new ``train.steps``), with a
``ScheduleWarning``.
``validate_run_config`` rejects values no run can use (an unknown ``data.format`` or
``data.packing``, negative ``train.steps``, a learning rate that is not a positive number, a
model section ``ModelConfig`` refuses, ...)
with a ``RunConfigError`` naming every bad field, before anything is built.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Optional

from lca_jax.errors import LcaError
from lca_jax.model.config import ConfigError, ModelConfig
from lca_jax.train import optim
from lca_jax.workdir.config_file import CONFIG_FILE as CONFIG_FILE  # the file's name, for callers
from lca_jax.workdir.config_file import RunConfigError, read_run_config

# Config fields that may differ between a checkpoint and the run resuming it.
RESUME_MUTABLE = (
  "train.steps",
  "optim.decay_steps",  # resume_schedule warns when the schedule's horizon changes
  "train.log_every",
  "train.eval_every",
  "train.eval_batches",
  "train.checkpoint_every",
  "train.keep_checkpoints",
  "train.progress_bar",
  "train.init_from",
  "train.micro_batch_size",
  "train.peak_tflops",
  "train.tensorboard",
  "train.async_checkpointing",
  "data.eval_files",
  "model.attention_impl",
  "model.remat",
  "model.scan_min_layers",
  "model.max_seq_len",
  "model.attn_block_q",
  "model.attn_block_k",
  "model.lca_block_q",
  "model.lca_lookback",
  "model.attn_parallel",
  "mesh.data",
  "mesh.fsdp",
  "mesh.tensor",
  "mesh.cpu_devices",
)


class ConfigMismatchError(LcaError, ValueError):
  """The run config differs from the one that wrote the checkpoint being resumed."""


# data.format values (``arrayrecord`` is the configs' spelling of ``array_record``; "" = infer
# from the file extension).
DATA_FORMATS = ("parquet", "jsonl", "text", "arrayrecord", "array_record", "tfds")
PACKINGS = ("concat", "segmented")
SFT_PACKINGS = ("concat", "segmented", "single")  # concat means segmented for SFT examples

_MISSING = object()


def _value(config, dotted: str):
  node = config
  for part in dotted.split("."):
    try:
      if part not in node:
        return _MISSING
      node = node[part]
    except (TypeError, KeyError, AttributeError):
      return _MISSING
  return node


def _number(v, integer: bool):
  """``v`` as an int / finite float, or None when it is not one."""
  if isinstance(v, bool):
    return None
  if integer:
    return int(v) if isinstance(v, int) else None
  if isinstance(v, (int, float)) and math.isfinite(float(v)):
    return float(v)
  return None


# (key, integer?, check, what it must be)
_NUMBERS = (
  ("data.seq_len", True, lambda x: x >= 1, "an integer >= 1"),
  ("mesh.cpu_devices", True, lambda x: x >= 0, "an integer >= 0 (0 = auto)"),
  ("data.worker_count", True, lambda x: x >= 0, "an integer >= 0"),
  ("train.steps", True, lambda x: x >= 0, "an integer >= 0"),
  ("train.seed", True, lambda x: True, "an integer"),
  ("train.global_batch_bytes", True, lambda x: x >= 1, "an integer >= 1"),
  ("train.micro_batch_size", True, lambda x: x >= 1, "an integer >= 1"),
  ("train.log_every", True, lambda x: x >= 0, "an integer >= 0"),
  ("train.eval_every", True, lambda x: x >= 0, "an integer >= 0 (0 = no eval)"),
  ("train.eval_batches", True, lambda x: x >= 0, "an integer >= 0 (0 = all)"),
  ("train.checkpoint_every", True, lambda x: x >= 0, "an integer >= 0 (0 = only at the end)"),
  ("train.keep_checkpoints", True, lambda x: x >= 0, "an integer >= 0"),
  ("train.lambda_ntp", False, lambda x: x >= 0, "a finite number >= 0"),
  ("train.lambda_mbp", False, lambda x: x >= 0, "a finite number >= 0"),
  ("train.lambda_bp", False, lambda x: x >= 0, "a finite number >= 0"),
  ("train.peak_tflops", False, lambda x: x >= 0, "a finite number >= 0 (0 = look up)"),
  ("optim.lr", False, lambda x: x > 0, "a finite number > 0"),
  ("optim.warmup_steps", True, lambda x: x >= 0, "an integer >= 0"),
  ("optim.decay_steps", True, lambda x: x >= 0, "an integer >= 0 (0 = train.steps)"),
  ("optim.final_lr_ratio", False, lambda x: x >= 0, "a finite number >= 0"),
  ("optim.b1", False, lambda x: 0 <= x < 1, "a number in [0, 1)"),
  ("optim.b2", False, lambda x: 0 <= x < 1, "a number in [0, 1)"),
  ("optim.eps", False, lambda x: x > 0, "a finite number > 0"),
  ("optim.weight_decay", False, lambda x: x >= 0, "a finite number >= 0"),
  ("optim.clip_norm", False, lambda x: x >= 0, "a finite number >= 0 (0 = no clipping)"),
)


def validate_run_config(config, *, min_steps: int = 0) -> None:
  """Raise ``RunConfigError`` naming every field of ``config`` (an ml_collections ConfigDict
  or a dict) that no run can use. Fields a config does not have are not checked.
  ``min_steps``: the least ``train.steps`` accepted (lca-train asks for 1: a run of 0 steps
  trains and saves nothing; the Python API allows 0 to get the initial state back)."""
  # lazy: importing this module (lca-train and lca-convert validate a config first) does not
  # import grain, which the lca_jax.data package imports (grain: the data / train extras)
  from lca_jax.data.sft_format import SFT_FORMATS  # pylint: disable=g-import-not-at-top

  bad = []
  fmt = _value(config, "data.format")
  if fmt is not _MISSING and not (isinstance(fmt, str) and fmt.strip() in DATA_FORMATS + ("",)):
    bad.append(
      f"data.format={fmt!r} is not a data format; use one of {', '.join(DATA_FORMATS[:3])}"
      f", arrayrecord or tfds"
    )
  sft = _value(config, "data.sft_format")
  sft_on = isinstance(sft, str) and bool(sft.strip())
  if (
    sft is not _MISSING
    and sft is not None
    and not (isinstance(sft, str) and sft.strip() in SFT_FORMATS + ("",))
  ):
    bad.append(
      f"data.sft_format={sft!r} is not an SFT format; use one of {', '.join(SFT_FORMATS)} "
      "(or \"\" for pretraining)"
    )
  packing = _value(config, "data.packing")
  allowed = SFT_PACKINGS if sft_on else PACKINGS
  if packing is not _MISSING and packing not in allowed:
    bad.append(f"data.packing={packing!r} is not a packing mode; use one of {', '.join(allowed)}")
  for key, integer, ok, what in _NUMBERS:
    v = _value(config, key)
    if v is _MISSING:
      continue
    x = _number(v, integer)
    if x is None or not ok(x):
      bad.append(f"{key} must be {what}, got {v!r}")
  steps = _number(_value(config, "train.steps"), True)
  if min_steps and steps is not None and 0 <= steps < min_steps:
    bad.append(
      f"train.steps must be >= {min_steps} (the number of optimizer steps to train to), got {steps}"
    )
  model = _value(config, "model")
  if model is not _MISSING:  # a zero n_heads or a negative d_model: named here, not in jax
    try:
      ModelConfig.from_dict(model.to_dict() if hasattr(model, "to_dict") else model)
    except ConfigError as e:
      bad.append(str(e))
  if bad:
    raise RunConfigError("bad config: " + "; ".join(bad))


def flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    key = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(flatten(v, key + "."))
    else:
      out[key] = v
  return out


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
  old["model"] = dict(
    {k: v for k, v in defaults.items() if k in config.get("model", {})}, **old.get("model", {})
  )
  diffs = config_diff(old, config)
  if diffs:
    shown = "; ".join(f"{k}: checkpoint {va!r}, now {vb!r}" for k, va, vb in diffs[:12])
    more = f" (+{len(diffs) - 12} more)" if len(diffs) > 12 else ""
    raise ConfigMismatchError(
      f"the config does not match the checkpoint in {workdir}: {shown}{more}. "
      "Use the checkpoint's values, or a new --workdir (train.init_from=<workdir> starts "
      "from its params)."
    )


# ---- the learning-rate schedule of a resume ---------------------------------------------------
class ScheduleWarning(UserWarning):
  """A resume whose config would move, or moves, the learning-rate schedule of the run."""


def saved_horizon(saved_config: dict) -> Optional[int]:
  """The warmup + cosine horizon of a saved run config (``train_config.json``'s ``config``);
  None when it lacks the optim section or ``train.steps``."""
  optim_cfg, train = saved_config.get("optim"), saved_config.get("train", {})
  if not isinstance(optim_cfg, dict) or "warmup_steps" not in optim_cfg or "steps" not in train:
    return None
  return optim.decay_horizon(optim_cfg, int(train["steps"]))


def resume_schedule(workdir: str, config):
  """``config`` for resuming ``workdir`` on the schedule its run was trained with: when the
  horizon would change (``optim.decay_steps`` 0 follows ``train.steps``: 4,000 -> 4,500 steps
  would make the learning rate jump), a copy whose ``optim.decay_steps`` is the saved horizon,
  with a ``ScheduleWarning``. An explicit ``optim.decay_steps`` is kept, with a warning when it
  changes the horizon."""
  saved = read_run_config(workdir)
  old = saved_horizon(saved.get("config", {})) if saved is not None else None
  new = optim.decay_horizon(config.optim, int(config.train.steps))
  if old is None or new == old:
    return config
  explicit = int(config.optim.get("decay_steps", 0) or 0)
  if explicit:
    warnings.warn(
      f"optim.decay_steps={explicit} moves the learning-rate schedule of {workdir}: its "
      f"horizon changes from {old} to {new} steps",
      ScheduleWarning,
      stacklevel=2,
    )
    return config
  warnings.warn(
    f"train.steps={int(config.train.steps)} keeps the learning-rate schedule {workdir} was "
    f"trained with (horizon {old} steps); set optim.decay_steps={new} to stretch it instead",
    ScheduleWarning,
    stacklevel=2,
  )
  pinned = copy.deepcopy(config)
  pinned.optim.decay_steps = old
  return pinned
