"""LlamaByte at paper scale (flat, 22 causal layers).

Run:
    lca-train --config configs/llamabyte.py --workdir runs/llamabyte --config.data.train_files='/data/fineweb-edu/train-*.parquet' --config.data.eval_files='/data/fineweb-edu/val-*.parquet'
"""

from configs import base


def get_config():
  return base.paper_config(base.paper_model(kind='flat', n_enc=22, n_lm=0, n_dec=0, n_mbp=0))
