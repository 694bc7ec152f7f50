"""Model hyper-parameters: one frozen dataclass for every variant of the family.

The variant is chosen by fields, never by a different class:
  * ``kind="flat"``: LlamaByte, a single causal stack over bytes (``n_enc`` layers).
  * ``kind="hierarchical"``: encoder / boundaries / latent LM / next-byte decoder, plus
    optional multi-byte heads: ``n_mbp > 0`` LCA-MBP layers, or ``n_mlp_mbp > 0`` Medusa-style
    residual MLP heads. ``boundaries="learned"`` (FxT, LCA-MBP, MLP-MBP) or ``"spacebyte"``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping, Optional

import numpy as np

from lca_jax.errors import LcaError

KINDS = ("flat", "hierarchical")
BOUNDARIES = ("learned", "spacebyte")
ATTENTION_IMPLS = ("auto", "xla", "dense", "pallas")
DTYPES = ("float32", "bfloat16")
# Auto block sizes of the causal stacks' blockwise attention (ModelConfig.causal_blocks).
CAUSAL_BLOCK = 64
CAUSAL_BLOCK_LONG = 128
CAUSAL_BLOCK_LONG_FROM = 2048


class ConfigError(LcaError, ValueError):
  """A model config that cannot be built (unknown key, bad value)."""


# Integer fields that must be >= 1 (every other integer field must be >= 0; the checks below
# divide by some of them, and jax fails deep inside on a negative width) and float fields that
# must be > 0 (every float must be finite).
_POSITIVE_INTS = (
  "n_tokens",
  "vocab_size",
  "d_model",
  "d_inner",
  "n_heads",
  "n_kv_heads",
  "n_enc",
  "max_seq_len",
  "spacebyte_max_group",
  "lca_block_q",
)
_POSITIVE_FLOATS = ("bp_temp", "rope_base", "rms_eps")


def _value_problem(name: str, kind: str, v) -> Optional[str]:
  """What is wrong with value ``v`` of field ``name`` annotated ``kind``, or None."""
  if kind == "bool":
    return None if isinstance(v, (bool, np.bool_)) else f"{name} must be true or false, got {v!r}"
  if kind == "str":
    return None if isinstance(v, str) else f"{name} must be a string, got {v!r}"
  if kind == "int":
    if not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)):
      return f"{name} must be an integer, got {v!r}"
    low = 1 if name in _POSITIVE_INTS else 0
    return None if v >= low else f"{name} must be an integer >= {low}, got {v}"
  if kind == "float":
    if not isinstance(v, numbers.Real) or isinstance(v, (bool, np.bool_)) or not math.isfinite(v):
      return f"{name} must be a finite number, got {v!r}"
    if name in _POSITIVE_FLOATS and v <= 0:
      return f"{name} must be > 0, got {v}"
    if name == "dropout" and not 0 <= v < 1:
      return f"dropout must be in [0, 1), got {v}"
  return None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  kind: str = "hierarchical"
  n_tokens: int = (
    261  # ByT5 ids 0..260 (lca_jax.vocab); real vocabulary (logits are returned for these ids)
  )
  vocab_size: int = 384  # embedding rows (n_tokens padded for speed)
  d_model: int = 64
  d_inner: int = 128
  n_heads: int = 4
  n_kv_heads: int = 4
  n_enc: int = 1
  n_lm: int = 2
  n_dec: int = 1
  n_mbp: int = 2  # LCA-MBP head layers (0 = no LCA head)
  n_mlp_mbp: int = 0  # Medusa-style heads (head k predicts x_{t+1+k})
  mlp_mbp_inner: int = 0  # MLP head hidden size; 0 = d_inner
  boundaries: str = "learned"
  bp_d_inner: int = 0  # boundary predictor hidden size; 0 = d_inner
  bp_temp: float = 0.5
  bp_prior: float = 0.333
  bp_prior_std: float = 0.023
  bp_lower_k: float = 3.0
  spacebyte_max_group: int = 16
  max_latent_ratio: float = 1.0  # latent slots per byte; 0 = auto (see latent_ratio)
  rope_base: float = 100000.0
  max_seq_len: int = 4096  # longest context (prompt + generation) the decoder accepts
  rms_eps: float = 1e-6
  dropout: float = 0.0
  # "auto": the platform's (backend.attention_impl): "pallas" on GPUs and TPUs, "xla" on the
  # CPU; "xla": blockwise attention in plain JAX (model/attention.py; every backend, no [T, T]
  # buffer, masked tiles skipped); "dense": the dense-masked reference (tests, A/B);
  # "pallas": the Pallas kernels (Triton on GPUs, Mosaic on TPUs; interpreted on the CPU).
  attention_impl: str = "auto"
  attn_block_q: int = 0  # blockwise query block of the causal stacks; 0 = auto (causal_blocks)
  attn_block_k: int = 0  # blockwise key tile of the causal stacks; 0 = auto (causal_blocks)
  lca_block_q: int = 64  # LCA head query block; its key tile is lca_block_q + lca_lookback
  lca_lookback: int = 32  # keys before a block that one LCA tile covers (more -> more tiles)
  attn_parallel: int = 1  # independent blockwise loop nests per call (0 = host cores on CPU)
  dtype: str = "float32"  # compute dtype; parameters stay float32
  remat: bool = False
  # full forwards (training, evaluation) run a stack of at least this many layers as one
  # lax.scan: one block compiled instead of one per layer (layers.Stack._scanned; compile time
  # of deep stacks); 0 = never. Decoding always runs them unrolled.
  scan_min_layers: int = 8

  def __post_init__(self):
    def check(ok, msg):
      if not ok:
        raise ConfigError(f"model config: {msg}")

    # types and ranges first: the checks below divide by head counts
    bad = [
      p
      for f in dataclasses.fields(self)
      for p in [_value_problem(f.name, f.type, getattr(self, f.name))]
      if p
    ]
    check(not bad, "; ".join(bad))
    check(self.kind in KINDS, f"kind must be one of {KINDS}, got {self.kind!r}")
    check(
      self.boundaries in BOUNDARIES,
      f"boundaries must be one of {BOUNDARIES}, got {self.boundaries!r}",
    )
    check(
      self.attention_impl in ATTENTION_IMPLS, f"attention_impl must be one of {ATTENTION_IMPLS}"
    )
    check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}")
    check(
      self.d_model % self.n_heads == 0,
      f"d_model {self.d_model} not divisible by n_heads {self.n_heads}",
    )
    check(
      self.n_heads % self.n_kv_heads == 0,
      f"n_heads {self.n_heads} not divisible by n_kv_heads {self.n_kv_heads}",
    )
    check(
      self.vocab_size >= self.n_tokens, f"vocab_size {self.vocab_size} < n_tokens {self.n_tokens}"
    )
    check(0.0 <= self.max_latent_ratio <= 1.0, "max_latent_ratio must be in [0, 1] (0 = auto)")
    if self.kind == "hierarchical":
      check(
        self.n_lm >= 1 and self.n_dec >= 1, "a hierarchical model needs n_lm >= 1 and n_dec >= 1"
      )
      check(
        not (self.n_mbp and self.n_mlp_mbp),
        "choose either an LCA-MBP head (n_mbp) or MLP heads (n_mlp_mbp)",
      )
    else:
      check(self.n_mbp == 0 and self.n_mlp_mbp == 0, "a flat model has no multi-byte head")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def hierarchical(self) -> bool:
    return self.kind == "hierarchical"

  @property
  def has_lca(self) -> bool:
    return self.hierarchical and self.n_mbp > 0

  @property
  def has_mbp(self) -> bool:
    return self.has_lca or self.n_mlp_mbp > 0

  @property
  def bp_hidden(self) -> int:
    return self.bp_d_inner or self.d_inner

  @property
  def mlp_hidden(self) -> int:
    return self.mlp_mbp_inner or self.d_inner

  @property
  def bp_beta(self) -> float:
    return self.bp_prior - self.bp_lower_k * self.bp_prior_std

  def scans(self, n_layers: int) -> bool:
    """Whether a stack of ``n_layers`` runs as one scan in full forwards (``scan_min_layers``)."""
    return n_layers > 1 and 0 < self.scan_min_layers <= n_layers

  def causal_blocks(self, length: int) -> tuple[int, int]:
    """(block_q, block_k) of a causal stack's blockwise attention over ``length`` tokens.

    ``attn_block_q`` / ``attn_block_k`` when set; 0 (auto) gives ``CAUSAL_BLOCK_LONG`` (128)
    from ``CAUSAL_BLOCK_LONG_FROM`` (2048) tokens on and ``CAUSAL_BLOCK`` (64) below: the
    larger block is faster on long sequences and wastes more of the diagonal tile on short
    ones (docs/design.md §3.3)."""
    auto = CAUSAL_BLOCK_LONG if length >= CAUSAL_BLOCK_LONG_FROM else CAUSAL_BLOCK
    return self.attn_block_q or auto, self.attn_block_k or auto

  def latent_ratio(self, seq_len: int) -> float:
    """Latent slots per byte the latent stack is compiled for (``latent_capacity``).

    ``max_latent_ratio > 0`` fixes it. ``0`` (auto) follows the compression the model is
    trained to: learned boundaries: the boundary loss keeps each row's rate at or below the
    prior alpha = ``bp_prior`` (a hinge above alpha), and a row's count of Bernoulli decisions
    has standard deviation <= sqrt(alpha (1 - alpha) T), so the ratio is
    alpha + 4 sqrt(alpha (1 - alpha) / T) (0.363 at T 4096, 0.5 at T 128). SpaceByte: rule
    closes are never adjacent (a close needs a space-like byte after a non-space-like one), so
    at most 1/2 plus one length close per ``spacebyte_max_group`` bytes. Groups beyond the
    capacity are not pooled and are counted in the ``overflow`` metric (``pooling``): early in
    training, before the rate reaches the prior, some rows overflow.
    """
    if self.max_latent_ratio > 0:
      return self.max_latent_ratio
    if self.boundaries == "spacebyte":
      return min(1.0, 0.5 + 1.0 / self.spacebyte_max_group)
    p = self.bp_prior
    return min(1.0, p + 4.0 * math.sqrt(p * (1.0 - p) / max(seq_len, 1)))

  def latent_capacity(self, seq_len: int) -> int:
    """Static number of latent slots S = 1 + ceil(T * latent_ratio(T)) (slot 0 is the null group)."""
    return 1 + int(math.ceil(seq_len * self.latent_ratio(seq_len) - 1e-9))

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    if not isinstance(d, Mapping):
      raise ConfigError(f"model config: expected a mapping of fields, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ConfigError(
        f"unknown model config key(s): {', '.join(unknown)}; known keys: {', '.join(sorted(names))}"
      )
    return cls(**dict(d))

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)
