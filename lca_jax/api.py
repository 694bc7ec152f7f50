"""The small public API: ``lca_jax.load(path)`` -> ``Model`` with ``forward`` and ``generate``."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lca_jax.decode import engine, weights
from lca_jax.decode.engine import DecodeError
from lca_jax.errors import LoadError
from lca_jax.interop import upstream
from lca_jax.interop.errors import CheckpointError
from lca_jax.model.config import DTYPES, ConfigError, ModelConfig
from lca_jax.model.hierarchical import ByteLM, init_params
from lca_jax.workdir import params as workdir_params

__all__ = ["LoadError", "Model", "load", "load_upstream"]


class Model:
  """An inference handle: a config, float32 params and jitted entry points.

  ``extras``: upstream tensors the JAX model does not use but an export must give back as they
  were (``rotary_embd.inv_freq`` of an imported checkpoint; see ``interop/upstream.py``)."""

  def __init__(self, cfg: ModelConfig, params, source: str = "", extras: Optional[dict] = None):
    self.cfg = cfg
    self.params = nn.unbox(params)
    self.source = source
    self.extras = dict(extras or {})
    self.module = ByteLM(cfg)
    self._forward = jax.jit(lambda p, ids: self.module.apply({"params": p}, ids, train=False))
    self._decode_params = None  # (the params it was built from, the tree)

  def decode_params(self):
    """``params`` plus the fused q/k/v and gate/up kernels decoding uses
    (``layers.fuse_decode_params``), built on first use and kept while ``params`` is the same
    object: a generate call then copies no weight (building them per call costs what dozens of
    batch-1 steps save), with the weights every use casts to the compute
    dtype stored in it (``layers.compute_dtype_weights``; a bfloat16 model's decode steps read
    half the bytes). Memory: the fused kernels are ~70% of each layer's weights more; with a
    bfloat16 ``cfg.dtype`` the whole tree is a bfloat16 copy beside the float32 params."""
    if self._decode_params is None or self._decode_params[0] is not self.params:
      self._decode_params = (self.params, weights.build(self.params, self.cfg.dtype))
    return self._decode_params[1]

  def __repr__(self):
    return f"Model({self.cfg.kind}, d={self.cfg.d_model}, source={self.source!r})"

  def forward(self, ids) -> dict:
    """Full inference forward on int ids [T] or [B, T].

    ``ids`` are vocabulary ids (``lca_jax.vocab``: byte b is id b + 3) in [0, n_tokens), at
    most ``cfg.max_seq_len`` per row. Returns numpy ``ntp_logits`` [.., T, V] (row t predicts
    byte t+1), ``mbp_logits`` (row t predicts byte t+2; None without an LCA-MBP head),
    ``mlp_mbp_logits`` [.., k, T, V] or None and ``boundaries`` [.., T] int32 (1 = byte t
    closes its group; None for a flat model). Bad ids raise ``DecodeError`` (a ValueError).
    """
    try:
      ids = np.asarray(ids)
    except (TypeError, ValueError):
      raise DecodeError(
        "forward expects integer ids of shape [T] or [B, T] (ragged rows?)"
      ) from None
    if ids.ndim not in (1, 2) or not np.issubdtype(ids.dtype, np.integer):
      raise DecodeError(
        f"forward expects integer ids of shape [T] or [B, T], got {ids.dtype} {ids.shape}"
      )
    if ids.size == 0:
      raise DecodeError("forward needs at least one byte")
    if ids.min() < 0 or ids.max() >= self.cfg.n_tokens:
      raise DecodeError(f"ids must lie in [0, {self.cfg.n_tokens}), got [{ids.min()}, {ids.max()}]")
    if ids.shape[-1] > self.cfg.max_seq_len:
      raise DecodeError(
        f"forward got {ids.shape[-1]} ids per row, more than the model context "
        f"(max_seq_len {self.cfg.max_seq_len})"
      )
    single = ids.ndim == 1
    out = self._forward(self.params, jnp.asarray(ids[None] if single else ids, jnp.int32))
    res = {}
    for key in ("ntp_logits", "mbp_logits", "mlp_mbp_logits", "boundaries"):
      v = out.get(key)
      if v is not None:
        v = np.asarray(v)
        v = v.astype(np.int32) if key == "boundaries" else v
        v = v[0] if single else v
      res[key] = v
    return res

  def generate(self, prompts, **kw):
    """Decode continuations; see ``lca_jax.decode.engine.generate`` for the options."""
    return engine.generate(self, prompts, **kw)


def _is_upstream_dir(path):
  return os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(
    os.path.join(path, "model.safetensors")
  )


def load_upstream(path: str) -> Model:
  uc, sd = upstream.read_dir(path)
  cfg = upstream.config_from_upstream(uc)
  params = upstream.state_dict_to_params(sd, cfg, shapes=_param_shapes(cfg))
  return Model(
    cfg,
    jax.tree_util.tree_map(jnp.asarray, params),
    source=path,
    extras=upstream.extras_of(sd, cfg),
  )


def _param_shapes(cfg: ModelConfig):
  abstract = jax.eval_shape(lambda: nn.unbox(init_params(cfg, jax.random.PRNGKey(0))))
  return jax.tree_util.tree_map(lambda x: x.shape, abstract)


def load(path: str, step: Optional[int] = None, dtype: Optional[str] = None) -> Model:
  """Load a model for inference from the paper's PyTorch layout (config.json +
  model.safetensors) or from an lca-train work directory (latest checkpoint, or ``step``).
  ``dtype`` (one of ``config.DTYPES``) replaces the checkpoint's compute dtype: float32 for a
  bfloat16 checkpoint on a CPU, whose XLA computes bfloat16 dots in float32 after converting
  the operands every step (docs/design.md §6.5)."""
  if dtype is not None and dtype not in DTYPES:
    raise LoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
  model = _load(os.fspath(path), step)
  if dtype is None or dtype == model.cfg.dtype:
    return model
  cfg = dataclasses.replace(model.cfg, dtype=dtype)
  return Model(cfg, model.params, source=model.source, extras=model.extras)


def _load(path: str, step: Optional[int]) -> Model:
  if not os.path.exists(path):
    raise LoadError(f"checkpoint path does not exist: {path}")
  if not os.path.isdir(path):
    raise LoadError(f"checkpoint path is not a directory: {path}")
  if _is_upstream_dir(path):
    try:
      return load_upstream(path)
    except CheckpointError as e:
      raise LoadError(str(e)) from e
  if workdir_params.is_workdir(path):
    try:
      cfg, params = workdir_params.load_for_inference(path, step=step)
    except ConfigError as e:  # a damaged or hand-edited train_config.json, named
      raise LoadError(str(e)) from None
    try:
      extras = upstream.read_extras(path, cfg)
    except CheckpointError as e:
      raise LoadError(str(e)) from e
    return Model(cfg, params, source=path, extras=extras)
  raise LoadError(
    f"{path}: neither an upstream checkpoint (config.json + model.safetensors) "
    "nor an lca-train work directory with checkpoints"
  )
