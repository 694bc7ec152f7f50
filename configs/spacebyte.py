"""SpaceByte at paper scale (2/16/4, heuristic space-like boundaries).

Run:
    lca-train --config configs/spacebyte.py --workdir runs/spacebyte --config.data.train_files='/data/fineweb-edu/train-*.parquet' --config.data.eval_files='/data/fineweb-edu/val-*.parquet'
"""

from configs import base


def get_config():
  return base.paper_config(
    base.paper_model(
      n_enc=2, n_lm=16, n_dec=4, n_mbp=0, boundaries='spacebyte', spacebyte_max_group=16
    )
  )
