"""lca-convert to-hf (lca_jax/interop/hf_export.py): transformers loads the export.

AutoModelForCausalLM / AutoTokenizer load it with trust_remote_code, its logits match lca_jax
within REL_IMPL of their scale (padded rows included), the tokenizer's ids are ours, greedy
``generate`` continues as lca_jax does, and the CLI writes it or fails in one line.
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
def _model(variant):
  cfg = tiny_config(variant, max_seq_len=128)
  return Model(cfg, random_params(cfg, seed=4))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  return {v: hf_export.to_hf(_model(v), str(root / v)) for v in VARIANTS}


def _load(path):
  model = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
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
  capsys.readouterr()
  assert cli.main(["to-hf", "--checkpoint", tiny_upstream_checkpoint, "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert "not empty" in err and err.count("\n") == 1
  missing = str(tmp_path / "nope")
  assert cli.main(["to-hf", "--checkpoint", missing, "--out", str(tmp_path / "o2")]) == 2
  err = capsys.readouterr().err
  assert "does not exist" in err and err.count("\n") == 1
