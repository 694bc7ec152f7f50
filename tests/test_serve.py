"""lca-serve end to end: the server as a child process on a free loopback port, called with the
official ``openai`` client (streaming and not) and with raw HTTP for bad requests.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_serve.py

Two servers of the session's tiny random LCA-MBP checkpoint: ``server`` (16 slots, a 512-byte
context, warmed up) for answers, log-probabilities, streaming, concurrency and disconnects;
``small`` (4 slots, a queue of 2, a 0.25 s request timeout, no warm-up, so a request that
needs a compile outlives its timeout, and an API key) for overload, timeouts and the key.
"""

import concurrent.futures
import json
import re
import socket
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
from lca_jax.decode.batch import GroupKey, RowParams, bucket_of, buckets
from lca_jax.serve.process import LOOPBACK, ServerProcess, get_json
from lca_jax.serve.scheduler import Job

CONTEXT = 512
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
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
    + ["--no-warmup", "--model-name", "tiny", "--api-key", KEY],
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


def metric(srv, name: str, **labels) -> float:
  """The sum of ``name``'s samples whose labels include ``labels``."""
  text = httpx.get(srv.url + "/metrics").text
  total, seen = 0.0, False
  for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
    have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
    if all(have.get(k) == v for k, v in labels.items()):
      total, seen = total + float(m.group(2)), True
  assert seen, (name, labels, text[:2000])
  return total


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
  job = Job(np.array([3]), GroupKey("ntp", 1), RowParams(10), ["abc"], events.append)
  job.sink = lambda kind, data: events.append((kind, data))
  assert job.push(list(vocab.encode("xxab")), final=False) is None
  assert events == [("delta", ("xx", None))]
  assert job.push(list(vocab.encode("cyy")), final=False) == "stop"
  assert events == [("delta", ("xx", None))] and job.text == "xxab"[:2]
  job.end("stop")  # usage counts the returned bytes only, not those past the stop string
  assert events[-1][1]["completion_tokens"] == 2 and events[-1][1]["completion_bytes"] == 2


def test_job_never_splits_a_character_or_its_logprobs():
  """A 2-byte character pushed a byte at a time: its text, and its ids' log-probabilities,
  go out once the character is whole."""
  events = []
  job = Job(np.array([3]), GroupKey("ntp", 1), RowParams(10), [], None, logprobs=0)
  job.sink = lambda kind, data: events.append(data)
  ids = list(vocab.encode("a\u00e9"))
  entries = [("lp", i) for i in ids]  # stand-ins for TokenLogprob
  job.push(ids[:2], final=False, lps=entries[:2])
  assert events == [("a", entries[:1])]
  job.push(ids[2:], final=True, lps=entries[2:])
  assert events[1] == ("\u00e9", entries[1:])


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
    "lca_serve_requests_waiting",
    "lca_serve_requests_running",
    "lca_serve_acceptance_rate",
    "lca_serve_time_to_first_byte_seconds_bucket",
    "lca_serve_inter_byte_latency_seconds_bucket",
    "lca_serve_e2e_latency_seconds_bucket",
    "lca_serve_queue_time_seconds_bucket",
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
  ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
  ({"prompt": "x", "logprobs": 1, "mode": "verify"}, 400, "logprobs"),
  ({"prompt": "x", "logit_bias": {"65": 5}}, 400, "logit_bias"),
  ({"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
  ({"prompt": "x", "suffix": "end"}, 400, "suffix"),
  ({"prompt": "x", "best_of": 3}, 400, "best_of"),
  ({"prompt": "x", "guided_json": {}}, 400, "guided_json"),
  ({"prompt": "x", "seed": 2**64}, 400, "seed"),
  ({"prompt": [3, 999999]}, 400, "prompt"),
  ({"prompt": [[]]}, 400, "prompt"),
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
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "x"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
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
  body = {"prompt": "x", "n": 3}
  r = httpx.post(small.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
  assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
  assert httpx.get(small.url + "/health").json()["status"] == "ok"


def test_request_timeout_ends_cleanly(small):
  """The first request of a mode compiles its programs (seconds), more than the 0.25 s timeout:
  a 504 error (non-streaming) or an error event then [DONE] (streaming); the server stays up."""
  body = {"prompt": "hello", "max_tokens": 20, "temperature": 0, "mode": "verify"}
  r = httpx.post(small.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
  assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
  body = {**body, "mode": "threshold", "stream": True}
  url = small.url + "/v1/completions"
  with httpx.stream("POST", url, json=body, headers=AUTH, timeout=60) as s:
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


def test_port_in_use_is_one_line_before_loading(tiny_upstream_checkpoint):
  """A port something listens on: exit 2 at once (no load, no compile), one line naming it."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
    taken.bind((LOOPBACK, 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    argv = ["--checkpoint", tiny_upstream_checkpoint, "--host", LOOPBACK, "--port", str(port)]
    t0 = time.monotonic()
    p = subprocess.run(
      [sys.executable, "-m", "lca_jax.cli.serve", *argv], capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - t0
  assert p.returncode == 2, p.stderr
  assert f"{LOOPBACK}:{port}" in p.stderr and "serving" not in p.stderr
  assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
  assert took < 30, took  # a load and warm-up compile of even the tiny model take longer


def log_softmax_rows(model, ids) -> np.ndarray:
  """log p(ids[t] | ids[:t]) for t >= 1 from the model's full forward (float64)."""
  logits = model.forward(np.asarray(ids[:-1]))["ntp_logits"].astype(np.float64)
  m = logits.max(-1, keepdims=True)
  lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
  return lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def test_logprobs_are_the_models(server, model):
  """Greedy completion with logprobs: each returned byte's log-probability is the model's own
  (full forward over prompt + generation), the best of its top list; byte tokens are named."""
  prompt = PROMPTS[4]  # multi-byte UTF-8 characters
  c = client(server)
  r = c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, logprobs=3)
  ref = generate(model, prompt, max_bytes=24)
  ch = r.choices[0]
  assert ch.text == ref.texts[0]
  lp = ch.logprobs
  gen = [int(i) for i in ref.ids[0]]
  assert len(lp.tokens) == len(gen) == r.usage.completion_tokens
  ids = list(vocab.encode(prompt)) + gen
  want = log_softmax_rows(model, ids)[-len(gen) :]
  scale = np.abs(want).max()
  np.testing.assert_allclose(lp.token_logprobs, want, rtol=0, atol=1e-4 * scale)
  for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
    assert len(top) == 3 and max(top.values()) == pytest.approx(v, abs=1e-5 * scale)
    assert tok in top
  assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
  echo = c.completions.create(
    model="tiny", prompt="\u00e9t\u00e9", max_tokens=0, echo=True, logprobs=1
  )
  assert echo.choices[0].logprobs.tokens[:3] == ["bytes:\\xc3", "bytes:\\xa9", "t"]


def test_echo_with_max_tokens_0_scores_the_prompt(server, model):
  c = client(server)
  prompts = [PROMPTS[0], PROMPTS[3]]
  r = c.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=2)
  for prompt, ch in zip(prompts, sorted(r.choices, key=lambda x: x.index)):
    ids = list(vocab.encode(prompt))
    assert ch.text == prompt and ch.finish_reason == "length"
    lp = ch.logprobs
    assert lp.tokens == list(prompt) and lp.token_logprobs[0] is None
    want = log_softmax_rows(model, ids)
    np.testing.assert_allclose(lp.token_logprobs[1:], want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert lp.top_logprobs[0] is None and all(len(t) == 2 for t in lp.top_logprobs[1:])
  assert r.usage.completion_tokens == 0
  ids = [int(i) for i in vocab.encode("token ids")]  # lm-eval's local-completions sends ids
  r = httpx.post(
    server.url + "/v1/completions",
    json={"prompt": [ids], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0},
    timeout=60,
  ).json()
  lp = r["choices"][0]["logprobs"]
  assert len(lp["token_logprobs"]) == len(ids) + 1 and r["choices"][0]["text"].startswith("token")
  np.testing.assert_allclose(lp["token_logprobs"][1:-1], log_softmax_rows(model, ids), atol=1e-3)


def test_chat_logprobs_and_streamed_logprobs(server):
  c = client(server)
  msgs = [{"role": "user", "content": "hi"}]
  r = c.chat.completions.create(
    model="tiny", messages=msgs, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
  )
  content = r.choices[0].logprobs.content
  assert len(content) == r.usage.completion_tokens
  for e in content:
    assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    assert e.bytes is None or len(e.bytes) == 1
  full = c.completions.create(
    model="tiny", prompt=PROMPTS[4], max_tokens=30, temperature=0, logprobs=0
  )
  stream = c.completions.create(
    model="tiny", prompt=PROMPTS[4], max_tokens=30, temperature=0, logprobs=0, stream=True
  )
  toks, lps = [], []
  for chunk in stream:
    for ch in chunk.choices:
      if ch.logprobs is not None:
        toks += ch.logprobs.tokens
        lps += ch.logprobs.token_logprobs
  assert toks == full.choices[0].logprobs.tokens
  np.testing.assert_allclose(lps, full.choices[0].logprobs.token_logprobs, atol=1e-6)
  assert all(t == {} for t in full.choices[0].logprobs.top_logprobs)


def test_stop_counts_only_returned_bytes(server):
  c = client(server)
  full = c.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=80, temperature=0)
  text = full.choices[0].text
  stop = text[10:13]
  want = text[: text.find(stop)]
  r = c.completions.create(
    model="tiny", prompt=PROMPTS[3], max_tokens=80, temperature=0, stop=stop, logprobs=0
  )
  assert r.choices[0].text == want
  assert r.usage.completion_tokens == len(want.encode()) == len(r.choices[0].logprobs.tokens)


def test_greedy_and_sampled_requests_together(server, model):
  """Greedy and sampled (temperature 1, OpenAI's default) requests at once: the greedy answers
  equal generate's, the seeded sampled ones their answer alone; nothing is compiled (the
  sampled program was warmed up at start)."""
  c = client(server)
  compiles = metric(server, "lca_serve_compiles_total")
  kw = dict(model="tiny", max_tokens=24)
  alone = c.completions.create(prompt=PROMPTS[1], seed=5, **kw).choices[0].text

  def ask(i):
    if i % 2:
      return c.completions.create(prompt=PROMPTS[1], seed=5, **kw).choices[0].text
    return c.completions.create(prompt=PROMPTS[i % 3], temperature=0, **kw).choices[0].text

  with concurrent.futures.ThreadPoolExecutor(8) as ex:
    out = list(ex.map(ask, range(8)))
  for i, text in enumerate(out):
    want = alone if i % 2 else generate(model, PROMPTS[i % 3], max_bytes=24).texts[0]
    assert text == want, i
  assert metric(server, "lca_serve_compiles_total") == compiles


def test_tokenize_detokenize(server):
  r = httpx.post(server.url + "/tokenize", json={"prompt": "h\u00e9"}).json()
  assert r["tokens"] == [int(i) for i in vocab.encode("h\u00e9")] and r["count"] == 3
  assert r["max_model_len"] == CONTEXT
  r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
  want = chat_prompt_ids([{"role": "user", "content": "hi"}])
  assert r.json()["tokens"] == [int(i) for i in want]
  back = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"][:3]}).json()
  assert back["prompt"] == vocab.decode(want[:3], specials="render")
  for path, body in (("/tokenize", {"text": "x"}), ("/detokenize", {"tokens": [-1]})):
    assert httpx.post(server.url + path, json=body).status_code == 400


def test_requests_are_counted_once(server):
  ok = metric(server, "lca_serve_requests_total", endpoint="completions", status="200")
  bad = metric(server, "lca_serve_requests_total", endpoint="completions", status="400")
  client(server).completions.create(model="tiny", prompt="a", max_tokens=3, temperature=0)
  httpx.post(server.url + "/v1/completions", json={"prompt": ""})
  assert metric(server, "lca_serve_requests_total", endpoint="completions", status="200") == ok + 1
  assert metric(server, "lca_serve_requests_total", endpoint="completions", status="400") == bad + 1
  assert metric(server, "lca_serve_e2e_latency_seconds_count") >= 1
  assert metric(server, "lca_serve_generated_bytes_total", mode="ntp") > 0


def test_api_key(small):
  r = httpx.post(small.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
  assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
  wrong = {"Authorization": "Bearer nope"}
  assert httpx.get(small.url + "/v1/models", headers=wrong).status_code == 401
  assert httpx.get(small.url + "/health").status_code == 200  # open: probes and scrapers
  with pytest.raises(openai.AuthenticationError):
    client(small).models.list()
  models = openai.OpenAI(base_url=small.url + "/v1", api_key=KEY, max_retries=0).models.list()
  assert [m.id for m in models] == ["tiny"]


def test_long_prompt_is_prefilled_in_pieces(server, model):
  """A prompt past ``batch.CHUNKED_FROM`` bytes joins the batch a piece at a time; its answer
  and a short request's running beside it both equal generate's."""
  long = ("The quick brown fox jumps over the lazy dog. " * 8)[:300]
  c = client(server)
  with concurrent.futures.ThreadPoolExecutor(2) as ex:
    futs = [
      ex.submit(c.completions.create, model="tiny", prompt=p, max_tokens=30, temperature=0)
      for p in (long, PROMPTS[0])
    ]
    texts = [f.result().choices[0].text for f in futs]
  assert texts[0] == model.generate(long, max_bytes=30, pad_to=64, budget_pad_to=128).texts[0]
  assert texts[1] == generate(model, PROMPTS[0], max_bytes=30).texts[0]
