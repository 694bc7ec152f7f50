"""Summarization's ROUGE (rouge-score), on a 0-100 scale.

Translation, CoQA and IFEval are scored by lm-evaluation-harness (:mod:`lca_jax.eval.lm_eval_tasks`).
"""

from __future__ import annotations

from typing import Dict, Sequence

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


def _check_lengths(a, b):
  if len(a) != len(b):
    raise ValueError(f"{len(a)} predictions for {len(b)} references")
