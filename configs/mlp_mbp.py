"""MLP-MBP at paper scale (2/16/2 + 3 Medusa-style residual MLP heads, inner 5504 to match parameters).

Run:
    lca-train --config configs/mlp_mbp.py --workdir runs/mlp_mbp --config.data.train_files='/data/fineweb-edu/train-*.parquet' --config.data.eval_files='/data/fineweb-edu/val-*.parquet'
"""

from configs import base


def get_config():
  return base.paper_config(
    base.paper_model(n_enc=2, n_lm=16, n_dec=2, n_mbp=0, n_mlp_mbp=3, mlp_mbp_inner=5504)
  )
