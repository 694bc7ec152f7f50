"""Forward + backward time per row of the model variants, printed as JSON.

    python tools/bench_model.py                          # configs/tiny_*.py, seq_len 4096, batch 1
    python tools/bench_model.py configs/lca_mbp.py --seq-len 8192 --batch 2 --repeats 5
    python tools/bench_model.py --set attention_impl=pallas   # override model fields

For each config: one jitted value_and_grad of the training loss (train=True: Gumbel boundaries,
dropout as configured, loss weights 1/1/10) on random bytes, compiled and run once (warm-up),
then timed ``--repeats`` times; ``fwd_bwd_s_per_row`` is the median step time divided by the
batch size (``cpu_s_per_row``: the same in process CPU time, all threads). Parameter counts come from the abstract init (no weights materialised twice).
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import flax.linen as nn  # noqa: E402  pylint: disable=g-import-not-at-top
import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # noqa: E402  pylint: disable=g-import-not-at-top
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top

from lca_jax import configs_io  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.model.config import ModelConfig  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.model.hierarchical import ByteLM, count_params, init_params  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.model.loss import compute_loss  # noqa: E402  pylint: disable=g-import-not-at-top


def _model_config(path: str, overrides) -> ModelConfig:
  d = configs_io.load_config(path).model.to_dict()
  for item in overrides:
    key, raw = item.split("=", 1)
    try:
      d[key] = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      d[key] = raw
  return ModelConfig.from_dict(d)


def bench_one(cfg: ModelConfig, seq_len: int, batch: int, repeats: int, seed: int = 0) -> dict:
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


def main(argv=None):
  ap = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ap.add_argument("configs", nargs="*", help="config files (default: configs/tiny_*.py)")
  ap.add_argument("--seq-len", type=int, default=4096)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="FIELD=VALUE",
    help="override a model config field (repeatable)",
  )
  args = ap.parse_args(argv)
  paths = args.configs or sorted(glob.glob(os.path.join(ROOT, "configs", "tiny_*.py")))
  if not paths:
    ap.error("no config files")
  results = {}
  for p in paths:
    cfg = _model_config(p, args.set)
    name = os.path.splitext(os.path.basename(p))[0]
    results[name] = bench_one(cfg, args.seq_len, args.batch, args.repeats)
    print(f"{name}: {results[name]['fwd_bwd_s_per_row']:.3f} s/row", file=sys.stderr, flush=True)
  dev = jax.devices()[0]
  print(
    json.dumps(
      {
        "backend": jax.default_backend(),
        "device": str(getattr(dev, "device_kind", dev)),
        "jax": jax.__version__,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "repeats": args.repeats,
        "overrides": args.set,
        "results": results,
      },
      indent=1,
    )
  )


if __name__ == "__main__":
  main()
