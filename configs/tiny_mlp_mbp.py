"""Tiny MLP-MBP for CPU.

Run:
    lca-train --config configs/tiny_mlp_mbp.py --workdir workdirs/tiny_mlp_mbp
"""

from configs import base


def get_config():
  return base.tiny_config(base.tiny_model(n_enc=1, n_lm=2, n_dec=1, n_mbp=0, n_mlp_mbp=2))
