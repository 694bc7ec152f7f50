"""Export to a Hugging Face transformers directory (``lca-convert to-hf``).

    from lca_jax.interop import hf_export
    hf_export.to_hf(lca_jax.load("workdirs/run"), "export/run-hf")

    model = AutoModelForCausalLM.from_pretrained("export/run-hf", trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained("export/run-hf", trust_remote_code=True)

The directory holds ``config.json`` (``auto_map`` to the classes below, the upstream config under
``lca_config``), ``generation_config.json``, ``model.safetensors`` (the upstream state dict of
``interop/upstream.py`` with names prefixed by ``model.``, in float32 or bfloat16: ``dtype``;
the RoPE buffer stays float32; ``config.json`` names the dtype as ``dtype`` and
``torch_dtype``), ``tokenizer_config.json``, ``special_tokens_map.json`` and the Python files
copied from this package: ``modeling_lca.py`` (``hf_modeling.py``), ``torch_model.py``,
``torch_incremental.py``, ``torch_multibyte.py`` and ``tokenization_lca.py``
(``hf_tokenizer.py``). Writing it needs neither torch nor transformers. ``lca_jax.load``,
``lca-sample`` and ``lca-convert from-hf`` read it back (``upstream.read_dir``). ``to_hf``
takes a loaded model; ``lca-convert to-hf`` (``lca_jax/cli/convert.py``) loads one from a
path.
"""

from __future__ import annotations

import json
import os
import shutil

from lca_jax.interop import upstream
from lca_jax.interop.convert import ConvertError, prepare_out
from lca_jax.interop.errors import CheckpointError
from lca_jax.interop.safetensors_io import write_safetensors
from lca_jax.vocab import EOS_ID, NUM_BASE_TOKENS, PAD_ID

HERE = os.path.dirname(os.path.abspath(__file__))
# export file name -> source file in this package
CODE_FILES = {
  "modeling_lca.py": "hf_modeling.py",
  "torch_model.py": "torch_model.py",
  "torch_incremental.py": "torch_incremental.py",
  "torch_multibyte.py": "torch_multibyte.py",
  "tokenization_lca.py": "hf_tokenizer.py",
}


def hf_config(cfg, dtype: str = "float32") -> dict:
  """``config.json`` of an export of a model of ``cfg`` with weights in ``dtype``."""
  return {
    "architectures": ["LcaForCausalLM"],
    "model_type": "lca_byte",
    "auto_map": {
      "AutoConfig": "modeling_lca.LcaConfig",
      "AutoModelForCausalLM": "modeling_lca.LcaForCausalLM",
    },
    upstream.HF_CONFIG_KEY: upstream.config_to_upstream(cfg),
    "vocab_size": int(cfg.n_tokens),
    "max_position_embeddings": int(cfg.max_seq_len),
    "pad_token_id": PAD_ID,
    "eos_token_id": EOS_ID,
    "tie_word_embeddings": False,
    "use_cache": True,
    "dtype": dtype,
    "torch_dtype": dtype,
  }


def tokenizer_config(cfg) -> dict:
  return {
    "tokenizer_class": "LcaByteTokenizer",
    "auto_map": {"AutoTokenizer": ["tokenization_lca.LcaByteTokenizer", None]},
    "model_max_length": int(cfg.max_seq_len),
    "pad_token": "<pad>",
    "eos_token": "<eos>",
    "unk_token": "<unk>",
    "additional_special_tokens": ["<en>", "<eot>"],
    "extra_ids": 0,
    "split_special_tokens": True,
    "padding_side": "left",
    "clean_up_tokenization_spaces": False,
  }


def _write_json(path: str, obj: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def write_hf_dir(out: str, model, dtype: str = "float32") -> str:
  """Write the export of ``model`` (an ``lca_jax.Model``) into the existing directory ``out``,
  weights in ``dtype`` (float32 or bfloat16)."""
  if model.cfg.n_tokens != NUM_BASE_TOKENS:
    raise ConvertError(
      f"the byte tokenizer has {NUM_BASE_TOKENS} ids; the model has {model.cfg.n_tokens}"
    )
  try:
    name = upstream.export_dtype(dtype).name
    sd = upstream.params_to_state_dict(model.params, model.cfg, name, model.extras)
  except CheckpointError as e:
    raise ConvertError(str(e)) from None
  write_safetensors(
    os.path.join(out, "model.safetensors"), {upstream.HF_PREFIX + k: v for k, v in sd.items()}
  )
  _write_json(os.path.join(out, "config.json"), hf_config(model.cfg, name))
  _write_json(
    os.path.join(out, "generation_config.json"),
    {"pad_token_id": PAD_ID, "eos_token_id": EOS_ID, "use_cache": True},
  )
  _write_json(os.path.join(out, "tokenizer_config.json"), tokenizer_config(model.cfg))
  _write_json(
    os.path.join(out, "special_tokens_map.json"),
    {
      "pad_token": "<pad>",
      "eos_token": "<eos>",
      "unk_token": "<unk>",
      "additional_special_tokens": ["<en>", "<eot>"],
    },
  )
  for dst, src in CODE_FILES.items():
    shutil.copyfile(os.path.join(HERE, src), os.path.join(out, dst))
  return out


def to_hf(model, out: str, *, dtype: str = "float32", force: bool = False) -> str:
  """Export the loaded ``model`` (an ``lca_jax.Model``) to the transformers directory ``out``
  (new or empty, or any directory with ``force``), weights in ``dtype`` (float32 or
  bfloat16). Returns the absolute output path."""
  if isinstance(model, (str, os.PathLike)):
    raise ConvertError(
      f"to_hf takes a loaded model (lca_jax.load({os.fspath(model)!r})), not a path"
    )
  try:
    upstream.export_dtype(dtype)  # checked before anything is written
  except CheckpointError as e:
    raise ConvertError(str(e)) from None
  return write_hf_dir(prepare_out(out, force), model, dtype)
