"""Checkpoint conversion: our lca-train work directories <-> the paper's PyTorch layout.

    from lca_jax.interop import convert
    convert.to_torch("workdirs/run", "export/run", dtype="bfloat16")   # config.json + model.safetensors
    convert.from_torch("export/run", "workdirs/imported")              # an lca-train work directory

``to_torch`` reads anything ``lca_jax.load`` reads (a work directory's latest or given step, or an
upstream directory); ``export_params`` writes params held in memory (sharded or not). The layout
and its documented extras (MLP-MBP, SpaceByte) are in ``interop/upstream.py``.

``from_torch`` writes a work directory in the format of ``lca_jax/train/checkpoint.py``:
``train_config.json`` and an orbax checkpoint at step 0. Two flavours:

  * default: items ``params``, ``step``, ``rng``, ``meta`` only. ``lca_jax.load`` /
    ``lca-sample`` serve it and ``train.init_from=<workdir>`` fine-tunes from it (fresh
    optimizer). It cannot be resumed in place (it has no optimizer or data state, and no run
    config); ``lca-train`` says so as a config mismatch.
  * ``config=`` a run config (ml_collections, as ``lca-train --config`` loads): a complete step-0
    TrainState (params, fresh optimizer state, rng, data-iterator state) saved by the training
    system's own Checkpointer, with that config as the run config, so
    ``lca-train --config SAME --workdir OUT`` resumes from it. The config's model must describe
    the imported model (its training-only fields — dtype, dropout, max_latent_ratio, remat,
    attention_impl, boundary-loss prior — are taken from the config).

The embedding and head are padded to ``vocab_size`` rows (default: the vocabulary rounded up to
a multiple of 128, 261 -> 384, as our configs use); padding rows are zero.

Round trip: ``to_torch`` of a directory written by ``from_torch`` (or of an upstream directory)
gives back every tensor of the source bit for bit when exported in the source's dtype, the
RoPE buffer ``rotary_embd.inv_freq`` included: the import keeps the source's own buffer in
``OUT/upstream_extras.safetensors`` (``interop/upstream.py``), which later checkpoints of
that work directory keep using.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from lca_jax import api
from lca_jax.errors import LcaError
from lca_jax.interop import upstream
from lca_jax.interop.errors import CheckpointError
from lca_jax.model.config import ConfigError, ModelConfig
from lca_jax.train import checkpoint as ckpt_lib
from lca_jax.train import run_config
from lca_jax.train import sharding as shd
from lca_jax.train import state as st
from lca_jax.workdir.params import CKPT_DIR, checkpoint_dir, is_workdir

VOCAB_MULTIPLE = 128


class ConvertError(LcaError, ValueError):
  """A conversion that cannot be done (bad input, existing output, mismatched model)."""


# ---- output directories ---------------------------------------------------------------------
def _same_path(a: str, b: str) -> bool:
  return os.path.realpath(a) == os.path.realpath(b)


def _prepare_out(out: str, force: bool, src: Optional[str] = None, workdir: bool = False) -> str:
  """Refuse an existing non-empty ``out`` unless ``force``; with ``force`` remove only what we
  are about to write (a work directory's checkpoints/ and run config)."""
  out = os.path.abspath(os.path.expanduser(os.fspath(out)))
  if src is not None and os.path.exists(src) and _same_path(src, out):
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
        for name in (run_config.CONFIG_FILE, upstream.EXTRAS_FILE):
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
  out = _prepare_out(out, force)
  try:
    upstream.write_dir(out, params, cfg, dtype, extras=extras)
  except CheckpointError as e:
    raise ConvertError(str(e)) from None
  return out


def to_torch(
  src, out: str, dtype: str = "float32", *, step: Optional[int] = None, force: bool = False
) -> str:
  """Export ``src`` — a path ``lca_jax.load`` accepts (work directory: latest checkpoint or
  ``step``; upstream directory) or a loaded ``lca_jax.Model`` — to ``out`` (config.json +
  model.safetensors). Returns the absolute output path."""
  upstream.export_dtype(dtype)
  if isinstance(src, api.Model):
    model = src
  else:
    src = os.fspath(src)
    out_abs = os.path.abspath(os.path.expanduser(os.fspath(out)))
    if os.path.exists(src) and _same_path(src, out_abs):
      raise ConvertError(f"output directory {out_abs} is the source; choose another --out")
    _check_out_free(out_abs, force)
    try:
      model = api.load(src, step=step)
    except (api.LoadError, CheckpointError, ConfigError, FileNotFoundError) as e:
      raise ConvertError(str(e)) from None
  return export_params(
    model.params, model.cfg, out, dtype, force=force, extras=getattr(model, "extras", None)
  )


def _check_out_free(out: str, force: bool, workdir: bool = False):
  """The checks of ``_prepare_out``, before any slow loading; changes nothing."""
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConvertError(f"output path {out} exists and is not a directory")
  if os.path.isdir(out) and os.listdir(out):
    if not force:
      raise ConvertError(
        f"output directory {out} exists and is not empty (use --force to overwrite)"
      )
    _check_kind(out, workdir)


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


def write_workdir(
  out: str, params, cfg: ModelConfig, *, meta: Optional[dict] = None, seed: int = 0
) -> str:
  """A fresh lca-train work directory holding ``params`` of ``cfg`` as step 0, in the format of
  ``lca_jax.train.checkpoint`` (items params / step / rng / meta; no optimizer or data state):
  ``lca_jax.load`` serves it, ``train.init_from`` fine-tunes from it. ``out`` must be empty."""
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  arrays = jax.tree_util.tree_map(lambda a: jax.device_put(np.asarray(a, np.float32), dev), params)
  run_config.write_run_config(out, {"model": cfg.to_dict()}, cfg)
  handlers = {name: ocp.StandardCheckpointHandler() for name in ("params", "step", "rng")}
  handlers["meta"] = ocp.JsonCheckpointHandler()
  opts = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
  with ocp.CheckpointManager(checkpoint_dir(out), options=opts, item_handlers=handlers) as mngr:
    mngr.save(
      0,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(arrays),
        step=ocp.args.StandardSave({"step": jnp.zeros((), jnp.int32)}),
        rng=ocp.args.StandardSave({"key": st.seed_key(seed)}),
        meta=ocp.args.JsonSave(dict(meta or {}, model=cfg.to_dict(), step=0)),
      ),
      force=True,
    )
    mngr.wait_until_finished()
  return out


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


def write_resumable_workdir(
  out: str, params, cfg: ModelConfig, config, *, meta: Optional[dict] = None, devices=None
) -> str:
  """A work directory that ``lca-train --config <config> --workdir out`` resumes at step 0:
  the full TrainState (``params``, fresh optimizer state, rng) and the data-iterator state,
  saved by ``lca_jax.train.checkpoint.Checkpointer`` with ``config`` as the run config.
  ``devices``: the mesh's devices while writing (default all; the checkpoint restores onto
  any mesh)."""
  # lazy: the training stack needs grain (the data / train extras); to_torch and the plain
  # from_torch work without it
  from lca_jax.train import inputs, loop  # pylint: disable=g-import-not-at-top

  model_cfg = loop.model_config_of(config)
  diffs = _model_diffs(cfg, model_cfg)
  if diffs:
    raise ConvertError("the config's model does not describe the checkpoint: " + "; ".join(diffs))
  inputs.check_data_files(config)
  setup = loop.prepare(config, devices)
  # The checkpoint's own padding may differ from the config's vocab_size: re-pad.
  params = _repad_vocab(params, cfg, model_cfg.vocab_size)
  bad = _shape_diffs(setup.abstract.params, params)
  if bad:
    raise ConvertError(
      "the config's model does not match the checkpoint's tensors: " + "; ".join(bad[:6])
    )
  with shd.mesh_context(setup.mesh):
    state = st.state_from_params(params, setup.tx, int(config.train.seed), setup.shardings)
  pipeline = inputs.make_train_pipeline(config, setup.plan)
  try:
    data_state = pipeline.get_state()
  finally:
    pipeline.close()
  run_config.write_run_config(out, config.to_dict(), model_cfg)
  ck = ckpt_lib.Checkpointer(out, keep=int(config.train.keep_checkpoints), async_save=False)
  try:
    ck.save(state, data_state, meta=dict(meta or {}, model=model_cfg.to_dict(), bytes_seen=0))
  finally:
    ck.close()
  return out


def _shape_diffs(want, got) -> list:
  w = {
    jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(want)
  }
  g = {
    jax.tree_util.keystr(k): tuple(np.shape(v)) for k, v in jax.tree_util.tree_leaves_with_path(got)
  }
  out = [f"{k}: missing" for k in sorted(set(w) - set(g))]
  out += [f"{k}: unexpected" for k in sorted(set(g) - set(w))]
  return out + [
    f"{k}: checkpoint {g[k]}, config {w[k]}" for k in sorted(set(w) & set(g)) if w[k] != g[k]
  ]


def _repad_vocab(params, cfg: ModelConfig, vocab_size: int):
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


def from_torch(
  src: str,
  out: str,
  *,
  vocab_size: Optional[int] = None,
  config: Any = None,
  force: bool = False,
  devices=None,
) -> str:
  """Import the upstream directory ``src`` (config.json + model.safetensors, float32 or bf16)
  into a new lca-train work directory ``out``. ``config``: a run config (ml_collections) to
  make ``out`` resumable by ``lca-train`` with that config (see the module docstring); its
  ``model.vocab_size`` then sets the padding. Returns the absolute output path."""
  src = os.fspath(src)
  out = os.path.abspath(os.path.expanduser(os.fspath(out)))
  if os.path.exists(src) and _same_path(src, out):
    raise ConvertError(f"output directory {out} is the source; choose another --out")
  _check_out_free(out, force, workdir=True)
  if config is not None and vocab_size is None:
    vocab_size = int(config.model.vocab_size)
  try:
    cfg, params, _, extras = read_torch_dir(src, vocab_size, with_extras=True)
  except CheckpointError as e:
    raise ConvertError(str(e)) from None
  meta = {"imported_from": os.path.abspath(src)}
  out = _prepare_out(out, force, src, workdir=True)
  if config is None:
    out = write_workdir(out, params, cfg, meta=meta)
  else:
    out = write_resumable_workdir(out, params, cfg, config, meta=meta, devices=devices)
  try:
    upstream.write_extras(out, extras)
  except CheckpointError as e:
    raise ConvertError(str(e)) from None
  return out
