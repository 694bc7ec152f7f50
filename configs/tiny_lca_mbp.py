"""Tiny LCA-MBP for CPU (the `make demo` model), bundled corpus by default.

Run:
    lca-train --config configs/tiny_lca_mbp.py --workdir workdirs/tiny_lca_mbp
"""

from configs import base


def get_config():
  return base.tiny_config(base.tiny_model(n_enc=1, n_lm=2, n_dec=1, n_mbp=2))
