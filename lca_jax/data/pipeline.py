"""grain pipelines: local documents -> shuffled, host-sharded, packed numpy batches.

Batch contract (``dict[str, np.ndarray]``, all int32, shape ``[batch_size, seq_len]``)::

    ids          byte-vocab ids (lca_jax.vocab), documents end with EOS_ID, pad = 0
    segment_ids  document piece number within the row (1, 2, ...); 0 = padding
    positions    position within the piece, restarting at 0; 0 on padding

(``concat`` packing: segment_ids all 1 and positions 0..T-1; only the padding rows
of a padded final eval batch have segment_ids 0.)

Order of documents.  Units (files / parquet row groups) are permuted per epoch
with ``seed``; consecutive blocks of ``block_units`` units are then shuffled as a
whole (grain's index_shuffle), so a block's rows are fully mixed while at most
~2 blocks of units are cached per reader (bounded memory, sequential-ish I/O).
Formats with a single unit (TFDS) or few files get a global shuffle.  Each epoch
uses a fresh permutation.  Host ``shard_index`` of ``shard_count`` takes the
contiguous range ``[N*i//n, N*(i+1)//n)`` of that epoch's order, so hosts see
disjoint documents whose union is the whole epoch.

Determinism / checkpoints.  Output depends only on the data, the arguments and
``worker_count`` (grain's multiprocess prefetch splits documents between workers
round-robin).  ``get_state()``/``set_state()`` restore exactly; for orbax use
``grain.checkpoint.CheckpointHandler`` with :meth:`Pipeline.save_args` /
:meth:`Pipeline.restore_args`.  A state restores only into a pipeline built with
the same files and arguments (incl. worker_count).

Throughput.  ``worker_count=0`` reads with ``read_threads`` threads and packs in the
calling process (a few MB/s of text); use ``worker_count > 0`` (grain mp_prefetch,
spawned processes: ~seconds to start) for large runs.  With parquet, every worker
caches the row groups of the current block (``2*block_units+1`` per worker at most).
"""

from __future__ import annotations

import bisect
import dataclasses
import signal
import sys
import threading
from typing import Any, Callable, Sequence

import grain
import jax
import numpy as np
from absl import flags
from grain.experimental import index_shuffle

from lca_jax.data.errors import DataError
from lca_jax.data.packing import PackIterDataset, SkipGuard, encode_document
from lca_jax.data.sources import DocumentIndex, open_index


class DocumentOrder(Sequence):
  """position -> document text (or Skipped) for one host, all epochs (lazy, picklable)."""

  def __init__(
    self,
    index: DocumentIndex,
    *,
    shuffle: bool,
    seed: int,
    block_units: int,
    shard_index: int,
    shard_count: int,
    num_epochs: int | None,
    holdout: str | None = None,
    holdout_every: int = 20,
  ):
    if not 0 <= shard_index < shard_count:
      raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}")
    self.reader = index.reader
    self.shuffle, self.seed, self.block = bool(shuffle), int(seed), max(1, int(block_units))
    units = index.units
    natural_start = np.concatenate([[0], np.cumsum(units[:, 2])[:-1]]).astype(np.int64)
    n_phys = units[:, 2]
    if holdout is None:
      n_sel = n_phys.copy()
    else:
      k = int(holdout_every)
      if holdout not in ("train", "eval") or k < 2:
        raise ValueError(
          f"holdout must be None/'train'/'eval' and holdout_every >= 2 ({holdout!r}, {k})"
        )
      end = natural_start + n_phys
      n_sel = (
        (end - end // k) - (natural_start - natural_start // k)
        if holdout == "train"
        else end // k - natural_start // k
      )
    keep = n_sel > 0
    self.units, self.start, self.n_sel = units[keep], natural_start[keep], n_sel[keep]
    self.holdout, self.k = holdout, int(holdout_every)
    self.num_units = len(self.units)
    self.total = int(self.n_sel.sum())
    self.lo = self.total * shard_index // shard_count
    self.hi = self.total * (shard_index + 1) // shard_count
    self.n_local = self.hi - self.lo
    if self.n_local <= 0:
      raise DataError(
        f"only {self.total} documents: too few for shard {shard_index} of {shard_count}"
      )
    self.num_epochs = num_epochs
    self._init_runtime()

  def _init_runtime(self):
    self._lock = threading.Lock()
    self._plans: dict[int, tuple] = {}
    self._units = [tuple(u) for u in self.units.tolist()]
    self._starts = self.start.tolist()

  def __getstate__(self):
    d = dict(self.__dict__)
    for k in ("_lock", "_plans", "_units", "_starts"):
      d.pop(k)
    return d

  def __setstate__(self, d):
    self.__dict__.update(d)
    self._init_runtime()

  def __len__(self) -> int:
    return sys.maxsize if self.num_epochs is None else self.n_local * int(self.num_epochs)

  def skip_guard(self) -> SkipGuard:
    """The packers' guard against a stream without usable records: bad records in a row
    that mean a whole epoch of this shard has no usable one. Any ``2 * n_local - 1``
    consecutive positions hold every position of some epoch (a finite stream: all of it)."""
    paths = self.reader.paths
    more = f" and {len(paths) - 3} more files" if len(paths) > 3 else ""
    return SkipGuard(
      limit=min(2 * self.n_local - 1, len(self)),
      epoch=self.n_local,
      source=", ".join(paths[:3]) + more,
    )

  def _plan(self, epoch: int):
    """(unit order, per-block seeds, cumulative doc counts) as Python lists (fast bisect)."""
    with self._lock:
      if epoch not in self._plans:
        if self.shuffle:
          rng = np.random.default_rng([self.seed, epoch])
          order = rng.permutation(self.num_units)
          seeds = rng.integers(
            0, 2**32, size=-(-self.num_units // self.block), dtype=np.uint64
          ).tolist()
        else:
          order, seeds = np.arange(self.num_units), None
        cum = np.concatenate([[0], np.cumsum(self.n_sel[order])]).astype(np.int64).tolist()
        if len(self._plans) > 4:
          self._plans.pop(next(iter(self._plans)))
        self._plans[epoch] = (order.tolist(), seeds, cum)
      return self._plans[epoch]

  def locate(self, index: int) -> tuple[int, int, int]:
    """position -> (file_idx, part, physical row)."""
    epoch, j = divmod(int(index), self.n_local)
    order, seeds, cum = self._plan(epoch)
    p = self.lo + j
    if self.shuffle:
      g = (bisect.bisect_right(cum, p) - 1) // self.block
      a, b = cum[g * self.block], cum[min((g + 1) * self.block, self.num_units)]
      if b - a > 1:
        p = a + index_shuffle(p - a, b - a - 1, seeds[g], 4)
    s = bisect.bisect_right(cum, p) - 1
    u = order[s]
    r = p - cum[s]
    if self.holdout is not None:  # r-th selected row of unit u -> physical row
      S, k = self._starts[u], self.k
      if self.holdout == "train":
        t = S - S // k + r
        r = t + t // (k - 1) - S
      else:
        r = (S // k + r) * k + k - 1 - S
    f, part, _ = self._units[u]
    return f, part, r

  def __getitem__(self, index):
    f, part, row = self.locate(index)
    return self.reader.read(f, part, row)


@dataclasses.dataclass
class DataStats:
  """``bad_shards``: shards skipped while indexing, plus (worker_count == 0 only) parts
  that failed at read time; ``skipped``: bad records consumed so far by this host's
  iterator (checkpointed with it, summed over worker processes)."""

  num_files: int
  bad_shards: list[tuple[str, str]]  # (path, reason)
  documents_total: int  # per epoch, all hosts (after holdout)
  documents_this_shard: int  # per epoch, this host
  skipped: dict[str, int]  # bad records consumed so far, by reason

  @property
  def skipped_records(self) -> int:
    return int(sum(self.skipped.values()))

  @property
  def num_bad_shards(self) -> int:
    return len(self.bad_shards)


def _sum_skipped(state: Any, acc: dict[str, int]) -> dict[str, int]:
  if isinstance(state, dict):
    for k, v in state.items():
      if k == "lca_skipped" and isinstance(v, dict):
        for r, n in v.items():
          acc[r] = acc.get(r, 0) + int(n)
      else:
        _sum_skipped(v, acc)
  elif isinstance(state, (list, tuple)):
    for v in state:
      _sum_skipped(v, acc)
  return acc


class _PadBatch(grain.transforms.Map):
  def __init__(self, batch_size: int):
    self.batch_size = batch_size

  def map(self, batch):
    n = len(batch["ids"])
    if n == self.batch_size:
      return batch
    return {
      k: np.concatenate([v, np.zeros((self.batch_size - n,) + v.shape[1:], v.dtype)])
      for k, v in batch.items()
    }


class Pipeline:
  """Iterator of batches (``for batch in pipeline``) with exact, checkpointable state."""

  def __init__(
    self, dataset: grain.IterDataset, index: DocumentIndex, order: DocumentOrder, config: dict
  ):
    self.dataset = dataset
    self.index = index
    self.order = order
    self.config = config
    self._iterator = None

  @property
  def iterator(self) -> grain.DatasetIterator:
    if self._iterator is None:
      self._iterator = iter(self.dataset)
    return self._iterator

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    try:
      return next(self.iterator)
    except DataError as e:  # re-raise without grain's internal frames
      raise DataError(str(e)) from None

  def get_state(self) -> dict[str, Any]:
    return self.iterator.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self.iterator.set_state(state)

  def reset(self) -> None:
    """Restart from the beginning (closes the current iterator)."""
    self.close()

  def close(self) -> None:
    if self._iterator is not None:
      self._iterator.close()
      self._iterator = None

  @property
  def stats(self) -> DataStats:
    skipped = _sum_skipped(self._iterator.get_state(), {}) if self._iterator is not None else {}
    bad = list(self.index.bad_shards) + self.index.reader.failed_parts()
    return DataStats(
      num_files=len(self.index.reader.paths),
      bad_shards=bad,
      documents_total=self.order.total,
      documents_this_shard=self.order.n_local,
      skipped={k: v for k, v in skipped.items() if v},
    )

  def save_args(self):
    """orbax args to save the iterator (item handler: grain.checkpoint.CheckpointHandler)."""
    return grain.checkpoint.CheckpointSave(self.iterator)

  def restore_args(self):
    """orbax args to restore the iterator in place (same pipeline arguments required)."""
    return grain.checkpoint.CheckpointRestore(self.iterator)


def _ensure_absl_flags_parsed():
  """grain's multiprocess prefetch reads absl flags; outside an absl app (pytest, notebooks,
  plain scripts) they are unparsed and grain would raise UnparsedFlagAccessError."""
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def _ignore_sigint(worker_index: int, worker_count: int) -> None:
  """grain worker init: Ctrl-C goes to the terminal's whole process group, and only the main
  process acts on it (lca-train checkpoints, then closes the workers), so workers ignore it."""
  del worker_index, worker_count
  signal.signal(signal.SIGINT, signal.SIG_IGN)


def checkpoint_handler():
  """The orbax item handler for pipeline iterators (``grain.checkpoint.CheckpointHandler``)."""
  return grain.checkpoint.CheckpointHandler()


def batch_and_prefetch(
  it, batch_size, drop_remainder, pad_final_batch, worker_count, worker_buffer_size, max_batches
):
  """The tail every pipeline shares: batch, optionally pad a short final batch with all-zero
  rows, multiprocess prefetch with ``worker_count`` > 0, and a batch limit."""
  it = it.batch(batch_size, drop_remainder=drop_remainder)
  if pad_final_batch:
    it = it.map(_PadBatch(batch_size))
  if worker_count > 0:
    _ensure_absl_flags_parsed()
    it = it.mp_prefetch(
      grain.MultiprocessingOptions(
        num_workers=worker_count, per_worker_buffer_size=worker_buffer_size
      ),
      worker_init_fn=_ignore_sigint,
    )
  if max_batches is not None:
    it = grain.experimental.LimitIterDataset(it, int(max_batches))
  return it


def reader_cache_units(block_units: int) -> int:
  """How many units (files / row groups) a reader caches: the current shuffle block and the
  next, so that a block's rows read from memory (module docstring)."""
  return 2 * block_units + 1


def build_pipeline(
  index: DocumentIndex,
  packer: Callable[..., grain.IterDataset],
  *,
  source: dict[str, Any],
  seq_len: int,
  packing: str,
  batch_size: int,
  seed: int,
  shuffle: bool,
  num_epochs: int | None,
  shard_index: int | None,
  shard_count: int | None,
  worker_count: int,
  block_units: int,
  drop_remainder: bool,
  pad_final_batch: bool,
  max_batches: int | None,
  read_threads: int,
  worker_buffer_size: int,
  encode: Callable[[Any], Any] | None = None,
  holdout: str | None = None,
  holdout_every: int = 20,
) -> Pipeline:
  """The chain every pipeline is built with: the documents of ``index`` in
  :class:`DocumentOrder` (per-epoch shuffle, host shard, epochs, holdout) -> ``encode`` on each
  record (None: the reader's records as they are) -> threaded reads -> rows packed by
  ``packer(parent, seq_len, packing, guard=...)`` -> :func:`batch_and_prefetch`.

  ``source``: what the pipeline reads (``files``, ``format``, ...), the head of
  :attr:`Pipeline.config`.  ``shard_index``/``shard_count`` default to
  jax.process_index()/process_count()."""
  if shard_index is None or shard_count is None:
    shard_index = jax.process_index() if shard_index is None else shard_index
    shard_count = jax.process_count() if shard_count is None else shard_count
  order = DocumentOrder(
    index,
    shuffle=shuffle,
    seed=seed,
    block_units=block_units,
    shard_index=shard_index,
    shard_count=shard_count,
    num_epochs=num_epochs,
    holdout=holdout,
    holdout_every=holdout_every,
  )
  ds = grain.MapDataset.source(order)
  if encode is not None:
    ds = ds.map(encode)
  it = ds.to_iter_dataset(
    grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=max(64, 16 * read_threads))
  )
  it = packer(it, seq_len, packing, guard=order.skip_guard())
  it = batch_and_prefetch(
    it, batch_size, drop_remainder, pad_final_batch, worker_count, worker_buffer_size, max_batches
  )
  config = dict(
    **source,
    reader=type(index.reader).__name__,
    seq_len=seq_len,
    batch_size=batch_size,
    packing=packing,
    seed=seed,
    shuffle=shuffle,
    num_epochs=num_epochs,
    shard_index=shard_index,
    shard_count=shard_count,
    worker_count=worker_count,
    holdout=holdout,
  )
  return Pipeline(it, index, order, config)


def make_pipeline(
  files: str | Sequence[str],
  format: str | None = None,
  seq_len: int = 1024,
  batch_size: int = 8,
  packing: str = "segmented",
  seed: int = 0,
  shuffle: bool = True,
  num_epochs: int | None = None,
  shard_index: int | None = None,
  shard_count: int | None = None,
  worker_count: int = 0,
  *,
  text_key: str = "text",
  text_mode: str = "paragraphs",
  record_format: str = "auto",
  tfds_split: str = "train",
  tfds_data_dir: str | None = None,
  on_bad_shard: str = "skip",
  block_units: int = 8,
  holdout: str | None = None,
  holdout_every: int = 20,
  drop_remainder: bool = True,
  pad_final_batch: bool = False,
  max_batches: int | None = None,
  read_threads: int = 4,
  worker_buffer_size: int = 2,
) -> Pipeline:
  """Builds a batch pipeline over local files (see module docstring for the contract).

  ``format``: parquet | jsonl | text | array_record | tfds (None: inferred from the
  first file's extension).  For tfds, ``files`` is a dataset name or builder dir.
  ``holdout``: None (all documents), "train" or "eval": document d (in natural file
  order) is held out for eval iff ``d % holdout_every == holdout_every - 1``.
  ``shard_index``/``shard_count`` default to jax.process_index()/process_count().
  """
  index = open_index(
    files,
    format,
    on_bad_shard=on_bad_shard,
    text_key=text_key,
    text_mode=text_mode,
    record_format=record_format,
    tfds_split=tfds_split,
    tfds_data_dir=tfds_data_dir,
    cache_units=reader_cache_units(block_units),
  )
  return build_pipeline(
    index,
    PackIterDataset,
    source=dict(files=files, format=format),
    encode=encode_document,
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
    holdout=holdout,
    holdout_every=holdout_every,
    drop_remainder=drop_remainder,
    pad_final_batch=pad_final_batch,
    max_batches=max_batches,
    read_threads=read_threads,
    worker_buffer_size=worker_buffer_size,
  )


def make_eval_pipeline(
  files,
  format=None,
  seq_len: int = 1024,
  batch_size: int = 8,
  packing: str = "segmented",
  max_batches: int | None = None,
  **kw,
) -> Pipeline:
  """Deterministic eval: no shuffle, one epoch, final batch padded to batch_size
  (padding rows have segment_ids == 0), optionally stopped after max_batches."""
  kw.setdefault("pad_final_batch", True)
  return make_pipeline(
    files,
    format,
    seq_len,
    batch_size,
    packing,
    shuffle=False,
    num_epochs=1,
    drop_remainder=False,
    max_batches=max_batches,
    **kw,
  )
