"""The bundled demo corpus (Jargon File 4.4.7, public domain; see corpus/SOURCE.md)."""

from __future__ import annotations

import os

from lca_jax.data.pipeline import Pipeline, make_eval_pipeline, make_pipeline

DEMO_HOLDOUT_EVERY = 20  # document d is held out for eval iff d % 20 == 19


def demo_corpus_path() -> str:
  """Path of the bundled corpus (gzip'd UTF-8 text; documents = blank-line paragraphs)."""
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "jargon.txt.gz")


def make_demo_pipeline(
  split: str = "train", seq_len: int = 256, batch_size: int = 8, **kw
) -> Pipeline:
  """Train (shuffled, repeating) or eval (one deterministic epoch) pipeline on the demo corpus.

  split: "train" (95% of paragraphs), "eval" (every 20th paragraph) or "all".
  Other keyword arguments go to make_pipeline / make_eval_pipeline.
  """
  if split not in ("train", "eval", "all"):
    raise ValueError(f"split must be 'train', 'eval' or 'all', got {split!r}")
  kw.setdefault("holdout", None if split == "all" else split)
  kw.setdefault("holdout_every", DEMO_HOLDOUT_EVERY)
  kw.setdefault("text_mode", "paragraphs")
  if split == "eval":
    return make_eval_pipeline(demo_corpus_path(), "text", seq_len, batch_size, **kw)
  return make_pipeline(demo_corpus_path(), "text", seq_len, batch_size, **kw)
