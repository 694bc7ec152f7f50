"""Local document sources: file globs, format inference and the document index.

Every format is turned into a list of *units* (a file, or a parquet row group) of
known size, built once in the main process (``build_index``) by the format's reader
(:mod:`lca_jax.data.readers`).  Documents are then read by ``(unit, row)`` from grain's
reader threads / worker processes.

Formats (``files`` are glob patterns, a str or a list of them):
  * ``parquet``      column ``text_key`` (FineWeb-Edu style); one unit per row group,
                     read lazily (only that column) and kept in a small LRU cache.
  * ``jsonl``        one JSON object per non-blank line, field ``text_key``
                     (``.gz`` files are decompressed in memory).
  * ``text``         ``text_mode="paragraphs"`` (default): documents are blocks
                     separated by blank lines, each dedented and stripped;
                     ``text_mode="file"``: one document per file.  ``.gz`` is fine.
                     A document that is not valid UTF-8 is its bytes as they are
                     (``bytes``, not skipped: see ``readers.TextReader``).
  * ``array_record`` records are UTF-8 text, or a JSON object with ``text_key``
                     (``record_format="auto"|"text"|"json"``).
  * ``tfds``         ``files`` is a dataset name (``tfds.data_source(name,
                     data_dir=tfds_data_dir, split=tfds_split)``) or a prepared
                     builder directory (``tfds.builder_from_directory``).  Needs the
                     dataset prepared with ``file_format="array_record"``; TensorFlow
                     is not needed.

Bad records (non-string, empty/whitespace-only, undecodable, bad JSON, unreadable)
are returned as :class:`Skipped` markers and counted downstream; a pipeline whose
whole epoch is bad records raises :class:`DataError` (``packing.SkipGuard``).  A shard that
cannot be opened/indexed is skipped with a :class:`BadShardWarning` naming it
(``on_bad_shard="skip"``) or raises :class:`DataError` naming it (``"error"``).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import warnings
from typing import Sequence

import numpy as np

from lca_jax.data.errors import BadShardWarning, DataError, Skipped, SourceNotFoundError
from lca_jax.data.readers import Reader, make_reader


def expand_files(files: str | Sequence[str]) -> list[str]:
  """Glob every pattern (sorted, de-duplicated); an empty match raises DataError."""
  patterns = [files] if isinstance(files, (str, os.PathLike)) else list(files)
  if not patterns:
    raise DataError("no file patterns given")
  out: list[str] = []
  for pat in patterns:
    pat = os.fspath(pat)
    hits = sorted(
      p for p in glob.glob(os.path.expanduser(pat), recursive=True) if os.path.isfile(p)
    )
    if not hits and os.path.isdir(os.path.expanduser(pat)):
      raise DataError(
        f"{pat!r} is a directory; give the files in it, e.g. {os.path.join(pat, '*.parquet')!r}"
      )
    if not hits:
      raise DataError(f"no files match pattern {pat!r}")
    out += [h for h in hits if h not in out]
  return out


def infer_format(path: str) -> str:
  p = path[:-3] if path.endswith(".gz") else path
  ext = os.path.splitext(p)[1].lower()
  table = {
    ".parquet": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".array_record": "array_record",
    ".arrayrecord": "array_record",
  }
  if ext in table:
    return table[ext]
  if "array_record" in os.path.basename(path):
    return "array_record"
  raise DataError(f"cannot infer the data format of {path!r}; pass format=")


@dataclasses.dataclass
class DocumentIndex:
  """Units ``(file_idx, part, num_docs)`` in natural order, plus skipped shards."""

  reader: Reader
  units: np.ndarray  # int64 [U, 3]
  bad_shards: list[tuple[str, str]]  # (path, reason)

  @property
  def num_documents(self) -> int:
    return int(self.units[:, 2].sum()) if len(self.units) else 0


def build_index(reader: Reader, on_bad_shard: str = "skip") -> DocumentIndex:
  if on_bad_shard not in ("skip", "error"):
    raise ValueError(f"on_bad_shard must be 'skip' or 'error', got {on_bad_shard!r}")
  units, bad = [], []
  for i, path in enumerate(reader.paths):
    try:
      parts = reader.scan(path)
    except SourceNotFoundError:
      raise
    except Exception as e:  # noqa: BLE001 - report any failure as a bad shard
      msg = f"{type(e).__name__}: {e}"
      if on_bad_shard == "error":
        raise DataError(f"corrupt or unreadable shard {path}: {msg}") from e
      warnings.warn(
        f"skipping corrupt or unreadable shard {path}: {msg}", BadShardWarning, stacklevel=3
      )
      bad.append((path, msg))
      continue
    units += [(i, part, n) for part, n in parts if n > 0]
  idx = DocumentIndex(reader, np.array(units, np.int64).reshape(-1, 3), bad)
  if idx.num_documents == 0:
    raise DataError(
      f"no documents found in {reader.paths}" + (f" ({len(bad)} bad shards)" if bad else "")
    )
  return idx


def open_index(
  files, format: str | None = None, *, on_bad_shard: str = "skip", **reader_kw
) -> DocumentIndex:
  """Glob ``files`` (for tfds: a dataset name or builder dir), pick the reader, index it."""
  if format == "tfds":
    paths = [os.fspath(files)] if isinstance(files, (str, os.PathLike)) else list(files)
  else:
    paths = expand_files(files)
    format = format or infer_format(paths[0])
  return build_index(
    make_reader(format, paths, on_bad_shard=on_bad_shard, **reader_kw), on_bad_shard
  )


def read_documents(files, format: str | None = None, *, with_skipped: bool = False, **kw):
  """Yields every document (``str``; ``bytes`` for a text-format one that is not UTF-8) in
  natural order (files sorted, rows in order); bad records are dropped unless
  ``with_skipped`` (then :class:`Skipped` markers are yielded)."""
  index = open_index(files, format, **kw)
  for f, part, n in index.units.tolist():
    for row in range(n):
      x = index.reader.read(f, part, row)
      if with_skipped or not isinstance(x, Skipped):
        yield x
