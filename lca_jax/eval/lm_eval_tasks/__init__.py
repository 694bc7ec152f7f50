"""The paper's tasks that lm-evaluation-harness has, as task YAMLs over local jsonl files.

=============  ====================  =========================================================
lca task       YAML (this folder)    lm-eval's scoring
=============  ====================  =========================================================
translation    lca_translation.yaml  corpus ``bleu`` and ``chrf`` (sacrebleu's defaults)
qa             lca_coqa.yaml         CoQA ``f1`` and ``em`` (``lm_eval.tasks.coqa.utils``)
ifeval         lca_ifeval.yaml       IFEval's 25 instruction types, prompt/instruction level,
                                     strict and loose (``lm_eval.tasks.ifeval``)
=============  ====================  =========================================================

``evaluate`` writes the examples of :mod:`lca_jax.eval.tasks` (the prompts in the formats of
:mod:`lca_jax.data.sft_format`, each ``lca_prompt``) with the fields lm-eval's scorers read to
a jsonl, points the task's YAML at it (``dataset_path: json``) and runs ``lm_eval.
simple_evaluate`` with an :class:`~lca_jax.eval.lm_eval_adapter.LcaJaxLM`; nothing is fetched.
CoQA has one line per scored turn (the story with the gold history up to it). A chat history's
end-of-reply id travels in the prompt text as the tag ``<eos>`` (the adapter's ``eos_tag``).

The YAMLs also run through ``lca-lm-eval --include_path lca_jax/eval/lm_eval_tasks`` on files at
their ``data_files`` paths (relative to the working directory). Scores are reported x100
(lm-eval's IFEval and CoQA figures are fractions; BLEU and chrF are already on 0-100).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lca_jax import vocab
from lca_jax.eval.lm_eval_tasks import offline

TASK_DIR = os.path.dirname(os.path.abspath(__file__))
YAML = {
  "translation": "lca_translation.yaml",
  "qa": "lca_coqa.yaml",
  "ifeval": "lca_ifeval.yaml",
}
TASKS = tuple(YAML)
HEADLINE = {"translation": "bleu", "qa": "f1", "ifeval": "inst_level_loose_acc"}
SCALE = {"translation": 1.0, "qa": 100.0, "ifeval": 100.0}
EOS_TAG = "<eos>"


def _coqa_doc(rec: dict, golds: List[str], extras: int) -> dict:
  """A flat QA example as an EleutherAI/coqa row ending at its turn, with ``extras`` additional
  answer lists: one file's rows share one schema, so a turn with fewer other golds repeats its
  own answer there (lm-eval's ``doc_to_target`` drops an answer it already has)."""
  hist = [
    (h["question"], h["answer"]) if isinstance(h, dict) else tuple(h)
    for h in rec.get("history") or []
  ]
  said = [a for _, a in hist]
  return {
    "story": rec.get("story", rec.get("context")),
    "questions": {"input_text": [q for q, _ in hist] + [rec["question"]]},
    "answers": {"input_text": said + [golds[0]]},
    "additional_answers": {
      str(k): {"input_text": said + [golds[k + 1] if k + 1 < len(golds) else golds[0]]}
      for k in range(extras)
    },
  }


def doc(task: str, example, extras: int = 0) -> Dict[str, Any]:
  """One jsonl line of ``task`` for an :class:`lca_jax.eval.tasks.Example` (``extras``: the
  number of additional answer lists of a CoQA row)."""
  prompt = vocab.decode(example.prompt_ids, specials="render")
  if task == "translation":
    return {"lca_prompt": prompt, "lca_target": example.references[0]}
  if task == "qa":
    return dict(_coqa_doc(example.record, example.references, extras), lca_prompt=prompt)
  if task == "ifeval":
    r = example.record
    return {
      "key": r.get("key", 0),
      "prompt": r["prompt"],
      "instruction_id_list": list(r["instruction_id_list"]),
      "kwargs": [dict(k or {}) for k in r.get("kwargs") or [{}] * len(r["instruction_id_list"])],
      "lca_prompt": prompt,
    }
  raise ValueError(f"{task!r} is not scored through lm-eval; choose one of {', '.join(TASKS)}")


def write_docs(task: str, examples: Sequence, path: str) -> str:
  extras = max(len(e.references) - 1 for e in examples) if task == "qa" else 0
  with open(path, "w", encoding="utf-8") as f:
    for e in examples:
      f.write(json.dumps(doc(task, e, extras), ensure_ascii=False) + "\n")
  return path


def task_config(
  task: str,
  data_file: str,
  max_bytes: int,
  temperature: float,
  top_p: float,
  cache_dir: Optional[str] = None,
) -> Dict[str, Any]:
  """The task's YAML as an lm-eval config dict, reading ``data_file``, with the generation
  budget and sampling of this run."""
  from lm_eval.tasks._yaml_loader import load_yaml  # pylint: disable=g-import-not-at-top

  offline.prepare()  # before the YAML imports IFEval's / CoQA's scorer modules
  cfg = load_yaml(os.path.join(TASK_DIR, YAML[task]), resolve_func=True)
  kw = {"data_files": {"test": os.path.abspath(data_file)}}
  if cache_dir:
    kw["cache_dir"] = cache_dir
  cfg["dataset_kwargs"] = kw
  gen = dict(cfg.get("generation_kwargs") or {})
  gen.update(max_gen_toks=int(max_bytes), do_sample=temperature > 0, temperature=temperature)
  gen["top_p"] = top_p
  cfg["generation_kwargs"] = gen
  return cfg


@functools.lru_cache(maxsize=1)
def task_manager():
  """lm-eval's task index with this folder included (built once: indexing takes seconds)."""
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top

  return TaskManager(include_path=TASK_DIR)


def evaluate(
  lm, task: str, examples: Sequence, max_bytes: int, temperature: float, top_p: float
) -> Tuple[Dict[str, float], List[str]]:
  """Run ``examples`` of ``task`` through lm-eval with the lm-eval model ``lm``; returns the
  task's metrics (x100, lm-eval's names) and the generated texts in example order."""
  import lm_eval  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory(prefix="lca_eval_") as tmp:
    data = write_docs(task, examples, os.path.join(tmp, f"{task}.jsonl"))
    cfg = task_config(task, data, max_bytes, temperature, top_p, os.path.join(tmp, "hf_cache"))
    res = lm_eval.simple_evaluate(
      model=lm,
      tasks=[cfg],
      task_manager=task_manager(),
      log_samples=True,
      bootstrap_iters=0,
    )
  name = cfg["task"]
  scale = SCALE[task]
  metrics = {
    k.split(",")[0]: float(v) * scale
    for k, v in res["results"][name].items()
    if "," in k and "_stderr" not in k and isinstance(v, (int, float))
  }
  samples = sorted(res["samples"][name], key=lambda s: s["doc_id"])
  outputs = [s["resps"][0][0] for s in samples]
  return metrics, outputs
