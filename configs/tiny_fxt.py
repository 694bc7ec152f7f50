"""Tiny FxT for CPU.

Run:
    lca-train --config configs/tiny_fxt.py --workdir workdirs/tiny_fxt
"""

from configs import base


def get_config():
  return base.tiny_config(base.tiny_model(n_enc=1, n_lm=2, n_dec=1, n_mbp=0))
