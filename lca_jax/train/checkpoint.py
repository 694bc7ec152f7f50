"""Checkpoints of an lca-train work directory (orbax), and loading them for inference.

Layout of WORKDIR:
  train_config.json      {"model": ModelConfig fields, "config": the full run config}
                         (written, read and checked on resume by train/run_config.py)
  checkpoints/<step>/    orbax Composite items
      params, opt_state               StandardSave (sharded arrays; restorable onto any mesh)
      step, rng                       StandardSave of {"step": int32} and {"key": uint32[2]}
      data                            the grain iterator state (grain.checkpoint handler)
      meta                            JSON: model config, step, bytes seen

``step`` is the number of optimizer steps completed. Saving is asynchronous (the arrays are
copied to host before ``save`` returns, so the next, donating train step is safe); the data
iterator state is captured at save time. Restores take their target shardings from the
abstract state of the *current* mesh, so a run can resume on a different device layout.

Fault tolerance:
  * orbax writes each step into ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>``
    only once every process has written its shards (commit). A save interrupted by a crash
    leaves only the tmp directory, which is never listed as a step (so never restored) and is
    deleted when the next run opens the directory.
  * Once a step is committed, process 0 writes ``<step>/lca_manifest.json`` (every file of
    the step and its size; see train/manifest.py). ``restore_latest`` checks it before
    restoring: a step with a missing or truncated file, or one that fails to restore, is
    skipped and the previous step restored; the skipped steps are then moved to
    ``WORKDIR/corrupt_checkpoints/`` with a ``CorruptCheckpointWarning`` naming them (nothing
    is moved when no step restores).
    (In a multi-process run the manifest check is agreed by all processes; a failure inside
    orbax's restore on only some processes cannot be recovered from safely, so it is an error
    naming the step to move away.)
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from lca_jax.errors import LoadError
from lca_jax.model.config import ModelConfig
from lca_jax.train.manifest import (
  MANIFEST,
  CorruptCheckpointError,
  CorruptCheckpointWarning,
  _short,
  check_process_count,
  verify_step,
  write_manifest,
)
from lca_jax.train.run_config import CONFIG_FILE, read_run_config

CKPT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"


class _IteratorSnapshot:
  """An iterator state frozen at save time (grain's handler calls ``get_state()``, which may
  happen on orbax's background thread while the live iterator has moved on)."""

  def __init__(self, state: Any):
    self._raw = json.dumps(state, indent=1).encode()

  def get_state(self) -> bytes:
    return self._raw


def _grain_handler():
  from lca_jax.data import pipeline  # pylint: disable=g-import-not-at-top

  return pipeline.checkpoint_handler()


def _grain_save(state):
  import grain  # pylint: disable=g-import-not-at-top

  return grain.checkpoint.CheckpointSave(_IteratorSnapshot(state))


def _grain_restore(data):
  """``data``: a ``lca_jax.data`` Pipeline (its own restore args) or a grain iterator."""
  if hasattr(data, "restore_args"):
    return data.restore_args()
  import grain  # pylint: disable=g-import-not-at-top

  return grain.checkpoint.CheckpointRestore(data)


# ---- the manager --------------------------------------------------------------------------
def _handlers(with_data: bool):
  h = {name: ocp.StandardCheckpointHandler() for name in ("params", "opt_state", "step", "rng")}
  h["meta"] = ocp.JsonCheckpointHandler()
  if with_data:
    h["data"] = _grain_handler()
  return h


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), CKPT_DIR)


class Checkpointer:
  """Saves and restores train states (+ data iterator state) of one work directory."""

  def __init__(self, workdir: str, keep: int = 3, async_save: bool = True, read_only: bool = False):
    # read_only: open an existing directory for restoring (no directory is created; orbax's
    # own read_only flag is not used because it logs warnings on every open).
    # cleanup_tmp_directories: saves interrupted by a crash leave <step>.orbax-checkpoint-tmp-*
    # directories (never restored); they are removed when a run opens the directory again.
    opts = ocp.CheckpointManagerOptions(
      max_to_keep=max(1, int(keep)) if keep else None,
      create=not read_only,
      enable_async_checkpointing=async_save and not read_only,
      cleanup_tmp_directories=not read_only,
    )
    self.workdir = os.path.abspath(workdir)
    self.directory = checkpoint_dir(workdir)
    self.read_only = read_only
    self.async_save = bool(async_save and not read_only)
    self._unsealed: list = []  # steps saved whose manifest is not written yet
    self.manager = ocp.CheckpointManager(
      self.directory, options=opts, item_handlers=_handlers(with_data=True)
    )

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def all_steps(self):
    return list(self.manager.all_steps())

  def save(self, state, data_state: Any = None, meta: Optional[dict] = None) -> None:
    step = int(jax.device_get(state.step))
    items = dict(
      params=ocp.args.StandardSave(state.params),
      opt_state=ocp.args.StandardSave(state.opt_state),
      step=ocp.args.StandardSave({"step": state.step}),
      rng=ocp.args.StandardSave({"key": state.rng}),
      meta=ocp.args.JsonSave(dict(meta or {}, step=step)),
    )
    if data_state is not None:
      items["data"] = _grain_save(data_state)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    # manager.save waited for the previous save's commit: those steps are final now (and this
    # one too when saving synchronously).
    self._seal()
    self._unsealed.append(step)
    if not self.async_save:
      self._seal()

  def _seal(self) -> None:
    for step in self._unsealed:
      try:
        write_manifest(os.path.join(self.directory, str(step)), step)
      except OSError as e:  # the checkpoint itself is complete; it just stays unverified
        warnings.warn(f"could not write {MANIFEST} of checkpoint step {step}: {e}")
    self._unsealed = []

  def restore(self, step: int, abstract_state, data_iterator=None):
    """The TrainState at ``step``, laid out as ``abstract_state``'s shardings; restores the data
    pipeline (or grain iterator) in place when given."""
    items = dict(
      params=ocp.args.StandardRestore(abstract_state.params),
      opt_state=ocp.args.StandardRestore(abstract_state.opt_state),
      step=ocp.args.StandardRestore({"step": abstract_state.step}),
      rng=ocp.args.StandardRestore({"key": abstract_state.rng}),
    )
    if data_iterator is not None:
      items["data"] = _grain_restore(data_iterator)
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    return abstract_state.replace(
      params=out["params"],
      opt_state=out["opt_state"],
      step=out["step"]["step"],
      rng=out["rng"]["key"],
    )

  def wait(self):
    self.manager.wait_until_finished()
    self._seal()

  def close(self):
    self.manager.wait_until_finished()
    self._seal()
    self.manager.close()

  # ---- fault tolerance ----
  def set_aside(self, step: int) -> Optional[str]:
    """Move step ``step`` out of the checkpoint directory (into WORKDIR/corrupt_checkpoints/)
    on process 0, then reload the step list on every process. Returns the new path."""
    dest = None
    if jax.process_index() == 0:
      dest = set_aside(self.workdir, step)
    from lca_jax.train import distributed  # pylint: disable=g-import-not-at-top

    distributed.barrier(f"lca_set_aside_{step}")
    self.manager.reload()
    return dest

  def restore_latest(self, abstract_state, data_iterator=None):
    """(state, step) from the newest checkpoint that verifies and restores; (None, None) when
    there is none. Steps newer than the one restored that failed are then set aside (into
    WORKDIR/corrupt_checkpoints/) with a ``CorruptCheckpointWarning`` naming them; nothing is
    moved when no step restores (``CorruptCheckpointError`` listing why), so a systematic
    problem never empties the directory."""
    from lca_jax.train import distributed  # pylint: disable=g-import-not-at-top

    steps = sorted(self.all_steps(), reverse=True)
    if not steps:
      return None, None
    check_process_count(os.path.join(self.directory, str(steps[0])), jax.process_count())
    multi = jax.process_count() > 1
    bad = []
    for i, step in enumerate(steps):
      nxt = steps[i + 1] if i + 1 < len(steps) else None
      reason = verify_step(os.path.join(self.directory, str(step)))
      if not distributed.all_agree(reason is None):
        reason = reason or "unreadable on another process"
      if reason is None:
        try:
          state = self.restore(step, abstract_state, data_iterator)
        except Exception as e:  # noqa: BLE001 - any read failure means a damaged checkpoint
          reason = _short(e)
          if multi:  # other processes may be inside orbax's restore barrier: no way back
            raise CorruptCheckpointError(
              f"checkpoint step {step} in {self.directory} cannot be restored on process "
              f"{jax.process_index()} ({reason}). Move it out of the way (e.g. into "
              f"{os.path.join(self.workdir, CORRUPT_DIR)}/) and rerun to resume from "
              f"{'step ' + str(nxt) if nxt is not None else 'scratch'}."
            ) from None
        else:
          for s_bad, r_bad in bad:
            warnings.warn(
              f"checkpoint step {s_bad} in {self.directory} is corrupt ({r_bad}); "
              f"falling back to step {step}",
              CorruptCheckpointWarning,
              stacklevel=2,
            )
            self.set_aside(s_bad)
          return state, step
      bad.append((step, reason))
    raise CorruptCheckpointError(
      f"no readable checkpoint in {self.directory}: "
      + "; ".join(f"step {s}: {r}" for s, r in bad)
      + " (nothing was moved; move the damaged steps away, or use a new --workdir)"
    )


def set_aside(workdir: str, step: int) -> Optional[str]:
  """Move ``checkpoints/<step>`` to ``corrupt_checkpoints/<step>[.N]``; the new path."""
  src = os.path.join(checkpoint_dir(workdir), str(step))
  if not os.path.isdir(src):
    return None
  root = os.path.join(os.path.abspath(workdir), CORRUPT_DIR)
  os.makedirs(root, exist_ok=True)
  dest, n = os.path.join(root, str(step)), 0
  while os.path.exists(dest):
    n += 1
    dest = os.path.join(root, f"{step}.{n}")
  try:
    os.replace(src, dest)
  except OSError:
    shutil.move(src, dest)
  return dest


def restore_params(workdir: str, abstract_params, step: Optional[int] = None):
  """Only the params of ``workdir``'s checkpoint ``step`` (default latest), laid out as the
  shardings/dtypes of ``abstract_params`` (a tree of ShapeDtypeStructs)."""
  directory = checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{workdir}: no checkpoint yet")
  opts = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
  with ocp.CheckpointManager(
    directory, options=opts, item_handlers={"params": ocp.StandardCheckpointHandler()}
  ) as mngr:
    restore = lambda s: mngr.restore(
      s, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params))
    )["params"]
    if step is not None:
      if step not in mngr.all_steps():
        raise FileNotFoundError(
          f"{workdir}: no checkpoint for step {step} (have {sorted(mngr.all_steps())})"
        )
      reason = verify_step(os.path.join(directory, str(step)))
      if reason is not None:
        raise CorruptCheckpointError(f"{workdir}: checkpoint step {step} is corrupt ({reason})")
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
        try:
          return restore(s)
        except Exception as e:  # noqa: BLE001 - any read failure means a damaged checkpoint
          reason = _short(e)
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


# ---- inference ----------------------------------------------------------------------------
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


def load_for_inference(path: str, step: Optional[int] = None):
  """(ModelConfig, float32 params on one device) from a work directory's checkpoint."""
  from lca_jax.train.state import abstract_params  # pylint: disable=g-import-not-at-top

  try:
    cfg = model_config(path)
  except FileNotFoundError as e:
    raise LoadError(str(e)) from None
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = abstract_params(cfg, jax.numpy.float32, dev)
  try:
    params = restore_params(path, abstract, step)
  except (FileNotFoundError, CorruptCheckpointError) as e:
    raise LoadError(str(e)) from None
  return cfg, params
