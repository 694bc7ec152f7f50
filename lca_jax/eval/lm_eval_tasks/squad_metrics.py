"""The SQuAD evaluation script's answer normalisation, exact match and token F1.

What lm-eval's CoQA scorer imports as ``transformers.data.metrics.squad_metrics`` (transformers
4's module of the same functions); installed under that name by :func:`offline.squad_metrics`
where the installed transformers lacks it.
"""

from __future__ import annotations

import collections
import re
import string
from typing import List

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
  """Lower case, drop punctuation, drop the articles a/an/the, collapse whitespace."""
  s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
  return " ".join(_ARTICLES.sub(" ", s).split())


def get_tokens(s: str) -> List[str]:
  return normalize_answer(s).split() if s else []


def compute_exact(a_gold: str, a_pred: str) -> int:
  return int(normalize_answer(a_gold) == normalize_answer(a_pred))


def compute_f1(a_gold: str, a_pred: str) -> float:
  """Token F1 after normalisation; two empty answers score 1, one empty answer scores 0."""
  gold, pred = get_tokens(a_gold), get_tokens(a_pred)
  if not gold or not pred:
    return float(gold == pred)
  same = sum((collections.Counter(gold) & collections.Counter(pred)).values())
  if same == 0:
    return 0.0
  precision, recall = same / len(pred), same / len(gold)
  return 2 * precision * recall / (precision + recall)
