"""LCA-MBP at paper scale (2/16/2 + 2-layer LCA-MBP head, ~373M params), FineWeb-Edu parquet.

Run (one GPU; on N GPUs add --config.train.micro_batch_size=16*N, checked beforehand with
`lca-train --config configs/lca_mbp.py --aot h100:N`):
    lca-train --config configs/lca_mbp.py --workdir runs/lca_mbp --config.data.train_files='/data/fineweb-edu/train-*.parquet' --config.data.eval_files='/data/fineweb-edu/val-*.parquet'
"""

from configs import base


def get_config():
  return base.paper_config(base.paper_model(n_enc=2, n_lm=16, n_dec=2, n_mbp=2))
