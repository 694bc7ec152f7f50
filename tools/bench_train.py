"""Training throughput of a config (default: the tiny LCA-MBP), printed as one JSON object.

    python tools/bench_train.py [--config configs/tiny_lca_mbp.py] [--steps 20] [--warmup 3] \
        [--config.train.micro_batch_size=32 ...]

Times ``--steps`` optimizer steps after ``--warmup`` steps (compile + first runs) on real
batches of the configured data (read beforehand, so the data pipeline is not timed; the
host->device copy is). Same jitted step, mesh and shardings as lca-train.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny_lca_mbp.py"))
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  args, rest = ap.parse_known_args(argv)

  import jax  # pylint: disable=g-import-not-at-top
  from lca_jax import configs_io  # pylint: disable=g-import-not-at-top
  from lca_jax.train import inputs, loop, metrics  # pylint: disable=g-import-not-at-top
  from lca_jax.train import sharding as shd  # pylint: disable=g-import-not-at-top

  config = configs_io.apply_overrides(configs_io.load_config(args.config),
                                     configs_io.split_overrides(rest))
  setup = loop.prepare(config)
  plan = setup.plan
  pipe = inputs.make_train_pipeline(config, plan)
  host = [next(pipe) for _ in range(args.warmup + args.steps)]
  pipe.close()

  t0 = time.perf_counter()
  state = setup.init_state()
  jax.block_until_ready(state)
  init_s = time.perf_counter() - t0
  with shd.mesh_context(setup.mesh):
    t0 = time.perf_counter()
    for b in host[:args.warmup]:
      state, m = setup.train_step(state, setup.device_batch(b))
    jax.block_until_ready((state, m))
    warm_s = time.perf_counter() - t0
    ms = []
    t0 = time.perf_counter()
    for b in host[args.warmup:]:
      state, m = setup.train_step(state, setup.device_batch(b))
      ms.append(m)
    jax.block_until_ready((state, ms))
    dt = (time.perf_counter() - t0) / max(args.steps, 1)
  ms = jax.device_get(ms)
  bpl = sum(float(m.get("bytes_per_latent", 0.0)) for m in ms) / max(len(ms), 1) or None
  n_dev = setup.mesh.devices.size
  flops = metrics.train_flops_per_step(setup.model_cfg, setup.abstract.params, plan.rows,
                                       plan.seq_len, bpl)
  peak = metrics.peak_flops_per_device(override_tflops=float(config.train.peak_tflops))
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(setup.abstract.params))
  out = dict(
      config=os.path.relpath(args.config, ROOT), backend=jax.default_backend(),
      device_kind=jax.devices()[0].device_kind, devices=n_dev, mesh=dict(setup.mesh.shape),
      params=int(n_params), dtype=setup.model_cfg.dtype, seq_len=plan.seq_len, rows=plan.rows,
      accum=plan.accum, bytes_per_step=plan.bytes_per_step, warmup_steps=args.warmup,
      timed_steps=args.steps, init_s=round(init_s, 3), warmup_s=round(warm_s, 3),
      step_time_s=dt, bytes_per_s=plan.bytes_per_step / dt,
      tflops_per_device=flops / dt / n_dev / 1e12,
      mfu=(flops / dt / (n_dev * peak)) if peak else None,
      final_loss=float(ms[-1]["loss"]) if ms else None)
  print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main()
