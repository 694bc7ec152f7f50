"""The weight-streaming bound of a decode step: bytes it must read / the machine's bandwidth.

A decode step of a small batch is memory-bound: every weight matrix it uses is read once per
step (a matrix-vector product per row), and so is every KV cache its attention reads. So no
step can be faster than ``read bytes / streaming bandwidth``; ``tools/bench_decode.py`` and
``tools/bench_vs_upstream.py decode`` report measured ms per step against that bound.

Bandwidth (``stream_bandwidth``): a jitted float32 matrix-vector product x[1, D] @ W[D, F]
with W of ``matrix_mb`` MB, chained ``chain`` times inside one call (each product's input
depends on the last one's output, so none is hoisted and dispatch is paid once), best of
``repeats`` calls: ``bytes(W) * chain / seconds``. The tools size W as the model's float32
parameters (``stream_mb_for``, at least ``MIN_STREAM_MB``), so that the probe streams from the
level of the memory hierarchy a decode step of that model streams its weights from: a fixed
size misleads on hosts whose last-level cache holds the probe's matrix but not the model's
weights (docs/performance.md has such a case).

Bytes one step must read (``step_read_bytes``), per mode at batch B, W bytes fed per row
(1 in ntp, n in threshold / verify), weights at the size decoding stores them
(``param_bytes``: the weight matrices and the embedding in the compute dtype,
``layers.compute_dtype_weights``; norms and the boundary predictor float32):

  params = embedding rows used  min(B * W, vocab_size) * d_model * itemsize(cfg.dtype)
         + encoder + boundary predictor + decoder + final norm + head    (every step)
         + f_lm * latent LM stack                                        (only when a group closes)
         + LCA-MBP stack + MLP-MBP heads                                 (threshold / verify)
  kv     = 2 (k and v) * B * n_kv_heads * head_dim * itemsize(cfg.dtype) *
           ( (n_enc + n_dec) * L  +  f_lm * n_lm * (L + 1)  +  n_mbp * W )
  read   = params + kv

L is the cache length the engine allocates (``cache_len``; the step reads the whole buffer
under a mask), the LM cache has a slot per byte plus the null group, the LCA-MBP head reads
W = ``incremental.mbp_window(L, k)`` slots (a window of ``MBP_WINDOW`` on long caches, the
engine's usual case there; the whole cache on short ones). ``f_lm`` is the expected fraction of
steps in which the latent LM runs (it runs under a ``lax.cond`` when any row closes a group):
with measured latents per byte ``r`` and bytes per step per row ``k``, a row closes a group in
a step with probability ``p = min(1, r * k)`` and the batch with ``1 - (1 - p) ** B`` (= r * k at
batch 1). Flat models have only the encoder (and its cache); SpaceByte no boundary predictor.
Each weight is counted once per step even where the engine reads it twice (the head for both
the NT and MBP logits, the MBP stack again for verify's copies): the bound is what a step must
read, not what this engine reads. ``bound_ms = read / bandwidth * 1e3``.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lca_jax.decode import engine
from lca_jax.decode.policies import POLICIES
from lca_jax.model.config import ModelConfig
from lca_jax.model.hierarchical import init_params
from lca_jax.model.incremental import mbp_window
from lca_jax.model.layers import compute_dtype_weights

PARAM_ITEMSIZE = 4  # parameters are stored float32 (ModelConfig.dtype is the compute dtype)
MIN_STREAM_MB = 16.0  # smallest probe: a few MB would measure one core's L2


# ---- bandwidth ------------------------------------------------------------------------------
def _matvec_chain(chain: int):
  def run(x, w):
    d = x.shape[1]

    def body(_, x):
      y = x @ w  # [1, F]
      return jnp.tanh(y[:, :d])  # the next input depends on this product

    return jax.lax.fori_loop(0, chain, body, x)

  return jax.jit(run)


def stream_bandwidth(matrix_mb: float = 128.0, repeats: int = 5, chain: int = 8, device=None):
  """Matrix-vector streaming bandwidth of this machine in bytes/s (see the module docstring).
  Returns a dict: ``bytes_per_s``, ``gb_s`` (1e9 bytes/s), ``matrix_bytes``, ``shape``,
  ``seconds`` (best call), ``chain``, ``repeats``."""
  if matrix_mb <= 0 or repeats < 1 or chain < 1:
    raise ValueError(
      f"stream_bandwidth: bad matrix_mb {matrix_mb}, repeats {repeats}, chain {chain}"
    )
  elems = max(int(matrix_mb * 1e6) // 4, 4)
  d = max(int(math.sqrt(elems / 2)), 1)  # W is [D, 2D]: x @ W reads W once, D inputs
  f = max(elems // d, d)
  device = device or jax.devices()[0]
  w = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (d, f), jnp.float32) * 0.01, device)
  x = jax.device_put(jnp.ones((1, d), jnp.float32), device)
  fn = _matvec_chain(chain)
  jax.block_until_ready(fn(x, w))  # compile + first touch
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(x, w))
    best = min(best, time.perf_counter() - t0)
  nbytes = d * f * 4
  bps = nbytes * chain / best
  return dict(
    bytes_per_s=bps,
    gb_s=bps / 1e9,
    matrix_bytes=nbytes,
    shape=[d, f],
    seconds=best,
    chain=chain,
    repeats=repeats,
  )


# ---- bytes per step -------------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _group_params(cfg: ModelConfig):
  """(group, parameters, bytes as decoding stores them) per top-level group."""
  decode_tree = lambda: compute_dtype_weights(
    nn.unbox(init_params(cfg, jax.random.PRNGKey(0), seq_len=8)), cfg.dtype
  )
  leaves = jax.tree_util.tree_leaves
  return tuple(
    (
      k,
      int(sum(int(np.prod(x.shape)) for x in leaves(v))),
      int(sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves(v))),
    )
    for k, v in jax.eval_shape(decode_tree).items()
  )


def param_counts(cfg: ModelConfig) -> dict:
  """Parameters per top-level group of the model (``encoder``, ``lm``, ``decoder``, ``mbp``,
  ``head``, ``token_embedding``, ``boundary_predictor``, ``mlp_mbp_i``, ...), from the config
  (nothing allocated)."""
  return {k: n for k, n, _ in _group_params(cfg)}


def param_bytes(cfg: ModelConfig) -> dict:
  """Bytes per top-level group as decoding stores them (``layers.compute_dtype_weights``: the
  float32 size for a float32 model, about half for a bfloat16 one)."""
  return {k: b for k, _, b in _group_params(cfg)}


def stream_mb_for(cfg: ModelConfig) -> float:
  """MB of the bandwidth probe's matrix for a model: its float32 parameters, at least
  ``MIN_STREAM_MB`` (module docstring)."""
  n = sum(param_counts(cfg).values())
  return max(MIN_STREAM_MB, n * PARAM_ITEMSIZE / 1e6)


def cache_len(prompt_lens, max_bytes: int, width: int, max_seq_len: int, pad_to: int = 32) -> int:
  """The cache length the engine allocates for prompts of ``prompt_lens`` bytes, a budget of
  ``max_bytes`` and ``width`` bytes fed per step (engine._request: padded prompt + capped
  budget + room for a block and copies past the end)."""
  longest = max(int(p) for p in prompt_lens)
  return engine.cache_length(longest, int(max_bytes), width, max_seq_len, pad_to)


def min_cache_bytes(cfg: ModelConfig, batch: int, length: int) -> int:
  """Bytes of the smallest KV-cache buffer of a decode call (one layer's keys over the bytes,
  [B, KV, L, E]): a copy of at least this size in a decode step is a cache copy."""
  return batch * cfg.n_kv_heads * length * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def lm_fraction(latents_per_byte: float, bytes_per_step: float, batch: int) -> float:
  """Expected fraction of steps in which the latent LM runs (some row closes a group)."""
  p = min(1.0, max(0.0, float(latents_per_byte) * float(bytes_per_step)))
  return 1.0 - (1.0 - p) ** int(batch)


def step_read_bytes(
  cfg: ModelConfig,
  mode: str,
  batch: int,
  width: int,
  length: int,
  latents_per_byte: float = 0.0,
  bytes_per_step: Optional[float] = None,
) -> dict:
  """Bytes one decode step must read (see the module docstring): ``params``, ``kv``, ``total``,
  the ``lm_fraction`` used and the ``groups`` of parameters counted (name -> bytes)."""
  groups = param_bytes(cfg)
  multi = POLICIES[mode].target_mbp  # the step runs the model's own multi-byte head
  k = float(width if bytes_per_step is None else bytes_per_step)
  f_lm = lm_fraction(latents_per_byte, k, batch) if cfg.hierarchical else 0.0
  counted = {}
  for name, n in groups.items():
    if name == "token_embedding":
      rows = min(batch * width, cfg.vocab_size)
      counted[name] = n * rows / cfg.vocab_size  # n: the whole table
    elif name == "lm":
      counted[name] = f_lm * n
    elif name == "mbp" or name.startswith("mlp_mbp"):
      if multi:
        counted[name] = n
    elif name == "null_group":
      continue  # read once, by init_state
    else:  # encoder, boundary_predictor, decoder, norm, head
      counted[name] = n
  per_slot = 2 * batch * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
  slots = cfg.n_enc * length
  if cfg.hierarchical:
    slots += cfg.n_dec * length + f_lm * cfg.n_lm * (length + 1)
    if multi and cfg.has_lca:
      slots += cfg.n_mbp * mbp_window(length, width)
  params = float(sum(counted.values()))
  kv = float(per_slot * slots)
  return dict(params=params, kv=kv, total=params + kv, lm_fraction=f_lm, groups=counted)


def bound_ms(read_bytes: float, bytes_per_s: float) -> float:
  """The weight-streaming bound of a step in ms: bytes it must read / bandwidth."""
  return read_bytes / bytes_per_s * 1e3
