"""Integrity of committed checkpoint steps: manifests and their verification.

Once orbax has committed a step, process 0 seals it with ``<step>/lca_manifest.json`` (every
file of the step and its size; ``write_manifest``, called by ``lca_jax.train.checkpoint``).
``verify_step`` checks a step against its manifest before it is restored (a missing or
truncated file names the step corrupt). ``CorruptCheckpointError`` /
``CorruptCheckpointWarning`` are what restoring raises / warns when steps fail this check or
their restore.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import jax

from lca_jax.errors import LcaError

MANIFEST = "lca_manifest.json"
# Files orbax may still rewrite after the commit; not part of the manifest.
_UNSEALED = frozenset({MANIFEST, MANIFEST + ".tmp", "_CHECKPOINT_METADATA"})


class CorruptCheckpointError(LcaError, RuntimeError):
  """No checkpoint of the work directory can be restored (or one cannot, in a multi-process
  run, where falling back is not safe)."""


class CorruptCheckpointWarning(UserWarning):
  """A checkpoint step was unreadable and set aside; an earlier one is used."""


def short_reason(e: BaseException, limit: int = 300) -> str:
  """``e``'s message on one line, cut at ``limit`` characters (its type name when empty)."""
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
    return f"unreadable {MANIFEST}: {short_reason(e)}"
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
