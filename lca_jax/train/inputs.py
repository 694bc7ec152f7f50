"""Data wiring of a training run: from a config to batch layout, data sources and pipelines.

``plan_batches`` turns ``data.seq_len`` / ``train.global_batch_bytes`` /
``train.micro_batch_size`` into a ``BatchPlan`` (rows per step, micro-batches, rows per process
and per batch shard), the one place these fields are read and checked; ``plan_and_mesh`` builds
the plan and the mesh laid out for it; ``data_sources`` resolves ``data.train_files`` /
``data.eval_files`` (or, for ``data.format=text`` only, the bundled demo corpus split into
train and held-out documents; ``describe_data`` names what a run reads);
``make_train_pipeline`` / ``make_eval_pipeline`` build this process's checkpointable training
batches and its deterministic eval pass (pretraining bytes via :mod:`lca_jax.data.pipeline`,
``data.sft_format`` examples via :mod:`lca_jax.data.sft`); ``check_data_files`` fails early
when a data glob matches nothing.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence

import jax

from lca_jax.data import demo, sft, sources
from lca_jax.data import pipeline as dp
from lca_jax.data.errors import DataError
from lca_jax.train import run_config
from lca_jax.train import sharding as shd
from lca_jax.train.errors import TrainError


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """The batch layout of a run: ``data.seq_len``, ``train.global_batch_bytes`` and
  ``train.micro_batch_size`` read and checked once (``plan_batches``). The mesh's layout
  (``plan_and_mesh``), the input pipelines and the loop's batch shapes all take it from here."""

  seq_len: int  # bytes per row (data.seq_len)
  rows: int  # rows per optimizer step, all processes (train.global_batch_bytes / seq_len)
  micro: int  # rows per micro-batch, all processes (train.micro_batch_size)
  accum: int  # micro-batches per optimizer step (gradient accumulation)
  shards: int = 1  # batch shards of the mesh (data x fsdp) a micro-batch's rows are split over
  processes: int = 1  # processes, each feeding its share of the rows

  @property
  def host_rows(self) -> int:
    return self.rows // self.processes

  @property
  def host_micro(self) -> int:
    return self.micro // self.processes

  @property
  def shard_rows(self) -> int:
    """Rows of a micro-batch on each batch shard (device of the data x fsdp axes)."""
    return self.micro // self.shards

  @property
  def bytes_per_step(self) -> int:
    return self.rows * self.seq_len

  def on_mesh(self, mesh) -> "BatchPlan":
    """This plan with the batch shards of ``mesh``; a ``TrainError`` when the rows of a
    micro-batch cannot be divided over them."""
    shards = shd.batch_shards(mesh)
    if self.micro % shards:
      raise TrainError(
        f"train.micro_batch_size={self.micro} rows cannot be divided over the {shards} batch "
        f"shards of the mesh (data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']}); use a "
        f"multiple of {shards}"
      )
    return dataclasses.replace(self, shards=shards)


def plan_batches(config, mesh=None) -> BatchPlan:
  """The ``BatchPlan`` of ``config``, checked: positive sizes, a step of whole micro-batches,
  micro-batches that divide over the processes and, given ``mesh``, over its batch shards. A
  combination no run can use is a ``TrainError`` naming the config fields."""
  t = int(config.data.seq_len)
  gbb = int(config.train.global_batch_bytes)
  micro = int(config.train.micro_batch_size)
  if t <= 0 or micro <= 0 or gbb <= 0:
    raise TrainError(
      "data.seq_len, train.micro_batch_size and train.global_batch_bytes must be positive, "
      f"got {t}, {micro} and {gbb}"
    )
  if gbb % (micro * t):
    raise TrainError(
      f"train.global_batch_bytes={gbb} is not a multiple of train.micro_batch_size * data.seq_len"
      f" = {micro} * {t} = {micro * t}"
    )
  processes = jax.process_count()
  rows = gbb // t
  plan = BatchPlan(seq_len=t, rows=rows, micro=micro, accum=rows // micro, processes=processes)
  if mesh is not None:
    plan = plan.on_mesh(mesh)
  if micro % processes:
    raise TrainError(
      f"train.micro_batch_size={micro} is not divisible by the {processes} processes"
    )
  return plan


def plan_and_mesh(config, devices: Optional[Sequence[Any]] = None):
  """(``BatchPlan``, mesh) of ``config`` over ``devices`` (default all): the plan is read and
  checked first, the mesh laid out for its micro-batch (a CPU host split by
  ``mesh.cpu_devices`` puts the devices its rows cannot use on 'tensor', ``sharding.cpu_mesh``),
  then the plan checked against the mesh's batch shards."""
  plan = plan_batches(config)
  mesh = shd.make_mesh(config.mesh, devices, micro_rows=plan.micro)
  return plan.on_mesh(mesh), mesh


def cfg_get(section, key, default):
  try:
    return section[key] if key in section else default
  except (KeyError, AttributeError):
    return default


def demo_corpus_files() -> list:
  """The bundled demo corpus (lca_jax/data/corpus), split by ``lca_jax.data.DEMO_HOLDOUT_EVERY``."""
  path = demo.demo_corpus_path()
  if not os.path.isfile(path):
    raise TrainError(f"the bundled demo corpus is missing: {path}")
  return [path]


DEMO_FORMAT = "text"  # the format of the bundled corpus, the only one that defaults to it


def _fmt(name: str) -> Optional[str]:
  name = (name or "").strip()
  return {"": None, "arrayrecord": "array_record"}.get(name, name)


def data_sources(config) -> dict:
  """Where training and eval documents come from: explicit files, or the demo corpus split
  into train / held-out documents."""
  train_files = str(config.data.train_files or "").strip()
  eval_files = str(config.data.eval_files or "").strip()
  split = lambda s: [p.strip() for p in s.split(",") if p.strip()]
  fmt = _fmt(config.data.format)
  if not train_files and _sft_format(config):
    raise TrainError(
      f"data.sft_format={_sft_format(config)!r} needs data.train_files "
      "(jsonl files of examples); the bundled demo corpus is plain text"
    )
  if not train_files and fmt != DEMO_FORMAT:
    raise TrainError(
      f"data.format={config.data.format!r} needs data.train_files (glob(s) of the files to "
      f"train on); only data.format={DEMO_FORMAT} without files trains on the bundled corpus"
    )
  if not train_files:
    demo_files = demo_corpus_files()
    out = dict(train=dict(files=demo_files, format="text", holdout="train"))
    out["eval"] = (
      dict(files=split(eval_files), format=fmt, holdout=None)
      if eval_files
      else dict(files=demo_files, format="text", holdout="eval")
    )
    return out
  train_src = split(train_files) if fmt != "tfds" else train_files
  out = dict(train=dict(files=train_src, format=fmt, holdout=None), eval=None)
  if eval_files:
    out["eval"] = dict(
      files=split(eval_files) if fmt != "tfds" else eval_files, format=fmt, holdout=None
    )
  return out


def describe_data(config) -> str:
  """What a run reads, for its header: the bundled corpus or ``data.train_files`` (format)."""
  src = data_sources(config)["train"]
  if src["holdout"]:
    return f"bundled corpus ({os.path.basename(src['files'][0])}, train split)"
  files = src["files"] if isinstance(src["files"], str) else ",".join(src["files"])
  kind = _sft_format(config) or "pretraining"
  return f"data.train_files={files} ({src['format'] or 'format from extension'}, {kind})"


def _pipeline_kwargs(config, src):
  kw = dict(
    format=src["format"],
    seq_len=int(config.data.seq_len),
    packing=str(config.data.packing),
    worker_count=int(config.data.worker_count),
  )
  if src["holdout"]:
    kw.update(holdout=src["holdout"], holdout_every=demo.DEMO_HOLDOUT_EVERY)
  if src["format"] == "tfds":
    kw["tfds_split"] = str(config.data.tfds_split)
  return kw


def _sft_format(config) -> str:
  return str(cfg_get(config.data, "sft_format", "") or "").strip()


def _sft_kwargs(config):
  packing = str(config.data.packing)
  # ``concat`` (cut documents into rows) has no meaning for prompt/target examples.
  return dict(
    sft_format=_sft_format(config),
    seq_len=int(config.data.seq_len),
    packing=packing if packing in sft.SFT_PACKING else "segmented",
    worker_count=int(config.data.worker_count),
  )


def make_train_pipeline(config, plan: BatchPlan):
  """This process's training batches ([host_rows, T] numpy dicts), checkpointable."""
  src = data_sources(config)["train"]
  if _sft_format(config):
    return sft.make_sft_pipeline(
      src["files"],
      batch_size=plan.host_rows,
      seed=int(config.train.seed),
      shuffle=True,
      **_sft_kwargs(config),
    )
  return dp.make_pipeline(
    src["files"],
    batch_size=plan.host_rows,
    seed=int(config.train.seed),
    shuffle=True,
    **_pipeline_kwargs(config, src),
  )


def make_eval_pipeline(config, plan: BatchPlan):
  """One deterministic pass over the held-out data (None when there is none)."""
  src = data_sources(config)["eval"]
  if src is None:
    return None
  max_batches = int(config.train.eval_batches) or None
  if _sft_format(config):
    return sft.make_sft_eval_pipeline(
      src["files"],
      batch_size=plan.host_micro,
      max_batches=max_batches,
      shard_index=jax.process_index(),
      shard_count=jax.process_count(),
      **_sft_kwargs(config),
    )
  return dp.make_eval_pipeline(
    src["files"],
    batch_size=plan.host_micro,
    max_batches=max_batches,
    **_pipeline_kwargs(config, src),
  )


def check_data_files(config) -> None:
  """Fail early (before compiling anything) on a config value no run can use
  (``run_config.validate_run_config``: unknown data.format / data.packing, negative
  train.steps, a learning rate that is not positive, ...) and when a data glob matches nothing."""
  run_config.validate_run_config(config)
  for name, src in data_sources(config).items():
    if src is None or src["format"] == "tfds":
      continue
    try:
      sources.expand_files(src["files"])
    except DataError as e:
      raise DataError(f"data.{name}_files: {e}") from None
