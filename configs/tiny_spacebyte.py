"""Tiny SpaceByte for CPU.

Run:
    lca-train --config configs/tiny_spacebyte.py --workdir workdirs/tiny_spacebyte
"""

from configs import base


def get_config():
  return base.tiny_config(
    base.tiny_model(
      n_enc=1, n_lm=2, n_dec=1, n_mbp=0, boundaries='spacebyte', spacebyte_max_group=8
    )
  )
