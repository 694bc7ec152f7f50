"""FxT at paper scale (2/16/4, learned boundaries, no MBP head; decoded as Eff-FxT).

Run:
    lca-train --config configs/fxt.py --workdir runs/fxt --config.data.train_files='/data/fineweb-edu/train-*.parquet' --config.data.eval_files='/data/fineweb-edu/val-*.parquet'
"""

from configs import base


def get_config():
  return base.paper_config(base.paper_model(n_enc=2, n_lm=16, n_dec=4, n_mbp=0))
