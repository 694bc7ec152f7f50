"""Supervised fine-tuning batches: grain readers, packing and checkpointable SFT pipelines.

Examples are rendered by :mod:`lca_jax.data.sft_format` (formats, prompt templates, loss masks,
truncation of too long examples).

Batches (``make_sft_pipeline``): dicts of int32 [B, T] arrays ``ids``, ``segment_ids``,
``positions`` (as :mod:`lca_jax.data.pipeline`) and ``loss_mask`` (1 on target bytes including
their <eos>, 0 on prompt bytes and padding).  ``loss_mask`` is aligned with ``ids``:
``loss_mask[t] == 1`` means predicting byte ``t`` carries loss (``lca_jax.model.loss`` reads it
that way).  ``packing="segmented"`` (default) puts whole examples side by side in a row, each its
own document (segment id 1, 2, ...; positions restart), never split across rows;
``packing="single"`` puts one example per row.  Malformed lines raise :class:`DataError` naming
the file and line (``on_bad_record="error"``, default) or are skipped and counted
(``"skip"``).
"""

from __future__ import annotations

import json
from typing import Sequence

import grain
import numpy as np

from lca_jax.data.errors import DataError, Skipped
from lca_jax.data.packing import SkipGuard
from lca_jax.data.pipeline import Pipeline, build_pipeline, reader_cache_units
from lca_jax.data.readers import JsonlReader
from lca_jax.data.sft_format import (
  SFT_FORMATS,
  ExampleError,
  encode_example,
  expand_qa,
  format_prompt,
  line_number,
  read_jsonl,
)
from lca_jax.data.sources import build_index, expand_files

SFT_PACKING = ("segmented", "single")
SFT_SKIP_REASONS = ("bad_json", "bad_example", "too_long", "no_target")


class SftJsonlReader(JsonlReader):
  """JSONL reader returning encoded examples ``{"ids", "loss_mask"}`` (or Skipped markers)."""

  def __init__(self, paths, sft_format: str, seq_len: int, on_bad_record: str = "error", **kw):
    if on_bad_record not in ("error", "skip"):
      raise ValueError(f"on_bad_record must be 'error' or 'skip', got {on_bad_record!r}")
    self.sft_format, self.seq_len, self.on_bad_record = sft_format, int(seq_len), on_bad_record
    super().__init__(paths, **kw)

  def _bad(self, file_idx, row, reason, msg):
    if self.on_bad_record == "skip":
      return Skipped(reason)
    start = int(self._all_spans[file_idx][row][0])
    path = self.paths[file_idx]
    raise DataError(f"{path}:{line_number(path, start)}: {msg}")

  def _decode(self, line, file_idx, row):
    try:
      obj = json.loads(line)
    except (UnicodeDecodeError, ValueError) as e:
      return self._bad(file_idx, row, "bad_json", f"malformed JSON line ({e})")
    if not isinstance(obj, dict):
      return self._bad(
        file_idx, row, "bad_json", f"expected a JSON object, got {type(obj).__name__}"
      )
    try:
      enc = encode_example(obj, self.sft_format, self.seq_len)
    except ExampleError as e:
      return self._bad(file_idx, row, "bad_example", f"not a {self.sft_format} example: {e}")
    if enc is None:
      msgs = obj.get("messages") if self.sft_format == "chat" else None
      no_target = isinstance(msgs, list) and not any(m.get("role") == "assistant" for m in msgs)
      return Skipped("no_target" if no_target else "too_long")
    return {"ids": enc[0], "loss_mask": enc[1]}


# ---- packing ------------------------------------------------------------------------------
class _SftPackIterator(grain.DatasetIterator):
  def __init__(self, parent, seq_len: int, packing: str, guard: SkipGuard | None = None):
    super().__init__(parent)
    self._T, self._packing = seq_len, packing
    self._guard = guard
    self._pending = None
    self._pending_state = None
    self._skipped: dict[str, int] = {}
    self._run = 0  # examples skipped in a row

  def _next_example(self):
    while True:
      state = self._parent.get_state()
      x = next(self._parent)  # StopIteration propagates
      if isinstance(x, Skipped):
        self._skipped[x.reason] = self._skipped.get(x.reason, 0) + 1
        self._run += 1
        if self._guard is not None:
          self._guard.check(self._run, self._skipped)
        continue
      self._run = 0
      return state, x

  def __next__(self):
    T = self._T
    row = {k: np.zeros(T, np.int32) for k in ("ids", "segment_ids", "positions", "loss_mask")}
    filled = k = 0
    while True:
      if self._pending is None:
        try:
          self._pending_state, self._pending = self._next_example()
        except StopIteration:
          if k == 0:
            raise
          break
      n = len(self._pending["ids"])
      if k > 0 and (filled + n > T or self._packing == "single"):
        break
      k += 1
      sl = slice(filled, filled + n)
      row["ids"][sl] = self._pending["ids"]
      row["loss_mask"][sl] = self._pending["loss_mask"]
      row["segment_ids"][sl] = k
      row["positions"][sl] = np.arange(n, dtype=np.int32)
      filled += n
      self._pending = None
      if self._packing == "single":
        break
    return row

  def get_state(self):
    pending = self._pending is not None
    return {
      "parent": self._pending_state if pending else self._parent.get_state(),
      "has_pending": pending,
      "lca_skipped": dict(self._skipped),
      "skip_run": self._run,
    }

  def set_state(self, state):
    self._parent.set_state(state["parent"])
    self._skipped = {k: int(v) for k, v in state["lca_skipped"].items()}
    self._run = int(state.get("skip_run", 0))
    self._pending = self._pending_state = None
    if state["has_pending"]:
      self._pending_state = state["parent"]
      self._pending = next(self._parent)


class SftPackIterDataset(grain.IterDataset):
  """Packs encoded examples ``{"ids", "loss_mask"}`` (each <= seq_len) into rows; ``guard``
  ends a stream without usable examples (as :class:`lca_jax.data.packing.PackIterDataset`)."""

  def __init__(
    self,
    parent: grain.IterDataset,
    seq_len: int,
    packing: str = "segmented",
    *,
    guard: SkipGuard | None = None,
  ):
    if packing not in SFT_PACKING:
      raise ValueError(f"SFT packing must be one of {SFT_PACKING}, got {packing!r}")
    super().__init__(parent)
    self._seq_len, self._packing = int(seq_len), packing
    self._guard = guard

  def __iter__(self):
    return _SftPackIterator(self._parent.__iter__(), self._seq_len, self._packing, self._guard)


def check_first_example(files, sft_format: str) -> None:
  """Fail fast (in the calling process) when the first line of the first file is not an
  example of ``sft_format``."""
  path = expand_files(files)[0]
  for lineno, obj in read_jsonl(path):
    try:
      if sft_format == "qa":
        obj = expand_qa(obj)[0]
      format_prompt(obj, sft_format)
    except ExampleError as e:
      raise DataError(f"{path}:{lineno}: not a {sft_format} example: {e}") from None
    return


def make_sft_pipeline(
  files: str | Sequence[str],
  sft_format: str,
  seq_len: int = 4096,
  batch_size: int = 8,
  seed: int = 0,
  shuffle: bool = True,
  shard_index: int | None = None,
  shard_count: int | None = None,
  num_epochs: int | None = None,
  *,
  packing: str = "segmented",
  worker_count: int = 0,
  drop_remainder: bool = True,
  pad_final_batch: bool = False,
  max_batches: int | None = None,
  on_bad_record: str = "error",
  block_units: int = 8,
  read_threads: int = 4,
  worker_buffer_size: int = 2,
) -> Pipeline:
  """SFT batches (module docstring) from jsonl ``files``, with the same iterator machinery as
  :func:`lca_jax.data.make_pipeline` (shuffle, host sharding, epochs, ``get_state`` /
  ``set_state``, orbax save/restore args, ``stats``).  ``num_epochs=None`` repeats forever.

  For an evaluation pass use ``shuffle=False, num_epochs=1, drop_remainder=False,
  pad_final_batch=True`` (padding rows have segment_ids and loss_mask 0).
  """
  if sft_format not in SFT_FORMATS:
    raise DataError(f"unknown sft_format {sft_format!r}; choose one of {', '.join(SFT_FORMATS)}")
  if packing not in SFT_PACKING:
    raise DataError(f"SFT packing must be one of {', '.join(SFT_PACKING)}, got {packing!r}")
  if sft_format == "qa":
    raise DataError("sft_format 'qa' is for evaluation prompts; train on CoQA rendered as chat")
  paths = expand_files(files)
  check_first_example(paths, sft_format)
  reader = SftJsonlReader(
    paths, sft_format, seq_len, on_bad_record, cache_units=reader_cache_units(block_units)
  )
  return build_pipeline(
    build_index(reader, on_bad_shard="error"),
    SftPackIterDataset,
    source=dict(files=files, format="jsonl", sft_format=sft_format),
    seq_len=seq_len,
    packing=packing,
    batch_size=batch_size,
    seed=seed,
    shuffle=shuffle,
    num_epochs=num_epochs,
    shard_index=shard_index,
    shard_count=shard_count,
    worker_count=worker_count,
    block_units=block_units,
    drop_remainder=drop_remainder,
    pad_final_batch=pad_final_batch,
    max_batches=max_batches,
    read_threads=read_threads,
    worker_buffer_size=worker_buffer_size,
  )


def make_sft_eval_pipeline(
  files,
  sft_format: str,
  seq_len: int = 4096,
  batch_size: int = 8,
  max_batches: int | None = None,
  **kw,
) -> Pipeline:
  """Deterministic SFT eval pass: no shuffle, one epoch, final batch padded."""
  return make_sft_pipeline(
    files,
    sft_format,
    seq_len,
    batch_size,
    shuffle=False,
    num_epochs=1,
    drop_remainder=False,
    pad_final_batch=True,
    max_batches=max_batches,
    shard_index=kw.pop("shard_index", 0),
    shard_count=kw.pop("shard_count", 1),
    **kw,
  )
