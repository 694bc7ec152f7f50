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
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # lca_jax from this checkout, installed or not
  sys.path.insert(0, ROOT)

from lca_jax.bench import machine, report  # noqa: E402
from lca_jax.bench.model_step import bench_one, model_config  # noqa: E402


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
    name = os.path.splitext(os.path.basename(p))[0]
    results[name] = bench_one(model_config(p, args.set), args.seq_len, args.batch, args.repeats)
    report.progress(name, f"{results[name]['fwd_bwd_s_per_row']:.3f} s/row")
  out = dict(
    **machine.jax_info(),
    seq_len=args.seq_len,
    batch=args.batch,
    repeats=args.repeats,
    overrides=args.set,
    results=results,
  )
  report.print_json(out)


if __name__ == "__main__":
  main()
