"""Forward + backward time of a model on random bytes: one jitted value_and_grad of the
training loss (train=True: Gumbel boundaries, dropout as configured), compiled and run once,
then timed in wall and process CPU time."""

from __future__ import annotations

import ast
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lca_jax import configs_io
from lca_jax.model.config import ModelConfig
from lca_jax.model.hierarchical import ByteLM, count_params, init_params
from lca_jax.model.loss import compute_loss


def model_config(path: str, overrides) -> ModelConfig:
  """The ModelConfig of config file ``path`` with ``FIELD=VALUE`` ``overrides`` (values read as
  Python literals, else as strings)."""
  d = configs_io.load_config(path).model.to_dict()
  for item in overrides:
    key, raw = item.split("=", 1)
    try:
      d[key] = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      d[key] = raw
  return ModelConfig.from_dict(d)


def bench_one(cfg: ModelConfig, seq_len: int, batch: int, repeats: int, seed: int = 0) -> dict:
  """Step times of ``cfg`` on ``batch`` rows of ``seq_len`` random bytes: the median of
  ``repeats`` timed steps after a warm-up, per row and in all."""
  model = ByteLM(cfg)
  t0 = time.perf_counter()
  params = nn.unbox(jax.jit(lambda k: init_params(cfg, k))(jax.random.PRNGKey(seed)))
  rng = np.random.default_rng(seed)
  ids = jnp.asarray(rng.integers(3, 259, size=(batch, seq_len)), jnp.int32)
  batch_d = {"ids": ids}

  def loss_fn(p, key):
    k1, k2 = jax.random.split(key)
    out = model.apply({"params": p}, ids, train=True, rngs={"gumbel": k1, "dropout": k2})
    return compute_loss(cfg, out, batch_d)

  step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  key = jax.random.PRNGKey(seed + 1)
  t1 = time.perf_counter()
  (loss, metrics), grads = step(params, key)  # compile + warm-up
  jax.block_until_ready(grads)
  t2 = time.perf_counter()
  times, cpu = [], []
  for i in range(repeats):
    k = jax.random.fold_in(key, i)
    t, c = time.perf_counter(), time.process_time()
    (loss, metrics), grads = step(params, k)
    jax.block_until_ready((loss, grads))
    times.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
  med = statistics.median(times)
  res = {
    "params": count_params(params),
    "fwd_bwd_s_per_row": med / batch,
    "fwd_bwd_s_median": med,
    "runs_s": [round(x, 4) for x in times],
    # CPU seconds of this process (all threads) per row: less sensitive to other load on a
    # shared machine than wall time
    "cpu_s_per_row": statistics.median(cpu) / batch,
    "bytes_per_s": batch * seq_len / med,
    "init_s": round(t1 - t0, 2),
    "compile_and_first_step_s": round(t2 - t1, 2),
    "loss": float(loss),
  }
  for k in ("bytes_per_latent", "overflow"):
    if k in metrics:
      res[k] = float(metrics[k])
  return res
