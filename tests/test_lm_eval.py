"""lm-evaluation-harness on lca-jax (lca_jax/eval/lm_eval_adapter.py, lm_eval_cli.py).

Tiny local task files written here (multiple choice, a rolling-loglikelihood document set, a
generation task) run through lm-eval's own ``simple_evaluate`` and CLI with ``--model lca_jax``:
loglikelihoods equal the model's own log-softmax sums, generation equals ``Model.generate`` cut
at the stop string (a row that meets it stops within a decode chunk and frees its slot; the
bytes generated are counted), ``batch_size=auto`` picks a size or refuses, the chat template is
the SFT chat format, and lm-eval's ``hf`` model on the ``lca-convert to-hf`` export gives the
same loglikelihoods and bits per byte. No network: local json files, offline hub.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from conftest import REL_IMPL, run_cli_process  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import lca_jax  # noqa: E402
from lca_jax import vocab  # noqa: E402
from lca_jax.cli import convert as convert_cli  # noqa: E402
from lca_jax.eval import lm_eval_cli  # noqa: E402

MAX_LEN = 64  # rolling windows: the long document spans several
MC = [
  ("The sky is", [" blue", " green", " loud"], 0),
  ("2 + 2 =", [" 4", " 5"], 0),
  ("Paris is in", [" France", " Spain", " Peru"], 0),
  ("", ["a", "b"], 1),  # empty context: eos as the context
]
DOCS = ["hello world, a tiny document.", "another line of text " * 8]
GEN = [("Q: say hi\nA:", " hi"), ("Q: count to three\nA:", " 1 2 3")]


def _yaml(d, name, data, body):
  with open(os.path.join(d, f"{name}.yaml"), "w") as f:
    f.write(
      f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
      f"    test: {os.path.join(d, data)}\ntest_split: test\n" + body
    )


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("tasks"))
  os.environ["HF_HOME"] = os.path.join(d, "hf_home")  # datasets' cache, not the user's
  with open(os.path.join(d, "mc.jsonl"), "w") as f:
    for q, c, a in MC:
      f.write(json.dumps({"question": q, "choices": c, "answer": a}) + "\n")
  with open(os.path.join(d, "docs.jsonl"), "w") as f:
    for t in DOCS:
      f.write(json.dumps({"text": t}) + "\n")
  with open(os.path.join(d, "gen.jsonl"), "w") as f:
    for p, t in GEN:
      f.write(json.dumps({"prompt": p, "target": t}) + "\n")
  _yaml(
    d,
    "tiny_mc",
    "mc.jsonl",
    'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
    'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
    "metric_list:\n  - metric: acc\n",
  )
  _yaml(
    d,
    "tiny_docs",
    "docs.jsonl",
    'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
    "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
    "  - metric: bits_per_byte\n",
  )
  _yaml(
    d,
    "tiny_gen",
    "gen.jsonl",
    'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
    'generation_kwargs:\n  until: ["\\n", "Q:"]\n  max_gen_toks: 12\n  do_sample: false\n'
    "metric_list:\n  - metric: exact_match\n",
  )
  return d


def _evaluate(model, model_args, names, tasks_dir, **kw):
  return lm_eval.simple_evaluate(
    model=model,
    model_args=model_args,
    tasks=names,
    task_manager=TaskManager(include_path=tasks_dir),
    batch_size=3,
    log_samples=True,
    **kw,
  )


def _lls(res, name):
  return [r[0] for s in res["samples"][name] for r in s["filtered_resps"]]


def _ref_ll(model, context: str, cont: str) -> float:
  ctx = vocab.encode(context).tolist() or [vocab.EOS_ID]
  ids = ctx + vocab.encode(cont).tolist()
  logits = model.forward(np.asarray(ids[:-1]))["ntp_logits"].astype(np.float64)
  lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
  lp -= logits.max(-1, keepdims=True)
  k = len(ids) - len(ctx)
  return float(lp[np.arange(len(ctx) - 1, len(ids) - 1), ids[len(ctx) :]].sum()) if k else 0.0


@pytest.fixture(scope="module")
def lca_results(tiny_upstream_checkpoint, tasks):
  args = f"checkpoint={tiny_upstream_checkpoint},mode=verify,n=3,max_length={MAX_LEN}"
  return _evaluate("lca_jax", args, ["tiny_mc", "tiny_docs", "tiny_gen"], tasks)


def test_loglikelihood_is_the_models(tiny_upstream_checkpoint, lca_results):
  model = lca_jax.load(tiny_upstream_checkpoint)
  got = _lls(lca_results, "tiny_mc")
  want = [_ref_ll(model, q, c) for q, cs, _ in MC for c in cs]
  np.testing.assert_allclose(got, want, rtol=0, atol=REL_IMPL * max(map(abs, want)))
  assert "acc,none" in lca_results["results"]["tiny_mc"]
  greedy = [r[1] for s in lca_results["samples"]["tiny_mc"] for r in s["filtered_resps"]]
  assert all(isinstance(g, bool) for g in greedy)


def test_rolling_bits_per_byte(lca_results):
  res = lca_results["results"]["tiny_docs"]
  lls = [s["filtered_resps"][0] for s in lca_results["samples"]["tiny_docs"]]
  lls = [x[0] if isinstance(x, (list, tuple)) else x for x in lls]
  n_bytes = sum(len(t.encode()) for t in DOCS)
  assert np.isclose(res["bits_per_byte,none"], -sum(lls) / n_bytes / np.log(2))
  assert np.isfinite(res["word_perplexity,none"])


def test_generate_until_is_the_engines(tiny_upstream_checkpoint, lca_results):
  model = lca_jax.load(tiny_upstream_checkpoint)
  got = [s["filtered_resps"][0] for s in lca_results["samples"]["tiny_gen"]]
  for (prompt, _), text in zip(GEN, got):
    ids = model.generate(prompt, max_bytes=12).ids[0]
    want = vocab.decode(ids, stop_at_eos=True).split("\n")[0].split("Q:")[0]
    assert text == want


def test_hf_export_agrees(tiny_upstream_checkpoint, lca_results, tasks, tmp_path):
  hf = convert_cli.to_hf(tiny_upstream_checkpoint, str(tmp_path / "hf"))
  args = f"pretrained={hf},trust_remote_code=True,dtype=float32,max_length={MAX_LEN}"
  res = _evaluate("hf", args, ["tiny_mc", "tiny_docs"], tasks, device="cpu")
  a, b = np.array(_lls(res, "tiny_mc")), np.array(_lls(lca_results, "tiny_mc"))
  np.testing.assert_allclose(a, b, rtol=0, atol=REL_IMPL * np.abs(b).max())
  x = res["results"]["tiny_docs"]["bits_per_byte,none"]
  y = lca_results["results"]["tiny_docs"]["bits_per_byte,none"]
  assert abs(x - y) <= REL_IMPL * abs(y)
  assert res["results"]["tiny_mc"]["acc,none"] == lca_results["results"]["tiny_mc"]["acc,none"]


def test_cli(tiny_upstream_checkpoint, tasks, tmp_path, capsys):
  out = tmp_path / "out"
  argv = ["--model", "lca_jax", "--model_args", f"checkpoint={tiny_upstream_checkpoint}"]
  argv += ["--tasks", "tiny_mc", "--include_path", tasks, "--batch_size", "auto"]
  argv += ["--max_batch_size", "4"]
  assert lm_eval_cli.main(argv + ["--output_path", str(out)]) == 0
  assert "tiny_mc" in capsys.readouterr().out
  assert any(p.name.startswith("results") for p in out.rglob("*.json"))
  bad = ["--model", "lca_jax", "--model_args", f"checkpoint={tmp_path / 'nope'}"]
  assert lm_eval_cli.main(bad + ["--tasks", "tiny_mc", "--include_path", tasks]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("lca-lm-eval: error:") and "does not exist" in err[-1]


@pytest.mark.skipif(shutil.which("git") is None, reason="lm_eval asks git only where it exists")
def test_cli_outside_a_git_checkout_prints_no_git_error(tiny_upstream_checkpoint, tasks, tmp_path):
  """lm_eval asks git for a commit hash for its results: lca-lm-eval run outside any git
  repository (an installed package, a fresh directory) shows no git error on stderr."""
  cwd = tmp_path / "outside"
  cwd.mkdir()
  probe = subprocess.run(["git", "rev-parse", "--git-dir"], cwd=cwd, capture_output=True)
  assert probe.returncode != 0, "the temporary directory lies inside a git repository"
  p = run_cli_process(
    "lca_jax.eval.lm_eval_cli",
    *("--model", "lca_jax", "--model_args", f"checkpoint={tiny_upstream_checkpoint}"),
    *("--tasks", "tiny_mc", "--include_path", tasks, "--batch_size", "4", "--limit", "2"),
    cwd=str(cwd),
  )
  assert p.returncode == 0, p.stderr
  assert "tiny_mc" in p.stdout
  assert "fatal:" not in p.stderr and "not a git repository" not in p.stderr, p.stderr


def _adapter(checkpoint, **kw):
  from lca_jax.eval.lm_eval_adapter import LcaJaxLM  # pylint: disable=g-import-not-at-top

  return LcaJaxLM(model=lca_jax.load(checkpoint), **kw)


def _req(context, **kw):
  return types.SimpleNamespace(args=(context, kw))


def test_generate_until_stops_rows_early(tiny_upstream_checkpoint):
  lm = _adapter(tiny_upstream_checkpoint, batch_size=2, stop_chunk=8)
  prompts = ["Q: say hi\nA:", "The sky is", "ab"]
  full = [
    vocab.decode(ids, stop_at_eos=True) for ids in lm.model.generate(prompts, max_bytes=96).ids
  ]
  assert len(full[0]) > 40  # no early eos: the stop string is what ends row 0
  stop = full[0][20:23]
  at = full[0].find(stop)
  stop_end = len(full[0][:at].encode()) + len(stop.encode())
  reqs = [
    _req(prompts[0], until=[stop], max_gen_toks=96),
    _req(prompts[1], max_gen_toks=40),  # no stop strings: its whole budget
    _req(prompts[2], until=["\x00never"], max_gen_toks=64),  # waits for a free slot
  ]
  got = lm.generate_until(reqs)
  assert got == [full[0][:at], full[1][: len(got[1])], full[2][: len(got[2])]]
  assert len(got[1].encode()) >= 30 and len(got[2].encode()) >= 50  # (a few replaced bytes)
  generated = lm.tally.figures()["generated_bytes"]
  assert generated <= (stop_end + 8) + 40 + 64 < 96 + 40 + 64  # row 0 stopped within a chunk
  assert generated >= stop_end + 40 + 64 - 6  # every real row's bytes are counted


def test_batch_size_auto(tiny_upstream_checkpoint):
  from lca_jax.eval import lm_eval_adapter as ad  # pylint: disable=g-import-not-at-top

  lm = _adapter(tiny_upstream_checkpoint, batch_size="auto", max_batch_size=8)
  assert lm.batch_size == 8
  assert _adapter(tiny_upstream_checkpoint, batch_size="auto:4").batch_size == ad.AUTO_MAX_BATCH
  cfg = lm.model.cfg
  row = ad.decode_cache_bytes(cfg, 64)
  assert ad.auto_batch_size(cfg, 64, 64, free=2 * row * 5) == 4  # half the memory: 5 rows
  with pytest.raises(ad.AdapterError, match="batch_size=auto: one row"):
    ad.auto_batch_size(cfg, 64, 64, free=row)
  with pytest.raises(ad.AdapterError, match="batch_size must be an integer or auto"):
    _adapter(tiny_upstream_checkpoint, batch_size="big")


def test_apply_chat_template(tiny_upstream_checkpoint, tasks):
  from lca_jax.data.sft_format import chat_prompt_ids  # pylint: disable=g-import-not-at-top

  lm = _adapter(tiny_upstream_checkpoint)
  msgs = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "again"},
  ]
  text = lm.apply_chat_template(msgs)
  assert text == "<|user|>\nhi\n<|assistant|>\nyo<eos>\n<|user|>\nagain\n<|assistant|>\n"
  assert lm.tok_encode(text) == chat_prompt_ids(msgs).tolist()
  open_reply = lm.apply_chat_template(msgs[:2], add_generation_prompt=False)
  assert open_reply == "<|user|>\nhi\n<|assistant|>\nyo"
  res = _evaluate(
    "lca_jax",
    f"checkpoint={tiny_upstream_checkpoint}",
    ["tiny_gen"],
    tasks,
    apply_chat_template=True,
  )
  prompts = [s["arguments"][0][0] for s in res["samples"]["tiny_gen"]]
  assert prompts and all(
    p.startswith("<|user|>\n") and p.endswith("<|assistant|>\n") for p in prompts
  )
