"""Training throughput and cost of a config (default: the tiny LCA-MBP), as one JSON object.

    python tools/bench_train.py [--config configs/tiny_lca_mbp.py] [--steps 20] [--warmup 3] \
        [--config.train.micro_batch_size=32 ...]
    python tools/bench_train.py --config configs/lca_mbp.py --lower-only \
        --config.train.micro_batch_size=1 --config.train.global_batch_bytes=4096

Times ``--steps`` optimizer steps after ``--warmup`` steps (compile + first runs) on real
batches of the configured data (read beforehand, so the data pipeline is not timed; the
host->device copy is). Same jitted step, mesh and shardings as lca-train.

Before running, it compiles the step and prints what it costs (``lca_jax/perf/costs.py``):
``xla_flops`` (XLA cost analysis of the compiled step: one device's program x the devices of the
mesh; ``xla_flops_per_device``), ``executed_flops`` (that plus the
attention tiles and scanned layers XLA's analysis does not see inside loops), ``useful_flops`` (6 x params per
stage x tokens through it + the attention the masks need, on a regular layout of groups of
``--group-len`` bytes, default 1 / bp_prior), their ratio, the tiles each attention stack runs,
the compiled step's temp memory (``memory_analysis``, per device), its largest buffer and every buffer with
two dimensions >= T (there should be none). ``--lower-only`` stops there (no data, no
parameters allocated: paper-scale configs on a small machine). ``--profile N`` also traces N
steps with the XLA profiler (XLA:CPU) and reports ``step_profile``: thread seconds per step
by op kind (weight products are ``fusion_custom`` there), model part (attention loops and
projections, MLP, norms, heads, optimizer...) and stage (``lca_jax/perf/xla_profile.py``); the traced
steps' own ``wall_s_per_step`` shows what tracing added.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # lca_jax from this checkout, installed or not
  sys.path.insert(0, ROOT)

from lca_jax import configs_io, hostmem  # noqa: E402
from lca_jax.bench import report  # noqa: E402
from lca_jax.bench import train as bench  # noqa: E402
from lca_jax.train import loop  # noqa: E402
from lca_jax.train import sharding as shd  # noqa: E402


def parse_args(argv=None):
  """(options, the config with its ``--config.key=value`` overrides applied); the config errors
  of ``configs_io`` on a bad file or override."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny_lca_mbp.py"))
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument(
    "--lower-only", action="store_true", help="compile and report costs only (no data, no run)"
  )
  ap.add_argument(
    "--group-len",
    type=float,
    default=None,
    help="bytes per group of the layout the useful FLOPs assume (1/bp_prior)",
  )
  ap.add_argument(
    "--profile",
    type=int,
    default=0,
    metavar="N",
    help="also trace N of the timed steps' batches with the XLA profiler (XLA:CPU): thread "
    "time per step by op kind, model part and stage (<= --steps)",
  )
  args, rest = ap.parse_known_args(argv)
  if not 0 <= args.profile <= args.steps:
    ap.error(f"--profile must be in [0, --steps], got {args.profile}")
  config = configs_io.apply_overrides(
    configs_io.load_config(args.config), configs_io.split_overrides(rest)
  )
  return args, config


def main(argv=None):
  args, config = parse_args(argv)
  # as lca-train: a CPU host split into mesh.cpu_devices devices (before any backend starts)
  shd.use_cpu_devices(shd.cpu_device_count(config.mesh))
  setup = loop.prepare(config)
  report.progress(
    "bench_train", f"built the {setup.model_cfg.kind} model and its mesh {dict(setup.mesh.shape)}"
  )
  out = bench.describe(setup, args.config)
  out["cost"], compiled = bench.step_costs(setup, args.group_len)
  report.progress("bench_train", f"compiled the step in {out['cost']['compile_s']} s")
  if not args.lower_only:
    timed_setup = dataclasses.replace(setup, train_step=compiled)
    out.update(bench.run_steps(config, timed_setup, args.steps, args.warmup, args.profile))
  return report.print_json(out)


if __name__ == "__main__":
  hostmem.use_huge_pages()  # as lca-train runs (lca_jax/hostmem.py)
  main()
