"""SFT data: prompt formats, loss masks (no loss / gradient on prompt bytes), the SFT pipeline."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json

import numpy as np
import pytest

from lca_jax import vocab
from lca_jax.data import sft, sft_format
from lca_jax.data.errors import DataError

CHAT = {
  "messages": [
    {"role": "system", "content": "Be nice."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Ciao ü"},
  ]
}


def write_jsonl(path, records, raw=()):
  with open(path, "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
    for line in raw:
      f.write(line + "\n")
  return str(path)


def chat_records(n):
  return [
    {
      "messages": [
        {"role": "user", "content": f"question {i} " + "x" * (i % 5)},
        {"role": "assistant", "content": f"answer {i}"},
      ]
    }
    for i in range(n)
  ]


# ---- formats ------------------------------------------------------------------------------
def test_format_prompt_every_format():
  assert sft_format.format_prompt({"es": "hola", "en": "hello"}, "translation") == (
    "<spanish> hola <translate to english> ",
    "hello",
  )
  assert sft_format.format_prompt(
    {"src": "salut", "tgt": "hi", "src_lang": "fr"}, "translation"
  ) == ("<french> salut <translate to english> ", "hi")
  assert sft_format.format_prompt({"translation": {"en": "hi", "fr": "salut"}}, "translation")[
    0
  ] == ("<french> salut <translate to english> ")
  assert sft_format.format_prompt(
    {"article": "Long text.", "highlights": "Short."}, "summarization"
  ) == ("Long text. <summarize> ", "Short.")
  assert sft_format.format_prompt({"article": "A", "summary": "B"}, "summarization") == (
    "A <summarize> ",
    "B",
  )
  assert sft_format.format_prompt(CHAT, "chat") == (
    "<|system|>\nBe nice.\n<|user|>\nHi\n<|assistant|>\nHello!<eos>\n<|user|>\nBye\n<|assistant|>\n",
    "Ciao ü",
  )
  qa = {
    "story": "Tom has a ball.",
    "question": "What?",
    "answers": ["a ball", "ball"],
    "history": [["Who?", "Tom"]],
  }
  assert sft_format.format_prompt(qa, "qa") == (
    "<|user|>\nTom has a ball.\n\nWho?\n<|assistant|>\nTom<eos>\n<|user|>\nWhat?\n<|assistant|>\n",
    "a ball",
  )
  assert sft_format.format_prompt({"prompt": "Write."}, "ifeval") == (
    "<|user|>\nWrite.\n<|assistant|>\n",
    "",
  )
  ids, _ = sft_format.format_prompt_ids(qa, "qa")
  assert (ids == vocab.EOS_ID).sum() == 1  # the earlier reply's eos is a real EOS id


def test_format_prompt_truncates_the_source_field():
  ex = {"article": "é" * 50, "summary": "short"}
  p, t = sft_format.format_prompt(ex, "summarization", max_prompt_bytes=20)
  assert t == "short" and p.endswith(" <summarize> ")
  assert len(p.encode()) <= 20 and "\ufffd" not in p  # no split UTF-8 character


def test_expand_coqa_record():
  rec = {
    "story": "S.",
    "questions": [{"input_text": "q1"}, {"input_text": "q2"}],
    "answers": [{"input_text": "a1"}, {"input_text": "a2"}],
    "additional_answers": {"0": [{"input_text": "b1"}, {"input_text": "b2"}]},
  }
  turns = sft_format.expand_qa(rec)
  assert [t["question"] for t in turns] == ["q1", "q2"]
  assert turns[1]["answers"] == ["a2", "b2"] and turns[1]["history"] == [["q1", "a1"]]


@pytest.mark.parametrize(
  "bad,fmt",
  [
    ({"messages": [{"role": "bot", "content": "x"}]}, "chat"),
    ({"article": "x"}, "summarization"),
    ({"de": "x", "fr": "y"}, "translation"),
  ],
)
def test_bad_examples_raise(bad, fmt):
  with pytest.raises(sft_format.ExampleError):
    sft_format.format_prompt(bad, fmt)


# ---- masks --------------------------------------------------------------------------------
def test_chat_mask_covers_exactly_the_replies_and_their_eos():
  ids, mask = sft_format.encode_example(CHAT, "chat")
  assert vocab.decode(ids[mask == 1], specials="render") == "Hello!<eos>Ciao ü<eos>"
  prompt_part = vocab.decode(ids[mask == 0], specials="render")
  assert "Hello" not in prompt_part and prompt_part.count("<|assistant|>") == 2
  assert ids[-1] == vocab.EOS_ID and mask[-1] == 1


@pytest.mark.parametrize(
  "fmt,ex",
  [
    ("translation", {"es": "hola", "en": "hello"}),
    ("summarization", {"article": "Some words.", "summary": "Few."}),
  ],
)
def test_single_turn_mask(fmt, ex):
  ids, mask = sft_format.encode_example(ex, fmt)
  prompt, target = sft_format.format_prompt(ex, fmt)
  n = len(prompt.encode())
  assert not mask[:n].any() and mask[n:].all()
  assert vocab.decode(ids[n:], specials="render") == target + "<eos>"


def test_long_examples_keep_their_target():
  ex = {"article": "word " * 100, "summary": "the gist"}
  ids, mask = sft_format.encode_example(ex, "summarization", seq_len=64)
  assert len(ids) <= 64
  assert vocab.decode(ids[mask == 1], specials="render") == "the gist<eos>"
  assert " <summarize> " in vocab.decode(ids)
  long_chat = {
    "messages": [{"role": "user", "content": "q" * 100}, {"role": "assistant", "content": "a"}]
  }
  assert (
    sft_format.encode_example(long_chat, "chat", seq_len=64) is None
  )  # nothing to learn: skipped


# ---- pipeline -----------------------------------------------------------------------------
def _pipe(path, **kw):
  kw.setdefault("shard_index", 0)
  kw.setdefault("shard_count", 1)
  return sft.make_sft_pipeline(
    path, kw.pop("fmt", "chat"), kw.pop("seq_len", 64), kw.pop("batch_size", 2), **kw
  )


def test_pipeline_batches_masks_and_segments(tmp_path):
  path = write_jsonl(tmp_path / "c.jsonl", chat_records(7))
  batches = list(
    _pipe(path, shuffle=False, num_epochs=1, drop_remainder=False, pad_final_batch=True)
  )
  expect = {
    vocab.decode(sft_format.encode_example(r, "chat")[0], specials="render")
    for r in chat_records(7)
  }
  seen = set()
  for b in batches:
    assert set(b) == {"ids", "segment_ids", "positions", "loss_mask"}
    assert all(v.dtype == np.int32 and v.shape == (2, 64) for v in b.values())
    assert not b["loss_mask"][b["segment_ids"] == 0].any()  # padding carries no loss
    for row in range(2):
      seg = b["segment_ids"][row]
      for s in range(1, seg.max() + 1):  # each example whole, its own document
        sel = seg == s
        assert (b["positions"][row][sel] == np.arange(sel.sum())).all()
        seen.add(vocab.decode(b["ids"][row][sel], specials="render"))
        m = b["loss_mask"][row][sel]
        assert vocab.decode(b["ids"][row][sel][m == 1], specials="render").startswith("answer")
  assert seen == expect
  single = list(_pipe(path, shuffle=False, num_epochs=1, drop_remainder=False, packing="single"))
  assert sum(int((b["segment_ids"].max(axis=1) > 0).sum()) for b in single) == 7
  assert all(b["segment_ids"].max() <= 1 for b in single)


def test_pipeline_state_roundtrip_and_sharding(tmp_path):
  path = write_jsonl(tmp_path / "c.jsonl", chat_records(20))
  p = _pipe(path, seed=3, shuffle=True)
  for _ in range(3):
    next(p)
  state = p.get_state()
  want = [next(p) for _ in range(4)]
  q = _pipe(path, seed=3, shuffle=True)
  q.set_state(json.loads(json.dumps(state)))
  got = [next(q) for _ in range(4)]
  for a, b in zip(want, got):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  docs = []
  for i in range(2):
    for b in _pipe(
      path, shuffle=False, num_epochs=1, drop_remainder=False, shard_index=i, shard_count=2
    ):
      for row in range(len(b["ids"])):
        docs += [
          vocab.decode(b["ids"][row][b["segment_ids"][row] == s])
          for s in range(1, b["segment_ids"][row].max() + 1)
        ]
  assert len(docs) == 20 and len(set(docs)) == 20


def test_malformed_lines_name_file_and_line(tmp_path):
  path = write_jsonl(tmp_path / "bad.jsonl", chat_records(2), raw=["", "{not json"])
  with pytest.raises(DataError, match=r"bad\.jsonl:4: malformed JSON"):
    list(_pipe(path, shuffle=False, num_epochs=1, drop_remainder=False))
  path2 = write_jsonl(tmp_path / "wrong.jsonl", [{"text": "pretraining doc"}])
  with pytest.raises(DataError, match=r"wrong\.jsonl:1: not a chat example"):
    _pipe(path2)
  p = _pipe(path, shuffle=False, num_epochs=1, drop_remainder=False, on_bad_record="skip")
  assert sum(int(b["segment_ids"].max(axis=1).sum()) for b in p) == 2  # the two good examples
  assert p.stats.skipped == {"bad_json": 1}
  with pytest.raises(DataError, match="unknown sft_format"):
    _pipe(path, fmt="poetry")


# ---- no loss and no gradient on prompt bytes ----------------------------------------------
def test_prompt_bytes_get_no_loss_and_no_gradient(tmp_path):
  import jax
  import jax.numpy as jnp
  from conftest import assert_close_rel, random_params, tiny_config

  from lca_jax.model.hierarchical import ByteLM
  from lca_jax.model.loss import compute_loss

  path = write_jsonl(tmp_path / "c.jsonl", [CHAT] + chat_records(3))
  batch = next(
    iter(
      _pipe(
        path, shuffle=False, num_epochs=1, drop_remainder=False, pad_final_batch=True, seq_len=96
      )
    )
  )
  cfg = tiny_config("lca_mbp")
  params = random_params(cfg)
  jb = {k: jnp.asarray(v) for k, v in batch.items()}
  fwd = jax.jit(
    lambda p, b: ByteLM(cfg).apply(
      {"params": p}, b["ids"], b["segment_ids"], b["positions"], train=False
    )
  )
  out = fwd(params, jb)
  logits = {"ntp_logits": out["ntp_logits"], "mbp_logits": out["mbp_logits"]}

  def loss_fn(lg, b):
    return compute_loss(cfg, {**out, **lg, "boundaries_st": None}, b, lambdas=(1.0, 2.0, 10.0))[0]

  grads = jax.jit(jax.grad(loss_fn))(logits, jb)
  mask, seg = batch["loss_mask"], batch["segment_ids"]
  for k, name in ((1, "ntp_logits"), (2, "mbp_logits")):
    g = np.abs(np.asarray(grads[name])).sum(-1)  # [B, T]
    tgt_mask = np.zeros_like(mask)
    tgt_mask[:, :-k] = mask[:, k:] * (seg[:, k:] == seg[:, :-k]) * (seg[:, :-k] > 0)
    assert (g[tgt_mask == 0] == 0).all(), name  # rows predicting prompt bytes / padding: exactly 0
    assert (g[tgt_mask == 1] > 0).all(), name

  # the loss does not depend on what the prompt bytes' targets are
  def masked_loss(ids):
    b = dict(jb, ids=ids)
    return float(compute_loss(cfg, {**out, "boundaries_st": None}, b)[0])

  ids2 = np.where(mask == 0, (batch["ids"] * 7 + 11) % 250 + 3, batch["ids"]) * (seg > 0)
  assert_close_rel(masked_loss(jnp.asarray(ids2, jnp.int32)), masked_loss(jb["ids"]), 1e-6)
