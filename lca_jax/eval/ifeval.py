"""IFEval (Zhou et al. 2023) checkers, strict and loose, re-implemented from the official rules.

Input records are the official ``input_data.jsonl`` lines: ``{"key", "prompt",
"instruction_id_list": [...], "kwargs": [{...}, ...]}`` (``None`` kwargs are ignored).

Implemented instruction ids (24 of the official 25)::

  keywords:existence  keywords:frequency  keywords:forbidden_words  keywords:letter_frequency
  length_constraints:number_words  length_constraints:number_sentences
  length_constraints:number_paragraphs  length_constraints:nth_paragraph_first_word
  detectable_content:number_placeholders  detectable_content:postscript
  detectable_format:number_bullet_lists  detectable_format:constrained_response
  detectable_format:number_highlighted_sections  detectable_format:multiple_sections
  detectable_format:json_format  detectable_format:title
  combination:two_responses  combination:repeat_prompt
  startend:end_checker  startend:quotation
  change_case:capital_word_frequency  change_case:english_capital  change_case:english_lowercase
  punctuation:no_comma

Not implemented: ``language:response_language`` (needs langdetect); such instructions are
counted as ``unsupported`` and left out of every accuracy.  Differences from the official code
(which needs nltk's punkt data and langdetect): sentences are split with the official
``split_into_sentences``-style regex rules instead of punkt; capital words are counted over
``\\w+`` tokens instead of ``nltk.word_tokenize``; english_capital / english_lowercase check the
case only, not the language.

Loose evaluation (official ``test_instruction_following_loose``): an instruction is followed if
any of 8 variants passes: the response, with its first line removed, last line removed, both
removed, and each of those four with every ``*`` deleted.  Strict: the response itself (empty
responses fail).
"""

from __future__ import annotations

import collections
import json
import re
from typing import Callable, Dict, List, Sequence

_REL_LESS, _REL_AT_LEAST = "less than", "at least"


def _compare(actual: int, relation: str, n: int) -> bool:
  if relation == _REL_LESS:
    return actual < n
  if relation == _REL_AT_LEAST:
    return actual >= n
  raise ValueError(f"unknown relation {relation!r} (expected 'less than' or 'at least')")


def count_words(text: str) -> int:
  return len(re.findall(r"\w+", text))


_ALPHA, _PREFIX, _SUFFIX = "([A-Za-z])", "(Mr|St|Mrs|Ms|Dr)[.]", "(Inc|Ltd|Jr|Sr|Co)"
_STARTERS = (
  r"(Mr|Mrs|Ms|Dr|Prof|Capt|Cpt|Lt|He\s|She\s|It\s|They\s|Their\s|Our\s|We\s|But\s|"
  r"However\s|That\s|This\s|Wherever)"
)
_ACRONYM, _WEBSITE, _DIGIT = (
  "([A-Z][.][A-Z][.](?:[A-Z][.])?)",
  "[.](com|net|org|io|gov|edu|me)",
  "([0-9])",
)


def split_sentences(text: str) -> List[str]:
  """Rule-based sentence splitter (abbreviations, acronyms, decimals, websites, ellipses)."""
  t = " " + text.replace("\n", " ") + "  "
  t = re.sub(_PREFIX, "\\1<prd>", t)
  t = re.sub(_WEBSITE, "<prd>\\1", t)
  t = re.sub(_DIGIT + "[.]" + _DIGIT, "\\1<prd>\\2", t)
  t = re.sub(r"\.{2,}", lambda m: "<prd>" * len(m.group(0)) + "<stop>", t)
  t = t.replace("Ph.D.", "Ph<prd>D<prd>")
  t = re.sub(r"\s" + _ALPHA + "[.] ", " \\1<prd> ", t)
  t = re.sub(_ACRONYM + " " + _STARTERS, "\\1<stop> \\2", t)
  t = re.sub(_ALPHA + "[.]" + _ALPHA + "[.]" + _ALPHA + "[.]", "\\1<prd>\\2<prd>\\3<prd>", t)
  t = re.sub(_ALPHA + "[.]" + _ALPHA + "[.]", "\\1<prd>\\2<prd>", t)
  t = re.sub(" " + _SUFFIX + "[.] " + _STARTERS, " \\1<stop> \\2", t)
  t = re.sub(" " + _SUFFIX + "[.]", " \\1<prd>", t)
  t = re.sub(" " + _ALPHA + "[.]", " \\1<prd>", t)
  for a, b in ((".\u201d", "\u201d."), ('."', '".'), ('!"', '"!'), ('?"', '"?')):
    t = t.replace(a, b)
  for p in ".?!":
    t = t.replace(p, p + "<stop>")
  t = t.replace("<prd>", ".")
  out = [s.strip() for s in t.split("<stop>")]
  return [s for s in out if s]


# ---- checkers: (response, kwargs) -> bool ------------------------------------------------------
def _existence(r, kw):
  return all(re.search(k, r, flags=re.IGNORECASE) for k in kw["keywords"])


def _frequency(r, kw):
  n = len(re.findall(kw["keyword"], r, flags=re.IGNORECASE))
  return _compare(n, kw["relation"], int(kw["frequency"]))


def _forbidden(r, kw):
  return not any(
    re.search(r"\b" + w + r"\b", r, flags=re.IGNORECASE) for w in kw["forbidden_words"]
  )


def _letter_frequency(r, kw):
  n = collections.Counter(r.lower())[kw["letter"].lower()]
  return _compare(n, kw["let_relation"], int(kw["let_frequency"]))


def _number_words(r, kw):
  return _compare(count_words(r), kw["relation"], int(kw["num_words"]))


def _number_sentences(r, kw):
  return _compare(len(split_sentences(r)), kw["relation"], int(kw["num_sentences"]))


def _number_paragraphs(r, kw):
  paras = re.split(r"\s?\*\*\*\s?", r)
  n = len(paras)
  for i, p in enumerate(paras):
    if not p.strip():
      if i in (0, len(paras) - 1):
        n -= 1
      else:
        return False
  return n == int(kw["num_paragraphs"])


def _nth_paragraph_first_word(r, kw):
  paras = re.split(r"\n\n", r)
  n = sum(1 for p in paras if p.strip())
  nth = int(kw["nth_paragraph"])
  if nth > n:
    return False
  para = paras[nth - 1].strip()
  if not para:
    return False
  word = para.split()[0].strip().lstrip("'").lstrip('"')
  first = ""
  for ch in word:
    if ch in {".", ",", "?", "!", "'", '"'}:
      break
    first += ch.lower()
  return n == int(kw["num_paragraphs"]) and first == kw["first_word"].lower()


def _placeholders(r, kw):
  return len(re.findall(r"\[.*?\]", r)) >= int(kw["num_placeholders"])


def _postscript(r, kw):
  marker = kw["postscript_marker"]
  low = r.lower()
  if marker == "P.P.S":
    pat = r"\s*p\.\s?p\.\s?s.*$"
  elif marker == "P.S.":
    pat = r"\s*p\.\s?s\..*$"
  else:
    pat = r"\s*" + marker.lower() + r".*$"
  return bool(re.findall(pat, low, flags=re.MULTILINE))


def _bullets(r, kw):
  n = len(re.findall(r"^\s*\*[^\*].*$", r, flags=re.MULTILINE))
  n += len(re.findall(r"^\s*-.*$", r, flags=re.MULTILINE))
  return n == int(kw["num_bullets"])


def _constrained(r, kw):
  r = r.strip()
  return any(c in r for c in ("My answer is yes.", "My answer is no.", "My answer is maybe."))


def _highlights(r, kw):
  n = sum(1 for h in re.findall(r"\*[^\n\*]*\*", r) if h.strip("*").strip())
  n += sum(1 for h in re.findall(r"\*\*[^\n\*]*\*\*", r) if h[2:-2].strip())
  return n >= int(kw["num_highlights"])


def _sections(r, kw):
  splitter = kw["section_spliter"].strip()
  parts = re.split(r"\s?" + splitter + r"\s?\d+\s?", r)
  return len(parts) - 1 >= int(kw["num_sections"])


def _json(r, kw):
  v = r.strip()
  for pre in ("```json", "```Json", "```JSON", "```"):
    if v.startswith(pre):
      v = v[len(pre) :]
      break
  if v.endswith("```"):
    v = v[:-3]
  try:
    json.loads(v.strip())
  except ValueError:
    return False
  return True


def _title(r, kw):
  return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", r))


def _two_responses(r, kw):
  parts = r.split("******")
  valid = []
  for i, p in enumerate(parts):
    if not p.strip():
      if i not in (0, len(parts) - 1):
        return False
    else:
      valid.append(p)
  return len(valid) == 2 and valid[0].strip() != valid[1].strip()


def _repeat_prompt(r, kw):
  return r.strip().lower().startswith(kw["prompt_to_repeat"].strip().lower())


def _end_checker(r, kw):
  return r.strip().strip('"').lower().endswith(kw["end_phrase"].strip().lower())


def _quotation(r, kw):
  v = r.strip()
  return len(v) > 1 and v[0] == '"' and v[-1] == '"'


def _capital_words(r, kw):
  n = sum(1 for w in re.findall(r"\w+", r) if w.isupper())
  return _compare(n, kw["capital_relation"], int(kw["capital_frequency"]))


def _all_capital(r, kw):
  return r.isupper()


def _all_lower(r, kw):
  return r.islower()


def _no_comma(r, kw):
  return "," not in r


CHECKERS: Dict[str, Callable[[str, dict], bool]] = {
  "keywords:existence": _existence,
  "keywords:frequency": _frequency,
  "keywords:forbidden_words": _forbidden,
  "keywords:letter_frequency": _letter_frequency,
  "length_constraints:number_words": _number_words,
  "length_constraints:number_sentences": _number_sentences,
  "length_constraints:number_paragraphs": _number_paragraphs,
  "length_constraints:nth_paragraph_first_word": _nth_paragraph_first_word,
  "detectable_content:number_placeholders": _placeholders,
  "detectable_content:postscript": _postscript,
  "detectable_format:number_bullet_lists": _bullets,
  "detectable_format:constrained_response": _constrained,
  "detectable_format:number_highlighted_sections": _highlights,
  "detectable_format:multiple_sections": _sections,
  "detectable_format:json_format": _json,
  "detectable_format:title": _title,
  "combination:two_responses": _two_responses,
  "combination:repeat_prompt": _repeat_prompt,
  "startend:end_checker": _end_checker,
  "startend:quotation": _quotation,
  "change_case:capital_word_frequency": _capital_words,
  "change_case:english_capital": _all_capital,
  "change_case:english_lowercase": _all_lower,
  "punctuation:no_comma": _no_comma,
}
UNSUPPORTED = ("language:response_language",)


def loose_variants(response: str) -> List[str]:
  lines = response.split("\n")
  first = "\n".join(lines[1:]).strip()
  last = "\n".join(lines[:-1]).strip()
  both = "\n".join(lines[1:-1]).strip()
  base = [response, first, last, both]
  return base + [v.replace("*", "") for v in base]


def check(
  instruction_id: str, response: str, kwargs: dict | None = None, loose: bool = False
) -> bool:
  """Is ``instruction_id`` (with ``kwargs``) followed by ``response``? KeyError if unsupported."""
  fn = CHECKERS[instruction_id]
  kw = {k: v for k, v in (kwargs or {}).items() if v is not None}
  variants = loose_variants(response) if loose else [response]
  return any(v.strip() and fn(v, kw) for v in variants)


def evaluate(records: Sequence[dict], responses: Sequence[str]) -> dict:
  """Prompt- and instruction-level accuracy x 100, strict and loose, over supported
  instructions; a prompt counts only if it has at least one supported instruction."""
  if len(records) != len(responses):
    raise ValueError(f"{len(responses)} responses for {len(records)} records")
  inst = {"strict": [0, 0], "loose": [0, 0]}
  prompt = {"strict": [0, 0], "loose": [0, 0]}
  unsupported = collections.Counter()
  per_type = collections.defaultdict(lambda: [0, 0])
  for rec, resp in zip(records, responses):
    ids = rec.get("instruction_id_list") or []
    kws = rec.get("kwargs") or [{}] * len(ids)
    if len(kws) != len(ids):
      raise ValueError(f"record {rec.get('key')}: {len(ids)} instructions but {len(kws)} kwargs")
    res = {"strict": [], "loose": []}
    for iid, kw in zip(ids, kws):
      if iid not in CHECKERS:
        unsupported[iid] += 1
        continue
      if iid == "combination:repeat_prompt" and not (kw or {}).get("prompt_to_repeat"):
        kw = dict(kw or {}, prompt_to_repeat=rec.get("prompt", ""))
      for mode in res:
        res[mode].append(check(iid, resp, kw, loose=mode == "loose"))
      per_type[iid][0] += int(res["loose"][-1])
      per_type[iid][1] += 1
    for mode, oks in res.items():
      if oks:
        inst[mode][0] += sum(oks)
        inst[mode][1] += len(oks)
        prompt[mode][0] += int(all(oks))
        prompt[mode][1] += 1
  pct = lambda a: 100.0 * a[0] / a[1] if a[1] else float("nan")  # noqa: E731
  return {
    "instruction_loose": pct(inst["loose"]),
    "instruction_strict": pct(inst["strict"]),
    "prompt_loose": pct(prompt["loose"]),
    "prompt_strict": pct(prompt["strict"]),
    "n_instructions": inst["loose"][1],
    "n_prompts": prompt["loose"][1],
    "unsupported": dict(unsupported),
    "per_instruction_loose": {k: pct(v) for k, v in sorted(per_type.items())},
  }
