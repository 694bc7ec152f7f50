import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np
import pytest

from lca_jax import vocab
from lca_jax.vocab import (
  BYTE_OFFSET,
  EN_ID,
  EOS_ID,
  EOT_ID,
  NUM_BASE_TOKENS,
  PAD_ID,
  UNK_ID,
  StreamDecoder,
  decode,
  encode,
  encode_bytes,
  ids_to_bytes,
)

TEXTS = [
  "",
  "hello",
  "héllo wörld",
  "日本語のテキスト",
  "emoji 🎉🚀 mix ∑ x²",
  "tab\tnew\nline\x00nul",
]


def test_constants_match_byt5_layout():
  assert (PAD_ID, EOS_ID, UNK_ID, BYTE_OFFSET) == (0, 1, 2, 3)
  assert (EN_ID, EOT_ID, NUM_BASE_TOKENS) == (259, 260, 261)
  ids = encode_bytes(bytes(range(256)))
  assert ids.dtype == np.int32 and ids.min() == 3 and ids.max() == 258


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text):
  ids = encode(text)
  assert ids.dtype == np.int32
  assert len(ids) == len(text.encode("utf-8"))
  assert decode(ids) == text
  ids_eos = encode(text, add_eos=True)
  assert ids_eos[-1] == EOS_ID and decode(ids_eos) == text
  assert decode(ids_eos, specials="render") == text + "<eos>"
  assert ids_to_bytes(ids_eos) == text.encode("utf-8")


def test_invalid_bytes_and_non_byte_ids_never_crash():
  bad = encode_bytes(b"ok \xff\xfe \xe6\x97 end")  # invalid + truncated multi-byte
  s = decode(bad)
  assert s.startswith("ok ") and s.endswith(" end") and "\ufffd" in s
  weird = [PAD_ID, -5, 10_000, EN_ID, EOT_ID, UNK_ID] + encode("é").tolist() + [EOS_ID, 999]
  assert decode(weird) == "é"
  assert decode(weird, specials="render") == "<pad><id:-5><id:10000><en><eot><unk>é<eos><id:999>"
  assert decode(np.array([[104, 105], [EOS_ID, 104]]), stop_at_eos=True) == "ef"
  assert decode([]) == ""
  with pytest.raises(ValueError):
    decode([3], specials="bogus")


def test_stream_decoder_never_splits_a_character():
  text = "aé日🎉b" * 20 + "z"
  ids = encode(text).tolist()
  rng = np.random.default_rng(0)
  for _ in range(20):
    dec = StreamDecoder()
    out, i = [], 0
    while i < len(ids):
      n = int(rng.integers(1, 5))
      piece = dec.push(ids[i : i + n])
      i += n
      assert "\ufffd" not in piece  # never a broken half character
      out.append(piece)
      # every prefix emitted so far is a prefix of the text made of whole characters
      assert text.startswith("".join(out))
    out.append(dec.flush())
    assert "".join(out) == text
  # one byte at a time, with specials interleaved (dropped)
  dec = StreamDecoder()
  out = "".join(dec.push([t, PAD_ID]) for t in ids) + dec.flush()
  assert out == text
  # pending incomplete character at flush -> replacement char, then clean reset
  dec = StreamDecoder()
  assert dec.push(encode("日")[:2]) == ""
  assert dec.flush() == "\ufffd"
  assert dec.push(encode("ok")) == "ok"


def test_stream_decoder_render_specials():
  dec = StreamDecoder(specials="render")
  assert dec.push(encode("a").tolist() + [EOS_ID]) == "a<eos>"
  assert dec.push(encode("é")[:1]) == ""
  assert dec.push(encode("é")[1:]) == "é"
  assert vocab.token_str(EOT_ID) == "<eot>"
