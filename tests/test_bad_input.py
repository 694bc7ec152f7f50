"""Bad input never shows a traceback and is never accepted silently (issue 12).

Every case is either a one-line error naming the problem (CLIs: ``PROG: error: ...`` on
stderr, exit status 2; Python API: the project's own error type, before anything is compiled)
or a documented behaviour checked here: raw-byte prompts, ids as vocabulary ids, why
generation stopped, skipped-record counts, strict JSON, and an export after an import that
gives back every tensor of the source bit for bit. The CLIs are called in-process
(``main(argv)``); only two tests compile anything (one decoder, one bpb forward, tiny model).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from conftest import REF_DIR, REF_NAMES, load_tool, random_params, tiny_config  # noqa: E402

import lca_jax  # noqa: E402
from lca_jax import configs_io, jsonio, vocab  # noqa: E402
from lca_jax.api import Model  # noqa: E402
from lca_jax.cli import common as cli_common  # noqa: E402
from lca_jax.cli import convert as convert_cli  # noqa: E402
from lca_jax.cli import eval as eval_cli  # noqa: E402
from lca_jax.cli import sample as sample_cli  # noqa: E402
from lca_jax.cli import train as train_cli  # noqa: E402
from lca_jax.decode import engine  # noqa: E402
from lca_jax.decode.engine import DecodeError  # noqa: E402
from lca_jax.interop import safetensors_io, upstream  # noqa: E402
from lca_jax.model.config import ConfigError, ModelConfig  # noqa: E402
from lca_jax.train import run_config  # noqa: E402

TINY_CONFIG = os.path.join(ROOT, "configs", "tiny_lca_mbp.py")
CTX = 64  # max_seq_len of the tiny checkpoint


def _strict_loads(s: str):
  def no_constant(name):
    raise AssertionError(f"not strict JSON: {name}")

  return json.loads(s, parse_constant=no_constant)


def _one_line_error(err: str, *words):
  lines = [x for x in err.strip().splitlines() if x.strip()]
  assert len(lines) == 1, err
  assert "error:" in lines[0] and "Traceback" not in err, err
  for w in words:
    assert w in lines[0], (w, lines[0])
  return lines[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  """A tiny FxT checkpoint (upstream layout) with a 64-byte context."""
  cfg = tiny_config("fxt", max_seq_len=CTX)
  path = str(tmp_path_factory.mktemp("tiny_fxt"))
  upstream.write_dir(path, random_params(cfg), cfg)
  return path


def _api_model(**kw) -> Model:
  """A model handle for checks that fail before anything runs (no params needed)."""
  return Model(ModelConfig(max_seq_len=CTX, **kw), {})


# ---- (a) tracebacks -> one line, exit 2 / the project's error type --------------------------
def test_sample_prompt_file_with_invalid_utf8_is_fed_as_raw_bytes(tiny_dir, tmp_path, capsys):
  line = b"caf\xe9 au lait, cr\xe8me br\xfbl\xe9e et pain grill\xe9 ok"  # Latin-1, 42 bytes
  assert 32 < len(line) < CTX - 4
  f = tmp_path / "prompts.txt"
  f.write_bytes(line + b"\r\n\r\n")  # CRLF, a blank line (skipped)
  rc = sample_cli.main(
    [
      "--checkpoint",
      tiny_dir,
      "--prompt-file",
      str(f),
      "--max-bytes",
      "4",
      "--ignore-eos",
      "--json",
    ]
  )
  cap = capsys.readouterr()
  assert rc == 0, cap.err
  recs = [_strict_loads(x) for x in cap.out.splitlines() if x.strip()]
  assert len(recs) == 1
  rec = recs[0]
  assert rec["prompt_ids"] == vocab.encode_bytes(line).tolist()  # the bytes of the file, exactly
  assert rec["prompt"] == line.decode("utf-8", errors="replace")
  assert rec["acceptance_rate"] is None  # ntp mode: strict JSON null, not NaN
  assert rec["stop_reason"] == "max_bytes" and len(rec["ids"]) == 4


def test_prompt_near_the_context_says_why_it_stopped(tiny_dir, capsys):
  model = lca_jax.load(tiny_dir)
  prompt = "x" * (CTX - 4)
  res = model.generate(prompt, max_bytes=16, ignore_eos=True)
  assert res.stop_reasons == ["context"] and res.budget == 4 and res.ids[0].size == 4
  rc = sample_cli.main(
    ["--checkpoint", tiny_dir, "--prompt", prompt, "--max-bytes", "16", "--ignore-eos"]
  )
  err = capsys.readouterr().err
  assert rc == 0, err
  assert "stopped: context" in err and "left 4 of --max-bytes 16" in err, err
  with pytest.raises(DecodeError, match="fills the model context"):
    model.generate("x" * CTX)


@pytest.mark.parametrize(
  "argv,words",
  [
    (["--tau", "2"], ["--tau", "[0, 1]"]),
    (["--tau", "nan"], ["--tau", "finite"]),
    (["--top-k", "-5"], ["--top-k must be in [0,"]),
    (["--mode", "threshold", "--n", "1000"], ["--n", "at most 64"]),
    (["--temperature", "nan"], ["--temperature", "finite"]),
    (["--max-bytes", "0"], ["--max-bytes", ">= 1"]),
    (["--top-p", "0"], ["--top-p"]),
    (
      ["--seed", str(10**21)],
      ["--seed must be a 64-bit integer"],
    ),  # an OverflowError deep in numpy before
    (
      ["--top-k", str(10**11)],
      ["--top-k must be in [0, 2147483647]"],
    ),  # out of bounds for int32 before
  ],
)
def test_sample_bad_options(tiny_dir, capsys, argv, words):
  rc = sample_cli.main(["--checkpoint", tiny_dir, "--prompt", "ab"] + argv)
  assert rc == 2
  _one_line_error(capsys.readouterr().err, *words)


def test_load_with_another_compute_dtype(tiny_dir, capsys):
  """``load(dtype=)`` / ``lca-sample --dtype``: the same float32 parameters under another
  compute dtype (a bfloat16 checkpoint decodes in float32 on a CPU); a dtype outside
  ``DTYPES`` is a LoadError naming it, and argparse refuses it in the CLI (exit 2)."""
  base = lca_jax.load(tiny_dir)
  bf = lca_jax.load(tiny_dir, dtype="bfloat16")
  assert base.cfg.dtype == "float32" and bf.cfg.dtype == "bfloat16"
  assert jax.tree_util.tree_all(
    jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(a, b)), base.params, bf.params)
  )
  assert lca_jax.load(tiny_dir, dtype="float32").cfg == base.cfg
  with pytest.raises(lca_jax.LoadError, match="dtype must be one of float32, bfloat16, got 'f16'"):
    lca_jax.load(tiny_dir, dtype="f16")
  argv = ["--checkpoint", tiny_dir, "--prompt", "ab", "--max-bytes", "3", "--ignore-eos"]
  assert sample_cli.main(argv + ["--dtype", "bfloat16", "--json"]) == 0
  rec = _strict_loads(capsys.readouterr().out.splitlines()[0])
  assert len(rec["ids"]) == 3
  with pytest.raises(SystemExit) as e:
    sample_cli.main(argv + ["--dtype", "f16"])
  assert e.value.code == 2 and "--dtype" in capsys.readouterr().err


def test_eval_with_another_compute_dtype(tiny_dir, tmp_path, capsys, monkeypatch):
  """``lca-eval bpb|tasks|sweep --dtype``: the checkpoint evaluated in that compute dtype (bpb
  runs; a sweep loads every checkpoint with it); a dtype outside ``DTYPES`` exits 2."""
  data = tmp_path / "d.txt"
  data.write_text("hello world, a first document\n\nsecond document here\n")
  argv = ["bpb", "--checkpoint", tiny_dir, "--data", str(data), "--seq-len", "32"]
  assert eval_cli.main(argv + ["--no-progress", "--json", "--dtype", "bfloat16"]) == 0
  assert _strict_loads(capsys.readouterr().out)["bpb_ntp"] > 0
  seen = {}

  def fake_sweep(checkpoints, *args, loader=None, **kw):
    seen["dtypes"] = [loader(c).cfg.dtype for c in checkpoints]
    return {"runs": [], "skipped": [], "plots": []}

  monkeypatch.setattr(eval_cli, "run_sweep", fake_sweep)
  sweep = ["sweep", "--checkpoints", tiny_dir, "--task", "qa", "--data", str(data)]
  assert eval_cli.main(sweep + ["--out", str(tmp_path / "s"), "--dtype", "bfloat16"]) == 0
  assert seen["dtypes"] == ["bfloat16"]
  for cmd in (argv, sweep):
    with pytest.raises(SystemExit) as e:
      eval_cli.main(cmd + ["--dtype", "f16"])
    assert e.value.code == 2 and "--dtype" in capsys.readouterr().err


def test_sample_unreadable_prompt_file(tiny_dir, tmp_path, capsys):
  assert sample_cli.main(["--checkpoint", tiny_dir, "--prompt-file", str(tmp_path)]) == 2
  _one_line_error(capsys.readouterr().err, "cannot read prompt file")


@pytest.mark.parametrize(
  "override,words",
  [
    ("--config.data.format=bogus", ["data.format='bogus'", "parquet"]),
    ("--config.data.packing=bogus", ["data.packing='bogus'", "concat, segmented"]),
    ("--config.train.steps=-5", ["train.steps", "-5"]),
    ("--config.train.steps=0", ["train.steps must be >= 1", "got 0"]),
    ("--config.optim.lr=-1", ["optim.lr", "> 0"]),
    ("--config.optim.lr=nan", ["optim.lr"]),
  ],
)
def test_train_bad_config_values(tmp_path, capsys, override, words):
  wd = tmp_path / "wd"
  rc = train_cli.main(["--config", TINY_CONFIG, "--workdir", str(wd), override])
  assert rc == 2
  _one_line_error(capsys.readouterr().err, "lca-train: error: bad config", *words)
  assert not wd.exists()  # refused before the work directory is created or locked


def test_train_api_rejects_bad_values_too():
  from lca_jax.train import inputs  # pylint: disable=g-import-not-at-top

  c = configs_io.apply_overrides(
    configs_io.load_config(TINY_CONFIG), ["data.format=bogus", "train.steps=-1"]
  )
  with pytest.raises(run_config.RunConfigError, match="data.format.*train.steps"):
    inputs.check_data_files(c)
  # the API keeps train.steps=0 (the initial state, e.g. to check an init_from)
  run_config.validate_run_config(
    configs_io.apply_overrides(configs_io.load_config(TINY_CONFIG), ["train.steps=0"])
  )


@pytest.mark.parametrize(
  "text,words",
  [
    ("def get_config(:\n  pass\n", ["bad.py:1", "syntax error"]),
    ("def get_config():\n  return 1 / 0\n", ["get_config() failed", "ZeroDivisionError"]),
    ("import no_such_module_here\n", ["failed while loading", "ModuleNotFoundError"]),
    ("x = 1\n", ["no get_config()"]),
  ],
)
def test_config_file_that_does_not_load(tmp_path, capsys, text, words):
  path = tmp_path / "configs" / "bad.py"
  path.parent.mkdir()
  path.write_text(text)
  with pytest.raises(configs_io.ConfigFileError):
    configs_io.load_config(str(path))
  assert train_cli.main(["--config", str(path), "--workdir", str(tmp_path / "wd")]) == 2
  _one_line_error(capsys.readouterr().err, *words)
  out = str(tmp_path / "imported")
  assert (
    convert_cli.main(
      [
        "from-torch",
        "--torch-dir",
        os.path.join(REF_DIR, "lca_small"),
        "--out",
        out,
        "--config",
        str(path),
      ]
    )
    == 2
  )
  _one_line_error(capsys.readouterr().err, *words)


def test_convert_from_torch_rejects_a_bad_run_config(tmp_path, capsys):
  rc = convert_cli.main(
    [
      "from-torch",
      "--torch-dir",
      os.path.join(REF_DIR, "lca_small"),
      "--out",
      str(tmp_path / "o"),
      "--config",
      TINY_CONFIG,
      "--config.data.packing=bogus",
    ]
  )
  assert rc == 2
  _one_line_error(capsys.readouterr().err, "data.packing")
  assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
  "argv,words",
  [
    (["--batch-size", "0"], ["--batch-size must be >= 1"]),
    (["--format", "bogus"], ["unknown --format 'bogus'"]),
    (["--seq-len", "0"], ["--seq-len must be >= 1"]),  # no longer silently the model's 4096
    (["--seq-len", str(CTX + 1)], ["longer than the model context"]),
    (["--max-batches", "0"], ["--max-batches"]),
    (["--sft-format", "bogus"], ["--sft-format"]),
    # a MemoryError traceback from inside grain before
    (["--batch-size", str(10**13), "--seq-len", "32"], ["--batch-size", "GiB", "logits"]),
  ],
)
def test_eval_bpb_bad_arguments(tiny_dir, tmp_path, capsys, argv, words):
  data = tmp_path / "d.txt"
  data.write_text("hello world\n\nsecond document\n")
  rc = eval_cli.main(["bpb", "--checkpoint", tiny_dir, "--data", str(data), "--no-progress"] + argv)
  assert rc == 2
  _one_line_error(capsys.readouterr().err, "lca-eval: error:", *words)


@pytest.mark.parametrize("content", [b"", b"not json\n{\"text\": 5}\n{\"text\": \"  \"}\n"])
def test_eval_bpb_without_a_usable_document(tiny_dir, tmp_path, capsys, content):
  data = tmp_path / "bad.jsonl"
  data.write_bytes(content)
  rc = eval_cli.main(
    [
      "bpb",
      "--checkpoint",
      tiny_dir,
      "--data",
      str(data),
      "--seq-len",
      "32",
      "--batch-size",
      "2",
      "--no-progress",
      "--json",
    ]
  )
  cap = capsys.readouterr()
  assert rc == 2 and cap.out == ""
  _one_line_error(cap.err, "lca-eval: error:", str(data))


def test_eval_bpb_json_counts_skipped_records_and_is_strict(tiny_dir, tmp_path, capsys):
  data = tmp_path / "mixed.jsonl"
  good = [json.dumps({"text": f"document number {i}, some words."}) for i in range(3)]
  data.write_text("\n".join([good[0], "{broken", good[1], '{"text": 5}', good[2]]) + "\n")
  rc = eval_cli.main(
    [
      "bpb",
      "--checkpoint",
      tiny_dir,
      "--data",
      str(data),
      "--seq-len",
      "32",
      "--batch-size",
      "2",
      "--no-progress",
      "--json",
    ]
  )
  cap = capsys.readouterr()
  assert rc == 0, cap.err
  res = _strict_loads(cap.out)
  assert res["skipped_records"] == 2
  assert res["skipped"] == {"bad_json": 1, "not_string": 1}
  assert res["batches"] >= 1 and res["seq_len"] == 32


def test_eval_tasks_json_and_out_are_strict(tiny_dir, tmp_path, capsys, monkeypatch):
  from lca_jax.eval import tasks  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(tasks, "load_examples", lambda *a, **k: ["example"])
  fake = {
    "task": "qa",
    "mode": "ntp",
    "tau": None,
    "n": 1,
    "metric": "f1",
    "quality": 1.0,
    "acceptance_rate": float("nan"),
    "bytes_per_s": float("inf"),
    "outputs": ["x"],
    "np": np.float32("nan"),
  }
  monkeypatch.setattr(tasks, "run_task", lambda *a, **k: dict(fake))
  out = tmp_path / "r.json"
  rc = eval_cli.main(
    [
      "tasks",
      "--checkpoint",
      tiny_dir,
      "--task",
      "qa",
      "--data",
      "unused.jsonl",
      "--json",
      "--out",
      str(out),
      "--no-progress",
    ]
  )
  cap = capsys.readouterr()
  assert rc == 0, cap.err
  res = _strict_loads(cap.out)
  assert res["acceptance_rate"] is None and res["bytes_per_s"] is None and res["np"] is None
  assert "outputs" not in res
  saved = _strict_loads(out.read_text())
  assert saved["acceptance_rate"] is None and saved["outputs"] == ["x"]
  assert (
    jsonio.dumps({"a": float("nan"), "b": [np.int64(3), float("-inf")]})
    == '{"a": null, "b": [3, null]}'
  )


def test_eval_out_paths(tiny_dir, tmp_path, capsys):
  taken = tmp_path / "taken.json"
  taken.write_text("{}")
  rc = eval_cli.main(
    [
      "sweep",
      "--checkpoints",
      tiny_dir,
      "--task",
      "translation",
      "--data",
      str(tmp_path / "none.jsonl"),
      "--out",
      str(taken),
      "--no-progress",
    ]
  )
  assert rc == 2
  _one_line_error(capsys.readouterr().err, "is not a directory")
  assert taken.read_text() == "{}"
  rc = eval_cli.main(
    [
      "tasks",
      "--checkpoint",
      tiny_dir,
      "--task",
      "qa",
      "--data",
      str(tmp_path / "none.jsonl"),
      "--out",
      str(tmp_path),
      "--no-progress",
    ]
  )
  assert rc == 2
  _one_line_error(capsys.readouterr().err, "is a directory")
  for argv, word in (
    (["--batch-size", "0"], "--batch-size"),
    (["--tau", "2"], "tau"),
    (["--limit", "0"], "--limit"),
    (["--max-bytes", "0"], "--max-bytes"),
  ):
    rc = eval_cli.main(
      [
        "tasks",
        "--checkpoint",
        tiny_dir,
        "--task",
        "qa",
        "--data",
        str(tmp_path / "none.jsonl"),
        "--no-progress",
      ]
      + argv
    )
    assert rc == 2
    _one_line_error(capsys.readouterr().err, word)


# ---- Python API: DecodeError naming the argument, before anything is compiled ---------------
@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(max_bytes=5.5), "max_bytes must be an integer"),
    (dict(max_bytes="5"), "max_bytes must be an integer"),
    (dict(max_bytes=0), "max_bytes must be >= 1"),
    (dict(mode="drafter", drafter="notamodel"), "drafter must be a model loaded with lca_jax.load"),
    (dict(tau=float("nan")), "tau must be a finite number"),
    (dict(mode="threshold", tau=2), r"tau must be a probability in \[0, 1\]"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_k=-5), r"top_k must be in \[0, "),
    (dict(seed=2**64), "seed must be a 64-bit integer"),
    (dict(mode="threshold", n=1000), "n must be at most 64"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(mode=None), "unknown mode"),
  ],
)
def test_generate_rejects_bad_arguments(kw, match):
  with pytest.raises(DecodeError, match=match):
    _api_model().generate("ab", **kw)
  assert issubclass(DecodeError, ValueError) and lca_jax.DecodeError is DecodeError


def test_generate_drafter_with_another_vocabulary():
  other = _api_model(n_tokens=300)
  with pytest.raises(DecodeError, match="vocabulary"):
    _api_model().generate("ab", mode="drafter", drafter=other, n=3)


def test_generate_ids_are_vocabulary_ids():
  """Documented: ids are vocabulary ids (byte b = id b + 3), a flat int list is one prompt."""
  enc = engine._encode_prompts  # pylint: disable=protected-access
  assert [p.tolist() for p in enc([123])] == [[123]]
  assert vocab.decode([123]) == "x"
  assert [p.tolist() for p in enc([72, 105])] == [[72, 105]]  # one prompt, not two
  assert [p.tolist() for p in enc([[72], [105, 106]])] == [[72], [105, 106]]
  assert [p.tolist() for p in enc(["a", b"\xff"])] == [[100], [258]]
  m = _api_model()
  with pytest.raises(DecodeError, match=r"outside \[0, 261\)"):
    m.generate([[300]])
  with pytest.raises(DecodeError, match=r"outside \[0, 261\)"):
    m.generate([-1])
  with pytest.raises(DecodeError, match="integer vocabulary ids"):
    m.generate([np.array([1.5, 2.0])])
  with pytest.raises(DecodeError, match="empty"):
    m.generate([""])


def test_forward_checks_ids_and_context():
  m = _api_model()
  with pytest.raises(DecodeError, match="more than the model context"):
    m.forward(np.full(CTX + 1, 10, np.int32))
  with pytest.raises(DecodeError, match=r"\[0, 261\)"):
    m.forward(np.array([3, 300]))  # an embedding padding row, not a vocabulary id
  with pytest.raises(DecodeError, match="integer ids"):
    m.forward(np.array([3.0, 4.0]))


# ---- (c) export after import: every tensor of the source, bit for bit -----------------------
def _bits(a):
  return np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def _assert_same_tensors(src_dir, out_dir):
  src = safetensors_io.read_safetensors(os.path.join(src_dir, "model.safetensors"))
  got = safetensors_io.read_safetensors(os.path.join(out_dir, "model.safetensors"))
  assert sorted(got) == sorted(src)
  for k in src:
    assert got[k].dtype == src[k].dtype and got[k].shape == src[k].shape, k
    np.testing.assert_array_equal(_bits(got[k]), _bits(src[k]), err_msg=k)
  with (
    open(os.path.join(src_dir, "config.json")) as f,
    open(os.path.join(out_dir, "config.json")) as g,
  ):
    assert json.load(g) == json.load(f)


@pytest.mark.parametrize("name", REF_NAMES)
def test_export_after_import_is_bit_identical(tmp_path, name):
  src = os.path.join(REF_DIR, name)
  wd = convert_cli.from_torch(src, str(tmp_path / "wd"))
  assert os.path.isfile(os.path.join(wd, upstream.EXTRAS_FILE))
  out = convert_cli.to_torch(wd, str(tmp_path / "out"))
  _assert_same_tensors(src, out)


def test_export_keeps_the_source_inv_freq_not_a_recomputed_one(tmp_path, capsys):
  """A source whose inv_freq is 1 ulp off numpy's (as torch's float32 pow is for some head
  dims): both the work-directory round trip and a direct upstream export give it back."""
  src = str(tmp_path / "src")
  shutil.copytree(os.path.join(REF_DIR, "lca_small"), src)
  sd = dict(safetensors_io.read_safetensors(os.path.join(src, "model.safetensors")))
  inv = np.array(sd[upstream.INV_FREQ], np.float32)
  inv[1::2] = np.nextafter(inv[1::2], np.float32(np.inf))
  sd = {k: np.array(v) for k, v in sd.items()}
  sd[upstream.INV_FREQ] = inv
  safetensors_io.write_safetensors(os.path.join(src, "model.safetensors"), sd)
  with open(os.path.join(src, "config.json")) as f:
    cfg = upstream.config_from_upstream(json.load(f))
  assert not np.array_equal(_bits(inv), _bits(upstream.inv_freq(cfg)))  # the test can fail

  wd = str(tmp_path / "wd")
  assert convert_cli.main(["from-torch", "--torch-dir", src, "--out", wd]) == 0
  assert convert_cli.main(["to-torch", "--checkpoint", wd, "--out", str(tmp_path / "a")]) == 0
  capsys.readouterr()
  _assert_same_tensors(src, str(tmp_path / "a"))
  _assert_same_tensors(src, convert_cli.to_torch(src, str(tmp_path / "b")))
  # --force over the imported directory replaces its extras with the new source's
  convert_cli.from_torch(os.path.join(REF_DIR, "lca_small"), wd, force=True)
  got = upstream.read_extras(wd, cfg)[upstream.INV_FREQ]
  ref = safetensors_io.read_safetensors(os.path.join(REF_DIR, "lca_small", "model.safetensors"))
  np.testing.assert_array_equal(_bits(got), _bits(ref[upstream.INV_FREQ]))


# ---- audit: damaged work directories, model values, data paths, tools ---------------------
_VALID_MODEL = ModelConfig(max_seq_len=CTX).to_dict()


@pytest.mark.parametrize(
  "content,words",
  [
    ('{"config": {', ["train_config.json", "not valid JSON"]),
    ("", ["train_config.json", "not valid JSON"]),
    (json.dumps({"config": {}}), ["train_config.json", 'no "model" object']),
    (json.dumps({"model": dict(_VALID_MODEL, d_model="abc")}), ["d_model must be an integer"]),
    (json.dumps({"model": dict(_VALID_MODEL, n_heads=0)}), ["n_heads must be an integer >= 1"]),
  ],
)
def test_workdir_with_a_damaged_run_config(tmp_path, capsys, content, words):
  """A work directory whose train_config.json is cut short or hand-edited: every CLI that
  reads it names the file in one line (a JSONDecodeError / KeyError / ZeroDivisionError
  traceback before) and leaves it as it was."""
  wd = tmp_path / "wd"
  (wd / "checkpoints").mkdir(parents=True)
  (wd / "train_config.json").write_text(content)
  with pytest.raises(lca_jax.LoadError, match=words[-1]):
    lca_jax.load(str(wd))
  for main, argv in (
    (sample_cli.main, ["--checkpoint", str(wd), "--prompt", "ab"]),
    (convert_cli.main, ["to-torch", "--checkpoint", str(wd), "--out", str(tmp_path / "o")]),
    (train_cli.main, ["--config", TINY_CONFIG, "--workdir", str(wd)]),
  ):
    assert main(argv) == 2
    _one_line_error(capsys.readouterr().err, *words)
  assert (wd / "train_config.json").read_text() == content
  assert sorted(os.listdir(wd)) == ["checkpoints", "train_config.json"]
  assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
  "override,words",
  [
    ("--config.model.n_heads=0", ["model config: n_heads must be an integer >= 1, got 0"]),
    ("--config.model.d_model=-8", ["model config: d_model must be an integer >= 1, got -8"]),
    ("--config.model.rms_eps=0.0", ["rms_eps must be > 0"]),
  ],
)
def test_train_bad_model_values(tmp_path, capsys, override, words):
  """A zero head count (ZeroDivisionError) or a negative width (a TypeError deep in jax) is
  named before the work directory is created."""
  wd = tmp_path / "wd"
  assert train_cli.main(["--config", TINY_CONFIG, "--workdir", str(wd), override]) == 2
  _one_line_error(capsys.readouterr().err, "lca-train: error:", *words)
  assert not wd.exists()
  with pytest.raises(ConfigError, match="n_kv_heads must be an integer >= 1"):
    ModelConfig.from_dict(dict(_VALID_MODEL, n_kv_heads=0))


def test_train_paths_that_are_the_wrong_kind(tmp_path, capsys):
  taken = tmp_path / "taken"
  taken.write_text("keep")
  assert train_cli.main(["--config", TINY_CONFIG, "--workdir", str(taken)]) == 2
  _one_line_error(capsys.readouterr().err, "--workdir", "exists and is not a directory")
  assert taken.read_text() == "keep"
  assert train_cli.main(["--config", str(tmp_path), "--workdir", str(tmp_path / "wd")]) == 2
  _one_line_error(capsys.readouterr().err, "is a directory")
  assert not (tmp_path / "wd").exists()


def test_upstream_config_with_zero_heads(tmp_path, capsys):
  src = tmp_path / "src"
  shutil.copytree(os.path.join(REF_DIR, "lca_small"), src)
  uc = json.loads((src / "config.json").read_text())
  uc["lm_n_heads"] = 0
  (src / "config.json").write_text(json.dumps(uc))
  with pytest.raises(lca_jax.LoadError, match="n_heads must be an integer >= 1"):
    lca_jax.load(str(src))
  assert (
    convert_cli.main(["from-torch", "--torch-dir", str(src), "--out", str(tmp_path / "o")]) == 2
  )
  _one_line_error(capsys.readouterr().err, "n_heads")
  assert not (tmp_path / "o").exists()


def test_eval_data_directory_and_seed(tiny_dir, tmp_path, capsys):
  rc = eval_cli.main(
    ["bpb", "--checkpoint", tiny_dir, "--data", str(tmp_path), "--seq-len", "32", "--no-progress"]
  )
  assert rc == 2
  _one_line_error(capsys.readouterr().err, "is a directory", "*.parquet")
  argv = ["tasks", "--checkpoint", tiny_dir, "--task", "qa", "--data", "x.jsonl", "--no-progress"]
  assert eval_cli.main(argv + ["--seed", str(10**20)]) == 2
  _one_line_error(capsys.readouterr().err, "seed must be a 64-bit integer")


def test_sweep_ns_below_two_is_refused_not_run_as_two(tiny_dir, tmp_path, capsys):
  """--ns 0 ran n=2 and recorded n=0 in sweep.json before."""
  out = tmp_path / "sweep"
  argv = ["sweep", "--checkpoints", tiny_dir, "--task", "qa", "--data", "x.jsonl"]
  argv += ["--out", str(out), "--modes", "threshold", "--ns", "0", "--no-progress"]
  assert eval_cli.main(argv) == 2
  _one_line_error(capsys.readouterr().err, "n must be >= 2", "got 0")
  assert not out.exists()


def test_cli_warnings_are_one_line(monkeypatch):
  monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
  cli_common.one_line_warnings("lca-x")
  got = warnings.formatwarning("step 8 is corrupt\n  (short)", UserWarning, "f.py", 3, "src")
  assert got == "lca-x: warning: step 8 is corrupt (short)\n"


def test_count_params_bad_configs(tmp_path, capsys):
  tool = load_tool("count_params")
  bad = tmp_path / "configs" / "zero_heads.py"
  bad.parent.mkdir()
  bad.write_text(
    "import ml_collections\n\n\ndef get_config():\n"
    "  return ml_collections.ConfigDict({'model': {'n_heads': 0}})\n"
  )
  for argv, words in (
    ([str(tmp_path / "missing.py")], ["config file not found"]),
    ([str(tmp_path)], ["is a directory"]),
    ([str(bad)], ["n_heads must be an integer >= 1"]),
  ):
    assert tool.main(argv) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    _one_line_error(cap.err, "count_params: error:", *words)


@pytest.mark.parametrize(
  "argv,words",
  [
    (["--max-bytes", "0"], ["--max-bytes must be >= 1"]),  # a silent fallback, exit 0, before
    (["--n", "0"], ["--n must be >= 2"]),
    (["--tau", "nan"], ["--tau"]),
    (["--prompt", ""], ["--prompt is empty"]),  # a DecodeError traceback before
    (["--sentence", ""], ["--sentence is empty"]),
    (["--repeats", "0"], ["--repeats"]),
  ],
)
def test_demo_sample_bad_options(tmp_path, capsys, argv, words):
  """Checked before the checkpoint is loaded (it does not exist here)."""
  rc = load_tool("demo_sample").main(["--checkpoint", str(tmp_path / "missing")] + argv)
  assert rc == 2
  _one_line_error(capsys.readouterr().err, "demo_sample: error:", *words)
