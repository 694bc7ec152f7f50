"""Tiny LlamaByte (flat) for CPU.

Run:
    lca-train --config configs/tiny_llamabyte.py --workdir workdirs/tiny_llamabyte
"""

from configs import base


def get_config():
  return base.tiny_config(base.tiny_model(kind='flat', n_enc=4, n_lm=0, n_dec=0, n_mbp=0))
