"""The `make demo` model: LCA-MBP sized for ~5 minutes of 2 CPU cores, bundled corpus.

Run:
    lca-train --config configs/demo.py --workdir workdirs/demo
    python tools/demo_sample.py --checkpoint workdirs/demo
"""

from configs import base


def get_config():
  model = base.tiny_model(
    d_model=128, d_inner=384, n_heads=4, n_kv_heads=2, n_enc=1, n_lm=3, n_dec=1, n_mbp=2
  )
  c = base.tiny_config(model)
  c.data.seq_len = 256
  c.train.micro_batch_size = 8
  c.train.global_batch_bytes = 8 * 256
  c.train.steps = 1500
  c.train.log_every = 25
  c.train.eval_every = 500
  c.train.eval_batches = 32
  c.train.checkpoint_every = 1500
  c.train.progress_bar = False
  c.train.tensorboard = False
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 100
  return c
