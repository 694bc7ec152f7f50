"""The paper's PyTorch checkpoint layout (DESIGN §5) <-> our parameter tree.

A directory holds ``config.json`` (upstream keys) and ``model.safetensors`` (torch state-dict
names, Linear weights [out, in]). Extras that upstream lacks, documented here and in
``interop/torch_model.py``: MLP-MBP heads (config ``mlp_mbp_heads`` and ``mlp_mbp_inner``; keys
``mlp_mbp.{i}.norm.weight``, ``mlp_mbp.{i}.fc1.weight`` [inter, d], ``mlp_mbp.{i}.fc2.weight``
[d, inter]) and SpaceByte (``boundaries_type: "spacebyte"``, ``spacebyte_max_group``; no
boundary predictor weights).
"""
from __future__ import annotations

import ast
import json
import os
from typing import Dict, Tuple

import numpy as np

from lca_jax.model.config import ModelConfig

STAGES = ("encoder", "lm", "decoder", "mbp")
ATTN = ("q_proj", "k_proj", "v_proj", "out_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
BP_PREFIX = "script_to_bp_layers.<en>.boundary_predictor"


class CheckpointError(ValueError):
  """An upstream directory that cannot be read (missing file, bad shape, unknown variant)."""


def parse_model_config(s: str) -> Tuple[int, int, int, int]:
  try:
    enc, (lm,), dec, mbp = ast.literal_eval(s)
  except (ValueError, SyntaxError, TypeError) as e:
    raise CheckpointError(f"config.json: cannot parse model_config {s!r} "
                          "(expected '[enc, (lm,), dec, mbp]')") from e
  return int(enc), int(lm), int(dec), int(mbp)


def config_from_upstream(uc: dict) -> ModelConfig:
  """ModelConfig for an upstream config.json dict."""
  try:
    enc, lm, dec, mbp = parse_model_config(uc["model_config"])
    btype = uc.get("boundaries_type", "gumbel")
    flat = lm == 0 and dec == 0
    if btype not in ("gumbel", "none", "spacebyte"):
      raise CheckpointError(f"config.json: unknown boundaries_type {btype!r} "
                            "(supported: gumbel, spacebyte, none)")
    prior, std = next(iter(uc.get("all_script_ids_dict", {"<en>": [0.333, 0.023]}).values()))
    n_mlp = int(uc.get("mlp_mbp_heads", 0))
    mlp_inner = int(uc.get("mlp_mbp_inner", 0)) if n_mlp else 0
    if mbp and not uc.get("use_group_attn", True):
      raise CheckpointError("config.json: an MBP stage without use_group_attn is not an LCA-MBP "
                            "model; this variant is not supported")
    return ModelConfig(
        kind="flat" if flat else "hierarchical",
        n_tokens=int(uc["lm_vocab_size"]), vocab_size=int(uc["lm_vocab_size"]),
        d_model=int(uc["lm_hidden_dim"]), d_inner=int(uc["lm_inter_dim"]),
        n_heads=int(uc["lm_n_heads"]), n_kv_heads=int(uc["lm_n_kv_heads"]),
        n_enc=enc, n_lm=lm, n_dec=dec, n_mbp=mbp, n_mlp_mbp=n_mlp, mlp_mbp_inner=mlp_inner,
        boundaries="spacebyte" if btype == "spacebyte" else "learned",
        spacebyte_max_group=int(uc.get("spacebyte_max_group", 16)),
        bp_temp=float(uc.get("temp", 0.5)), bp_prior=float(prior), bp_prior_std=float(std),
        bp_lower_k=float(uc.get("s_lower_bound", 3)), rope_base=float(uc["lm_re_base"]),
        rms_eps=float(uc["lm_rms_eps"]), max_latent_ratio=1.0,
        max_seq_len=int(uc.get("seq_len", uc.get("lm_max_position_embeddings", 4096))))
  except KeyError as e:
    raise CheckpointError(f"config.json: missing key {e.args[0]!r}") from e


def config_to_upstream(cfg: ModelConfig) -> dict:
  """An upstream config.json dict for ``cfg`` (same keys as the paper's own checkpoints)."""
  if cfg.hierarchical:
    mc = f"[{cfg.n_enc}, ({cfg.n_lm},), {cfg.n_dec}, {cfg.n_mbp}]"
    btype = "spacebyte" if cfg.boundaries == "spacebyte" else "gumbel"
  else:
    mc, btype = f"[{cfg.n_enc}, (0,), 0, 0]", "none"
  out = {
      "lm_vocab_size": cfg.n_tokens, "n_token": cfg.n_tokens, "lm_hidden_dim": cfg.d_model,
      "lm_inter_dim": cfg.d_inner, "lm_n_heads": cfg.n_heads, "lm_n_kv_heads": cfg.n_kv_heads,
      "lm_dropout": 0.0, "dropout": 0.0, "lm_rms_eps": cfg.rms_eps, "lm_re_base": cfg.rope_base,
      "lm_max_position_embeddings": cfg.max_seq_len, "lm_attn_scaling": 1.0, "lm_tie_weights": False,
      "id_to_script": {"259": "<en>", "260": "<eot>"},
      "all_script_ids_dict": {"<en>": [cfg.bp_prior, cfg.bp_prior_std],
                              "<eot>": [cfg.bp_prior, cfg.bp_prior_std]},
      "model_config": mc, "boundaries_type": btype, "num_predictors": 1,
      "activation_function": "gelu", "temp": cfg.bp_temp, "use_binomial": False,
      "s_lower_bound": int(cfg.bp_lower_k) if float(cfg.bp_lower_k).is_integer() else cfg.bp_lower_k,
      "spikes_left": 2, "use_group_attn": cfg.n_mbp > 0, "attn_type": "prev_group_self",
      "ignore_index": -100, "seq_len": cfg.max_seq_len,
  }
  if cfg.n_mlp_mbp:
    out["mlp_mbp_heads"] = cfg.n_mlp_mbp
    out["mlp_mbp_inner"] = cfg.mlp_hidden
  if cfg.boundaries == "spacebyte":
    out["spacebyte_max_group"] = cfg.spacebyte_max_group
  return out


def _stage_layers(cfg: ModelConfig):
  if not cfg.hierarchical:
    return [("encoder", 0, cfg.n_enc)]
  out = [("encoder", 0, cfg.n_enc), ("lm", 1, cfg.n_lm), ("decoder", 2, cfg.n_dec)]
  if cfg.n_mbp:
    out.append(("mbp", 3, cfg.n_mbp))
  return out


def name_map(cfg: ModelConfig):
  """[(torch key, our param path, transpose?)] for every tensor of ``cfg``."""
  rows = [("token_embedding.weight", ("token_embedding", "embedding"), False),
          ("head.weight", ("head", "kernel"), True), ("norm.weight", ("norm", "scale"), False)]
  for stage, idx, n in _stage_layers(cfg):
    for i in range(n):
      pre, path = f"blocks.{idx}.{i}", (stage, f"layer_{i}")
      rows += [(f"{pre}.norm1.weight", path + ("norm1", "scale"), False),
               (f"{pre}.norm2.weight", path + ("norm2", "scale"), False)]
      rows += [(f"{pre}.attn.{p}.weight", path + ("attn", p, "kernel"), True) for p in ATTN]
      rows += [(f"{pre}.mlp.{p}.weight", path + ("mlp", p, "kernel"), True) for p in MLP]
  if cfg.hierarchical:
    rows.append(("null_group", ("null_group",), False))
    if cfg.boundaries == "learned":
      for tk, ours in (("0", "fc1"), ("2", "fc2")):
        rows += [(f"{BP_PREFIX}.{tk}.weight", ("boundary_predictor", ours, "kernel"), True),
                 (f"{BP_PREFIX}.{tk}.bias", ("boundary_predictor", ours, "bias"), False)]
    for i in range(cfg.n_mlp_mbp):
      path = (f"mlp_mbp_{i}",)
      rows += [(f"mlp_mbp.{i}.norm.weight", path + ("norm", "scale"), False),
               (f"mlp_mbp.{i}.fc1.weight", path + ("fc1", "kernel"), True),
               (f"mlp_mbp.{i}.fc2.weight", path + ("fc2", "kernel"), True)]
  return rows


def _set(tree, path, value):
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def state_dict_to_params(sd: Dict[str, np.ndarray], cfg: ModelConfig, shapes=None) -> dict:
  """Our float32 params from an upstream state dict. ``shapes``: expected param shapes."""
  params: dict = {}
  missing = []
  for key, path, transpose in name_map(cfg):
    if key not in sd:
      missing.append(key)
      continue
    arr = np.asarray(sd[key], np.float32)
    if key == "null_group":
      arr = arr.reshape(-1)
    if transpose:
      arr = arr.T
    if shapes is not None:
      want = tuple(_get(shapes, path))
      if key in ("token_embedding.weight",) and arr.shape[0] < want[0]:
        arr = np.pad(arr, ((0, want[0] - arr.shape[0]), (0, 0)))
      if key == "head.weight" and arr.shape[1] < want[1]:
        arr = np.pad(arr, ((0, 0), (0, want[1] - arr.shape[1])))
      if arr.shape != want:
        raise CheckpointError(f"tensor {key}: shape {tuple(np.asarray(sd[key]).shape)} does not "
                              f"match the model's {want if not transpose else want[::-1]}")
    _set(params, path, arr)
  if missing:
    raise CheckpointError(f"model.safetensors lacks {len(missing)} tensor(s) the config needs, "
                          f"e.g. {', '.join(missing[:3])}")
  return params


def params_to_state_dict(params, cfg: ModelConfig, dtype=np.float32) -> Dict[str, np.ndarray]:
  """Upstream state dict (rows 0..n_tokens-1 of the embedding and head) from our params."""
  sd = {}
  for key, path, transpose in name_map(cfg):
    arr = np.asarray(_get(params, path), np.float32)
    if transpose:
      arr = arr.T
    if key in ("token_embedding.weight", "head.weight"):
      arr = arr[: cfg.n_tokens]
    if key == "null_group":
      arr = arr.reshape(1, 1, -1)
    sd[key] = np.ascontiguousarray(arr).astype(dtype)
  d = cfg.head_dim
  sd["rotary_embd.inv_freq"] = (1.0 / (cfg.rope_base ** (np.arange(0, d, 2, dtype=np.float32) / d))
                                ).astype(np.float32)
  return sd


def read_dir(path: str):
  """(upstream config dict, state dict of numpy arrays) with clear errors."""
  cfg_path = os.path.join(path, "config.json")
  st_path = os.path.join(path, "model.safetensors")
  for p in (cfg_path, st_path):
    if not os.path.isfile(p):
      raise CheckpointError(f"{path}: missing {os.path.basename(p)} (expected the upstream layout: "
                            "config.json + model.safetensors)")
  try:
    with open(cfg_path, encoding="utf-8") as f:
      uc = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{cfg_path}: unreadable config ({e})") from e
  try:
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
    sd = load_file(st_path)
  except Exception as e:  # safetensors raises several types for corrupt files
    raise CheckpointError(f"{st_path}: corrupt or unreadable safetensors file ({e})") from e
  return uc, sd


def write_dir(path: str, params, cfg: ModelConfig, dtype=np.float32):
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config_to_upstream(cfg), f, indent=1)
  save_file(params_to_state_dict(params, cfg, dtype), os.path.join(path, "model.safetensors"))
