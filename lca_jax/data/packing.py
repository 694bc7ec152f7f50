"""Byte encoding and checkpointable packing of documents into fixed-length rows.

Each document is encoded as its UTF-8 bytes (id = byte + 3) followed by EOS_ID.
Rows are dicts of int32 arrays of shape [T]:

``concat``     documents (+eos) are concatenated and cut into T-id rows; every id is
               real data (the trailing partial row of a finite stream is dropped);
               ``segment_ids`` are all 1, ``positions`` are 0..T-1.
``segmented``  sequential fill: a document (<= T ids) that fits in the rest of the
               current row is appended whole; one that does not fit is never split:
               the row is emitted padded (ids 0 = PAD_ID, segment_ids 0, positions 0)
               and the document starts the next row.  A document longer than T must
               be split anyway, so its pieces fill rows exactly: the first piece takes
               whatever room the current row has left, then T-id pieces, and the last
               piece shares a row with the next documents.  ``segment_ids`` number the
               pieces within a row from 1; ``positions`` restart at 0 for each piece.
               The trailing partial row of a finite stream is emitted (padded).

Both packers are deterministic and their state is exact and JSON-serializable:
the parent state *before* the document being consumed plus an offset into it (and
the skipped-record counts), so a restore re-reads at most one document.

A stream that yields only :class:`Skipped` markers would keep a packer reading new
epochs forever: given a :class:`SkipGuard` (``DocumentOrder.skip_guard()``), the packer
raises :class:`DataError` naming the files once as many records in a row were skipped as
can all be bad only when a whole epoch is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grain
import numpy as np

from lca_jax import vocab
from lca_jax.data.errors import SKIP_REASONS, DataError, Skipped

PACKING_MODES = ("concat", "segmented")


def encode_document(x: str | bytes | Skipped) -> np.ndarray | Skipped:
  """str (its UTF-8 bytes) or bytes (as they are) -> int32 byte ids + EOS; Skipped markers
  pass through."""
  if isinstance(x, Skipped):
    return x
  if isinstance(x, (bytes, bytearray)):
    return vocab.encode_bytes(bytes(x), add_eos=True)
  return vocab.encode(x, add_eos=True)


@dataclasses.dataclass(frozen=True)
class SkipGuard:
  """Ends a stream with no usable record: ``limit`` records skipped in a row mean that a whole
  epoch of ``epoch`` records had none; ``source`` names the files in the error."""

  limit: int
  epoch: int
  source: str

  def check(self, run: int, skipped: dict) -> None:
    """Raise DataError when the last ``run`` records were all skipped (``skipped``: the
    counts by reason, for the message) and that is ``limit`` or more."""
    if run < self.limit:
      return
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()) if v)
    raise DataError(
      f"no usable document in {self.source}: a whole epoch of its {self.epoch} "
      f"records was skipped ({reasons} in the last {run} read); check the files "
      "and the data settings (format, text_key, seq_len)"
    )


class _PackIterator(grain.DatasetIterator):
  def __init__(self, parent, seq_len: int, mode: str, guard: SkipGuard | None = None):
    super().__init__(parent)
    self._T = seq_len
    self._mode = mode
    self._guard = guard
    self._doc: np.ndarray | None = None
    self._off = 0
    self._skipped = {r: 0 for r in SKIP_REASONS}
    self._run = 0  # records skipped in a row
    self._doc_state = self._parent.get_state()

  def _fetch(self) -> bool:
    """Next good document; Skipped markers are counted.  ``_doc_state`` is the parent
    state right before the returned document (after the skipped ones)."""
    while True:
      self._doc_state = self._parent.get_state()
      try:
        x = next(self._parent)
      except StopIteration:
        self._doc = None
        return False
      if isinstance(x, Skipped):
        self._skipped[x.reason] = self._skipped.get(x.reason, 0) + 1
        self._run += 1
        if self._guard is not None:
          self._guard.check(self._run, self._skipped)
        continue
      self._run = 0
      self._doc = np.asarray(x, np.int32)
      self._off = 0
      return True

  def _have_doc(self) -> bool:
    return self._doc is not None and self._off < len(self._doc)

  def __next__(self) -> dict[str, np.ndarray]:
    T = self._T
    ids = np.zeros(T, np.int32)
    if self._mode == "concat":
      filled = 0
      while filled < T:
        if not self._have_doc():
          if not self._fetch():
            raise StopIteration
          continue
        take = min(T - filled, len(self._doc) - self._off)
        ids[filled : filled + take] = self._doc[self._off : self._off + take]
        filled += take
        self._off += take
      return {
        "ids": ids,
        "segment_ids": np.ones(T, np.int32),
        "positions": np.arange(T, dtype=np.int32),
      }
    seg = np.zeros(T, np.int32)
    pos = np.zeros(T, np.int32)
    filled, k = 0, 0
    while filled < T:
      if not self._have_doc():
        if not self._fetch():
          if k == 0:
            raise StopIteration
          break
        continue
      rem = len(self._doc) - self._off
      if filled + rem <= T:
        piece = rem
      elif rem > T:  # must be split anyway: fill the row
        piece = T - filled
      else:  # fits in a fresh row: keep it whole
        break
      ids[filled : filled + piece] = self._doc[self._off : self._off + piece]
      k += 1
      seg[filled : filled + piece] = k
      pos[filled : filled + piece] = np.arange(piece, dtype=np.int32)
      filled += piece
      self._off += piece
    return {"ids": ids, "segment_ids": seg, "positions": pos}

  def get_state(self) -> dict[str, Any]:
    return {
      "parent": self._doc_state,
      "has_doc": self._doc is not None,
      "offset": int(self._off),
      "lca_skipped": dict(self._skipped),
      "skip_run": self._run,
    }

  def set_state(self, state):
    self._parent.set_state(state["parent"])
    self._doc_state = state["parent"]
    self._skipped = {r: 0 for r in SKIP_REASONS}
    self._skipped.update({k: int(v) for k, v in state["lca_skipped"].items()})
    self._run = int(state.get("skip_run", 0))
    self._doc, self._off = None, 0
    if state["has_doc"]:
      self._doc = np.asarray(next(self._parent), np.int32)
      self._off = int(state["offset"])


class PackIterDataset(grain.IterDataset):
  """Packs a stream of int32 id arrays (one per document, eos included) into rows.

  :class:`Skipped` markers in the stream are dropped and counted by reason in the
  iterator state (key ``lca_skipped``), so the counts survive checkpoints and are
  visible from the main process with multiprocess prefetch. ``guard`` ends a stream without
  usable records with a :class:`DataError` (module docstring)."""

  def __init__(
    self,
    parent: grain.IterDataset,
    seq_len: int,
    mode: str = "segmented",
    *,
    guard: SkipGuard | None = None,
  ):
    if mode not in PACKING_MODES:
      raise ValueError(f"packing must be one of {PACKING_MODES}, got {mode!r}")
    if seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    super().__init__(parent)
    self._seq_len = seq_len
    self._mode = mode
    self._guard = guard

  def __iter__(self):
    return _PackIterator(self._parent.__iter__(), self._seq_len, self._mode, self._guard)

  def __str__(self):
    return f"PackIterDataset(seq_len={self._seq_len}, mode={self._mode})"


def pack_documents(docs, seq_len: int, mode: str = "segmented") -> list[dict[str, np.ndarray]]:
  """Eager helper: pack an iterable of texts / id arrays (tests, small jobs)."""
  arrays = [
    encode_document(d) if isinstance(d, (str, bytes)) else np.asarray(d, np.int32) for d in docs
  ]
  ds = grain.MapDataset.source(arrays).to_iter_dataset()
  return list(PackIterDataset(ds, seq_len, mode))
