"""Evaluation: ROUGE, lm-eval's IFEval / CoQA scorers offline, bpb, tasks end to end, sweeps and
lca-eval errors.

Decoder compiles dominate on CPU, so every real-model generation uses the same shapes
(threshold mode, n=3, batch 2, max_bytes 16, greedy, prompts of 65..128 bytes): one compile
for summarization and the sweep, one for the three tasks lm-eval scores.  Mode-specific bookkeeping (ntp, verify, drafter) and the
IFEval sampling settings are tested with a stand-in model.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json
import math
import re
import types

import numpy as np
import pytest

from lca_jax import vocab
from lca_jax.cli import eval as cli
from lca_jax.decode import policies
from lca_jax.decode.engine import DecodeError, GenerateResult
from lca_jax.eval import bpb, metrics, plots, sweep, tasks
from lca_jax.eval.lm_eval_tasks import offline, squad_metrics

SUMM = [
  {
    "article": "The small cat sat on the warm mat all day long while the rain fell.",
    "highlights": "A cat sat on a mat.",
  },
  {
    "article": "Rain fell over the old city for many hours and the streets were flooded.",
    "summary": "Rain flooded the city.",
  },
]
TRANS = [
  {"es": "El gato duerme en la casa grande.", "en": "The cat sleeps in the big house."},
  {"src": "Hola amigo mio, que tal estas hoy?", "tgt": "Hello my friend, how are you today?"},
]
QA = [
  {
    "story": "Tom has a red ball and a blue kite.",
    "question": "What color is the ball?",
    "answers": ["red", "Red."],
  },
  {
    "story": "Ann is ten years old and lives in Rome.",
    "questions": [{"input_text": "Who is it?"}, {"input_text": "How old?"}],
    "answers": [{"input_text": "Ann"}, {"input_text": "ten"}],
  },
]
IFE = [
  {
    "key": 1,
    "prompt": "Write a short poem about cats and dogs, please.",
    "instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
    "kwargs": [{}, {"relation": "less than", "num_words": 50}],
  },
  {
    "key": 2,
    "prompt": "Say hello to my friend in Spanish, all lowercase.",
    "instruction_id_list": ["language:response_language", "change_case:english_lowercase"],
    "kwargs": [{"language": "es"}, {}],
  },
]
DATA = {"summarization": SUMM, "translation": TRANS, "qa": QA, "ifeval": IFE}
GEN = [
  "--mode",
  "threshold",
  "--n",
  "3",
  "--tau",
  "0.9",
  "--max-bytes",
  "16",
  "--batch-size",
  "2",
  "--no-progress",
]


def write_jsonl(path, records, raw=()):
  with open(path, "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
    for line in raw:
      f.write(line + "\n")
  return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("evaldata")
  out = {t: write_jsonl(d / f"{t}.jsonl", recs) for t, recs in DATA.items()}
  out["text"] = str(d / "held.txt")
  with open(out["text"], "w") as f:
    f.write(
      "Hello world, this is a held-out document.\n\nAnother paragraph, with more words in it.\n\n"
      "A third one.\n\nAnd a fourth paragraph to make two batches.\n"
    )
  return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  from conftest import random_params, tiny_config

  from lca_jax.interop import upstream

  d = tmp_path_factory.mktemp("ckpt")
  out = {}
  for name, variant in (("lca", "lca_mbp"), ("fxt", "fxt")):
    cfg = tiny_config(variant, vocab_size=261, max_seq_len=256)
    upstream.write_dir(str(d / name), random_params(cfg, seed=1), cfg)
    out[name] = str(d / name)
  return out


def run_cli(capsys, *args):
  rc = cli.main(list(args))
  cap = capsys.readouterr()
  return rc, cap.out, cap.err


# ---- metrics ------------------------------------------------------------------------------
def test_rouge_hand_values():
  r = metrics.rouge(["the cat sat"], ["the cat sat on the mat"])
  assert r["rouge1"] == pytest.approx(100 * 2 / 3)  # P 3/3, R 3/6
  assert r["rouge2"] == pytest.approx(100 * 2 * 0.4 / 1.4)  # P 2/2, R 2/5
  assert r["rougeL"] == pytest.approx(100 * 2 / 3)
  assert metrics.rouge(["same text here"], ["same text here"])["rouge2"] == pytest.approx(100)
  assert metrics.rouge(["alpha beta"], ["gamma delta"])["rouge1"] == 0
  with pytest.raises(ValueError):
    metrics.rouge(["a"], ["a", "b"])


def test_coqa_scorer_offline():
  """lm-eval's CoQA scorer imports transformers 4's squad_metrics; the stand-in answers."""
  offline.squad_metrics()
  from lm_eval.tasks.coqa import utils as coqa

  assert squad_metrics.normalize_answer("An apple a day; THE end.") == "apple day end"
  assert squad_metrics.normalize_answer("theater") == "theater"  # articles only as whole words
  assert squad_metrics.compute_f1("red ball", "ball red big") == pytest.approx(0.8)
  assert squad_metrics.compute_f1("", "") == 1.0 and squad_metrics.compute_f1("a", "x") == 0.0
  doc = {
    "story": "s",
    "questions": {"input_text": ["q1", "q2"]},
    "answers": {"input_text": ["a1", "red"]},
    "additional_answers": {
      "0": {"input_text": ["a1", "red ball"]},
      "1": {"input_text": ["", "Red"]},
    },
  }
  assert coqa.doc_to_target(doc) == ["red", "red ball"]  # "Red" is "red" again
  s = coqa.process_results(doc, ["red\nmore"])  # the first line; leave-one-out: (2/3 + 1) / 2
  assert s["f1"] == pytest.approx((2 / 3 + 1) / 2) and s["em"] == pytest.approx(0.5)


IFEVAL_CASES = [
  ("keywords:existence", {"keywords": ["cat", "dog"]}, "A Cat and a dog.", "A cat only."),
  (
    "keywords:frequency",
    {"keyword": "yes", "frequency": 2, "relation": "at least"},
    "yes YES",
    "yes",
  ),
  ("keywords:frequency", {"keyword": "no", "frequency": 2, "relation": "less than"}, "no", "no no"),
  ("keywords:forbidden_words", {"forbidden_words": ["bad"]}, "badge is fine", "a Bad day"),
  (
    "keywords:letter_frequency",
    {"letter": "z", "let_frequency": 2, "let_relation": "at least"},
    "zZ",
    "z",
  ),
  (
    "length_constraints:number_words",
    {"num_words": 3, "relation": "less than"},
    "two words",
    "one two three",
  ),
  (
    "length_constraints:number_sentences",
    {"num_sentences": 2, "relation": "at least"},
    "Dr. Smith came. He left!",
    "Dr. Smith came home.",
  ),
  (
    "length_constraints:number_paragraphs",
    {"num_paragraphs": 2},
    "one\n***\ntwo",
    "one\n***\ntwo\n***\nthree",
  ),
  (
    "length_constraints:nth_paragraph_first_word",
    {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
    "First.\n\n\"Then, second.",
    "First.\n\nNow second.",
  ),
  (
    "detectable_content:number_placeholders",
    {"num_placeholders": 2},
    "[name] at [place]",
    "[name] only",
  ),
  ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\np.s. bye", "Hi. bye"),
  (
    "detectable_content:postscript",
    {"postscript_marker": "P.P.S"},
    "Hi.\nP.P.S more",
    "Hi.\nP.S. more",
  ),
  ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n- b", "* a\n* b\n* c"),
  ("detectable_format:constrained_response", {}, "My answer is yes.", "Yes."),
  (
    "detectable_format:number_highlighted_sections",
    {"num_highlights": 2},
    "*a* and **b**",
    "*a* and **",
  ),
  (
    "detectable_format:multiple_sections",
    {"section_spliter": "Section", "num_sections": 2},
    "Section 1\nx\nSection 2\ny",
    "Section 1\nx",
  ),
  ("detectable_format:json_format", {}, "```json\n{\"a\": 1}\n```", "{a: 1}"),
  ("detectable_format:title", {}, "<<My Title>>\ntext", "<< >> text"),
  ("combination:two_responses", {}, "one******two", "one******one"),
  ("combination:repeat_prompt", {"prompt_to_repeat": "Say hi."}, "say hi. Hi!", "Hi! Say hi."),
  (
    "startend:end_checker",
    {"end_phrase": "Any questions?"},
    "Done. Any questions?\"",
    "Any questions? Done.",
  ),
  ("startend:quotation", {}, " \"quoted\" ", "\"half"),
  (
    "change_case:capital_word_frequency",
    {"capital_frequency": 2, "capital_relation": "at least"},
    "THE BIG dog",
    "The BIG dog",
  ),
  ("change_case:english_capital", {}, "THIS ANSWER IS WRITTEN IN CAPITAL LETTERS", "Not caps"),
  ("change_case:english_lowercase", {}, "all lower", "Not lower"),
  ("punctuation:no_comma", {}, "no commas here", "a, b"),
  (
    "language:response_language",
    {"language": "es"},
    "Hola amigo, como estas? Muy bien, gracias por preguntar.",
    "Hello my friend, how are you today? Very well, thanks.",
  ),
]


def _ifeval(iid, kw, response, loose=False):
  offline.prepare()  # NLTK's punkt_tab from the installed package, langdetect seeded
  from lm_eval.tasks.ifeval import utils as ifeval

  inp = ifeval.InputExample(key=0, instruction_id_list=[iid], prompt="Say hi.", kwargs=[kw])
  check = (
    ifeval.test_instruction_following_loose if loose else ifeval.test_instruction_following_strict
  )
  return check(inp, response).follow_all_instructions


@pytest.mark.parametrize(
  "iid,kw,good,bad", IFEVAL_CASES, ids=[c[0] + str(i) for i, c in enumerate(IFEVAL_CASES)]
)
def test_ifeval_checkers(iid, kw, good, bad):
  assert _ifeval(iid, kw, good)
  assert not _ifeval(iid, kw, bad)


def test_ifeval_covers_every_instruction_type_offline_and_loose_rules():
  offline.prepare()
  from lm_eval.tasks.ifeval import instructions_registry

  assert len(instructions_registry.INSTRUCTION_DICT) == 25
  assert {c[0] for c in IFEVAL_CASES} == set(instructions_registry.INSTRUCTION_DICT)
  resp = "Sure, here it is:\n\"quoted\"\nHope this helps!"
  assert not _ifeval("startend:quotation", {}, resp)
  assert _ifeval("startend:quotation", {}, resp, loose=True)  # first and last line removed
  assert _ifeval("startend:quotation", {}, '*"x"*', loose=True)  # asterisks stripped
  assert not _ifeval("startend:quotation", {}, '*"x"*')
  assert not _ifeval("punctuation:no_comma", {}, "   ", loose=True)  # empty never follows


def test_pareto_front():
  pts = [(1, 5), (2, 4), (3, 1), (1.5, 3), (2, 4.5)]
  assert plots.pareto_front(pts) == [0, 4, 2]


# ---- tasks and sweeps with a stand-in model (no compilation) -----------------------------------
class FakeModel:
  """Answers each prompt with its reference; 2 rows x steps of committed bytes [3, 1, 2]."""

  def __init__(self, examples, has_mbp=True):
    self.cfg = types.SimpleNamespace(max_seq_len=512, has_mbp=has_mbp)
    self.answers = {
      np.asarray(e.prompt_ids, np.int32).tobytes(): (e.references or ["ok"])[0] for e in examples
    }
    self.calls = []

  def generate(self, prompts, mode="ntp", n=3, drafter=None, **kw):
    self.calls.append(dict(kw, mode=mode, n=n, batch=len(prompts)))
    if mode != "ntp" and not self.cfg.has_mbp:
      raise DecodeError(f"{mode} mode needs a multi-byte head")
    if mode == "drafter" and drafter is None:
      raise DecodeError("drafter mode needs a drafter model")
    texts = [self.answers[np.asarray(p, np.int32).tobytes()] for p in prompts]
    per = [[1] * len(vocab.encode(t)) if mode == "ntp" else [3, 1, 2] for t in texts]
    return GenerateResult(
      texts=texts,
      ids=[vocab.encode(t, add_eos=True) for t in texts],
      prompt_boundaries=[],
      boundaries=[],
      accepted_per_step=per,
      histogram={},
      acceptance_rate=float("nan") if mode == "ntp" else 0.5,
      latent_steps_per_byte=0.25,
      bytes_per_s=0.0,
      elapsed_s=0.01,
      compile_s=0.0,
      steps=3,
    )


@pytest.mark.parametrize(
  "task,metric", [("summarization", "rougeL"), ("translation", "bleu"), ("qa", "f1")]
)
def test_run_task_scores_and_bookkeeping(files, task, metric):
  ex = tasks.load_examples(task, files[task])
  model = FakeModel(ex)
  # the fake answers whole references (up to 35 bytes): a budget that holds them (the lm-eval
  # adapter keeps at most max_bytes of what a call returns)
  r = tasks.run_task(model, task, ex, mode="threshold", n=3, batch_size=2, max_bytes=64)
  assert r["metric"] == metric and r["quality"] == pytest.approx(100)
  assert r["accepted_hist"] == {2: len(ex), 0: len(ex), 1: len(ex)}  # committed - 1 (the NT byte)
  assert r["committed_hist"] == {3: len(ex), 1: len(ex), 2: len(ex)}
  assert r["acceptance_rate"] == pytest.approx(0.5)
  assert r["bytes_per_s"] == pytest.approx(
    sum(len(e.references[0].encode()) for e in ex) / (0.01 * len(model.calls))
  )
  assert all(
    c["batch"] == 2 and c["temperature"] == 0.0 for c in model.calls
  )  # padded batches, greedy
  assert all(c["pad_to"] in (32, 64, 128) for c in model.calls)


def test_run_task_modes_and_ifeval_sampling(files):
  ex = tasks.load_examples("ifeval", files["ifeval"])
  model = FakeModel(ex)
  r = tasks.run_task(model, "ifeval", ex, mode="drafter", drafter=object(), batch_size=1)
  assert (
    model.calls[0]["temperature"] == 0.7 and model.calls[0]["top_p"] == 0.9
  )  # paper's IFEval setting
  assert (
    r["accepted_hist"] == {3: 2, 1: 2, 2: 2} and r["max_bytes"] == tasks.DEFAULT_MAX_BYTES["ifeval"]
  )
  r = tasks.run_task(model, "ifeval", ex, mode="ntp")
  assert math.isnan(r["acceptance_rate"]) and r["accepted_hist"] == {} and r["n"] == 1
  with pytest.raises(tasks.TaskError, match="metric 'bleu'"):
    tasks.run_task(model, "ifeval", ex, metric="bleu")


def test_run_task_counts_candidates_by_the_policy_not_its_name(files):
  """The accepted-bytes histogram, n, tau and max_candidates come from the mode's policy
  (``head_bytes``, ``multi_byte``, ``uses_tau``): a registered mode is scored like the others."""
  ex = tasks.load_examples("qa", files["qa"])

  class ToyTwoHead(policies.Policy):  # two head bytes per step, no tau
    name, head_bytes = "toy_two_head", 2

  policies.register(ToyTwoHead())
  try:
    r = tasks.run_task(FakeModel(ex), "qa", ex, mode="toy_two_head", tau=0.3, n=4)
  finally:
    policies.POLICIES.pop("toy_two_head")
  assert r["committed_hist"] == {3: len(ex), 1: len(ex), 2: len(ex)}
  assert r["accepted_hist"] == {1: len(ex), 0: 2 * len(ex)}  # a step cut short accepts none
  assert r["tau"] is None and r["n"] == 4 and r["max_candidates"] == 2
  r = tasks.run_task(FakeModel(ex), "qa", ex, mode="drafter", drafter=object(), n=4)
  assert r["max_candidates"] == 4 and r["accepted_hist"] == r["committed_hist"]
  with pytest.raises(DecodeError, match="unknown mode 'toy_two_head'"):
    tasks.run_task(FakeModel(ex), "qa", ex, mode="toy_two_head")


def test_sweep_grid_follows_the_policy_registry():
  """The grid comes from each mode's policy: one point for ntp, one per n for verify /
  drafter, one per (tau, n) for threshold; a registered mode is swept like the others."""
  assert sweep.grid(["ntp", "threshold", "verify"], [0.5, 0.9], [2, 3]) == [
    ("ntp", None, 1),
    ("threshold", 0.5, 2),
    ("threshold", 0.5, 3),
    ("threshold", 0.9, 2),
    ("threshold", 0.9, 3),
    ("verify", None, 2),
    ("verify", None, 3),
  ]
  with pytest.raises(tasks.TaskError, match="unknown mode 'toy_tau'"):
    sweep.grid(["toy_tau"], [0.5], [2])

  class ToyTau(policies.Policy):
    name, uses_tau = "toy_tau", True

  policies.register(ToyTau())
  try:
    assert sweep.grid(["toy_tau"], [0.5], [2, 4]) == [("toy_tau", 0.5, 2), ("toy_tau", 0.5, 4)]
  finally:
    policies.POLICIES.pop("toy_tau")


def test_sweep_with_stand_in_models(files, tmp_path):
  ex = tasks.load_examples("translation", files["translation"])
  models = {"a/lca": FakeModel(ex), "b/fxt": FakeModel(ex, has_mbp=False)}
  res = sweep.run_sweep(
    list(models),
    "translation",
    files["translation"],
    str(tmp_path),
    modes=["ntp", "threshold", "verify", "drafter"],
    taus=[0.7, 0.9],
    ns=[3, 4],
    progress=False,
    loader=models.__getitem__,
  )
  runs = {(r["label"], r["mode"], r["tau"], r["n"]) for r in res["runs"]}
  assert runs == (
    {("lca", "ntp", None, 1), ("fxt", "ntp", None, 1)}
    | {("lca", "threshold", t, n) for t in (0.7, 0.9) for n in (3, 4)}
    | {("lca", "verify", None, n) for n in (3, 4)}
  )
  reasons = {(s["label"], s["mode"]): s["reason"] for s in res["skipped"]}
  assert (
    "needs --drafter" in reasons[("lca", "drafter")]
    and "multi-byte head" in reasons[("fxt", "threshold")]
  )
  table = json.load(open(tmp_path / "sweep.json"))
  assert len(table["runs"]) == 8 and table["machine"]["backend"]
  for name in ("quality_vs_throughput", "throughput_vs_n", "accepted_hist"):
    with open(tmp_path / f"{name}.png", "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ---- real tiny checkpoint ------------------------------------------------------------------
def test_group_lengths_and_bpb_weighting(ckpts, files, capsys):
  b = np.array([[0, 1, 0, 0, 1, 1, 0, 1]])
  d = np.array([[1, 1, 1, 1, 1, 2, 2, 2]])
  assert bpb.group_lengths(b, d).tolist() == [2, 3, 1, 2]
  assert bpb.group_lengths(np.array([[1, 0, 1, 0]]), np.array([[1, 1, 1, 0]])).tolist() == [1, 2]
  rc, out, err = run_cli(
    capsys,
    "bpb",
    "--checkpoint",
    ckpts["lca"],
    "--data",
    files["text"],
    "--seq-len",
    "48",
    "--batch-size",
    "2",
    "--json",
    "--no-progress",
  )
  assert rc == 0, err
  res = json.loads(out)
  assert res["batches"] == 2
  for k in (
    "bpb_ntp",
    "bpb_mbp",
    "bytes_per_latent",
    "boundary_rate",
    "group_len_mean",
    "group_len_p50",
    "group_len_p90",
  ):
    assert math.isfinite(res[k]) and res[k] > 0, k
  assert res["bytes_per_latent"] == pytest.approx(1 / res["boundary_rate"])
  # target-weighted over the run, not a mean of batch means
  from conftest import assert_close_rel

  import lca_jax
  from lca_jax.data import make_eval_pipeline

  model = lca_jax.load(ckpts["lca"])
  batches = list(make_eval_pipeline(files["text"], "text", 48, 2, shard_index=0, shard_count=1))
  parts = [bpb.evaluate_bpb(model, [x]) for x in batches]
  for head in ("ntp", "mbp"):
    n = [p[f"targets_{head}"] for p in parts]
    want = sum(p[f"bpb_{head}"] * k for p, k in zip(parts, n)) / sum(n)
    assert_close_rel(res[f"bpb_{head}"], want)
    assert res[f"targets_{head}"] == sum(n)


@pytest.mark.parametrize("task", ["summarization", "translation", "qa", "ifeval"])
def test_tasks_end_to_end(ckpts, files, capsys, tmp_path, task):
  ex = tasks.load_examples(task, files[task])
  assert all(64 < len(e.prompt_ids) <= 128 for e in ex)  # one prompt bucket: one compile
  out_file = str(tmp_path / "result.json")
  # IFEval samples (T=0.7, top-p 0.9; see test_run_task_modes_and_ifeval_sampling); greedy here
  # shares the one compiled decoder with the other tasks.
  greedy = ["--temperature", "0"] if task == "ifeval" else []
  rc, out, err = run_cli(
    capsys,
    "tasks",
    "--checkpoint",
    ckpts["lca"],
    "--task",
    task,
    "--data",
    files[task],
    *GEN,
    *greedy,
    "--json",
    "--out",
    out_file,
  )
  assert rc == 0, err
  r = json.loads(out)
  assert r["task"] == task and r["examples"] == len(ex) and r["metric"] == tasks.HEADLINE[task]
  assert 0 <= r["quality"] <= 100 and r["bytes_per_s"] > 0 and r["generated_bytes"] > 0
  assert r["acceptance_rate"] is None or 0 <= r["acceptance_rate"] <= 1
  assert sum(r["committed_hist"].values()) == sum(r["accepted_hist"].values()) > 0
  assert max(int(k) for k in r["accepted_hist"]) <= 2
  assert r["temperature"] == 0.0 and r["top_p"] == (0.9 if task == "ifeval" else 1.0)
  full = json.load(open(out_file))
  assert len(full["outputs"]) == len(ex) and all(isinstance(o, str) for o in full["outputs"])


def test_sweep_cli_on_real_checkpoints(ckpts, files, capsys, tmp_path):
  out_dir = str(tmp_path / "sweep")
  rc, out, err = run_cli(
    capsys,
    "sweep",
    "--checkpoints",
    ckpts["lca"],
    ckpts["fxt"],
    "--task",
    "summarization",
    "--data",
    files["summarization"],
    "--modes",
    "threshold",
    "--taus",
    "0.5,0.9",
    "--ns",
    "3",
    "--max-bytes",
    "16",
    "--batch-size",
    "2",
    "--out",
    out_dir,
    "--no-progress",
  )
  assert rc == 0, err
  table = json.load(open(os.path.join(out_dir, "sweep.json")))
  assert [(r["label"], r["tau"], r["n"]) for r in table["runs"]] == [
    ("lca", 0.5, 3),
    ("lca", 0.9, 3),
  ]
  assert [(s["label"], s["tau"]) for s in table["skipped"]] == [("fxt", 0.5), ("fxt", 0.9)]
  assert "multi-byte head" in table["skipped"][0]["reason"]
  assert all(r["bytes_per_s"] > 0 and "accepted_hist" in r for r in table["runs"])
  for name in ("quality_vs_throughput", "throughput_vs_n", "accepted_hist"):
    assert os.path.getsize(os.path.join(out_dir, f"{name}.png")) > 2000


# ---- one-line errors ------------------------------------------------------------------------
def test_cli_errors(ckpts, files, capsys, tmp_path):
  bad = write_jsonl(tmp_path / "bad.jsonl", SUMM[:1], raw=["", "{oops"])
  cases = [
    (
      ["tasks", "--checkpoint", str(tmp_path / "nope"), "--task", "qa", "--data", files["qa"]],
      "checkpoint path does not exist",
    ),
    (
      ["tasks", "--checkpoint", ckpts["lca"], "--task", "poetry", "--data", files["qa"]],
      "unknown task 'poetry'",
    ),
    (
      [
        "tasks",
        "--checkpoint",
        ckpts["lca"],
        "--task",
        "qa",
        "--data",
        str(tmp_path / "none.jsonl"),
      ],
      "data file not found",
    ),
    (
      ["tasks", "--checkpoint", ckpts["lca"], "--task", "summarization", "--data", bad],
      "bad.jsonl:3: malformed JSON",
    ),
    (
      ["tasks", "--checkpoint", ckpts["lca"], "--task", "qa", "--data", files["summarization"]],
      "summarization.jsonl:1: not a qa example",
    ),
    (["bpb", "--checkpoint", ckpts["lca"], "--data", str(tmp_path / "none.txt")], "no files match"),
    (
      [
        "sweep",
        "--checkpoints",
        ckpts["lca"],
        "--task",
        "qa",
        "--data",
        files["qa"],
        "--modes",
        "fast",
        "--out",
        str(tmp_path / "o"),
      ],
      "unknown mode 'fast'",
    ),
  ]
  for args, msg in cases:
    rc, out, err = run_cli(capsys, *args)
    assert rc == 2 and msg in err, (args, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("lca-eval: error: ")


# ---- the documented task data --------------------------------------------------------------
EVAL_DOC = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "evaluation.md"
)


def _documented_task_data() -> dict:
  """task -> the example jsonl of its section in docs/evaluation.md ("#### TASK", a jsonl block)."""
  with open(EVAL_DOC, encoding="utf-8") as f:
    text = f.read()
  found = re.findall(r"^#### (\w+)\n.*?^```jsonl\n(.*?)^```", text, re.M | re.S)
  return dict(found)


@pytest.mark.parametrize(
  "task,n_examples,reference",
  [
    ("summarization", 2, "Council approves budget."),
    ("translation", 4, "The cat sleeps."),
    ("qa", 4, "red"),
    ("ifeval", 1, None),
  ],
)
def test_documented_task_data_loads(tmp_path, task, n_examples, reference):
  """docs/evaluation.md documents the jsonl of every lca-eval task with lines it reads."""
  data = _documented_task_data()
  assert sorted(data) == sorted(tasks.TASKS)
  path = tmp_path / f"{task}.jsonl"
  path.write_text(data[task], encoding="utf-8")
  examples = tasks.load_examples(task, str(path))
  assert len(examples) == n_examples
  if reference is not None:
    assert examples[0].references[0] == reference
  assert all(len(e.prompt_ids) > 0 for e in examples)
