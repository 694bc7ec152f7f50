"""The paper's PyTorch checkpoint layout (docs/design.md §7.2) <-> our parameter tree.

A directory holds ``config.json`` (upstream keys) and ``model.safetensors`` (torch state-dict
names, Linear weights [out, in], float32 or bfloat16). LCA-MBP, FxT and LlamaByte directories
are exactly what the paper's code loads with ``load_state_dict``. Extras that upstream lacks,
documented here and in ``interop/torch_model.py`` (written only when the model needs them):

  * MLP-MBP heads: config ``mlp_mbp_heads`` (k) and ``mlp_mbp_inner`` (hidden width); keys
    ``mlp_mbp.{i}.norm.weight`` [d], ``mlp_mbp.{i}.fc1.weight`` [inner, d],
    ``mlp_mbp.{i}.fc2.weight`` [d, inner] for i = 0..k-1.
  * SpaceByte: ``boundaries_type: "spacebyte"`` with ``spacebyte_max_group``; no
    boundary-predictor weights.
  * ``bp_inter_dim``: the boundary predictor's hidden width when it differs from
    ``lm_inter_dim`` (upstream always uses ``lm_inter_dim``).

Our embedding/head may hold more rows than the vocabulary (``vocab_size`` > ``n_tokens``,
padding for speed): export writes rows 0..n_tokens-1, import pads with zeros. The
``model.safetensors`` file itself is read and written by :mod:`lca_jax.interop.safetensors_io`.

The RoPE buffer ``rotary_embd.inv_freq`` is not a parameter of ours (the JAX model computes its
rotations from ``lm_re_base``), and recomputing it is not bit-exact across libraries (numpy and
torch's float32 ``pow`` differ by 1 ulp for some head dims). So the source's own tensor is kept
as an *extra*: ``lca_jax.load`` of an upstream directory holds it in ``Model.extras``, an
import (``lca-convert from-torch``) stores it in ``WORKDIR/upstream_extras.safetensors``, and an
export writes it back unchanged (same bits, same dtype); without one (a model trained from
scratch, or ``train.init_from`` of an imported directory) it is computed in float32.
"""

from __future__ import annotations

import ast
import copy
import functools
import json
import os
from typing import Dict, Optional, Tuple

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils

from lca_jax.interop.errors import CheckpointError
from lca_jax.interop.safetensors_io import read_safetensors, write_safetensors
from lca_jax.model.config import ConfigError, ModelConfig
from lca_jax.model.hierarchical import init_params

STAGES = ("encoder", "lm", "decoder", "mbp")
ATTN = ("q_proj", "k_proj", "v_proj", "out_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
DEFAULT_SCRIPT = "<en>"
BP_PREFIX = f"script_to_bp_layers.{DEFAULT_SCRIPT}.boundary_predictor"
INV_FREQ = "rotary_embd.inv_freq"
EXPORT_DTYPES = ("float32", "bfloat16")
EXTRAS_FILE = "upstream_extras.safetensors"  # in a work directory: tensors kept for export
# A transformers export (``lca-convert to-hf``, interop/hf_export.py) holds the same layout: its
# config.json keeps the upstream config under HF_CONFIG_KEY, its model.safetensors names every
# tensor with HF_PREFIX; ``read_dir`` reads both kinds of directory.
HF_CONFIG_KEY = "lca_config"
HF_PREFIX = "model."


# ---- config ---------------------------------------------------------------------------------
def parse_model_config(s: str) -> Tuple[int, int, int, int]:
  try:
    enc, (lm,), dec, mbp = ast.literal_eval(s)
    return int(enc), int(lm), int(dec), int(mbp)
  except (ValueError, SyntaxError, TypeError) as e:
    raise CheckpointError(
      f"config.json: cannot parse model_config {s!r} (expected '[enc, (lm,), dec, mbp]')"
    ) from e


def script_of(uc: dict) -> str:
  """The script whose boundary predictor upstream uses (the first of all_script_ids_dict)."""
  scripts = uc.get("all_script_ids_dict") or {DEFAULT_SCRIPT: None}
  return next(iter(scripts))


def config_from_upstream(uc: dict, vocab_size: Optional[int] = None) -> ModelConfig:
  """ModelConfig for an upstream config.json dict. ``vocab_size``: embedding rows (default the
  vocabulary size ``lm_vocab_size``; larger pads)."""
  try:
    enc, lm, dec, mbp = parse_model_config(uc["model_config"])
    flat = lm == 0 and dec == 0
    btype = uc.get("boundaries_type", "none" if flat else "gumbel")
    if btype not in ("gumbel", "none", "spacebyte"):
      raise CheckpointError(
        f"config.json: unknown boundaries_type {btype!r} (supported: gumbel, spacebyte, none)"
      )
    if flat and (btype != "none" or mbp):
      raise CheckpointError(
        f"config.json: a flat model_config {uc['model_config']!r} needs "
        f"boundaries_type 'none' and no MBP stage (got {btype!r})"
      )
    if not flat and btype == "none":
      raise CheckpointError(
        f"config.json: hierarchical model_config {uc['model_config']!r} "
        "with boundaries_type 'none' is not a supported variant"
      )
    if mbp and not uc.get("use_group_attn", True):
      raise CheckpointError(
        "config.json: an MBP stage without use_group_attn is not an LCA-MBP "
        "model; this variant is not supported"
      )
    act = uc.get("activation_function", "gelu")
    if not flat and btype == "gumbel" and act != "gelu":
      raise CheckpointError(
        f"config.json: activation_function {act!r} is not supported "
        "(the boundary predictor uses exact gelu)"
      )
    if float(uc.get("lm_attn_scaling", 1.0)) != 1.0:
      raise CheckpointError(
        f"config.json: lm_attn_scaling {uc['lm_attn_scaling']} is not supported (only 1.0)"
      )
    scripts = uc.get("all_script_ids_dict") or {DEFAULT_SCRIPT: [0.333, 0.023]}
    prior, std = scripts[script_of(uc)]
    n_mlp = int(uc.get("mlp_mbp_heads", 0))
    inter = int(uc["lm_inter_dim"])
    mlp_inner = int(uc.get("mlp_mbp_inner", inter)) if n_mlp else 0
    bp_inner = int(uc.get("bp_inter_dim", inter))
    n_tokens = int(uc["lm_vocab_size"])
    return ModelConfig(
      kind="flat" if flat else "hierarchical",
      n_tokens=n_tokens,
      vocab_size=int(vocab_size or n_tokens),
      d_model=int(uc["lm_hidden_dim"]),
      d_inner=inter,
      n_heads=int(uc["lm_n_heads"]),
      n_kv_heads=int(uc["lm_n_kv_heads"]),
      n_enc=enc,
      n_lm=lm,
      n_dec=dec,
      n_mbp=mbp,
      n_mlp_mbp=n_mlp,
      mlp_mbp_inner=0 if mlp_inner == inter else mlp_inner,
      bp_d_inner=0 if bp_inner == inter else bp_inner,
      boundaries="spacebyte" if btype == "spacebyte" else "learned",
      spacebyte_max_group=int(uc.get("spacebyte_max_group", 16)),
      bp_temp=float(uc.get("temp", 0.5)),
      bp_prior=float(prior),
      bp_prior_std=float(std),
      bp_lower_k=float(uc.get("s_lower_bound", 3)),
      rope_base=float(uc["lm_re_base"]),
      rms_eps=float(uc["lm_rms_eps"]),
      dropout=float(uc.get("lm_dropout", 0.0)),
      max_latent_ratio=1.0,
      max_seq_len=int(uc.get("seq_len", uc.get("lm_max_position_embeddings", 4096))),
    )
  except KeyError as e:
    raise CheckpointError(f"config.json: missing key {e.args[0]!r}") from None
  except (ConfigError, TypeError) as e:
    raise CheckpointError(f"config.json: not a supported model ({e})") from None
  except ValueError as e:
    if isinstance(e, CheckpointError):
      raise
    raise CheckpointError(f"config.json: bad value ({e})") from None


def _num(x: float):
  return int(x) if float(x).is_integer() else x


def config_to_upstream(cfg: ModelConfig) -> dict:
  """An upstream config.json dict for ``cfg`` (the keys of the paper's own checkpoints, plus the
  documented extras when the model needs them)."""
  if cfg.hierarchical:
    mc = f"[{cfg.n_enc}, ({cfg.n_lm},), {cfg.n_dec}, {cfg.n_mbp}]"
    btype = "spacebyte" if cfg.boundaries == "spacebyte" else "gumbel"
  else:
    mc, btype = f"[{cfg.n_enc}, (0,), 0, 0]", "none"
  prior = [cfg.bp_prior, cfg.bp_prior_std]
  out = {
    "lm_vocab_size": cfg.n_tokens,
    "n_token": cfg.n_tokens,
    "lm_hidden_dim": cfg.d_model,
    "lm_inter_dim": cfg.d_inner,
    "lm_n_heads": cfg.n_heads,
    "lm_n_kv_heads": cfg.n_kv_heads,
    "lm_dropout": cfg.dropout,
    "dropout": cfg.dropout,
    "lm_rms_eps": cfg.rms_eps,
    "lm_re_base": cfg.rope_base,
    "lm_max_position_embeddings": cfg.max_seq_len,
    "lm_attn_scaling": 1.0,
    "lm_tie_weights": False,
    "id_to_script": {"259": DEFAULT_SCRIPT, "260": "<eot>"},
    "all_script_ids_dict": {DEFAULT_SCRIPT: prior, "<eot>": list(prior)},
    "model_config": mc,
    "boundaries_type": btype,
    "num_predictors": 1,
    "activation_function": "gelu",
    "temp": cfg.bp_temp,
    "use_binomial": False,
    "s_lower_bound": _num(cfg.bp_lower_k),
    "spikes_left": 2,
    "use_group_attn": cfg.n_mbp > 0,
    "attn_type": "prev_group_self",
    "ignore_index": -100,
    "seq_len": cfg.max_seq_len,
  }
  if cfg.n_mlp_mbp:
    out["mlp_mbp_heads"] = cfg.n_mlp_mbp
    out["mlp_mbp_inner"] = cfg.mlp_hidden
  if cfg.hierarchical and cfg.boundaries == "spacebyte":
    out["spacebyte_max_group"] = cfg.spacebyte_max_group
  if cfg.hierarchical and cfg.boundaries == "learned" and cfg.bp_hidden != cfg.d_inner:
    out["bp_inter_dim"] = cfg.bp_hidden
  return out


# ---- names ----------------------------------------------------------------------------------
def _stage_layers(cfg: ModelConfig):
  if not cfg.hierarchical:
    return [("encoder", 0, cfg.n_enc)]
  out = [("encoder", 0, cfg.n_enc), ("lm", 1, cfg.n_lm), ("decoder", 2, cfg.n_dec)]
  if cfg.n_mbp:
    out.append(("mbp", 3, cfg.n_mbp))
  return out


def name_map(cfg: ModelConfig, script: str = DEFAULT_SCRIPT):
  """[(torch key, our param path, transpose?)] for every tensor of ``cfg``."""
  rows = [
    ("token_embedding.weight", ("token_embedding", "embedding"), False),
    ("head.weight", ("head", "kernel"), True),
    ("norm.weight", ("norm", "scale"), False),
  ]
  for stage, idx, n in _stage_layers(cfg):
    for i in range(n):
      pre, path = f"blocks.{idx}.{i}", (stage, f"layer_{i}")
      rows += [
        (f"{pre}.norm1.weight", path + ("norm1", "scale"), False),
        (f"{pre}.norm2.weight", path + ("norm2", "scale"), False),
      ]
      rows += [(f"{pre}.attn.{p}.weight", path + ("attn", p, "kernel"), True) for p in ATTN]
      rows += [(f"{pre}.mlp.{p}.weight", path + ("mlp", p, "kernel"), True) for p in MLP]
  if cfg.hierarchical:
    rows.append(("null_group", ("null_group",), False))
    if cfg.boundaries == "learned":
      bp = f"script_to_bp_layers.{script}.boundary_predictor"
      for tk, ours in (("0", "fc1"), ("2", "fc2")):
        rows += [
          (f"{bp}.{tk}.weight", ("boundary_predictor", ours, "kernel"), True),
          (f"{bp}.{tk}.bias", ("boundary_predictor", ours, "bias"), False),
        ]
    for i in range(cfg.n_mlp_mbp):
      path = (f"mlp_mbp_{i}",)
      rows += [
        (f"mlp_mbp.{i}.norm.weight", path + ("norm", "scale"), False),
        (f"mlp_mbp.{i}.fc1.weight", path + ("fc1", "kernel"), True),
        (f"mlp_mbp.{i}.fc2.weight", path + ("fc2", "kernel"), True),
      ]
  return rows


def _set(tree, path, value):
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def inv_freq(cfg: ModelConfig) -> np.ndarray:
  d = cfg.head_dim
  return (1.0 / (cfg.rope_base ** (np.arange(0, d, 2, dtype=np.float32) / d))).astype(np.float32)


def _inv_freq_matches(got: np.ndarray, cfg: ModelConfig) -> bool:
  want = inv_freq(cfg)
  got = np.asarray(got).astype(np.float32).reshape(-1)
  return got.shape == want.shape and bool(np.allclose(got, want, rtol=1e-3, atol=0))


def extras_of(sd: Dict[str, np.ndarray], cfg: ModelConfig) -> Dict[str, np.ndarray]:
  """The tensors of an upstream state dict that an export must give back as they are
  (``rotary_embd.inv_freq``, when it matches ``cfg``), copied out of ``sd``."""
  out = {}
  if INV_FREQ in sd and _inv_freq_matches(sd[INV_FREQ], cfg):
    out[INV_FREQ] = np.array(sd[INV_FREQ], copy=True)
  return out


def write_extras(workdir: str, extras: Dict[str, np.ndarray]) -> None:
  """Store ``extras`` in ``workdir/EXTRAS_FILE`` (nothing is written for none)."""
  if extras:
    write_safetensors(os.path.join(workdir, EXTRAS_FILE), dict(extras))


def read_extras(workdir: str, cfg: ModelConfig) -> Dict[str, np.ndarray]:
  """The extras a work directory holds ({} without ``EXTRAS_FILE``)."""
  path = os.path.join(workdir, EXTRAS_FILE)
  if not os.path.isfile(path):
    return {}
  return extras_of(read_safetensors(path), cfg)


def param_shapes(cfg: ModelConfig):
  """Our param tree of shape tuples for ``cfg`` (nothing allocated; a fresh copy per call)."""
  return copy.deepcopy(_param_shapes(cfg))


@functools.lru_cache(maxsize=32)
def _param_shapes(cfg: ModelConfig):
  abstract = jax.eval_shape(lambda: nn.unbox(init_params(cfg, jax.random.PRNGKey(0), seq_len=8)))
  return jax.tree_util.tree_map(lambda x: tuple(x.shape), abstract)


def _ignorable(key: str, uc: Optional[dict]) -> bool:
  """Keys upstream may hold that we do not need: the RoPE buffer and the predictors of other
  scripts (upstream decides boundaries with the first script's predictor)."""
  if key == INV_FREQ:
    return True
  return (
    key.startswith("script_to_bp_layers.")
    and uc is not None
    and not key.startswith(f"script_to_bp_layers.{script_of(uc)}.")
  )


def state_dict_to_params(
  sd: Dict[str, np.ndarray], cfg: ModelConfig, shapes=None, uc: Optional[dict] = None
) -> dict:
  """Our float32 params from an upstream state dict.

  ``shapes``: our expected param shapes (e.g. ``param_shapes(cfg)``); the embedding and head
  are zero-padded to ``cfg.vocab_size`` rows. ``uc``: the upstream config (script of the
  boundary predictor, tied weights); with it, tensors the model does not use are an error.
  """
  script = script_of(uc) if uc is not None else DEFAULT_SCRIPT
  if (
    uc is not None
    and uc.get("lm_tie_weights")
    and "head.weight" not in sd
    and "token_embedding.weight" in sd
  ):
    sd = dict(sd, **{"head.weight": sd["token_embedding.weight"]})
  params: dict = {}
  missing = []
  rows = name_map(cfg, script)
  for key, path, transpose in rows:
    if key not in sd:
      missing.append(key)
      continue
    src = sd[key]
    arr = np.asarray(src).astype(np.float32)
    torch_want = None
    if shapes is not None:
      want = tuple(_get(shapes, path))
      torch_want = want[::-1] if transpose else want
      if key == "null_group":
        torch_want = (1, 1) + want
      if key in ("token_embedding.weight", "head.weight"):
        torch_want = (cfg.n_tokens,) + torch_want[1:]
      if tuple(arr.shape) != tuple(torch_want):
        raise CheckpointError(
          f"tensor {key}: shape {tuple(arr.shape)} in the checkpoint, "
          f"but the config needs {tuple(torch_want)}"
        )
    if key == "null_group":
      arr = arr.reshape(-1)
    if transpose:
      arr = arr.T
    if shapes is not None and key in ("token_embedding.weight", "head.weight"):
      if key == "token_embedding.weight":
        arr = np.pad(arr, ((0, want[0] - arr.shape[0]), (0, 0)))
      else:
        arr = np.pad(arr, ((0, 0), (0, want[1] - arr.shape[1])))
    _set(params, path, np.ascontiguousarray(arr))
  if missing:
    raise CheckpointError(
      f"model.safetensors lacks {len(missing)} tensor(s) the config needs: "
      f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
    )
  if uc is not None:
    known = {k for k, _, _ in rows}
    extra = sorted(k for k in sd if k not in known and not _ignorable(k, uc))
    if extra:
      raise CheckpointError(
        f"model.safetensors holds {len(extra)} tensor(s) the config does not "
        f"use: {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''} "
        "(config.json and weights disagree about the variant)"
      )
    if INV_FREQ in sd and not _inv_freq_matches(sd[INV_FREQ], cfg):
      raise CheckpointError(
        f"tensor {INV_FREQ}: shape {tuple(np.shape(sd[INV_FREQ]))} / values "
        f"do not match lm_re_base {cfg.rope_base} and head dim "
        f"{cfg.head_dim} (expected shape {inv_freq(cfg).shape})"
      )
  return params


def to_host(x) -> np.ndarray:
  """A numpy copy of a (possibly sharded, possibly multi-host) jax array or numpy array."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def params_to_state_dict(
  params, cfg: ModelConfig, dtype="float32", extras: Optional[Dict[str, np.ndarray]] = None
) -> Dict[str, np.ndarray]:
  """Upstream state dict (rows 0..n_tokens-1 of the embedding and head) from our params, which
  may be sharded jax arrays. ``dtype``: 'float32' or 'bfloat16' (ml_dtypes; rotary buffer stays
  float32, as upstream registers it). ``extras`` (``Model.extras``): the source's own
  ``rotary_embd.inv_freq``, written unchanged instead of the computed one."""
  np_dtype = export_dtype(dtype)
  shapes = None
  sd = {}
  for key, path, transpose in name_map(cfg):
    try:
      leaf = _get(params, path)
    except (KeyError, TypeError):
      raise CheckpointError(f"params lack {'/'.join(path)} (needed for {key})") from None
    arr = to_host(getattr(leaf, "value", leaf)).astype(np.float32)
    if shapes is None:
      shapes = param_shapes(cfg)
    want = tuple(_get(shapes, path))
    if tuple(arr.shape) != want:
      raise CheckpointError(
        f"param {'/'.join(path)}: shape {tuple(arr.shape)}, but the config needs {want}"
      )
    if transpose:
      arr = arr.T
    if key in ("token_embedding.weight", "head.weight"):
      arr = arr[: cfg.n_tokens]
    if key == "null_group":
      arr = arr.reshape(1, 1, -1)
    sd[key] = np.ascontiguousarray(arr.astype(np_dtype))
  kept = extras_of(extras or {}, cfg)
  sd[INV_FREQ] = np.ascontiguousarray(kept[INV_FREQ]) if INV_FREQ in kept else inv_freq(cfg)
  return sd


def export_dtype(dtype) -> np.dtype:
  name = getattr(dtype, "name", None) or str(dtype)
  name = {"bf16": "bfloat16", "f32": "float32", "fp32": "float32"}.get(name, name)
  if name not in EXPORT_DTYPES:
    raise CheckpointError(f"unsupported export dtype {dtype!r} (use float32 or bfloat16)")
  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(np.float32)


# ---- directories ----------------------------------------------------------------------------
def read_dir(path: str):
  """(upstream config dict, state dict of numpy arrays) of an upstream directory or of a
  transformers export (``HF_CONFIG_KEY``), with clear errors."""
  cfg_path = os.path.join(path, "config.json")
  st_path = os.path.join(path, "model.safetensors")
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: no such directory")
  for p in (cfg_path, st_path):
    if not os.path.isfile(p):
      raise CheckpointError(
        f"{path}: missing {os.path.basename(p)} (expected the upstream layout: "
        "config.json + model.safetensors)"
      )
  try:
    with open(cfg_path, encoding="utf-8") as f:
      uc = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{cfg_path}: unreadable config ({e})") from None
  if not isinstance(uc, dict):
    raise CheckpointError(f"{cfg_path}: expected a JSON object")
  sd = read_safetensors(st_path)
  if HF_CONFIG_KEY in uc:
    return _from_hf_export(path, uc, sd)
  return uc, sd


def _from_hf_export(path: str, hf_config: dict, sd: Dict[str, np.ndarray]):
  """(upstream config dict, state dict) of the transformers export at ``path``: its config.json
  holds the upstream config under ``HF_CONFIG_KEY``, its tensors are named ``HF_PREFIX`` + the
  upstream name."""
  uc = hf_config[HF_CONFIG_KEY]
  if not isinstance(uc, dict):
    raise CheckpointError(
      f"{os.path.join(path, 'config.json')}: {HF_CONFIG_KEY!r} is not a JSON object"
    )
  stray = sorted(k for k in sd if not k.startswith(HF_PREFIX))
  if stray:
    raise CheckpointError(
      f"{os.path.join(path, 'model.safetensors')}: tensor {stray[0]!r} lacks the "
      f"{HF_PREFIX!r} prefix of a transformers export"
    )
  return uc, {k[len(HF_PREFIX) :]: v for k, v in sd.items()}


def load_dir(path: str, vocab_size: Optional[int] = None):
  """(ModelConfig, float32 numpy params) of an upstream directory, fully checked."""
  uc, sd = read_dir(path)
  cfg = config_from_upstream(uc, vocab_size)
  return cfg, state_dict_to_params(sd, cfg, shapes=param_shapes(cfg), uc=uc)


def write_dir(
  path: str,
  params,
  cfg: ModelConfig,
  dtype="float32",
  extras: Optional[Dict[str, np.ndarray]] = None,
):
  """Write ``config.json`` + ``model.safetensors`` for ``params`` of ``cfg`` into ``path``
  (``extras``: see ``params_to_state_dict``)."""
  sd = params_to_state_dict(params, cfg, dtype, extras)
  os.makedirs(path, exist_ok=True)
  write_safetensors(os.path.join(path, "model.safetensors"), sd)
  tmp = os.path.join(path, "config.json.tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(config_to_upstream(cfg), f, indent=1)
  os.replace(tmp, os.path.join(path, "config.json"))
