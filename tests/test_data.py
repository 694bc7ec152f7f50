import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import gzip
import json
import re
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lca_jax import vocab
from lca_jax.data import (
  BadShardWarning,
  DataError,
  demo_corpus_path,
  make_demo_pipeline,
  make_eval_pipeline,
  make_pipeline,
  pack_documents,
  read_documents,
)

RNG_WORDS = "alpha beta gamma delta épsilon ζeta 日本 rocket 🎉 byte model packing".split()


def make_docs(n, lo=10, hi=90, seed=0, prefix="doc"):
  rng = np.random.default_rng(seed)
  docs = []
  for i in range(n):
    words = [f"{prefix}-{i:04d}"]
    target = int(rng.integers(lo, hi))
    while len(" ".join(words).encode()) < target:
      words.append(RNG_WORDS[int(rng.integers(len(RNG_WORDS)))])
    docs.append(" ".join(words))
  return docs


def write_jsonl(path, docs, raw_lines=()):
  with open(path, "wb") as f:
    for d in docs:
      f.write(json.dumps({"text": d, "id": 1}).encode() + b"\n")
    for line in raw_lines:
      f.write(line + b"\n")
  return str(path)


def write_parquet(path, docs, row_group_size=16):
  pq.write_table(
    pa.table({"text": docs, "n": list(range(len(docs)))}), str(path), row_group_size=row_group_size
  )
  return str(path)


def write_array_record(path, records):
  from array_record.python.array_record_module import ArrayRecordWriter

  w = ArrayRecordWriter(str(path), "group_size:1")
  for r in records:
    w.write(r)
  w.close()
  return str(path)


def segments(batch):
  """Decoded text of every (segment) piece in a batch, in row order."""
  out = []
  for ids, seg in zip(batch["ids"], batch["segment_ids"]):
    for s in range(1, int(seg.max()) + 1):
      out.append(vocab.decode(ids[seg == s]))
  return out


def take(it, n):
  return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


# ---------------------------------------------------------------- sources


@pytest.fixture(scope="module")
def docs():
  return make_docs(60)


def test_parquet_jsonl_text_array_record_read_back(tmp_path, docs):
  a, b = docs[:25], docs[25:]
  write_parquet(tmp_path / "p-0.parquet", a, row_group_size=7)
  write_parquet(tmp_path / "p-1.parquet", b, row_group_size=7)
  assert list(read_documents(str(tmp_path / "p-*.parquet"))) == docs
  write_jsonl(tmp_path / "j-0.jsonl", a)
  with gzip.open(tmp_path / "j-1.jsonl.gz", "wb") as f:
    f.write(b"\n".join(json.dumps({"text": d}).encode() for d in b) + b"\n\n")
  assert list(read_documents([str(tmp_path / "j-0.jsonl"), str(tmp_path / "j-1.jsonl.gz")])) == docs
  # text, paragraphs: blank lines (with spaces / CRLF) separate docs; common indentation removed
  para = "   first line\n     indented more\n   last"
  (tmp_path / "t.txt").write_text("\n\n".join(a) + "\n \n\r\n" + para + "\n\n\n", encoding="utf-8")
  assert list(read_documents(str(tmp_path / "t.txt"), text_mode="paragraphs")) == a + [
    "first line\n  indented more\nlast"
  ]
  with gzip.open(tmp_path / "u.txt.gz", "wt", encoding="utf-8") as f:
    f.write("\n\n".join(b))
  assert list(read_documents(str(tmp_path / "u.txt.gz"))) == b
  assert list(read_documents(str(tmp_path / "*.txt*"), "text", text_mode="file")) == [
    (tmp_path / "t.txt").read_bytes().decode(),
    "\n\n".join(b),
  ]
  recs = [d.encode() for d in a] + [json.dumps({"text": d, "x": 1}).encode() for d in b]
  write_array_record(tmp_path / "r.array_record", recs)
  assert list(read_documents(str(tmp_path / "r.array_record"))) == docs


import tensorflow_datasets as tfds  # noqa: E402  (TensorFlow itself is not installed)


class LcaTinyTextDocs(tfds.core.GeneratorBasedBuilder):
  VERSION = tfds.core.Version("1.0.0")
  DOCS = make_docs(30, seed=3, prefix="tfds")

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()})
    )

  def _split_generators(self, dl_manager):
    return {
      "train": self._generate_examples(self.DOCS[:24]),
      "test": self._generate_examples(self.DOCS[24:]),
    }

  def _generate_examples(self, docs=()):
    for i, d in enumerate(docs):
      yield i, {"text": d}


def test_tfds_data_source_without_tensorflow(tmp_path):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    builder = LcaTinyTextDocs(data_dir=str(tmp_path), file_format="array_record")
    builder.download_and_prepare()
  want = LcaTinyTextDocs.DOCS
  got = list(read_documents(builder.data_dir, "tfds", tfds_split="train"))  # builder dir
  assert sorted(got) == sorted(want[:24])  # tfds shuffles examples when writing
  got = list(
    read_documents("lca_tiny_text_docs", "tfds", tfds_split="test", tfds_data_dir=str(tmp_path))
  )
  assert sorted(got) == sorted(want[24:])
  p = make_eval_pipeline(
    builder.data_dir,
    "tfds",
    seq_len=256,
    batch_size=4,
    tfds_split="train",
    shard_index=0,
    shard_count=1,
  )
  assert sorted(s for b in p for s in segments(b)) == sorted(want[:24])
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a missing dataset is an error, not a skipped shard
    with pytest.raises(DataError, match="cannot open TFDS data source 'no_such_dataset'"):
      make_pipeline(
        "no_such_dataset", "tfds", tfds_data_dir=str(tmp_path), shard_index=0, shard_count=1
      )


# ---------------------------------------------------------------- packing


def ref_pack(texts, T, mode):
  seqs = [list(t.encode()) for t in texts]
  seqs = [[b + 3 for b in s] + [vocab.EOS_ID] for s in seqs]
  if mode == "concat":
    flat = [x for s in seqs for x in s]
    return [(flat[i : i + T], [1] * T, list(range(T))) for i in range(0, len(flat) - T + 1, T)]
  rows, cur = [], []

  def flush():
    ids = [x for p in cur for x in p]
    seg = [k + 1 for k, p in enumerate(cur) for _ in p]
    pos = [i for p in cur for i in range(len(p))]
    pad = T - len(ids)
    rows.append((ids + [0] * pad, seg + [0] * pad, pos + [0] * pad))
    cur.clear()

  for rest in seqs:
    while rest:
      room = T - sum(map(len, cur))
      if len(rest) <= room:
        cur.append(rest)
        rest = []
      elif len(rest) > T:
        cur.append(rest[:room])
        rest = rest[room:]
      else:
        flush()
        continue
      if sum(map(len, cur)) == T:
        flush()
  if cur:
    flush()
  return rows


@pytest.mark.parametrize("mode", ["concat", "segmented"])
@pytest.mark.parametrize("T", [7, 32, 64])
def test_packing_matches_reference(mode, T):
  texts = make_docs(40, lo=1, hi=150, seed=T) + ["x", "é" * 40, "y"]
  rows = pack_documents(texts, T, mode)
  ref = ref_pack(texts, T, mode)
  assert len(rows) == len(ref)
  for row, (ids, seg, pos) in zip(rows, ref):
    assert all(v.dtype == np.int32 and v.shape == (T,) for v in row.values())
    assert row["ids"].tolist() == ids
    assert row["segment_ids"].tolist() == seg
    assert row["positions"].tolist() == pos
  if mode == "segmented":  # every byte survives, documents are recovered in order
    real = np.concatenate([r["ids"][r["segment_ids"] > 0] for r in rows])
    assert vocab.decode(real, specials="render") == "".join(t + "<eos>" for t in texts)


# ---------------------------------------------------------------- pipeline


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  d = tmp_path_factory.mktemp("corpus")
  docs = make_docs(240, seed=1)
  for i in range(3):
    write_parquet(d / f"train-{i}.parquet", docs[i * 80 : (i + 1) * 80], row_group_size=10)
    write_jsonl(d / f"train-{i}.jsonl", docs[i * 80 : (i + 1) * 80])
  return d, docs


def test_batch_contract_and_determinism(corpus):
  d, _ = corpus
  kw = dict(seq_len=128, batch_size=4, shard_index=0, shard_count=1, block_units=2)
  a = take(make_pipeline(str(d / "*.parquet"), seed=1, **kw), 6)
  b = take(make_pipeline(str(d / "*.parquet"), seed=1, **kw), 6)
  c = take(make_pipeline(str(d / "*.parquet"), seed=2, **kw), 6)
  assert_batches_equal(a, b)
  assert any(not np.array_equal(x["ids"], y["ids"]) for x, y in zip(a, c))
  for batch in a:
    assert set(batch) == {"ids", "segment_ids", "positions"}
    for v in batch.values():
      assert v.shape == (4, 128) and v.dtype == np.int32
    assert batch["ids"].max() < vocab.NUM_BASE_TOKENS
    assert np.all((batch["ids"] == 0) == (batch["segment_ids"] == 0))
  cc = next(make_pipeline(str(d / "*.jsonl"), packing="concat", **kw))
  assert np.all(cc["segment_ids"] == 1) and np.all(cc["positions"] == np.arange(128))
  assert np.all(cc["ids"] >= 1)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_host_shards_disjoint_and_complete(corpus, fmt):
  d, docs = corpus
  seen = []
  for shard in range(2):
    p = make_pipeline(
      str(d / f"*.{fmt}"),
      seq_len=128,
      batch_size=3,
      seed=5,
      num_epochs=1,
      shard_index=shard,
      shard_count=2,
      drop_remainder=False,
      block_units=2,
    )
    seen.append([s for b in p for s in segments(b)])
  assert len(seen[0]) == len(set(seen[0])) and len(seen[1]) == len(set(seen[1]))
  assert not set(seen[0]) & set(seen[1])
  assert sorted(seen[0] + seen[1]) == sorted(docs)
  assert abs(len(seen[0]) - len(seen[1])) <= 1
  assert seen[0][:10] != sorted(seen[0])[:10]  # shuffled


def test_epochs_reshuffle_and_cover(corpus):
  d, docs = corpus
  p = make_pipeline(
    str(d / "*.jsonl"),
    seq_len=128,
    batch_size=1,
    seed=0,
    num_epochs=2,
    shard_index=0,
    shard_count=1,
    drop_remainder=False,
  )
  got = [s for b in p for s in segments(b)]
  assert sorted(got[:240]) == sorted(docs) and sorted(got[240:]) == sorted(docs)
  assert got[:240] != got[240:]


@pytest.mark.parametrize(
  "fmt,packing", [("parquet", "segmented"), ("jsonl", "concat"), ("parquet", "concat")]
)
def test_exact_resume(corpus, fmt, packing):
  d, _ = corpus
  kw = dict(
    files=str(d / f"*.{fmt}"),
    seq_len=96,
    batch_size=3,
    packing=packing,
    seed=7,
    shard_index=1,
    shard_count=2,
    block_units=2,
  )
  full = take(make_pipeline(**kw), 40)  # > 1 epoch of this shard
  p = make_pipeline(**kw)
  first = take(p, 13)
  state = json.loads(json.dumps(p.get_state()))
  p2 = make_pipeline(**kw)
  p2.set_state(state)
  assert_batches_equal(first + take(p2, 27), full)


def test_orbax_checkpoint_roundtrip(corpus, tmp_path):
  import orbax.checkpoint as ocp

  d, _ = corpus
  kw = dict(
    files=str(d / "*.jsonl"), seq_len=64, batch_size=2, seed=3, shard_index=0, shard_count=1
  )
  full = take(make_pipeline(**kw), 10)
  p = make_pipeline(**kw)
  take(p, 4)
  mngr = ocp.CheckpointManager(str(tmp_path / "ckpt"))
  mngr.save(4, args=ocp.args.Composite(data=p.save_args()))
  mngr.wait_until_finished()
  p2 = make_pipeline(**kw)
  mngr.restore(4, args=ocp.args.Composite(data=p2.restore_args()))
  assert_batches_equal(take(p2, 6), full[4:])
  mngr.close()


def test_multiprocess_workers_deterministic_and_resumable(corpus):
  # worker processes are spawned (a few seconds each): one run, then a resumed one
  d, _ = corpus
  kw = dict(
    files=str(d / "*.parquet"),
    seq_len=64,
    batch_size=2,
    seed=3,
    shard_index=0,
    shard_count=1,
    worker_count=2,
  )
  p = make_pipeline(**kw)
  first = take(p, 5)
  state = json.loads(json.dumps(p.get_state()))
  rest = take(p, 7)
  p.close()
  p2 = make_pipeline(**kw)
  p2.set_state(state)
  assert_batches_equal(take(p2, 7), rest)
  p2.close()
  # 2 workers split the documents round-robin: every document of the shard shows up
  assert len({s for b in first + rest for s in segments(b)}) > 12


def test_eval_mode_and_holdout(tmp_path):
  docs = make_docs(83, seed=4)
  write_jsonl(tmp_path / "a.jsonl", docs[:37])
  write_jsonl(tmp_path / "b.jsonl", docs[37:])
  kw = dict(seq_len=128, batch_size=4, shard_index=0, shard_count=1, holdout_every=20)
  ev = make_eval_pipeline(str(tmp_path / "*.jsonl"), holdout="eval", **kw)
  ev_batches = list(ev)
  assert [s for b in ev_batches for s in segments(b)] == [
    x for i, x in enumerate(docs) if i % 20 == 19
  ]
  assert all(b["ids"].shape == (4, 128) for b in ev_batches)  # final batch padded with empty rows
  assert_batches_equal(
    ev_batches, list(make_eval_pipeline(str(tmp_path / "*.jsonl"), holdout="eval", **kw))
  )
  tr = make_eval_pipeline(str(tmp_path / "*.jsonl"), holdout="train", **kw)
  assert [s for b in tr for s in segments(b)] == [x for i, x in enumerate(docs) if i % 20 != 19]
  assert len(list(make_eval_pipeline(str(tmp_path / "*.jsonl"), max_batches=2, **kw))) == 2


# ---------------------------------------------------------------- bad data


def test_bad_records_skipped_and_counted(tmp_path):
  good = make_docs(10, seed=9)
  raw = [
    json.dumps({"text": ""}).encode(),
    json.dumps({"text": "  \n "}).encode(),
    json.dumps({"text": 5}).encode(),
    json.dumps({"text": None}).encode(),
    json.dumps({"other": "x"}).encode(),
    b"this is not json",
    b"[1, 2]",
    b'{"text": "\xff\xfe broken"}',
  ]
  write_jsonl(tmp_path / "j.jsonl", good, raw)
  p = make_eval_pipeline(
    str(tmp_path / "j.jsonl"), seq_len=128, batch_size=4, shard_index=0, shard_count=1
  )
  assert [s for b in p for s in segments(b)] == good
  assert p.stats.skipped == {"empty": 2, "not_string": 3, "bad_json": 2, "undecodable": 1}
  assert p.stats.skipped_records == 8

  write_parquet(tmp_path / "p.parquet", good[:3] + [None, "", " "], row_group_size=2)
  p = make_eval_pipeline(
    str(tmp_path / "p.parquet"), seq_len=128, batch_size=4, shard_index=0, shard_count=1
  )
  assert [s for b in p for s in segments(b)] == good[:3]
  assert p.stats.skipped == {"empty": 2, "not_string": 1}

  write_array_record(
    tmp_path / "r.array_record", [good[0].encode(), b"\xff\xfe", b'{"text": 3}', b"{not json", b""]
  )
  got = list(read_documents(str(tmp_path / "r.array_record"), with_skipped=True))
  assert got[0] == good[0] and got[3] == "{not json"
  assert [getattr(x, "reason", None) for x in got] == [
    None,
    "undecodable",
    "not_string",
    None,
    "empty",
  ]


def test_text_that_is_not_utf8_is_read_as_bytes(tmp_path):
  """A text file is bytes: Latin-1 or random bytes are trained on exactly as they are in the
  file (byte b -> id b + 3), nothing replaced, dropped or counted as skipped."""
  latin = "caf\u00e9 cr\u00e8me\n\n  na\u00efve\r\n  line\n\n  \n".encode("latin-1")
  (tmp_path / "latin1.txt").write_bytes(latin)
  got = list(read_documents(str(tmp_path / "latin1.txt"), with_skipped=True))
  assert got == [b"caf\xe9 cr\xe8me", b"na\xefve\nline"]  # dedented, CRLF -> LF, as for UTF-8
  p = make_eval_pipeline(
    str(tmp_path / "latin1.txt"), seq_len=32, batch_size=2, shard_index=0, shard_count=1
  )
  batch = next(p)
  assert vocab.ids_to_bytes(batch["ids"][0][batch["segment_ids"][0] == 1]) == b"caf\xe9 cr\xe8me"
  assert vocab.ids_to_bytes(batch["ids"][0][batch["segment_ids"][0] == 2]) == b"na\xefve\nline"
  assert p.stats.skipped == {}
  # a valid UTF-8 file is unchanged: str documents, its UTF-8 bytes
  (tmp_path / "utf8.txt").write_bytes("caf\u00e9\n".encode())
  assert list(read_documents(str(tmp_path / "utf8.txt"))) == ["caf\u00e9"]
  noise = np.random.default_rng(0).bytes(3000).replace(b"\n", b"x")  # one paragraph
  (tmp_path / "noise.bin").write_bytes(b"A" + noise + b"Z")
  p = make_pipeline(
    str(tmp_path / "noise.bin"), "text", seq_len=64, batch_size=4, shard_index=0, shard_count=1
  )
  rows = np.concatenate([next(p)["ids"] for _ in range(12)])  # 48 rows: more than one epoch
  assert vocab.ids_to_bytes(rows.reshape(-1)[:3002]) == (b"A" + noise + b"Z").strip()
  assert p.stats.skipped == {}


@pytest.mark.parametrize(
  "case", ["jsonl_bad_json", "jsonl_wrong_key", "parquet_empty", "text_blank", "sft"]
)
def test_no_usable_record_is_an_error_not_a_hang(tmp_path, case):
  """When a whole epoch yields no usable record, the training pipeline (endless epochs) and
  the eval pipeline (one epoch) raise DataError naming the file, after at most two epochs."""
  if case == "jsonl_bad_json":
    path = write_jsonl(
      tmp_path / "bad.jsonl", [], [b"not json %d" % i for i in range(40)] + [b"\xff\xfe{"]
    )
  elif case == "jsonl_wrong_key":
    path = str(tmp_path / "other_key.jsonl")
    with open(path, "w") as f:
      f.writelines(json.dumps({"body": d}) + "\n" for d in make_docs(30))
  elif case == "parquet_empty":
    path = write_parquet(tmp_path / "empty.parquet", [None, "", "  "] * 5, row_group_size=4)
  elif case == "text_blank":  # blank by Unicode's rules only: kept by the byte split, then empty
    path = str(tmp_path / "blank.txt")
    with open(path, "wb") as f:
      f.write("\u3000\u00a0\n\n\u2003\n".encode())
  if case == "sft":
    from lca_jax.data import sft

    path = str(tmp_path / "long.jsonl")
    with open(path, "w") as f:  # every example longer than seq_len: all skipped as too_long
      f.writelines(
        json.dumps(
          {
            "messages": [
              {"role": "user", "content": "q" * 200},
              {"role": "assistant", "content": "a" * 200},
            ]
          }
        )
        + "\n"
        for _ in range(8)
      )
    pipes = [
      sft.make_sft_pipeline(path, "chat", seq_len=64, batch_size=2, shard_index=0, shard_count=1),
      sft.make_sft_eval_pipeline(path, "chat", seq_len=64, batch_size=2),
    ]
  else:
    kw = dict(seq_len=64, batch_size=2, shard_index=0, shard_count=1)
    pipes = [make_pipeline(path, **kw), make_eval_pipeline(path, **kw)]
  for p in pipes:
    with pytest.raises(DataError, match=f"no usable document in {re.escape(path)}: .*whole epoch"):
      next(p)
    p.close()


def test_one_usable_record_is_enough(tmp_path):
  """The guard counts bad records in a row: one good document among 60 bad ones, wherever
  the shuffle puts it, feeds the training pipeline for many epochs, with the skips counted."""
  path = write_jsonl(tmp_path / "mostly_bad.jsonl", ["the only good one"], [b"not json"] * 60)
  p = make_pipeline(path, seq_len=32, batch_size=2, shard_index=0, shard_count=1)
  rows = [s for b in take(p, 10) for s in segments(b)]
  assert set(rows) == {"the only good one"} and len(rows) == 20
  assert p.stats.skipped["bad_json"] >= 60 * 19


def test_corrupt_parquet_shard_skip_or_error(tmp_path):
  docs = make_docs(20, seed=2)
  write_parquet(tmp_path / "a-good.parquet", docs)
  (tmp_path / "b-bad.parquet").write_bytes(b"PAR1 this is not really parquet" * 10)
  pattern = str(tmp_path / "*.parquet")
  with pytest.warns(BadShardWarning, match="b-bad.parquet"):
    p = make_eval_pipeline(pattern, seq_len=128, batch_size=4, shard_index=0, shard_count=1)
  assert sorted(s for b in p for s in segments(b)) == sorted(docs)
  assert [os.path.basename(f) for f, _ in p.stats.bad_shards] == ["b-bad.parquet"]
  with pytest.raises(DataError, match="b-bad.parquet"):
    make_pipeline(pattern, on_bad_shard="error", shard_index=0, shard_count=1)
  (tmp_path / "c-nocol.parquet").write_bytes(b"")
  pq.write_table(pa.table({"body": ["x"]}), str(tmp_path / "c-nocol.parquet"))
  with pytest.raises(DataError, match="c-nocol.parquet.*text"):
    make_pipeline(str(tmp_path / "c-*.parquet"), on_bad_shard="error", shard_index=0, shard_count=1)
  (tmp_path / "only-bad.parquet").write_bytes(b"garbage")
  with pytest.warns(BadShardWarning), pytest.raises(DataError, match="no documents"):
    make_pipeline(str(tmp_path / "only-bad.parquet"), shard_index=0, shard_count=1)


def test_shard_vanishing_at_read_time(tmp_path):
  docs = make_docs(20, seed=5)
  path = write_jsonl(tmp_path / "gone.jsonl", docs)
  p = make_eval_pipeline(
    path, seq_len=128, batch_size=4, shard_index=0, shard_count=1, read_threads=1
  )
  os.remove(path)
  with pytest.warns(BadShardWarning, match="gone.jsonl"):  # all gone: an error, not 0 batches
    with pytest.raises(DataError, match=r"no usable document in .*gone.jsonl: .*\(unreadable 20 "):
      list(p)
  assert p.stats.skipped == {"unreadable": 20}
  assert [os.path.basename(f) for f, _ in p.stats.bad_shards] == ["gone.jsonl"]
  write_jsonl(tmp_path / "gone.jsonl", docs)
  p = make_eval_pipeline(
    path, seq_len=128, batch_size=4, shard_index=0, shard_count=1, on_bad_shard="error"
  )
  os.remove(path)
  with pytest.raises(DataError, match="gone.jsonl"):
    next(p)


def test_missing_files_clear_error(tmp_path):
  with pytest.raises(DataError, match="nothing-here"):
    make_pipeline(str(tmp_path / "nothing-here-*.parquet"), shard_index=0, shard_count=1)
  with pytest.raises(DataError, match="missing.jsonl"):
    make_pipeline([str(tmp_path / "missing.jsonl")], shard_index=0, shard_count=1)


# ---------------------------------------------------------------- demo corpus


def test_demo_corpus():
  path = demo_corpus_path()
  assert os.path.exists(path) and os.path.getsize(path) <= 3 * 2**20
  assert os.path.exists(os.path.join(os.path.dirname(path), "SOURCE.md"))
  docs = list(read_documents(path, "text"))
  assert len(docs) > 10000 and docs[0] == "The Jargon File"
  tr = make_demo_pipeline("train", seq_len=256, batch_size=2, shard_index=0, shard_count=1)
  b = next(tr)
  assert b["ids"].shape == (2, 256)
  assert tr.stats.documents_total == len(docs) - len(docs) // 20
  ev = make_demo_pipeline(
    "eval", seq_len=256, batch_size=2, max_batches=3, shard_index=0, shard_count=1
  )
  ev_docs = [s for b in ev for s in segments(b)]
  assert ev_docs[0] == docs[19]
