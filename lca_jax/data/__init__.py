"""Local-data grain pipelines: sources, byte packing, batching, checkpointable iterators.

Batches are dicts of int32 numpy arrays ``ids``, ``segment_ids``, ``positions`` of shape
[batch_size, seq_len]; see :mod:`lca_jax.data.pipeline`.  No flax/model imports here.
"""

from lca_jax.data.demo import DEMO_HOLDOUT_EVERY, demo_corpus_path, make_demo_pipeline
from lca_jax.data.errors import BadShardWarning, DataError, Skipped
from lca_jax.data.packing import PACKING_MODES, PackIterDataset, encode_document, pack_documents
from lca_jax.data.pipeline import (
  DataStats,
  DocumentOrder,
  Pipeline,
  checkpoint_handler,
  make_eval_pipeline,
  make_pipeline,
)
from lca_jax.data.readers import FORMATS, make_reader
from lca_jax.data.sources import build_index, expand_files, open_index, read_documents

__all__ = [
  "DEMO_HOLDOUT_EVERY",
  "demo_corpus_path",
  "make_demo_pipeline",
  "PACKING_MODES",
  "PackIterDataset",
  "encode_document",
  "pack_documents",
  "DataStats",
  "DocumentOrder",
  "Pipeline",
  "checkpoint_handler",
  "make_eval_pipeline",
  "make_pipeline",
  "FORMATS",
  "BadShardWarning",
  "DataError",
  "Skipped",
  "build_index",
  "expand_files",
  "make_reader",
  "open_index",
  "read_documents",
]
