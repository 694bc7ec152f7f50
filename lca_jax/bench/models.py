"""Models to benchmark: a config file and / or shape flags, random weights, prompts of real text.

Without a config file the shape flags apply to configs/lca_mbp.py in float32 with plain XLA
attention (``FLAG_BASE``), missing ones taking the 11M shape (``SHAPE_DEFAULTS``): the models
the comparison with the paper's code builds.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from lca_jax import configs_io, vocab
from lca_jax.api import Model
from lca_jax.bench.args import parse_layers
from lca_jax.model.config import ModelConfig
from lca_jax.model.hierarchical import init_params

# the repository checkout this package lives in (its configs/ folder)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
BASE_CONFIG = os.path.join(CONFIGS, "lca_mbp.py")
# the shape flags' defaults without a config file (the 11M model)
SHAPE_DEFAULTS = dict(d_model=256, d_inner=1024, n_heads=4, n_kv_heads=0, layers="2,4,2,2")
# what a model of shape flags sets besides the shape (float32, plain XLA attention, LCA-MBP)
FLAG_BASE = (
  "model.kind=hierarchical",
  "model.boundaries=learned",
  "model.n_mlp_mbp=0",
  "model.max_latent_ratio=0.0",
  "model.dropout=0.0",
  "model.dtype=float32",
  "model.attention_impl=xla",
)


def prompt_ids(n_bytes: int, seed: int = 0):
  """A real-text prompt from the bundled corpus (held-out part), cut to n_bytes."""
  from lca_jax.data import demo_corpus_path, read_documents  # pylint: disable=g-import-not-at-top

  docs = [d for i, d in enumerate(read_documents([demo_corpus_path()], "text")) if i % 20 == 19]
  text = "\n\n".join(docs[seed:])
  return vocab.encode(text)[:n_bytes]


def shape_overrides(d_model=None, d_inner=None, n_heads=None, n_kv_heads=None, layers=None):
  """``model.key=value`` overrides for the given shape values (None = not given; n_kv_heads 0
  = n_heads)."""
  out = []
  for key, v in (("d_model", d_model), ("d_inner", d_inner), ("n_heads", n_heads)):
    if v is not None:
      if int(v) < 1:
        raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {v}")
      out.append(f"model.{key}={int(v)}")
  kv = int(n_kv_heads or 0)
  if kv < 0:
    raise ValueError(f"--n-kv-heads must be >= 0 (0 = --n-heads), got {kv}")
  if kv or n_heads is not None:  # a new head count brings its kv heads (the config's may not fit)
    out.append(f"model.n_kv_heads={kv or int(n_heads)}")
  if layers is not None:
    names = ("n_enc", "n_lm", "n_dec", "n_mbp")
    out += [f"model.{k}={v}" for k, v in zip(names, parse_layers(layers))]
  return out


def model_config(config_path=None, overrides=(), **shape) -> ModelConfig:
  """The ModelConfig of ``config_path`` (default configs/lca_mbp.py in float32 with the
  SHAPE_DEFAULTS for missing shape values) with ``overrides`` (``model.key=value``) and the
  shape flags applied. ConfigError / ConfigFileError / ValueError on bad input."""
  if config_path is None:
    shape = {k: (SHAPE_DEFAULTS[k] if shape.get(k) is None else shape[k]) for k in SHAPE_DEFAULTS}
    base = list(FLAG_BASE)
  else:
    base = []
  config = configs_io.load_config(config_path or BASE_CONFIG)
  ov = base + list(overrides) + shape_overrides(**shape)
  configs_io.apply_overrides(config, ov)
  return ModelConfig.from_dict(config.model.to_dict())


def random_params(cfg: ModelConfig, seed: int = 0):
  """The model's own init of ``cfg`` as host numpy arrays."""
  return jax.tree_util.tree_map(np.asarray, init_params(cfg, jax.random.PRNGKey(seed)))


def random_model(cfg: ModelConfig, seed: int = 0) -> Model:
  """A Model of random weights (the model's own init) of ``cfg``."""
  return Model(cfg, random_params(cfg, seed), source=f"random(seed={seed})")


def n_params(model) -> int:
  return int(sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(model.params)))


def model_info(model) -> dict:
  c = model.cfg
  return dict(
    source=model.source,
    kind=c.kind,
    d_model=c.d_model,
    d_inner=c.d_inner,
    n_heads=c.n_heads,
    n_kv_heads=c.n_kv_heads,
    layers=dict(enc=c.n_enc, lm=c.n_lm, dec=c.n_dec, mbp=c.n_mbp, mlp_mbp=c.n_mlp_mbp),
    dtype=c.dtype,
    max_seq_len=c.max_seq_len,
    params=n_params(model),
  )
