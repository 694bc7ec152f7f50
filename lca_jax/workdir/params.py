"""Restoring only the params of a work directory's checkpoint: for ``lca_jax.load`` (float32 on
one device) and for ``train.init_from`` (onto a training mesh).

A corrupt step (see ``manifest.verify_step``) is skipped with a ``CorruptCheckpointWarning`` and
the previous one restored; nothing is moved (the training run that resumes the directory sets
corrupt steps aside). A step holding another model's parameters than the work directory's run
config describes is a ``CheckpointModelError``, named before any restore and never taken for a
corrupt one.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from lca_jax.errors import LcaError, LoadError
from lca_jax.model.config import ModelConfig
from lca_jax.param_tree import abstract_params
from lca_jax.workdir.config_file import CONFIG_FILE, read_run_config
from lca_jax.workdir.manifest import (
  CorruptCheckpointError,
  CorruptCheckpointWarning,
  short_reason,
  verify_step,
)

CKPT_DIR = "checkpoints"


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), CKPT_DIR)


def is_workdir(path: str) -> bool:
  """True for an lca-train work directory (its run config or a checkpoints folder exists)."""
  path = os.fspath(path)
  return os.path.isfile(os.path.join(path, CONFIG_FILE)) or os.path.isdir(
    os.path.join(path, CKPT_DIR)
  )


def model_config(workdir: str) -> ModelConfig:
  saved = read_run_config(workdir)
  if saved is None:
    raise FileNotFoundError(f"{workdir}: no {CONFIG_FILE}; not an lca-train work directory")
  return ModelConfig.from_dict(saved["model"])


# ---- a checkpoint of another model ----------------------------------------------------------
class CheckpointModelError(LcaError, RuntimeError):
  """A checkpoint's parameters are not those of the model its run config describes (a
  hand-edited train_config.json, a checkpoint copied from another work directory): named
  before the restore, and the step is not treated as corrupt (never set aside)."""


def _model_mismatch(step_dir: str, abstract) -> Optional[str]:
  """Where the parameters stored in checkpoint step ``step_dir`` differ from ``abstract``
  (names, shapes; the first three); None when they agree, or when the step's metadata cannot
  be read (its restore then reports why, as for a corrupt step)."""
  try:
    stored_tree = ocp.StandardCheckpointHandler().metadata(epath.Path(step_dir) / "params")
  except Exception:  # noqa: BLE001 - unreadable metadata is the restore's to report
    return None
  shape = lambda leaves: {jax.tree_util.keystr(k): tuple(v.shape) for k, v in leaves}
  stored = shape(jax.tree_util.tree_leaves_with_path(stored_tree))
  want = shape(jax.tree_util.tree_leaves_with_path(abstract))
  diffs = [
    f"{k} stored {stored[k] if k in stored else 'nowhere'}, the model has {w}"
    for k, w in want.items()
    if stored.get(k) != w
  ] + [f"{k} stored, not in the model" for k in sorted(set(stored) - set(want))]
  if not diffs:
    return None
  more = f" (+{len(diffs) - 3} more)" if len(diffs) > 3 else ""
  return "; ".join(diffs[:3]) + more


def check_step_model(workdir: str, step: int, abstract) -> None:
  """``CheckpointModelError`` when checkpoint ``step`` of ``workdir`` holds another model's
  parameters than ``abstract`` (those of the model its run config describes)."""
  diff = _model_mismatch(os.path.join(checkpoint_dir(workdir), str(step)), abstract)
  if diff is not None:
    raise CheckpointModelError(
      f"checkpoint step {step} in {checkpoint_dir(workdir)} holds another model's parameters "
      f"than {os.path.join(workdir, CONFIG_FILE)} describes ({diff}); restore that file's "
      "model, or use a new --workdir"
    )


# ---- restoring ------------------------------------------------------------------------------
def restore_params(workdir: str, abstract, step: Optional[int] = None):
  """Only the params of ``workdir``'s checkpoint ``step`` (default latest), laid out as the
  shardings/dtypes of ``abstract`` (a tree of ShapeDtypeStructs)."""
  directory = checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{workdir}: no checkpoint yet")
  opts = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
  with ocp.CheckpointManager(
    directory, options=opts, item_handlers={"params": ocp.StandardCheckpointHandler()}
  ) as mngr:
    restore = lambda s: mngr.restore(
      s, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract))
    )["params"]
    if step is not None:
      if step not in mngr.all_steps():
        raise FileNotFoundError(
          f"{workdir}: no checkpoint for step {step} (have {sorted(mngr.all_steps())})"
        )
      reason = verify_step(os.path.join(directory, str(step)))
      if reason is not None:
        raise CorruptCheckpointError(f"{workdir}: checkpoint step {step} is corrupt ({reason})")
      check_step_model(workdir, step, abstract)
      return restore(step)
    steps = sorted(mngr.all_steps(), reverse=True)
    if not steps:
      raise FileNotFoundError(f"{workdir}: no checkpoint yet")
    bad = []
    for i, s in enumerate(steps):
      # The latest readable step; a corrupt one is skipped with a warning (left in place:
      # the training run that resumes this directory sets it aside).
      reason = verify_step(os.path.join(directory, str(s)))
      if reason is None:
        check_step_model(workdir, s, abstract)  # another model's step is not corrupt
        try:
          return restore(s)
        except Exception as e:  # noqa: BLE001 - any read failure means a damaged checkpoint
          reason = short_reason(e)
      bad.append((s, reason))
      nxt = f"using step {steps[i + 1]}" if i + 1 < len(steps) else "no earlier checkpoint"
      warnings.warn(
        f"checkpoint step {s} in {directory} is corrupt ({reason}); {nxt}",
        CorruptCheckpointWarning,
        stacklevel=2,
      )
    raise CorruptCheckpointError(
      f"no readable checkpoint in {directory}: " + "; ".join(f"step {s}: {r}" for s, r in bad)
    )


def load_for_inference(path: str, step: Optional[int] = None):
  """(ModelConfig, float32 params on one device) from a work directory's checkpoint. No run
  config or checkpoint, no intact step, or one of another model is a ``LoadError``; a damaged
  run config is its ``RunConfigError``."""
  try:
    cfg = model_config(path)
  except FileNotFoundError as e:
    raise LoadError(str(e)) from None
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = abstract_params(cfg, jax.numpy.float32, dev)
  try:
    params = restore_params(path, abstract, step)
  except (FileNotFoundError, CorruptCheckpointError, CheckpointModelError) as e:
    raise LoadError(str(e)) from None
  return cfg, params
