"""Checkpoints of an lca-train work directory (orbax), and loading them for inference.

Layout of WORKDIR:
  train_config.json      {"model": ModelConfig fields, "config": the full run config}
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
    the step and its size). ``restore_latest`` checks it before restoring: a step with a missing
    or truncated file, or one that fails to restore, is skipped and the previous step restored;
    the skipped steps are then moved to ``WORKDIR/corrupt_checkpoints/`` with a
    ``CorruptCheckpointWarning`` naming them (nothing is moved when no step restores).
    (In a multi-process run the manifest check is agreed by all processes; a failure inside
    orbax's restore on only some processes cannot be recovered from safely, so it is an error
    naming the step to move away.)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from lca_jax.model.config import ModelConfig

CKPT_DIR = "checkpoints"
CONFIG_FILE = "train_config.json"

# Config fields that may differ between a checkpoint and the run resuming it.
RESUME_MUTABLE = (
    "train.steps", "train.log_every", "train.eval_every", "train.eval_batches",
    "train.checkpoint_every", "train.keep_checkpoints", "train.progress_bar", "train.init_from",
    "train.micro_batch_size", "train.peak_tflops", "train.tensorboard",
    "train.async_checkpointing", "data.eval_files", "model.attention_impl", "model.remat",
    "model.max_seq_len",
    "mesh.data", "mesh.fsdp", "mesh.tensor",
)


MANIFEST = "lca_manifest.json"
CORRUPT_DIR = "corrupt_checkpoints"
# Files orbax may still rewrite after the commit; not part of the manifest.
_UNSEALED = frozenset({MANIFEST, MANIFEST + ".tmp", "_CHECKPOINT_METADATA"})


class ConfigMismatchError(ValueError):
  """The run config differs from the one that wrote the checkpoint being resumed."""


class CorruptCheckpointError(RuntimeError):
  """No checkpoint of the work directory can be restored (or one cannot, in a multi-process
  run, where falling back is not safe)."""


class CorruptCheckpointWarning(UserWarning):
  """A checkpoint step was unreadable and set aside; an earlier one is used."""


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


# ---- run config ---------------------------------------------------------------------------
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

  def __init__(self, workdir: str, keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    # read_only: open an existing directory for restoring (no directory is created; orbax's
    # own read_only flag is not used because it logs warnings on every open).
    # cleanup_tmp_directories: saves interrupted by a crash leave <step>.orbax-checkpoint-tmp-*
    # directories (never restored); they are removed when a run opens the directory again.
    opts = ocp.CheckpointManagerOptions(
        max_to_keep=max(1, int(keep)) if keep else None, create=not read_only,
        enable_async_checkpointing=async_save and not read_only,
        cleanup_tmp_directories=not read_only)
    self.workdir = os.path.abspath(workdir)
    self.directory = checkpoint_dir(workdir)
    self.read_only = read_only
    self.async_save = bool(async_save and not read_only)
    self._unsealed: list = []  # steps saved whose manifest is not written yet
    self.manager = ocp.CheckpointManager(self.directory, options=opts,
                                         item_handlers=_handlers(with_data=True))

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def all_steps(self):
    return list(self.manager.all_steps())

  def save(self, state, data_state: Any = None, meta: Optional[dict] = None) -> None:
    step = int(jax.device_get(state.step))
    items = dict(params=ocp.args.StandardSave(state.params),
                 opt_state=ocp.args.StandardSave(state.opt_state),
                 step=ocp.args.StandardSave({"step": state.step}),
                 rng=ocp.args.StandardSave({"key": state.rng}),
                 meta=ocp.args.JsonSave(dict(meta or {}, step=step)))
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
    items = dict(params=ocp.args.StandardRestore(abstract_state.params),
                 opt_state=ocp.args.StandardRestore(abstract_state.opt_state),
                 step=ocp.args.StandardRestore({"step": abstract_state.step}),
                 rng=ocp.args.StandardRestore({"key": abstract_state.rng}))
    if data_iterator is not None:
      items["data"] = _grain_restore(data_iterator)
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    return abstract_state.replace(params=out["params"], opt_state=out["opt_state"],
                                  step=out["step"]["step"], rng=out["rng"]["key"])

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
                f"{'step ' + str(nxt) if nxt is not None else 'scratch'}.") from None
        else:
          for s_bad, r_bad in bad:
            warnings.warn(f"checkpoint step {s_bad} in {self.directory} is corrupt ({r_bad}); "
                          f"falling back to step {step}", CorruptCheckpointWarning, stacklevel=2)
            self.set_aside(s_bad)
          return state, step
      bad.append((step, reason))
    raise CorruptCheckpointError(
        f"no readable checkpoint in {self.directory}: " +
        "; ".join(f"step {s}: {r}" for s, r in bad) +
        " (nothing was moved; move the damaged steps away, or use a new --workdir)")


def _short(e: BaseException, limit: int = 300) -> str:
  msg = " ".join(str(e).split()) or type(e).__name__
  return msg if len(msg) <= limit else msg[:limit] + "..."


# ---- manifests -----------------------------------------------------------------------------
def _files(step_dir: str) -> dict:
  out = {}
  for root, _, names in os.walk(step_dir):
    for name in names:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir)
      if rel in _UNSEALED:
        continue
      out[rel] = os.path.getsize(path)
  return out


def write_manifest(step_dir: str, step: int) -> None:
  """Record every file of the committed step ``step_dir`` and its size (process 0 only)."""
  if jax.process_index() != 0 or not os.path.isdir(step_dir):
    return  # deleted by max_to_keep meanwhile
  files = _files(step_dir)
  tmp = os.path.join(step_dir, MANIFEST + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({"step": int(step), "files": files}, f, indent=0, sort_keys=True)
  os.replace(tmp, os.path.join(step_dir, MANIFEST))


def verify_step(step_dir: str) -> Optional[str]:
  """None when every file of the step's manifest is present with its recorded size (or the
  step has no manifest: written by an older version, or the run died before sealing it);
  else what is wrong."""
  path = os.path.join(step_dir, MANIFEST)
  if not os.path.isfile(path):
    return None if os.path.isdir(step_dir) else "missing"
  try:
    with open(path, encoding="utf-8") as f:
      files = json.load(f)["files"]
  except (OSError, ValueError, KeyError) as e:
    return f"unreadable {MANIFEST}: {_short(e)}"
  problems = []
  for rel, size in sorted(files.items()):
    full = os.path.join(step_dir, rel)
    if not os.path.isfile(full):
      problems.append(f"{rel} missing")
    elif os.path.getsize(full) != size:
      problems.append(f"{rel} has {os.path.getsize(full)} of {size} bytes")
  if not problems:
    return None
  more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
  return "; ".join(problems[:3]) + more


def check_process_count(step_dir: str, n: int) -> None:
  """A ``ConfigMismatchError`` when the step's data-iterator state was written by another
  number of processes (each process checkpoints its own position in its shard of the data)."""
  data = os.path.join(step_dir, "data")
  if not os.path.isdir(data):
    return
  counts = set()
  for name in os.listdir(data):
    m = re.fullmatch(r"process_\d+-of-(\d+)\.json", name)
    if m:
      counts.add(int(m.group(1)))
  if counts and n not in counts:
    raise ConfigMismatchError(
        f"the checkpoint in {os.path.dirname(step_dir)} was written by {max(counts)} processes, "
        f"this run has {n}: resume it with {max(counts)} processes (any number of devices per "
        "process), or start a new --workdir with train.init_from=<this workdir> (params only)")


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
  with ocp.CheckpointManager(directory, options=opts,
                             item_handlers={"params": ocp.StandardCheckpointHandler()}) as mngr:
    restore = lambda s: mngr.restore(s, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params)))["params"]
    if step is not None:
      if step not in mngr.all_steps():
        raise FileNotFoundError(f"{workdir}: no checkpoint for step {step} "
                                f"(have {sorted(mngr.all_steps())})")
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
      warnings.warn(f"checkpoint step {s} in {directory} is corrupt ({reason}); {nxt}",
                    CorruptCheckpointWarning, stacklevel=2)
    raise CorruptCheckpointError(f"no readable checkpoint in {directory}: " +
                                 "; ".join(f"step {s}: {r}" for s, r in bad))


# ---- inference ----------------------------------------------------------------------------
def is_workdir(path: str) -> bool:
  """True for an lca-train work directory (its run config or a checkpoints folder exists)."""
  path = os.fspath(path)
  return os.path.isfile(os.path.join(path, CONFIG_FILE)) or os.path.isdir(
      os.path.join(path, CKPT_DIR))


def model_config(workdir: str) -> ModelConfig:
  saved = read_run_config(workdir)
  if saved is None:
    raise FileNotFoundError(f"{workdir}: no {CONFIG_FILE}; not an lca-train work directory")
  return ModelConfig.from_dict(saved["model"])


def load_for_inference(path: str, step: Optional[int] = None):
  """(ModelConfig, float32 params on one device) from a work directory's checkpoint."""
  from lca_jax.api import LoadError  # pylint: disable=g-import-not-at-top
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
