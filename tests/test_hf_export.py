"""lca-convert to-hf (lca_jax/interop/hf_export.py): transformers loads the export.

AutoModelForCausalLM / AutoTokenizer load it with trust_remote_code, its logits match lca_jax
within REL_IMPL of their scale (padded rows included), the tokenizer's ids are ours, greedy
``generate`` keeps its cache (one byte fed per step) and continues as lca_jax does for 256
bytes of a padded batch, equals the uncached and beam-search paths, runs the multi-byte heads
only when asked, loads and generates from a bfloat16 export, decodes with the multi-byte head
(verify equals ntp, threshold equals lca_jax's), and the CLI writes it or fails in one line.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import REL_IMPL, assert_close_rel, random_ids, random_params, tiny_config  # noqa: E402

from lca_jax import vocab  # noqa: E402
from lca_jax.api import Model  # noqa: E402
from lca_jax.cli import convert as cli  # noqa: E402
from lca_jax.interop import hf_export  # noqa: E402

VARIANTS = ("lca_mbp", "spacebyte", "llamabyte", "mlp_mbp")


@functools.lru_cache(maxsize=None)
def _model(variant, max_seq_len=128):
  cfg = tiny_config(variant, max_seq_len=max_seq_len)
  return Model(cfg, random_params(cfg, seed=4))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  return {v: hf_export.to_hf(_model(v), str(root / v)) for v in VARIANTS}


def _load(path, **kw):
  model = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kw)
  tok = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=True)
  return model.eval(), tok


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_lca_jax(exported, variant):
  hf, _ = _load(exported[variant])
  ids = random_ids(np.random.default_rng(2), (2, 48))
  want = _model(variant).forward(ids)["ntp_logits"]
  got = hf(torch.tensor(ids, dtype=torch.long)).logits
  assert got.dtype == torch.float32 and got.shape == want.shape
  assert_close_rel(got.numpy(), want, REL_IMPL, err_msg=variant)
  # a left-padded row is the unpadded row's logits at its own positions
  mask = torch.ones(ids.shape, dtype=torch.long)
  mask[1, :7] = 0
  got = hf(torch.tensor(ids, dtype=torch.long), attention_mask=mask).logits.numpy()
  assert_close_rel(got[1, 7:], _model(variant).forward(ids[1, 7:])["ntp_logits"], REL_IMPL)


def test_tokenizer_ids_are_ours(exported):
  _, tok = _load(exported["lca_mbp"])
  text = "héllo <eos> ✓\n"
  ids = tok(text)["input_ids"]
  assert ids == vocab.encode(text).tolist()  # no eos appended, "<eos>" in text is bytes
  assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
  assert tok.convert_tokens_to_ids(["<en>", "<eot>"]) == [vocab.EN_ID, vocab.EOT_ID]
  assert len(tok) == vocab.NUM_BASE_TOKENS
  assert tok.decode(ids) == text
  assert tok.decode([vocab.EOS_ID] + ids, skip_special_tokens=True) == text


def test_generate_matches_lca_jax(exported):
  hf, tok = _load(exported["lca_mbp"])
  prompts = ["The quick brown", "ab"]
  enc = tok(prompts, return_tensors="pt", padding=True)
  assert enc["attention_mask"][1, 0] == 0  # left padding
  out = hf.generate(**enc, max_new_tokens=10, do_sample=False)
  new = out[:, enc["input_ids"].shape[1] :].tolist()
  want = _model("lca_mbp").generate(prompts, max_bytes=10, ignore_eos=True).ids
  for row, ref in zip(new, want):
    assert row[: len(ref)] == ref.tolist()


def test_export_files(exported):
  path = exported["lca_mbp"]
  cfg = json.load(open(os.path.join(path, "config.json")))
  assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_lca.LcaForCausalLM"
  assert cfg["vocab_size"] == vocab.NUM_BASE_TOKENS
  for name in hf_export.CODE_FILES:  # the remote code does not need lca_jax
    src = open(os.path.join(path, name)).read()
    assert not re.search(r"^\s*(from|import)\s+lca_jax", src, re.M), name


def test_cli_to_hf(tiny_upstream_checkpoint, tmp_path, capsys):
  out = tmp_path / "hf"
  assert cli.main(["to-hf", "--checkpoint", tiny_upstream_checkpoint, "--out", str(out)]) == 0
  assert {"config.json", "model.safetensors", "modeling_lca.py", "tokenizer_config.json"} <= set(
    os.listdir(out)
  )
  bf16 = tmp_path / "hf16"
  argv = ["to-hf", "--checkpoint", tiny_upstream_checkpoint, "--out", str(bf16)]
  assert cli.main(argv + ["--dtype", "bfloat16"]) == 0
  assert json.load(open(bf16 / "config.json"))["torch_dtype"] == "bfloat16"
  hf, tok = _load(str(bf16), dtype=torch.bfloat16)
  assert hf.generate(**tok(["ab"], return_tensors="pt"), max_new_tokens=4).shape == (1, 6)
  capsys.readouterr()
  assert cli.main(argv[:-1] + [str(tmp_path / "o3"), "--dtype", "float16"]) == 2
  err = capsys.readouterr().err
  assert "float16" in err and err.count("\n") == 1
  assert cli.main(["to-hf", "--checkpoint", tiny_upstream_checkpoint, "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert "not empty" in err and err.count("\n") == 1
  missing = str(tmp_path / "nope")
  assert cli.main(["to-hf", "--checkpoint", missing, "--out", str(tmp_path / "o2")]) == 2
  err = capsys.readouterr().err
  assert "does not exist" in err and err.count("\n") == 1


PROMPTS = ["The quick brown", "ab"]  # left-padded into one batch


def _fed_widths(hf):
  """Records the width of every block of ids the model embeds (a hook on the embedding)."""
  widths = []
  hf.model.token_embedding.register_forward_hook(lambda m, a, o: widths.append(a[0].shape[1]))
  return widths


def _new_bytes(out, enc):
  return out[:, enc["input_ids"].shape[1] :].tolist()


def _same_until_eos(row, ref):
  """HF rows stop at eos (then pad); lca_jax's ``ignore_eos`` rows go on."""
  n = next((i + 1 for i, t in enumerate(ref) if t == vocab.EOS_ID), len(ref))
  assert row[:n] == ref[:n]
  return n


def test_cached_generate_256_bytes_matches_lca_jax(tmp_path):
  model = _model("lca_mbp", 512)
  hf, tok = _load(hf_export.to_hf(model, str(tmp_path / "hf")))
  widths = _fed_widths(hf)
  enc = tok(PROMPTS, return_tensors="pt", padding=True)
  out = hf.generate(**enc, max_new_tokens=256, do_sample=False)
  assert widths[0] == enc["input_ids"].shape[1] and set(widths[1:]) == {1}  # one byte a step
  want = model.generate(PROMPTS, max_bytes=256, ignore_eos=True).ids
  for row, ref in zip(_new_bytes(out, enc), want):
    assert _same_until_eos(row, ref.tolist()) == 256


@pytest.mark.parametrize("variant", VARIANTS)
def test_generate_with_and_without_cache(exported, variant):
  hf, tok = _load(exported[variant])
  enc = tok(PROMPTS, return_tensors="pt", padding=True)
  cached = hf.generate(**enc, max_new_tokens=24, do_sample=False)
  widths = _fed_widths(hf)
  plain = hf.generate(**enc, max_new_tokens=24, do_sample=False, use_cache=False)
  assert torch.equal(cached, plain)
  assert widths == list(range(enc["input_ids"].shape[1], cached.shape[1]))  # all ids each step
  want = _model(variant).generate(PROMPTS, max_bytes=24, ignore_eos=True).ids
  for row, ref in zip(_new_bytes(cached, enc), want):
    _same_until_eos(row, ref.tolist())
  beams = dict(max_new_tokens=12, num_beams=3, do_sample=False)
  assert torch.equal(hf.generate(**enc, **beams), hf.generate(**enc, **beams, use_cache=False))


def test_multi_byte_heads_only_when_asked(exported):
  hf, tok = _load(exported["lca_mbp"])
  calls = []
  hf.model.blocks[3][0].register_forward_hook(lambda *a: calls.append(1))
  enc = tok(PROMPTS, return_tensors="pt", padding=True)
  hf.generate(**enc, max_new_tokens=8, do_sample=False)
  out = hf(enc["input_ids"], attention_mask=enc["attention_mask"])
  assert not calls and out.mbp_logits is None
  ids = random_ids(np.random.default_rng(3), (2, 32))
  out = hf(torch.tensor(ids, dtype=torch.long), output_mbp_logits=True)
  assert calls and out.logits.shape == out.mbp_logits.shape
  assert_close_rel(out.mbp_logits.numpy(), _model("lca_mbp").forward(ids)["mbp_logits"], REL_IMPL)
  hf_mlp, _ = _load(exported["mlp_mbp"])
  got = hf_mlp(torch.tensor(ids, dtype=torch.long), output_mbp_logits=True).mlp_mbp_logits
  want = _model("mlp_mbp").forward(ids)["mlp_mbp_logits"]
  assert_close_rel(got.numpy(), want, REL_IMPL)


def test_bfloat16_export_loads_and_generates(tmp_path):
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top

  model = _model("lca_mbp")
  path = hf_export.to_hf(model, str(tmp_path / "bf16"), dtype="bfloat16")
  cfg = json.load(open(os.path.join(path, "config.json")))
  assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
  with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
    dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
  assert dtypes.pop("model.rotary_embd.inv_freq") == torch.float32
  assert set(dtypes.values()) == {torch.bfloat16}
  hf, tok = _load(path, dtype=torch.bfloat16)
  assert hf.model.head.weight.dtype == torch.bfloat16
  assert hf.model.rotary_embd.inv_freq.dtype == torch.float32
  enc = tok(PROMPTS, return_tensors="pt", padding=True)
  out = hf.generate(**enc, max_new_tokens=16, do_sample=False)
  assert out.shape[1] > enc["input_ids"].shape[1]
  ids = random_ids(np.random.default_rng(2), (2, 48))
  got = hf(torch.tensor(ids, dtype=torch.long)).logits
  assert_close_rel(got.numpy(), model.forward(ids)["ntp_logits"], 5e-2)  # bfloat16 weights
  with pytest.raises(hf_export.ConvertError, match="export dtype"):
    hf_export.to_hf(model, str(tmp_path / "f16"), dtype="float16")


@pytest.mark.parametrize("variant", ("lca_mbp", "mlp_mbp"))
def test_multi_byte_generate(exported, variant):
  hf, tok = _load(exported[variant])
  enc = tok(PROMPTS, return_tensors="pt", padding=True)
  ntp = hf.generate(**enc, max_new_tokens=48, do_sample=False)
  n = 3
  got = hf.generate(**enc, max_new_tokens=48, mode="verify", n=n, return_dict_in_generate=True)
  assert torch.equal(got["sequences"], ntp)
  for tau in (0.0, 0.3):
    got = hf.generate(**enc, max_new_tokens=48, mode="threshold", n=n, tau=tau)
    want = _model(variant).generate(PROMPTS, mode="threshold", n=n, tau=tau, max_bytes=48)
    for row, ref in zip(_new_bytes(got, enc), want.ids):
      assert row[: len(ref)] == ref.tolist()
  # tau 0 accepts every candidate: n bytes a step (until a row's eos)
  got = hf.generate(**enc, max_new_tokens=48, mode="threshold", n=n, tau=0.0, eos_token_id=None)
  steps = hf.generate(
    **enc,
    max_new_tokens=48,
    mode="threshold",
    n=n,
    tau=0.0,
    eos_token_id=None,
    return_dict_in_generate=True,
  )["steps"]
  assert steps == 48 // n and got.shape[1] == enc["input_ids"].shape[1] + 48


def test_multi_byte_generate_bad_requests(exported):
  hf, tok = _load(exported["llamabyte"])
  enc = tok(PROMPTS, return_tensors="pt", padding=True)
  with pytest.raises(ValueError, match="multi-byte head"):
    hf.generate(**enc, mode="verify")
  hf, _ = _load(exported["mlp_mbp"])
  with pytest.raises(ValueError, match="unknown mode"):
    hf.generate(**enc, mode="fast")
  with pytest.raises(ValueError, match=r"n \(bytes drafted per step\)"):
    hf.generate(**enc, mode="verify", n=5)  # two MLP heads: at most 3 bytes a step
  with pytest.raises(ValueError, match="greedily"):
    hf.generate(**enc, mode="threshold", do_sample=True)
