"""lca-serve end to end: the server as a child process on a free loopback port, called with the
official ``openai`` client (streaming and not) and with raw HTTP for bad requests.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_serve.py

Two servers of the session's tiny random LCA-MBP checkpoint: ``server`` (16 slots, a 512-byte
context, warmed up) for answers, streaming, concurrency and disconnects; ``small`` (4 slots, a
queue of 2, a 0.25 s request timeout, no warm-up, so a request that needs a compile outlives
its timeout) for overload and timeouts.
"""

import concurrent.futures
import json
import re
import subprocess
import sys
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")  # the serve extra (requirements.txt has it)
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import lca_jax
from lca_jax import vocab
from lca_jax.data.sft_format import chat_prompt_ids
from lca_jax.serve.process import ServerProcess, get_json
from lca_jax.serve.scheduler import Job
from lca_jax.serve.slots import GroupKey, RowParams, bucket_of, buckets

CONTEXT = 512
PROMPTS = [
  "The hacker",
  "hello world, ",
  "a",
  "Once upon a time there was a byte-level model that",
  "\u00e9t\u00e9 \u2603 snow",
  "0123456789",
  "The quick brown fox jumps over the lazy dog. " * 3,
  "x y z",
]


@pytest.fixture(scope="module")
def servers(tiny_upstream_checkpoint):
  big = ServerProcess(
    tiny_upstream_checkpoint,
    ["--context", str(CONTEXT), "--max-batch", "16", "--chunk-steps", "2", "--model-name", "tiny"],
  )
  small = ServerProcess(
    tiny_upstream_checkpoint,
    ["--context", "64", "--max-batch", "4", "--max-queue", "2", "--request-timeout", "0.25"]
    + ["--no-warmup", "--model-name", "tiny"],
  )
  try:
    small.launch()
    big.launch()
    small.wait()
    big.wait()
    yield big, small
  finally:
    big.stop()
    small.stop()


@pytest.fixture(scope="module")
def server(servers):
  return servers[0]


@pytest.fixture(scope="module")
def small(servers):
  return servers[1]


@pytest.fixture(scope="module")
def model(tiny_upstream_checkpoint):
  return lca_jax.load(tiny_upstream_checkpoint)


def generate(model, prompt, **kw):
  """``model.generate`` with one program for every prompt here (up to 64 bytes, or 192) and
  every budget up to 128 bytes."""
  return model.generate(prompt, pad_to=64, budget_pad_to=128, **kw)


def client(srv, **kw):
  return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120, **kw)


def metric(srv, name: str) -> float:
  text = httpx.get(srv.url + "/metrics").text
  m = re.search(rf"^{name} (\S+)$", text, re.M)
  assert m, (name, text[:2000])
  return float(m.group(1))


def wait_idle(srv, timeout=20.0):
  t_end = time.monotonic() + timeout
  while time.monotonic() < t_end:
    _, h = get_json(srv.url + "/health")
    if h and h["active"] == 0 and h["queued"] == 0:
      return h
    time.sleep(0.05)
  raise AssertionError(f"server still busy: {h}")


def test_greedy_completion_equals_generate(server, model):
  c = client(server)
  for prompt in PROMPTS[:3]:
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
    ref = generate(model, prompt, max_bytes=40)
    assert r.choices[0].text == ref.texts[0]
    assert r.choices[0].finish_reason == {"eos": "stop", "max_bytes": "length"}[ref.stop_reasons[0]]
    u = r.usage
    assert u.prompt_tokens == len(prompt.encode()) and u.completion_tokens == len(ref.ids[0])
    extra = u.model_extra
    assert extra["completion_bytes"] == int(np.sum(vocab.is_byte_id(ref.ids[0])))
    assert extra["mode"] == "ntp" and extra["prompt_bytes"] == u.prompt_tokens
    assert extra["bytes_per_step"] == pytest.approx(1.0) and extra["acceptance_rate"] is None


@pytest.mark.parametrize("mode", ["threshold", "verify"])
def test_multi_byte_modes(server, model, mode):
  """verify is exact (greedy ntp's text); threshold equals generate's threshold decode; both
  report accepted bytes per step."""
  r = client(server).completions.create(
    model="tiny",
    prompt=PROMPTS[1],
    max_tokens=30,
    temperature=0,
    extra_body={"mode": mode, "tau": 0.2, "mbp_n": 3},
  )
  ref = generate(model, PROMPTS[1], mode=mode, tau=0.2, n=3, max_bytes=30)
  assert r.choices[0].text == ref.texts[0]
  extra = r.usage.model_extra
  assert extra["mode"] == mode and extra["decode_steps"] >= 1
  assert extra["bytes_per_step"] == pytest.approx(r.usage.completion_tokens / extra["decode_steps"])
  assert 0.0 <= extra["acceptance_rate"] <= 1.0


def test_streaming_matches_non_streaming(server):
  c = client(server)
  for prompt in (PROMPTS[0], PROMPTS[4]):
    full = c.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0)
    parts, finish, usage = [], None, None
    stream = c.completions.create(
      model="tiny",
      prompt=prompt,
      max_tokens=60,
      temperature=0,
      stream=True,
      stream_options={"include_usage": True},
    )
    for chunk in stream:
      if chunk.usage is not None:
        usage = chunk.usage
      for ch in chunk.choices:
        parts.append(ch.text)
        finish = ch.finish_reason or finish
    assert "".join(parts) == full.choices[0].text
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens


def test_stream_never_splits_a_character(server):
  """Raw SSE events: every text piece is whole characters (a split one would decode to
  U+FFFD pieces that differ from the whole text)."""
  body = {"prompt": PROMPTS[4], "max_tokens": 80, "temperature": 0, "echo": True, "stream": True}
  texts = []
  with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    for line in r.iter_lines():
      if line.startswith("data: ") and line != "data: [DONE]":
        texts.append(json.loads(line[6:])["choices"][0]["text"])
  whole = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}).json()
  assert "".join(texts) == whole["choices"][0]["text"]
  assert whole["choices"][0]["text"].startswith(PROMPTS[4])  # echo


def test_chat(server, model):
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
  c = client(server)
  r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=0)
  ref = generate(model, chat_prompt_ids(msgs), max_bytes=40)
  assert r.choices[0].message.role == "assistant"
  assert r.choices[0].message.content == ref.texts[0]
  stream = c.chat.completions.create(
    model="tiny", messages=msgs, max_tokens=40, temperature=0, stream=True
  )
  parts = [ch.delta.content or "" for chunk in stream for ch in chunk.choices]
  assert "".join(parts) == ref.texts[0]


def test_stop_strings(server):
  c = client(server)
  full = c.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=80, temperature=0)
  text = full.choices[0].text
  stop = text[10:13]
  want = text[: text.find(stop)]
  r = c.completions.create(
    model="tiny", prompt=PROMPTS[3], max_tokens=80, temperature=0, stop=[stop, "\x00never"]
  )
  assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
  stream = c.completions.create(
    model="tiny", prompt=PROMPTS[3], max_tokens=80, temperature=0, stop=stop, stream=True
  )
  chunks = [ch for chunk in stream for ch in chunk.choices]
  assert "".join(ch.text for ch in chunks) == want
  assert chunks[-1].finish_reason == "stop"


def test_job_holds_back_a_possible_stop_string():
  """A stop string split across steps is never sent in part."""
  events = []
  job = Job(np.array([3]), GroupKey("ntp", 1, True), RowParams(10), ["abc"], events.append)
  job.sink = lambda kind, data: events.append((kind, data))
  assert job.push(list(vocab.encode("xxab")), final=False) is None
  assert events == [("delta", "xx")]
  assert job.push(list(vocab.encode("cyy")), final=False) == "stop"
  assert events == [("delta", "xx")] and job.text == "xxab"[:2]


def test_seeded_sampling_is_reproducible(server):
  c = client(server)
  kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0.8, top_p=0.9, seed=7)
  first = c.completions.create(**kw).choices[0].text
  with concurrent.futures.ThreadPoolExecutor(4) as ex:  # other rows in the batch: same bytes
    texts = list(ex.map(lambda _: c.completions.create(**kw).choices[0].text, range(4)))
  assert texts == [first] * 4
  two = c.completions.create(**{**kw, "n": 2, "seed": 11})
  assert [ch.index for ch in two.choices] == [0, 1]
  assert c.completions.create(**{**kw, "seed": 12}).choices[0].text == two.choices[1].text


def test_concurrent_clients(server, model):
  """16 clients at once (the server's 16 slots; greedy, prompts of different buckets): every
  answer equals generate's for its prompt, complete; nothing was compiled for them."""
  prompts = [PROMPTS[i % len(PROMPTS)] + f" #{i}" for i in range(16)]
  lengths = [20 + 3 * i for i in range(16)]
  refs = [generate(model, p, max_bytes=n) for p, n in zip(prompts, lengths)]
  compiles = metric(server, "lca_serve_compiles_total")
  c = client(server)

  def ask(i):
    return c.completions.create(
      model="tiny", prompt=prompts[i], max_tokens=lengths[i], temperature=0
    )

  with concurrent.futures.ThreadPoolExecutor(16) as ex:
    out = list(ex.map(ask, range(16)))
  for i, (r, ref) in enumerate(zip(out, refs)):
    assert r.choices[0].text == ref.texts[0], i
    assert r.usage.completion_tokens == len(ref.ids[0])
  assert metric(server, "lca_serve_compiles_total") == compiles
  assert {bucket_of(len(p.encode()), CONTEXT) for p in prompts} <= set(buckets(CONTEXT))
  assert metric(server, "lca_serve_batch_occupancy") > 0
  wait_idle(server)


def test_disconnect_mid_stream_frees_the_slot(server):
  before = metric(server, "lca_serve_generated_bytes_total")
  body = {"prompt": "a", "max_tokens": CONTEXT - 2, "temperature": 0, "ignore_eos": True}
  with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
    for line in r.iter_lines():
      if line.startswith("data: "):
        break  # the first event, then the connection is closed
  h = wait_idle(server, timeout=10)
  assert h["active"] == 0
  assert metric(server, "lca_serve_generated_bytes_total") - before < CONTEXT - 2
  r = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 5}, timeout=60)
  assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_models_health_metrics(server):
  models = httpx.get(server.url + "/v1/models").json()
  assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
  assert [m.id for m in client(server).models.list()] == ["tiny"]
  health = httpx.get(server.url + "/health").json()
  assert health["status"] == "ok" and health["slots"] == 16
  text = httpx.get(server.url + "/metrics").text
  for name in (
    "lca_serve_requests_total",
    "lca_serve_generated_bytes_total",
    "lca_serve_bytes_per_second",
    "lca_serve_batch_occupancy",
    "lca_serve_queue_length",
    "lca_serve_acceptance_rate",
    "lca_serve_time_to_first_byte_seconds_bucket",
  ):
    assert name in text, name


BAD = [
  (b"{not json", 400, None),
  (b"[1, 2]", 400, None),
  (b'"a string"', 400, None),
  ({"prompt": ""}, 400, "prompt"),
  ({"prompt": 5}, 400, "prompt"),
  ({"prompt": "x", "mode": "fast"}, 400, "mode"),
  ({"prompt": "x", "mode": "verify", "mbp_n": 1}, 400, "mbp_n"),
  ({"prompt": "x", "tau": 1.5}, 400, "tau"),
  ({"prompt": "x", "tau": "high"}, 400, "tau"),
  ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
  ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
  ({"prompt": "x", "max_tokens": CONTEXT}, 400, "max_tokens"),
  ({"prompt": "x" * CONTEXT}, 400, "prompt"),
  ({"prompt": "x", "temperature": -1}, 400, "temperature"),
  ({"prompt": "x", "top_p": 0}, 400, "top_p"),
  ({"prompt": "x", "n": 17}, 400, "n"),
  ({"prompt": "x", "stop": [""]}, 400, "stop"),
  ({"prompt": "x", "stream": "yes"}, 400, "stream"),
  ({"prompt": "x", "logprobs": 3}, 400, "logprobs"),
  ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_requests(server, body, status, param):
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  r = httpx.post(server.url + "/v1/completions", content=data, timeout=30)
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert err["message"] and err["type"] and err["param"] == param
  assert "Traceback" not in r.text


@pytest.mark.parametrize(
  "body,param",
  [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, None),
  ],
)
def test_bad_chat_requests(server, body, param):
  r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
  assert r.status_code == 400, r.text
  assert param is None or r.json()["error"]["param"] == param


def test_unknown_path_and_method(server):
  r = httpx.get(server.url + "/v1/nothing")
  assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
  r = httpx.get(server.url + "/v1/completions")
  assert r.status_code == 405 and "error" in r.json()


def test_openai_client_sees_errors(server):
  with pytest.raises(openai.BadRequestError):
    client(server).completions.create(model="tiny", prompt="x", max_tokens=0)


def test_overload_answers_429(small):
  r = httpx.post(small.url + "/v1/completions", json={"prompt": "x", "n": 3}, timeout=30)
  assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
  assert httpx.get(small.url + "/health").json()["status"] == "ok"


def test_request_timeout_ends_cleanly(small):
  """The first request of a mode compiles its programs (seconds), more than the 0.25 s timeout:
  a 504 error (non-streaming) or an error event then [DONE] (streaming); the server stays up."""
  body = {"prompt": "hello", "max_tokens": 20, "temperature": 0, "mode": "verify"}
  r = httpx.post(small.url + "/v1/completions", json=body, timeout=60)
  assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
  body = {**body, "mode": "threshold", "stream": True}
  with httpx.stream("POST", small.url + "/v1/completions", json=body, timeout=60) as s:
    lines = [x for x in s.iter_lines() if x.startswith("data: ")]
  assert json.loads(lines[-2][6:])["error"]["code"] == "timeout" and lines[-1] == "data: [DONE]"
  wait_idle(small)
  assert httpx.get(small.url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize(
  "argv,needle",
  [
    (["--checkpoint", "/nonexistent/dir"], "does not exist"),
    (["--checkpoint", ".", "--port", "0"], "--port"),
    (["--checkpoint", ".", "--max-batch", "0"], "--max-batch"),
    (["--checkpoint", ".", "--context", "1"], "--context"),
  ],
)
def test_cli_bad_options(argv, needle):
  p = subprocess.run(
    [sys.executable, "-m", "lca_jax.cli.serve", *argv], capture_output=True, text=True, timeout=60
  )
  assert p.returncode == 2 and needle in p.stderr
  assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
