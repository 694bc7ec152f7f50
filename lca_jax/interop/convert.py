"""Checkpoint conversion: a model's params <-> the paper's PyTorch layout.

    from lca_jax.interop import convert
    convert.to_torch(lca_jax.load("workdirs/run"), "export/run", dtype="bfloat16")
    convert.export_params(params, cfg, "export/run")           # params held in memory
    cfg, params, uc = convert.read_torch_dir("export/run")    # float32 numpy params

The functions here take a loaded model (``lca_jax.Model`` or anything with ``params``, ``cfg``
and ``extras``) or a param tree and its ``ModelConfig``; they import neither ``lca_jax.api`` nor
the training stack. Loading a checkpoint from a path and writing an lca-train work directory are
done by their callers: ``lca-convert`` (``lca_jax/cli/convert.py``: ``to_torch``, ``to_hf`` and
``from_torch`` of paths), ``lca_jax.workdir.write`` (a work directory holding params as step 0)
and ``lca_jax.train.loop.write_resumable_workdir`` (one that ``lca-train`` resumes). The layout
and its documented extras (MLP-MBP, SpaceByte) are in ``interop/upstream.py``.

The embedding and head are padded to ``vocab_size`` rows on import (default: the vocabulary
rounded up to a multiple of 128, 261 -> 384, as our configs use); padding rows are zero.
``prepare_out`` / ``check_out_free`` guard output directories: a non-empty one only with
``force``, never the source, never a directory of the other kind (a work directory vs an
upstream one).

Round trip: an export of an imported directory gives back every tensor of the source bit for
bit when exported in the source's dtype, the RoPE buffer ``rotary_embd.inv_freq`` included: the
import keeps the source's own buffer in ``WORKDIR/upstream_extras.safetensors``
(``interop/upstream.py``), which later checkpoints of that work directory keep using.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

import numpy as np

from lca_jax.errors import LcaError
from lca_jax.interop import upstream
from lca_jax.interop.errors import CheckpointError
from lca_jax.model.config import ModelConfig
from lca_jax.workdir.config_file import CONFIG_FILE
from lca_jax.workdir.params import CKPT_DIR, is_workdir

VOCAB_MULTIPLE = 128


class ConvertError(LcaError, ValueError):
  """A conversion that cannot be done (bad input, existing output, mismatched model)."""


# ---- output directories ---------------------------------------------------------------------
def same_path(a: str, b: str) -> bool:
  return os.path.realpath(a) == os.path.realpath(b)


def prepare_out(out: str, force: bool, src: Optional[str] = None, workdir: bool = False) -> str:
  """The absolute ``out``, created. An existing non-empty ``out`` is refused unless ``force``;
  with ``force`` only what is about to be written is removed (a work directory's checkpoints/,
  run config and extras)."""
  out = os.path.abspath(os.path.expanduser(os.fspath(out)))
  if src is not None and os.path.exists(src) and same_path(src, out):
    raise ConvertError(f"output directory {out} is the source; choose another --out")
  if os.path.exists(out):
    if not os.path.isdir(out):
      raise ConvertError(f"output path {out} exists and is not a directory")
    if os.listdir(out):
      if not force:
        raise ConvertError(
          f"output directory {out} exists and is not empty (use --force to overwrite)"
        )
      _check_kind(out, workdir)
      if workdir:
        shutil.rmtree(os.path.join(out, CKPT_DIR), ignore_errors=True)
        for name in (CONFIG_FILE, upstream.EXTRAS_FILE):
          if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
  try:
    os.makedirs(out, exist_ok=True)
  except OSError as e:
    raise ConvertError(f"cannot create output directory {out}: {e.strerror or e}") from None
  return out


def _check_kind(out: str, workdir: bool):
  """--force never turns a work directory into an upstream one or back (lca_jax.load would
  then read the wrong one)."""
  has_torch = os.path.exists(os.path.join(out, "model.safetensors"))
  if workdir and has_torch:
    raise ConvertError(
      f"{out} holds an upstream checkpoint (model.safetensors); refusing to "
      "write a work directory over it"
    )
  if not workdir and is_workdir(out):
    raise ConvertError(
      f"{out} is an lca-train work directory; refusing to write an upstream checkpoint into it"
    )


def check_out_free(out: str, force: bool, workdir: bool = False):
  """The checks of ``prepare_out``, before any slow loading; changes nothing."""
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConvertError(f"output path {out} exists and is not a directory")
  if os.path.isdir(out) and os.listdir(out):
    if not force:
      raise ConvertError(
        f"output directory {out} exists and is not empty (use --force to overwrite)"
      )
    _check_kind(out, workdir)


# ---- JAX -> torch ---------------------------------------------------------------------------
def export_params(
  params,
  cfg: ModelConfig,
  out: str,
  dtype: str = "float32",
  *,
  force: bool = False,
  extras: Optional[dict] = None,
) -> str:
  """Write ``params`` (float32, may be sharded over devices/hosts) of ``cfg`` in the upstream
  layout into ``out`` (``extras``: ``Model.extras``, tensors written back as they are). Returns
  the absolute output path."""
  upstream.export_dtype(dtype)  # validate before touching the output
  out = prepare_out(out, force)
  try:
    upstream.write_dir(out, params, cfg, dtype, extras=extras)
  except CheckpointError as e:
    raise ConvertError(str(e)) from None
  return out


def to_torch(model, out: str, dtype: str = "float32", *, force: bool = False) -> str:
  """Export the loaded ``model`` (``lca_jax.Model``) to ``out`` (config.json +
  model.safetensors). Returns the absolute output path."""
  if isinstance(model, (str, os.PathLike)):
    raise ConvertError(
      f"to_torch takes a loaded model (lca_jax.load({os.fspath(model)!r})), not a path"
    )
  return export_params(
    model.params, model.cfg, out, dtype, force=force, extras=getattr(model, "extras", None)
  )


# ---- torch -> JAX ---------------------------------------------------------------------------
def padded_vocab(n_tokens: int, multiple: int = VOCAB_MULTIPLE) -> int:
  return -(-int(n_tokens) // multiple) * multiple


def read_torch_dir(src: str, vocab_size: Optional[int] = None, with_extras: bool = False):
  """(ModelConfig, float32 numpy params, upstream config dict) of an upstream directory, with
  the embedding/head padded to ``vocab_size`` rows (default ``padded_vocab(n_tokens)``);
  ``with_extras``: also the tensors an export must give back (``upstream.extras_of``)."""
  uc, sd = upstream.read_dir(src)
  base = upstream.config_from_upstream(uc)
  vs = int(vocab_size) if vocab_size else padded_vocab(base.n_tokens)
  if vs < base.n_tokens:
    raise ConvertError(
      f"vocab_size {vs} is smaller than the checkpoint's vocabulary {base.n_tokens}"
    )
  cfg = base.replace(vocab_size=vs)
  params = upstream.state_dict_to_params(sd, cfg, shapes=upstream.param_shapes(cfg), uc=uc)
  if with_extras:
    return cfg, params, uc, upstream.extras_of(sd, cfg)
  return cfg, params, uc


# Fields that must agree between a run config's model and an imported checkpoint (shapes and
# inference semantics); the others (dtype, dropout, max_latent_ratio, ...) come from the config.
_MODEL_FIELDS = (
  "kind",
  "n_tokens",
  "d_model",
  "d_inner",
  "n_heads",
  "n_kv_heads",
  "n_enc",
  "n_lm",
  "n_dec",
  "n_mbp",
  "n_mlp_mbp",
  "boundaries",
  "rope_base",
  "rms_eps",
)


def _model_diffs(imported: ModelConfig, wanted: ModelConfig) -> list:
  fields = list(_MODEL_FIELDS)
  props = [
    ("mlp_hidden", imported.n_mlp_mbp > 0),
    ("bp_hidden", imported.hierarchical and imported.boundaries == "learned"),
    ("spacebyte_max_group", imported.hierarchical and imported.boundaries == "spacebyte"),
  ]
  fields += [name for name, used in props if used]
  out = []
  for f in fields:
    a, b = getattr(imported, f), getattr(wanted, f)
    if a != b:
      out.append(f"model.{f}: checkpoint {a!r}, config {b!r}")
  return out


def params_for_config(params, cfg: ModelConfig, wanted: ModelConfig):
  """``params`` of an imported checkpoint of ``cfg`` for a run config whose model is
  ``wanted``: a ``ConvertError`` names the fields where ``wanted`` does not describe the
  checkpoint (its training-only fields, such as dtype, dropout, remat, may differ); the
  embedding and head are re-padded to ``wanted.vocab_size`` rows."""
  diffs = _model_diffs(cfg, wanted)
  if diffs:
    raise ConvertError("the config's model does not describe the checkpoint: " + "; ".join(diffs))
  vocab_size = wanted.vocab_size
  if vocab_size == cfg.vocab_size:
    return params
  if vocab_size < cfg.n_tokens:
    raise ConvertError(
      f"config model.vocab_size {vocab_size} is smaller than the checkpoint's "
      f"vocabulary {cfg.n_tokens}"
    )
  params = dict(params)
  emb = np.asarray(params["token_embedding"]["embedding"])[: cfg.n_tokens]
  head = np.asarray(params["head"]["kernel"])[:, : cfg.n_tokens]
  pad = vocab_size - cfg.n_tokens
  params["token_embedding"] = {"embedding": np.pad(emb, ((0, pad), (0, 0)))}
  params["head"] = {"kernel": np.pad(head, ((0, 0), (0, pad)))}
  return params
