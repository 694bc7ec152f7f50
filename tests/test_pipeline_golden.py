"""Golden digests of pretraining and SFT pipeline output: the same batches (and iterator states,
stats and config) in the same order for the same arguments and seed.

The digests were recorded from the pipelines as they were before make_pipeline and
make_sft_pipeline were built on one shared chain (lca_jax.data.pipeline.build_pipeline); a
change that moves any digest changes which batches training sees (or breaks resuming from an
older checkpoint's data state), so it must be deliberate: rerun with LCA_JAX_PRINT_DIGESTS=1 to
print the new values.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lca_jax.data import make_eval_pipeline, make_pipeline
from lca_jax.data.sft import make_sft_eval_pipeline, make_sft_pipeline

WORDS = "alpha beta gamma delta épsilon ζeta 日本 rocket 🎉 byte model packing".split()


def _docs(n, seed):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    words = [f"doc-{i:04d}"]
    for _ in range(int(rng.integers(2, 25))):
      words.append(WORDS[int(rng.integers(len(WORDS)))])
    out.append(" ".join(words))
  return out


def _chats(n):
  return [
    {
      "messages": [
        {"role": "user", "content": f"question {i} " + "x" * (i % 7)},
        {"role": "assistant", "content": f"answer {i} " + "y" * (i % 11)},
      ]
    }
    for i in range(n)
  ]


def write_corpus(d):
  docs = _docs(150, seed=7)
  for i in range(3):
    part = docs[i * 50 : (i + 1) * 50]
    with open(d / f"p-{i}.jsonl", "w", encoding="utf-8") as f:
      for t in part:
        f.write(json.dumps({"text": t}) + "\n")
    pq.write_table(pa.table({"text": part}), str(d / f"p-{i}.parquet"), row_group_size=8)
  with open(d / "sft.jsonl", "w", encoding="utf-8") as f:
    for r in _chats(40):
      f.write(json.dumps(r) + "\n")
  with open(d / "sft_bad.jsonl", "w", encoding="utf-8") as f:
    for i, r in enumerate(_chats(12)):
      f.write(json.dumps(r) + "\n")
      if i % 4 == 3:
        f.write("{not json\n")
  return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp("golden"))


def _digest(pipe, n=None):
  """sha256 over n batches (all when None), the iterator state, stats and config."""
  h = hashlib.sha256()
  for i, batch in enumerate(pipe):
    for k in sorted(batch):
      v = np.asarray(batch[k])
      h.update(f"{k}{v.dtype.str}{v.shape}".encode())
      h.update(np.ascontiguousarray(v, dtype=v.dtype.newbyteorder("<")).tobytes())
    if n is not None and i + 1 == n:
      break
  h.update(json.dumps(pipe.get_state(), sort_keys=True, default=repr).encode())
  st = pipe.stats
  h.update(repr((st.documents_total, st.documents_this_shard, sorted(st.skipped.items()))).encode())
  h.update(repr(sorted((k, repr(v)) for k, v in pipe.config.items() if k != "files")).encode())
  pipe.close()
  return h.hexdigest()[:16]


SHARD = dict(shard_index=0, shard_count=1)

CASES = {
  "jsonl_segmented_shuffled": (
    lambda d: make_pipeline(str(d / "p-*.jsonl"), seq_len=64, batch_size=3, seed=5, **SHARD),
    12,
  ),
  "parquet_blocks_two_epochs": (
    lambda d: make_pipeline(
      str(d / "*.parquet"), seq_len=48, batch_size=4, seed=2, num_epochs=2, block_units=2, **SHARD
    ),
    None,
  ),
  "parquet_concat_shard_1_of_3": (
    lambda d: make_pipeline(
      str(d / "*.parquet"),
      seq_len=40,
      batch_size=2,
      packing="concat",
      seed=9,
      shard_index=1,
      shard_count=3,
    ),
    10,
  ),
  "jsonl_holdout_train": (
    lambda d: make_pipeline(
      str(d / "p-*.jsonl"),
      seq_len=64,
      batch_size=2,
      seed=1,
      holdout="train",
      holdout_every=5,
      **SHARD,
    ),
    8,
  ),
  # all the jsonl files: the SFT ones' records have no "text" or are malformed (skipped, counted)
  "eval_holdout_padded_with_bad_records": (
    lambda d: make_eval_pipeline(
      str(d / "*.jsonl"), seq_len=64, batch_size=4, holdout="eval", holdout_every=5, **SHARD
    ),
    None,
  ),
  "sft_chat_segmented_shuffled": (
    lambda d: make_sft_pipeline(str(d / "sft.jsonl"), "chat", 96, 2, seed=4, **SHARD),
    15,
  ),
  "sft_chat_single_shard_0_of_2": (
    lambda d: make_sft_pipeline(
      str(d / "sft.jsonl"),
      "chat",
      80,
      3,
      seed=1,
      num_epochs=2,
      packing="single",
      shard_index=0,
      shard_count=2,
      block_units=1,
    ),
    None,
  ),
  "sft_chat_two_workers": (
    lambda d: make_sft_pipeline(
      str(d / "sft.jsonl"), "chat", 96, 2, seed=6, worker_count=2, **SHARD
    ),
    8,
  ),
  "sft_eval_skip_bad_lines": (
    lambda d: make_sft_eval_pipeline(str(d / "sft_bad.jsonl"), "chat", 64, 3, on_bad_record="skip"),
    None,
  ),
}

EXPECTED = {
  "jsonl_segmented_shuffled": "9657d0e2cffecc30",
  "parquet_blocks_two_epochs": "76e59ef767326420",
  "parquet_concat_shard_1_of_3": "e6249dbe59bc6a7a",
  "jsonl_holdout_train": "84ccbfcdd2cf5058",
  "eval_holdout_padded_with_bad_records": "3023e0f4dafd5028",
  "sft_chat_segmented_shuffled": "0cd814ae27bde319",
  "sft_chat_single_shard_0_of_2": "bb62f9d2ada5dd15",
  "sft_chat_two_workers": "33c4b08c29d9628f",
  "sft_eval_skip_bad_lines": "2ad34d91ca5e0ac3",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pipeline_output_digest(corpus, name):
  build, n = CASES[name]
  got = _digest(build(corpus), n)
  if os.environ.get("LCA_JAX_PRINT_DIGESTS"):
    print(f'\n  "{name}": "{got}",')
  assert got == EXPECTED[name]
