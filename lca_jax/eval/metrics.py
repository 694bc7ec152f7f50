"""Task metrics: ROUGE (rouge-score), BLEU and chrF (sacrebleu), CoQA F1 (official normalisation).

Every corpus-level score is on a 0-100 scale.
"""

from __future__ import annotations

import collections
import re
import string
from typing import Dict, List, Sequence

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def rouge(
  predictions: Sequence[str], references: Sequence[str], use_stemmer: bool = True
) -> Dict[str, float]:
  """Mean ROUGE F-measures x 100 (rouge1, rouge2, rougeL, rougeLsum; Porter stemming as in
  the usual CNN/DailyMail setup; rougeLsum splits summaries at newlines)."""
  # lazy: rouge-score is optional (the eval extra) and takes seconds to import
  from rouge_score import rouge_scorer  # pylint: disable=g-import-not-at-top

  _check_lengths(predictions, references)
  scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=use_stemmer)
  tot = {k: 0.0 for k in ROUGE_TYPES}
  for p, r in zip(predictions, references):
    s = scorer.score(r, p)
    for k in ROUGE_TYPES:
      tot[k] += s[k].fmeasure
  n = max(len(predictions), 1)
  return {k: 100.0 * v / n for k, v in tot.items()}


def bleu(predictions: Sequence[str], references: Sequence[str]) -> float:
  """Corpus BLEU (sacrebleu defaults: 13a tokenisation, exponential smoothing off)."""
  # lazy: sacrebleu is optional (the eval extra)
  import sacrebleu  # pylint: disable=g-import-not-at-top

  _check_lengths(predictions, references)
  return float(sacrebleu.corpus_bleu(list(predictions), [list(references)]).score)


def chrf(predictions: Sequence[str], references: Sequence[str]) -> float:
  """Corpus chrF (sacrebleu defaults: character 6-grams, beta 2)."""
  # lazy: sacrebleu is optional (the eval extra)
  import sacrebleu  # pylint: disable=g-import-not-at-top

  _check_lengths(predictions, references)
  return float(sacrebleu.corpus_chrf(list(predictions), [list(references)]).score)


def _check_lengths(a, b):
  if len(a) != len(b):
    raise ValueError(f"{len(a)} predictions for {len(b)} references")


# ---- CoQA (official evaluation script semantics) ---------------------------------------------
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
  """Lower case, drop punctuation, drop the articles a/an/the, collapse whitespace."""
  s = s.lower()
  s = "".join(ch for ch in s if ch not in _PUNCT)
  s = _ARTICLES.sub(" ", s)
  return " ".join(s.split())


def _tokens(s: str) -> List[str]:
  return normalize_answer(s).split() if s else []


def exact_match(gold: str, pred: str) -> int:
  return int(normalize_answer(gold) == normalize_answer(pred))


def f1_score(gold: str, pred: str) -> float:
  """Token F1 after normalisation; two empty answers score 1, one empty answer scores 0."""
  g, p = _tokens(gold), _tokens(pred)
  if not g or not p:
    return float(g == p)
  same = sum((collections.Counter(g) & collections.Counter(p)).values())
  if same == 0:
    return 0.0
  precision, recall = same / len(p), same / len(g)
  return 2 * precision * recall / (precision + recall)


def coqa_turn_scores(golds: Sequence[str], pred: str) -> Dict[str, float]:
  """F1 and EM of one turn as the official CoQA script: with several gold answers, the mean over
  leaving each gold out of the max over the rest; with one, the plain score."""
  golds = list(golds)
  if not golds:
    raise ValueError("a QA turn needs at least one gold answer")
  if len(golds) == 1:
    return {"f1": f1_score(golds[0], pred), "em": float(exact_match(golds[0], pred))}
  f1 = em = 0.0
  for i in range(len(golds)):
    rest = golds[:i] + golds[i + 1 :]
    f1 += max(f1_score(g, pred) for g in rest)
    em += max(exact_match(g, pred) for g in rest)
  return {"f1": f1 / len(golds), "em": em / len(golds)}


def coqa(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> Dict[str, float]:
  """Mean CoQA F1 and EM x 100 over turns."""
  _check_lengths(predictions, references)
  f1 = em = 0.0
  for p, golds in zip(predictions, references):
    s = coqa_turn_scores(golds, p)
    f1 += s["f1"]
    em += s["em"]
  n = max(len(predictions), 1)
  return {"f1": 100.0 * f1 / n, "em": 100.0 * em / n}
