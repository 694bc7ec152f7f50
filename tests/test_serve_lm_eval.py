"""lm-evaluation-harness's own OpenAI client (``--model local-completions``) scores a
loglikelihood task through ``lca-serve`` (``echo`` + ``logprobs`` on token-id prompts, the
tokenizer of the ``lca-convert to-hf`` export) with the numbers of ``--model lca_jax``.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_serve_lm_eval.py

A local multiple-choice task file (an empty context included: both clients prefix eos), the
session's tiny random checkpoint, a server of 4 slots on a loopback port. No network.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import json  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
for _pkg in ("aiohttp", "requests", "tenacity"):  # lm-eval's API models (lm-eval[api])
  pytest.importorskip(_pkg)

from lm_eval.tasks import TaskManager  # noqa: E402

from lca_jax.cli import convert as convert_cli  # noqa: E402
from lca_jax.eval import lm_eval_adapter  # noqa: E402, F401  (registers --model lca_jax)
from lca_jax.serve.process import ServerProcess  # noqa: E402

MC = [
  ("The sky is", [" blue", " green", " loud"], 0),
  ("2 + 2 =", [" 4", " 5"], 0),
  ("Caf\u00e9s in", [" Paris", " Z\u00fcrich"], 1),
  ("", ["a", "b"], 1),
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("serve_tasks"))
  os.environ["HF_HOME"] = os.path.join(d, "hf_home")
  with open(os.path.join(d, "mc.jsonl"), "w") as f:
    for q, c, a in MC:
      f.write(json.dumps({"question": q, "choices": c, "answer": a}) + "\n")
  with open(os.path.join(d, "serve_mc.yaml"), "w") as f:
    f.write(
      "task: serve_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
      f"    test: {os.path.join(d, 'mc.jsonl')}\ntest_split: test\n"
      'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
      'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
      "metric_list:\n  - metric: acc\n"
    )
  return d


def _evaluate(model, model_args, task_dir):
  res = lm_eval.simple_evaluate(
    model=model,
    model_args=model_args,
    tasks=["serve_mc"],
    task_manager=TaskManager(include_path=task_dir),
    batch_size=1,
    log_samples=True,
  )
  lls = [r[0] for s in res["samples"]["serve_mc"] for r in s["filtered_resps"]]
  return res["results"]["serve_mc"]["acc,none"], np.array(lls)


def test_local_completions_through_the_server(tiny_upstream_checkpoint, task_dir, tmp_path):
  hf = convert_cli.to_hf(tiny_upstream_checkpoint, str(tmp_path / "hf"))
  argv = ["--context", "128", "--max-batch", "4", "--no-warmup", "--model-name", "tiny"]
  with ServerProcess(tiny_upstream_checkpoint, argv) as srv:
    args = (
      f"model=tiny,base_url={srv.url}/v1/completions,tokenizer_backend=huggingface,"
      f"tokenizer={hf},trust_remote_code=True,max_length=128,num_concurrent=1,max_retries=1"
    )
    acc_srv, got = _evaluate("local-completions", args, task_dir)
  acc_ref, want = _evaluate("lca_jax", f"checkpoint={tiny_upstream_checkpoint}", task_dir)
  assert got.shape == want.shape == (sum(len(c) for _, c, _ in MC),)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
  assert acc_srv == acc_ref
