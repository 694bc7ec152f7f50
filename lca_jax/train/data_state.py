"""The data iterator's position in a checkpoint: what makes a resume exact.

Each process saves its own iterator state as the ``data`` item of a step (grain's checkpoint
handler; ``process_<i>-of-<n>.json``), frozen when ``save`` is called, and restores it in
place. A step whose data state was written by another number of processes cannot be resumed
(``check_process_count``). grain is imported when a save or restore needs it (the data / train
extras).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from lca_jax.train.run_config import ConfigMismatchError


class _IteratorSnapshot:
  """An iterator state frozen at save time (grain's handler calls ``get_state()``, which may
  happen on orbax's background thread while the live iterator has moved on)."""

  def __init__(self, state: Any):
    self._raw = json.dumps(state, indent=1).encode()

  def get_state(self) -> bytes:
    return self._raw


def grain_handler():
  """orbax's handler of the ``data`` item (grain's, as ``lca_jax.data`` configures it)."""
  from lca_jax.data import pipeline  # pylint: disable=g-import-not-at-top

  return pipeline.checkpoint_handler()


def grain_save(state):
  """The ``data`` item's save args for the iterator state ``state`` (frozen now)."""
  import grain  # pylint: disable=g-import-not-at-top

  return grain.checkpoint.CheckpointSave(_IteratorSnapshot(state))


def grain_restore(data):
  """``data``: a ``lca_jax.data`` Pipeline (its own restore args) or a grain iterator."""
  if hasattr(data, "restore_args"):
    return data.restore_args()
  import grain  # pylint: disable=g-import-not-at-top

  return grain.checkpoint.CheckpointRestore(data)


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
      "process), or start a new --workdir with train.init_from=<this workdir> (params only)"
    )
