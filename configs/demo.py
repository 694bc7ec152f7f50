"""The `make demo` model: LCA-MBP sized for ~5 minutes of 2 CPU cores, bundled corpus.

Run:
    lca-train --config configs/demo.py --workdir workdirs/demo
    python tools/demo_sample.py --checkpoint workdirs/demo

1.72M parameters (d 128, inner 384, 4 heads / 2 kv heads; layers enc/lm/dec/mbp = 1/3/3/1),
8 rows x 256 bytes per step, 700 steps (1.4M bytes, about 0.9 epoch of the training split),
lr 3e-3 (warmup 100, cosine to 0.1x), the tiny configs' lambda_bp 0.3. Chosen by held-out bpb
at 700 steps (README "Demo" has the table): from the d 128 1/3/1/2 start (3.16), moving byte
layers from the MBP head to the next-byte decoder (1/3/2/1: 2.97, 1/3/3/1: 2.91) gave the most;
lr 2e-3 was a wash (1/3/2/1: 2.95, 1/3/3/1: 2.92), 4 x 256 rows (1200 steps) matched 8 x 256,
lr 5e-3 with b2 0.99 was worse. Rows of 256 bytes cover the demo's prompt + 120 generated
bytes (decoding past the trained length degrades).
"""

from configs import base


def get_config():
  model = base.tiny_model(
    d_model=128, d_inner=384, n_heads=4, n_kv_heads=2, n_enc=1, n_lm=3, n_dec=3, n_mbp=1
  )
  c = base.tiny_config(model)
  c.data.seq_len = 256
  c.train.micro_batch_size = 8
  c.train.global_batch_bytes = 8 * 256
  c.train.steps = 700
  c.train.log_every = 25
  c.train.eval_every = 350
  c.train.eval_batches = 32
  c.train.checkpoint_every = 700
  c.train.tensorboard = False
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 100
  return c
