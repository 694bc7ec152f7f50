"""Byte vocabulary, ByT5-compatible.

Layout (``NUM_BASE_TOKENS = 261`` ids)::

    0        <pad>   PAD_ID
    1        <eos>   EOS_ID
    2        <unk>   UNK_ID
    3..258   bytes   byte b -> b + BYTE_OFFSET (ids 0..258 are exactly ByT5's)
    259      <en>    EN_ID
    260      <eot>   EOT_ID

Decoding never raises on bad input with the default ``errors="replace"``: byte ids
are joined and decoded as UTF-8 (invalid sequences become U+FFFD); any other id
(specials, negative or out-of-range ids) is *dropped* by default
(``specials="drop"``) or *rendered* as a tag such as ``<eos>`` / ``<id:999>``
(``specials="render"``).
"""

from __future__ import annotations

import codecs
from typing import Iterable

import numpy as np

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
BYTE_OFFSET = 3
NUM_BYTES = 256
EN_ID = 259
EOT_ID = 260
NUM_BASE_TOKENS = 261

SPECIAL_TOKENS = {PAD_ID: "<pad>", EOS_ID: "<eos>", UNK_ID: "<unk>", EN_ID: "<en>", EOT_ID: "<eot>"}
TOKEN_TO_ID = {v: k for k, v in SPECIAL_TOKENS.items()}

__all__ = [
  "PAD_ID",
  "EOS_ID",
  "UNK_ID",
  "BYTE_OFFSET",
  "NUM_BYTES",
  "EN_ID",
  "EOT_ID",
  "NUM_BASE_TOKENS",
  "SPECIAL_TOKENS",
  "encode",
  "encode_bytes",
  "decode",
  "ids_to_bytes",
  "is_byte_id",
  "token_str",
  "StreamDecoder",
]


def encode_bytes(b: bytes, add_eos: bool = False) -> np.ndarray:
  """bytes -> int32 ids (byte + 3), optionally followed by EOS_ID."""
  ids = np.frombuffer(bytes(b), dtype=np.uint8).astype(np.int32) + BYTE_OFFSET
  if add_eos:
    ids = np.concatenate([ids, np.array([EOS_ID], dtype=np.int32)])
  return ids


def encode(text: str, add_eos: bool = False) -> np.ndarray:
  """str -> int32 ids of its UTF-8 bytes (lone surrogates are encoded as '?')."""
  return encode_bytes(text.encode("utf-8", errors="replace"), add_eos=add_eos)


def _as_int_array(ids) -> np.ndarray:
  return np.asarray(ids, dtype=np.int64).reshape(-1)


def is_byte_id(ids) -> np.ndarray:
  a = _as_int_array(ids)
  return (a >= BYTE_OFFSET) & (a < BYTE_OFFSET + NUM_BYTES)


def token_str(i: int) -> str:
  """Printable tag for a non-byte id: '<eos>', '<en>', '<id:1234>'."""
  return SPECIAL_TOKENS.get(int(i), f"<id:{int(i)}>")


def ids_to_bytes(ids) -> bytes:
  """Byte ids -> raw bytes; every non-byte id (specials, out of range) is dropped."""
  a = _as_int_array(ids)
  a = a[(a >= BYTE_OFFSET) & (a < BYTE_OFFSET + NUM_BYTES)]
  return (a - BYTE_OFFSET).astype(np.uint8).tobytes()


def decode(ids, errors: str = "replace", specials: str = "drop", stop_at_eos: bool = False) -> str:
  """ids -> str.

  Args:
    ids: any int sequence / array (any shape is flattened).
    errors: passed to ``bytes.decode`` ("replace" default: never raises).
    specials: "drop" (default) removes every non-byte id; "render" writes it as
      a tag (``<eos>``, ``<pad>``, ``<id:N>`` for unknown ids) at its position.
    stop_at_eos: truncate at the first EOS_ID.
  """
  a = _as_int_array(ids)
  if stop_at_eos:
    hits = np.nonzero(a == EOS_ID)[0]
    if hits.size:
      a = a[: hits[0]]
  if specials == "drop":
    return ids_to_bytes(a).decode("utf-8", errors=errors)
  if specials != "render":
    raise ValueError(f"specials must be 'drop' or 'render', got {specials!r}")
  out, run = [], []
  for i in a.tolist():
    if BYTE_OFFSET <= i < BYTE_OFFSET + NUM_BYTES:
      run.append(i - BYTE_OFFSET)
    else:
      if run:
        out.append(bytes(run).decode("utf-8", errors=errors))
        run = []
      out.append(token_str(i))
  if run:
    out.append(bytes(run).decode("utf-8", errors=errors))
  return "".join(out)


class StreamDecoder:
  """Incremental ids -> text for streaming generation.

  ``push(ids)`` returns only complete characters: the trailing bytes of an
  unfinished multi-byte UTF-8 character are held back until the next push.
  Invalid sequences become U+FFFD (never raises).  ``flush()`` emits whatever is
  pending (an unfinished character becomes U+FFFD) and resets the decoder.
  Non-byte ids follow ``specials`` like :func:`decode`; with "render", pending
  bytes are flushed before the tag so output order is preserved.
  """

  def __init__(self, specials: str = "drop", errors: str = "replace"):
    if specials not in ("drop", "render"):
      raise ValueError(f"specials must be 'drop' or 'render', got {specials!r}")
    self.specials = specials
    self.errors = errors
    self._dec = codecs.getincrementaldecoder("utf-8")(errors=errors)

  def push(self, ids: Iterable[int] | int) -> str:
    a = _as_int_array(ids)
    if self.specials == "drop":
      return self._dec.decode(ids_to_bytes(a), final=False)
    out, run = [], []
    for i in a.tolist():
      if BYTE_OFFSET <= i < BYTE_OFFSET + NUM_BYTES:
        run.append(i - BYTE_OFFSET)
      else:
        out.append(self._dec.decode(bytes(run), final=True))
        run = []
        self._dec.reset()
        out.append(token_str(i))
    out.append(self._dec.decode(bytes(run), final=False))
    return "".join(out)

  def flush(self) -> str:
    text = self._dec.decode(b"", final=True)
    self._dec.reset()
    return text

  def reset(self) -> None:
    self._dec.reset()
