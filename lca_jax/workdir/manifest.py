"""Integrity of committed checkpoint steps: manifests, verification, process-count checks.

Once orbax has committed a step, process 0 seals it with ``<step>/lca_manifest.json`` (every
file of the step and its size; ``write_manifest``). ``verify_step`` checks a step against its
manifest before it is restored (a missing or truncated file names the step corrupt), and
``check_process_count`` refuses a step whose data-iterator state was written by another number
of processes. ``CorruptCheckpointError`` / ``CorruptCheckpointWarning`` are what
:mod:`lca_jax.train.checkpoint` raises / warns when steps fail these checks or their restore.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

import jax

from lca_jax.errors import LcaError
from lca_jax.train.run_config import ConfigMismatchError

MANIFEST = "lca_manifest.json"
# Files orbax may still rewrite after the commit; not part of the manifest.
_UNSEALED = frozenset({MANIFEST, MANIFEST + ".tmp", "_CHECKPOINT_METADATA"})


class CorruptCheckpointError(LcaError, RuntimeError):
  """No checkpoint of the work directory can be restored (or one cannot, in a multi-process
  run, where falling back is not safe)."""


class CorruptCheckpointWarning(UserWarning):
  """A checkpoint step was unreadable and set aside; an earlier one is used."""


def _short(e: BaseException, limit: int = 300) -> str:
  msg = " ".join(str(e).split()) or type(e).__name__
  return msg if len(msg) <= limit else msg[:limit] + "..."


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
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump({"step": int(step), "files": files}, f, indent=0, sort_keys=True)
    os.replace(tmp, os.path.join(step_dir, MANIFEST))
  except OSError:  # e.g. no space left: no partial manifest stays behind (the step is intact)
    try:
      os.remove(tmp)
    except OSError:
      pass
    raise


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
      "process), or start a new --workdir with train.init_from=<this workdir> (params only)"
    )
