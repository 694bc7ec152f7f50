"""SFT examples as plain Python: prompt formats, rendering, loss masks and jsonl reading.

This module turns one JSON example into text or ids: ``format_prompt`` / ``format_prompt_ids``
(the evaluation prompt and its reference), ``encode_example`` (the ids and loss mask one
training example contributes), ``expand_qa`` (official CoQA records into one example per turn)
and ``read_jsonl``: plain Python and numpy over single examples.  The grain readers and the
checkpointable pipelines that pack encoded examples into batches are in :mod:`lca_jax.data.sft`.

Formats (``sft_format``), one JSON object per line of a ``.jsonl`` (or ``.jsonl.gz``) file:

``chat``           Tulu-3 SFT mix: ``{"messages": [{"role": "system"|"user"|"assistant",
                   "content": str}, ...]}``.  Rendered with the Tulu chat template as plain
                   text markers (no new vocabulary ids, so checkpoints stay convertible to the
                   upstream 261-id layout)::

                       <|system|>\\n{content}\\n
                       <|user|>\\n{content}\\n
                       <|assistant|>\\n{content}<eos>\\n      (no "\\n" after the last reply)

                   ``<eos>`` is the EOS_ID token (id 1), not text.  Loss is on every assistant
                   reply (its bytes and its <eos>); markers, system and user turns carry none.
``translation``    ``<spanish> {src} <translate to english> {tgt}<eos>``, loss on ``{tgt}<eos>``.
                   Fields: ``src``/``tgt`` (optional ``src_lang``/``tgt_lang``: codes or names,
                   default es -> en), or two language-code fields (``es``/``en``, ``fr``/``en``,
                   ...; the target is ``en`` unless ``tgt_lang`` says otherwise), or Opus-100's
                   ``{"translation": {"en": ..., "es": ...}}``.
``summarization``  ``{article} <summarize> {summary}<eos>``, loss on ``{summary}<eos>``.  Fields
                   ``article`` (or ``document``/``text``) and ``summary`` (or ``highlights``, as in
                   CNN/DailyMail).
``qa``             CoQA as chat: the first user turn is ``{story}\\n\\n{question 1}``, earlier
                   question/answer turns are user/assistant turns, the target is the last answer.
                   Fields: ``story``/``context``, ``question``, ``answer`` (str) or ``answers``
                   (list, first is the target), optional ``history`` ([[q, a], ...] or
                   [{"question", "answer"}]).  An official CoQA record (``story``, ``questions``,
                   ``answers``) is expanded into one example per turn (``expand_qa``).
``ifeval``         ``{"prompt": str, ...}``: one user turn; no target (evaluation only).

``format_prompt(example, fmt)`` returns ``(prompt_text, target_text)``: the text the model is
given at evaluation time (ending right where the target starts; for chat, after
``<|assistant|>\\n``) and the reference (without <eos>).

Too long examples (``seq_len``): for the single-turn formats the long source field (article,
src, story) is cut, keeping its beginning, so the prompt's markers and the target stay; if the
target itself does not fit, the sequence is cut at ``seq_len``.  Chat examples are cut at
``seq_len`` (as open-instruct does); an example left with no target byte is skipped (counted as
``too_long``; a conversation without any assistant turn as ``no_target``).  UTF-8 characters are never split by a cut.
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from lca_jax import vocab
from lca_jax.data.errors import DataError
from lca_jax.data.readers import read_file_bytes
from lca_jax.errors import LcaError

SFT_FORMATS = ("chat", "translation", "summarization", "qa")
PROMPT_FORMATS = SFT_FORMATS + ("ifeval",)

SYSTEM, USER, ASSISTANT = "<|system|>\n", "<|user|>\n", "<|assistant|>\n"
ROLE_MARKERS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
SUMMARIZE = " <summarize> "
LANGUAGES = {
  "en": "english",
  "es": "spanish",
  "fr": "french",
  "de": "german",
  "it": "italian",
  "pt": "portuguese",
  "nl": "dutch",
  "ru": "russian",
  "zh": "chinese",
  "ja": "japanese",
  "ar": "arabic",
  "hi": "hindi",
  "ko": "korean",
  "pl": "polish",
  "tr": "turkish",
}


class ExampleError(LcaError, ValueError):
  """An example that does not have the fields its format needs."""


# ---- text helpers ---------------------------------------------------------------------------
def _cut_utf8(b: bytes, n: int) -> bytes:
  """The first <= n bytes of ``b`` without splitting a UTF-8 character."""
  if n >= len(b):
    return b
  n = max(n, 0)
  while n > 0 and (b[n] & 0xC0) == 0x80:
    n -= 1
  return b[:n]


def _truncate_text(text: str, max_bytes: int | None) -> str:
  if max_bytes is None:
    return text
  b = text.encode("utf-8", errors="replace")
  return _cut_utf8(b, max_bytes).decode("utf-8", errors="replace") if len(b) > max_bytes else text


def _nbytes(s: str) -> int:
  return len(s.encode("utf-8", errors="replace"))


def _field(ex: dict, names: Sequence[str], what: str) -> str:
  for k in names:
    v = ex.get(k)
    if isinstance(v, str):
      return v
    if k == "highlights" and isinstance(v, list) and v and all(isinstance(x, str) for x in v):
      return "\n".join(v)
  raise ExampleError(
    f"needs a string field {' or '.join(repr(n) for n in names)} ({what}); got keys {sorted(ex)}"
  )


def _lang(code_or_name: str) -> str:
  s = str(code_or_name).strip().lower()
  return LANGUAGES.get(s, s)


# ---- single-turn formats: (prompt head, long field, prompt tail, target) ----------------------
def _translation_parts(ex: dict):
  if isinstance(ex.get("translation"), dict):
    ex = {**ex["translation"], **{k: v for k, v in ex.items() if k != "translation"}}
  if "src" in ex or "tgt" in ex:
    src, tgt = _field(ex, ("src",), "source text"), _field(ex, ("tgt",), "target text")
    src_lang, tgt_lang = ex.get("src_lang", "es"), ex.get("tgt_lang", "en")
  else:
    tgt_lang = ex.get("tgt_lang", "en")
    codes = [k for k in ex if k in LANGUAGES and isinstance(ex[k], str)]
    if tgt_lang not in codes or len(codes) != 2:
      raise ExampleError(
        "needs fields src/tgt, two language-code fields (e.g. es/en) or a "
        f"'translation' dict; got keys {sorted(ex)}"
      )
    src_lang = ex.get("src_lang") or next(c for c in codes if c != tgt_lang)
    src, tgt = ex[src_lang], ex[tgt_lang]
  return f"<{_lang(src_lang)}> ", src, f" <translate to {_lang(tgt_lang)}> ", tgt


def _summarization_parts(ex: dict):
  article = _field(ex, ("article", "document", "text"), "the article")
  summary = _field(ex, ("summary", "highlights"), "the reference summary")
  return "", article, SUMMARIZE, summary


def _single_turn(head: str, body: str, tail: str, target: str, max_prompt_bytes: int | None):
  if max_prompt_bytes is not None:
    room = max_prompt_bytes - _nbytes(head) - _nbytes(tail)
    if room < 0:
      raise ExampleError(
        f"max_prompt_bytes={max_prompt_bytes} leaves no room for the prompt markers"
      )
    body = _truncate_text(body, room)
  return head + body + tail, target


# ---- chat ---------------------------------------------------------------------------------
def _check_messages(msgs) -> list[dict]:
  if not isinstance(msgs, list) or not msgs:
    raise ExampleError("needs a non-empty 'messages' list of {role, content}")
  for m in msgs:
    if (
      not isinstance(m, dict)
      or m.get("role") not in ROLE_MARKERS
      or not isinstance(m.get("content"), str)
    ):
      raise ExampleError(
        f"bad message {str(m)[:80]!r}: needs role system|user|assistant and a string content"
      )
  return msgs


def render_chat(messages: list[dict]) -> list[tuple[np.ndarray, bool]]:
  """Tulu template as (ids, is_target) spans; assistant replies (+ eos) are the targets."""
  out = []
  last = len(messages) - 1
  for i, m in enumerate(_check_messages(messages)):
    marker = ROLE_MARKERS[m["role"]]
    if m["role"] == "assistant":
      out.append((vocab.encode(marker), False))
      out.append((vocab.encode(m["content"], add_eos=True), True))
      if i != last:
        out.append((vocab.encode("\n"), False))
    else:
      out.append((vocab.encode(marker + m["content"] + "\n"), False))
  return out


def chat_prompt_ids(messages: list[dict]) -> np.ndarray:
  """Ids of ``messages`` in the chat template followed by the generation prompt
  ``<|assistant|>\n`` (earlier replies end with EOS_ID, as in training)."""
  spans = render_chat(messages) if messages else []
  ids = [s for s, _ in spans] + [vocab.encode(ASSISTANT)]
  return np.concatenate(ids).astype(np.int32)


def _qa_messages(ex: dict, max_story_bytes: int | None = None):
  story = _field(ex, ("story", "context"), "the story")
  question = _field(ex, ("question",), "the question")
  hist = ex.get("history") or []
  turns = []
  for h in hist:
    if isinstance(h, dict):
      q, a = h.get("question"), h.get("answer")
    elif isinstance(h, (list, tuple)) and len(h) == 2:
      q, a = h
    else:
      q = a = None
    if not isinstance(q, str) or not isinstance(a, str):
      raise ExampleError("history must be [[question, answer], ...] or [{question, answer}, ...]")
    turns.append((q, a))
  story = _truncate_text(story, max_story_bytes)
  msgs = []
  for i, (q, a) in enumerate(turns + [(question, None)]):
    content = f"{story}\n\n{q}" if i == 0 else q
    msgs.append({"role": "user", "content": content})
    if a is not None:
      msgs.append({"role": "assistant", "content": a})
  return msgs, qa_references(ex)


def qa_references(ex: dict) -> list[str]:
  """Gold answers of a QA example (``answer`` and/or ``answers``)."""
  golds = []
  if isinstance(ex.get("answer"), str):
    golds.append(ex["answer"])
  if isinstance(ex.get("answers"), list):
    golds += [a for a in ex["answers"] if isinstance(a, str)]
  if not golds:
    raise ExampleError("needs 'answer' (str) or 'answers' (list of str)")
  return golds


def expand_qa(record: dict) -> list[dict]:
  """An official CoQA record (story, questions, answers, additional_answers) -> one flat example
  per turn with the gold history; any other record is returned as is."""
  if not isinstance(record.get("questions"), list):
    return [record]
  story = _field(record, ("story",), "the story")
  qs, ans = record["questions"], record.get("answers")
  if not isinstance(ans, list) or len(ans) != len(qs):
    raise ExampleError("a CoQA record needs 'answers' with one entry per question")
  extra = record.get("additional_answers") or {}
  text = lambda x: x.get("input_text") if isinstance(x, dict) else x  # noqa: E731
  out, hist = [], []
  for i, (q, a) in enumerate(zip(qs, ans)):
    q, a = text(q), text(a)
    if not isinstance(q, str) or not isinstance(a, str):
      raise ExampleError(f"CoQA turn {i + 1}: question/answer must have 'input_text'")
    golds = [a] + [text(v[i]) for v in extra.values() if isinstance(v, list) and i < len(v)]
    out.append(
      {
        "story": story,
        "question": q,
        "answers": [g for g in golds if isinstance(g, str)],
        "history": list(hist),
        "id": record.get("id"),
        "turn": i + 1,
      }
    )
    hist.append([q, a])
  return out


# ---- public: prompt / encode --------------------------------------------------------------
def format_prompt_ids(
  example: dict, sft_format: str, max_prompt_bytes: int | None = None
) -> tuple[np.ndarray, str]:
  """Like :func:`format_prompt`, but the prompt as exact vocabulary ids (a chat history holds
  the EOS_ID that ends each earlier assistant reply, which has no text form)."""
  if not isinstance(example, dict):
    raise ExampleError("an example must be a JSON object")
  if sft_format in ("translation", "summarization"):
    parts = (
      _translation_parts(example) if sft_format == "translation" else _summarization_parts(example)
    )
    prompt, target = _single_turn(*parts, max_prompt_bytes)
    return vocab.encode(prompt), target
  if sft_format == "chat":
    msgs = _check_messages(example.get("messages"))
    if msgs[-1]["role"] != "assistant":
      return _keep_last(chat_prompt_ids(msgs), max_prompt_bytes), ""
    return _keep_last(chat_prompt_ids(msgs[:-1]), max_prompt_bytes), msgs[-1]["content"]
  if sft_format == "qa":
    msgs, golds = _qa_messages(example)
    prompt = chat_prompt_ids(msgs)
    if max_prompt_bytes is not None and len(prompt) > max_prompt_bytes:
      story = _nbytes(_field(example, ("story", "context"), "the story"))
      msgs, _ = _qa_messages(example, max(0, story - (len(prompt) - max_prompt_bytes)))
      prompt = chat_prompt_ids(msgs)
    return _keep_last(prompt, max_prompt_bytes), golds[0]
  if sft_format == "ifeval":
    p = _field(example, ("prompt",), "the instruction prompt")
    return _keep_last(chat_prompt_ids([{"role": "user", "content": p}]), max_prompt_bytes), ""
  raise ValueError(f"unknown sft_format {sft_format!r}; choose one of {', '.join(PROMPT_FORMATS)}")


def format_prompt(
  example: dict, sft_format: str, max_prompt_bytes: int | None = None
) -> tuple[str, str]:
  """(prompt_text, target_text) of ``example`` in ``sft_format``; the target has no <eos> ("" for
  ifeval).  ``max_prompt_bytes`` cuts the long source field (article, src, story; for chat the
  start of the prompt) so the prompt fits.  An <eos> inside a chat history is written as the
  tag ``<eos>``; use :func:`format_prompt_ids` for exact ids."""
  ids, target = format_prompt_ids(example, sft_format, max_prompt_bytes)
  return vocab.decode(ids, specials="render"), target


def _keep_last(ids: np.ndarray, max_bytes: int | None) -> np.ndarray:
  """The last ``max_bytes`` ids, not starting inside a UTF-8 character."""
  if max_bytes is not None and len(ids) > max_bytes:
    ids = ids[len(ids) - max_bytes :]
    while (
      len(ids)
      and vocab.is_byte_id(ids[:1])[0]
      and ((int(ids[0]) - vocab.BYTE_OFFSET) & 0xC0) == 0x80
    ):
      ids = ids[1:]
  return np.asarray(ids, np.int32)


def encode_example(
  example: dict, sft_format: str, seq_len: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """(ids, loss_mask) int32 [L] with L <= seq_len; raises ExampleError for a malformed example
  and returns None for one that has no target byte left after truncation."""
  if sft_format not in SFT_FORMATS:
    raise ValueError(f"unknown sft_format {sft_format!r}; choose one of {', '.join(SFT_FORMATS)}")
  if sft_format == "chat":
    msgs = _check_messages(example.get("messages") if isinstance(example, dict) else None)
    spans = render_chat(msgs)
  else:
    prompt, target = format_prompt_ids(example, sft_format)
    tgt = vocab.encode(target, add_eos=True)
    if seq_len is not None and len(prompt) + len(tgt) > seq_len:
      budget = max(seq_len - len(tgt), min(len(prompt), seq_len // 2))
      try:
        prompt, _ = format_prompt_ids(example, sft_format, max_prompt_bytes=budget)
      except ExampleError:
        pass
    spans = [(prompt, False), (tgt, True)]
  ids = np.concatenate([s for s, _ in spans]).astype(np.int32)
  mask = np.concatenate([np.full(len(s), int(t), np.int32) for s, t in spans])
  if seq_len is not None and len(ids) > seq_len:
    ids, mask = ids[:seq_len], mask[:seq_len]
  if not mask.any():
    return None
  return ids, mask


# ---- reading ------------------------------------------------------------------------------
def line_number(path: str, byte_offset: int) -> int:
  """1-based line number of ``byte_offset`` in ``path`` (decompressed for .gz)."""
  return read_file_bytes(path)[:byte_offset].count(b"\n") + 1


def read_jsonl(path: str):
  """Yields (line_number, object) for each non-blank line; a malformed line raises DataError
  naming the file and line."""
  data = read_file_bytes(path)
  for i, line in enumerate(data.split(b"\n"), start=1):
    if not line.strip():
      continue
    try:
      obj = json.loads(line)
    except (UnicodeDecodeError, ValueError) as e:
      raise DataError(f"{path}:{i}: malformed JSON line ({e})") from None
    if not isinstance(obj, dict):
      raise DataError(f"{path}:{i}: expected a JSON object, got {type(obj).__name__}")
    yield i, obj
