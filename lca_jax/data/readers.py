"""Per-format document readers: random access to the documents of local files.

A reader (``make_reader`` picks one per format: parquet, jsonl, text, array_record, tfds)
``scan``s each file into units of known size in the main process, then ``read``s one document
by ``(file, part, row)`` from grain's reader threads / worker processes, thread-safely, with a
small LRU cache of loaded units; readers pickle without their caches, locks and handles, which
are rebuilt lazily in each process. A document is a ``str`` (trained on as its UTF-8 bytes), or
``bytes`` for a text-format document that is not valid UTF-8 (see :class:`TextReader`: the
bytes as they are). A bad record comes back as a :class:`Skipped` marker; a unit
that fails at read time is a bad shard (``BadShardWarning`` once, or ``DataError`` when
``on_bad_shard="error"``). File globbing, format inference and the document index over a
reader's units are in :mod:`lca_jax.data.sources`.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import textwrap
import threading
import warnings
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from lca_jax.data.errors import BadShardWarning, DataError, Skipped, SourceNotFoundError

FORMATS = ("parquet", "jsonl", "text", "array_record", "tfds")


def validate_text(value: Any) -> str | Skipped:
  if isinstance(value, (bytes, bytearray, memoryview)):
    try:
      value = bytes(value).decode("utf-8")
    except UnicodeDecodeError:
      return Skipped("undecodable")
  if not isinstance(value, str):
    return Skipped("not_string")
  if not value.strip():
    return Skipped("empty")
  return value


def read_file_bytes(path: str) -> bytes:
  """The whole content of the local file ``path``, gunzipped when the name ends in ``.gz``
  (as every reader of this module reads jsonl and text files)."""
  with open(path, "rb") as f:
    data = f.read()
  return gzip.decompress(data) if path.endswith(".gz") else data


class _LRU:
  def __init__(self, capacity: int):
    self.capacity = max(1, capacity)
    self._d: OrderedDict = OrderedDict()

  def get(self, key, load):
    if key in self._d:
      self._d.move_to_end(key)
      return self._d[key]
    value = load()
    self._d[key] = value
    while len(self._d) > self.capacity:
      self._d.popitem(last=False)
    return value


class Reader:
  """Base reader: ``scan(path) -> [(part, num_docs), ...]`` (main process) and a
  thread-safe ``read(file_idx, part, row) -> str | Skipped``.  Picklable: caches,
  locks and handles are rebuilt lazily in each process."""

  def __init__(
    self,
    paths: Sequence[str],
    text_key: str = "text",
    on_bad_shard: str = "skip",
    cache_units: int = 8,
  ):
    self.paths = list(paths)
    self.text_key = text_key
    self.on_bad_shard = on_bad_shard
    self.cache_units = cache_units
    self._init_runtime()

  def _init_runtime(self):
    self._lock = threading.RLock()
    self._cache = _LRU(self.cache_units)
    self._failed: set = set()

  def __getstate__(self):
    d = dict(self.__dict__)
    for k in ("_lock", "_cache", "_failed"):
      d.pop(k, None)
    return d

  def __setstate__(self, d):
    self.__dict__.update(d)
    self._init_runtime()

  def scan(self, path: str) -> list[tuple[int, int]]:
    raise NotImplementedError

  def read(self, file_idx: int, part: int, row: int) -> str | Skipped:
    raise NotImplementedError

  def failed_parts(self) -> list[tuple[str, str]]:
    """(path, note) for units that failed at read time *in this process*."""
    with self._lock:
      return [(self.paths[f], f"read failure (part {p})") for f, p in sorted(self._failed)]

  def _fail(self, key, e: BaseException):
    """A read failure is a bad shard: raise (on_bad_shard="error") or warn once."""
    msg = f"failed to read {self.paths[key[0]]} (part {key[1]}): {type(e).__name__}: {e}"
    if self.on_bad_shard == "error":
      raise DataError(msg) from e
    with self._lock:
      first = key not in self._failed
      self._failed.add(key)
    if first:
      warnings.warn("skipping unreadable shard: " + msg, BadShardWarning, stacklevel=3)
    return None

  def _cached(self, key, load):
    """Load-once LRU cache; a load error makes the whole unit unreadable (None)."""
    with self._lock:

      def guarded():
        try:
          return load()
        except Exception as e:  # noqa: BLE001 - any reader failure is a bad shard
          return self._fail(key, e)

      return self._cache.get(key, guarded)


def _pyarrow_parquet():
  # lazy: pyarrow is optional (the data / train extras) and takes a second to import; only
  # parquet pipelines (and their worker processes) load it
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  return pq


class ParquetReader(Reader):
  def _load(self, file_idx, group):
    with _pyarrow_parquet().ParquetFile(self.paths[file_idx]) as pf:
      return pf.read_row_group(group, columns=[self.text_key]).column(0).to_pylist()

  def scan(self, path):
    with _pyarrow_parquet().ParquetFile(path) as pf:
      names, md = pf.schema_arrow.names, pf.metadata
    if self.text_key not in names:
      raise DataError(f"column {self.text_key!r} not found in {path} (columns: {names})")
    return [(g, md.row_group(g).num_rows) for g in range(md.num_row_groups)]

  def read(self, file_idx, part, row):
    col = self._cached((file_idx, part), lambda: self._load(file_idx, part))
    return Skipped("unreadable") if col is None else validate_text(col[row])


class _LineReader(Reader):
  """Shared logic for readers whose documents are byte spans of a (maybe gz) file."""

  def _spans(self, data: bytes) -> np.ndarray:
    raise NotImplementedError

  def scan(self, path):
    spans = self._spans(read_file_bytes(path))
    if not hasattr(self, "_all_spans"):
      self._all_spans = {}
    self._all_spans[self.paths.index(path)] = spans
    return [(0, len(spans))]

  def _bytes(self, file_idx, row) -> bytes | None:
    start, end = (int(x) for x in self._all_spans[file_idx][row])
    path = self.paths[file_idx]
    if path.endswith(".gz"):
      data = self._cached((file_idx, 0), lambda: read_file_bytes(path))
      return None if data is None else data[start:end]
    try:  # plain file: positional read, no shared file offset, no fd kept open
      fd = os.open(path, os.O_RDONLY)
      try:
        return os.pread(fd, end - start, start)
      finally:
        os.close(fd)
    except OSError as e:
      return self._fail((file_idx, 0), e)


class JsonlReader(_LineReader):
  def _spans(self, data):
    nl = np.nonzero(np.frombuffer(data, np.uint8) == ord("\n"))[0]
    starts = np.concatenate([[0], nl + 1]).astype(np.int64)
    ends = np.concatenate([nl, [len(data)]]).astype(np.int64)
    keep = ends > starts
    for i in np.nonzero(keep & (ends - starts <= 8))[0]:  # drop short whitespace-only lines
      keep[i] = bool(data[starts[i] : ends[i]].strip())
    return np.stack([starts[keep], ends[keep]], 1)

  def read(self, file_idx, part, row):
    line = self._bytes(file_idx, row)
    if line is None:
      return Skipped("unreadable")
    return self._decode(line, file_idx, row)

  def _decode(self, line: bytes, file_idx: int, row: int):
    """Line ``row`` of file ``file_idx`` -> its document (or a Skipped marker)."""
    try:
      obj = json.loads(line)
    except UnicodeDecodeError:
      return Skipped("undecodable")
    except ValueError:
      return Skipped("bad_json")
    if not isinstance(obj, dict):
      return Skipped("bad_json")
    return validate_text(obj.get(self.text_key))


_BLANK = re.compile(rb"\n[ \t\r\f\v]*\n")


class TextReader(_LineReader):
  """Plain text files: blank-line separated paragraphs (``text_mode="paragraphs"``: each one
  dedented, CRLF -> LF, stripped) or one document per file (``"file"``).

  A text file is a sequence of bytes, and a byte-level model trains on bytes: a document that
  is not valid UTF-8 (Latin-1 or another legacy encoding, binary data) is kept, byte for
  byte, and comes back as ``bytes`` (a Latin-1 "\xe9" is the one byte 0xE9, not "é"'s two
  UTF-8 bytes); valid UTF-8 comes back as ``str``. Invalid bytes are never replaced,
  dropped or counted as skipped; only paragraphs of whitespace are skipped ("empty").
  """

  def __init__(self, paths, text_mode: str = "paragraphs", **kw):
    if text_mode not in ("paragraphs", "file"):
      raise ValueError(f"text_mode must be 'paragraphs' or 'file', got {text_mode!r}")
    self.text_mode = text_mode
    super().__init__(paths, **kw)

  def _spans(self, data):
    if self.text_mode == "file":
      return np.array([[0, len(data)]], np.int64)
    spans, start = [], 0
    for m in _BLANK.finditer(data):
      spans.append((start, m.start()))
      start = m.end()
    spans.append((start, len(data)))
    spans = [(s, e) for s, e in spans if data[s:e].strip()]
    return np.array(spans, np.int64).reshape(-1, 2)

  def read(self, file_idx, part, row):
    raw = self._bytes(file_idx, row)
    if raw is None:
      return Skipped("unreadable")
    try:
      text, utf8 = raw.decode("utf-8"), True
    except UnicodeDecodeError:  # each invalid byte -> a lone surrogate that encodes back to
      text, utf8 = raw.decode("utf-8", errors="surrogateescape"), False  # it (not whitespace)
    text = validate_text(text)
    if isinstance(text, str) and self.text_mode == "paragraphs":
      text = textwrap.dedent(text.replace("\r\n", "\n")).strip()
    if isinstance(text, str) and not utf8:  # not UTF-8: the bytes as they are
      return text.encode("utf-8", errors="surrogateescape")
    return text


def parse_record(raw: bytes, text_key: str, record_format: str = "auto") -> str | Skipped:
  """ArrayRecord payload -> text. "auto": a JSON object is a json record, else raw text."""
  if record_format in ("auto", "json") and raw.lstrip()[:1] == b"{":
    try:
      obj = json.loads(raw)
    except UnicodeDecodeError:
      return Skipped("undecodable")
    except ValueError:
      obj = None
    if isinstance(obj, dict):
      return validate_text(obj.get(text_key))
  if record_format == "json":
    return Skipped("bad_json")
  return validate_text(raw)


class ArrayRecordReader(Reader):
  def __init__(self, paths, record_format: str = "auto", **kw):
    self.record_format = record_format
    super().__init__(paths, **kw)

  @staticmethod
  def _open(path):
    # lazy: array-record is optional (the data extra); only array_record pipelines load it
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

    return array_record_module.ArrayRecordReader(path, "readahead_buffer_size:0")

  def scan(self, path):
    r = self._open(path)
    try:
      return [(0, int(r.num_records()))]
    finally:
      r.close()

  def read(self, file_idx, part, row):
    r = self._cached((file_idx, 0), lambda: self._open(self.paths[file_idx]))
    if r is None:
      return Skipped("unreadable")
    with self._lock:
      raw = r.read([row])[0]
    return parse_record(raw, self.text_key, self.record_format)


class TfdsReader(Reader):
  """``paths == [name_or_builder_dir]``; one unit for the whole split."""

  def __init__(self, paths, tfds_split: str = "train", tfds_data_dir: str | None = None, **kw):
    self.tfds_split = tfds_split
    self.tfds_data_dir = tfds_data_dir
    super().__init__(paths, **kw)

  def _source(self):
    try:  # lazy: tensorflow-datasets is optional (the data extra) and slow to import
      import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    except ImportError as e:  # pragma: no cover
      raise DataError("format='tfds' needs `pip install tensorflow-datasets`") from e
    spec = self.paths[0]
    if os.path.isdir(spec) and os.path.exists(os.path.join(spec, "dataset_info.json")):
      return tfds.builder_from_directory(spec).as_data_source(split=self.tfds_split)
    return tfds.data_source(spec, data_dir=self.tfds_data_dir, split=self.tfds_split)

  def scan(self, path):
    try:
      src = self._source()
    except DataError:
      raise
    except Exception as e:
      lines = [ln for ln in str(e).splitlines() if ln.strip() and not ln.lstrip().startswith("- ")]
      detail = "\n".join(lines)
      detail = detail if len(detail) < 1500 else detail[:1500] + " [...]"
      raise SourceNotFoundError(
        f"cannot open TFDS data source {path!r} (split={self.tfds_split!r}, data_dir="
        f"{self.tfds_data_dir!r}): {type(e).__name__}: {detail}\nTFDS data sources need the dataset "
        "prepared with file_format='array_record' (TensorFlow itself is not required)."
      ) from e
    return [(0, len(src))]

  def read(self, file_idx, part, row):
    src = self._cached((0, 0), self._source)
    if src is None:
      return Skipped("unreadable")
    rec = src[row]
    return validate_text(rec.get(self.text_key) if isinstance(rec, dict) else rec)


def make_reader(
  fmt: str,
  paths,
  *,
  text_key="text",
  on_bad_shard="skip",
  cache_units=8,
  text_mode="paragraphs",
  record_format="auto",
  tfds_split="train",
  tfds_data_dir=None,
) -> Reader:
  kw = dict(text_key=text_key, on_bad_shard=on_bad_shard, cache_units=cache_units)
  if fmt == "parquet":
    return ParquetReader(paths, **kw)
  if fmt == "jsonl":
    return JsonlReader(paths, **kw)
  if fmt == "text":
    return TextReader(paths, text_mode=text_mode, **kw)
  if fmt == "array_record":
    return ArrayRecordReader(paths, record_format=record_format, **kw)
  if fmt == "tfds":
    return TfdsReader(paths, tfds_split=tfds_split, tfds_data_dir=tfds_data_dir, **kw)
  raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
