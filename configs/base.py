"""Shared defaults for every config; variant files override what differs.

Not run directly: see the variant files (e.g. ``configs/lca_mbp.py``) for commands.
"""

import ml_collections

from lca_jax.model.config import ModelConfig


def model_config(**overrides) -> ml_collections.ConfigDict:
  """Every ModelConfig field with its default, then ``overrides`` (unknown keys fail early)."""
  return ml_collections.ConfigDict(ModelConfig(**overrides).to_dict())


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = model_config()

  c.data = ml_collections.ConfigDict()
  c.data.format = "text"  # parquet | jsonl | text | arrayrecord | tfds
  c.data.train_files = ""  # glob(s) of local files, comma separated ("" = bundled demo corpus)
  c.data.eval_files = ""
  c.data.seq_len = 4096
  c.data.packing = "concat"  # concat | segmented
  c.data.worker_count = 0  # grain multiprocess prefetch workers
  c.data.tfds_name = ""  # for format=tfds: dataset name (or a builder dir in train_files)
  c.data.tfds_split = "train"
  c.data.sft_format = ""  # "" (pretraining) | chat | translation | summarization

  c.train = ml_collections.ConfigDict()
  c.train.steps = 100_000
  c.train.seed = 0
  c.train.global_batch_bytes = 1_048_576  # bytes per optimizer step (the paper's 1M)
  c.train.micro_batch_size = (
    32  # rows per forward/backward over all devices (accumulation fills the rest)
  )
  c.train.log_every = 50
  c.train.eval_every = 1000
  c.train.eval_batches = 20
  c.train.checkpoint_every = 1000
  c.train.keep_checkpoints = 3
  c.train.init_from = ""  # a checkpoint to start from (SFT / fine-tuning): workdir or upstream dir
  c.train.lambda_ntp = 1.0
  c.train.lambda_mbp = 1.0
  c.train.lambda_bp = 10.0
  c.train.progress_bar = True
  c.train.tensorboard = True  # TensorBoard event files in WORKDIR/tb
  c.train.async_checkpointing = True
  c.train.peak_tflops = (
    0.0  # per-device peak for MFU; 0 = look up the device kind (lca_jax/train/metrics.py)
  )

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 3e-4
  c.optim.warmup_steps = 2000
  c.optim.final_lr_ratio = 0.1  # cosine decays to lr * final_lr_ratio
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.eps = 1e-8
  c.optim.weight_decay = 0.0
  c.optim.clip_norm = 0.25
  c.optim.decay_steps = 0  # warmup + cosine horizon; 0 = train.steps

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # -1: all devices not used by the other axes
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  # CPU backend only: devices the host is split into (data-parallel over the rows of a step
  # when they divide, else heads and MLP split over them: sharding.py::cpu_mesh);
  # 0 = auto (2 on a host with >= 2 cores), see lca_jax/train/sharding.py::cpu_device_count.
  # XLA_FLAGS's device count takes precedence.
  c.mesh.cpu_devices = 0
  return c


def paper_model(**overrides) -> ml_collections.ConfigDict:
  """Paper scale (Table 2): d 1024, inner 4096, 8 heads / 8 kv heads, bf16 compute."""
  kw = dict(
    d_model=1024,
    d_inner=4096,
    n_heads=8,
    n_kv_heads=8,
    dropout=0.1,
    dtype="bfloat16",
    max_latent_ratio=0.0,
    vocab_size=384,
  )
  kw.update(overrides)
  return model_config(**kw)


def tiny_model(**overrides) -> ml_collections.ConfigDict:
  """A CPU-sized model (~0.36M params; the tiny_* configs and the tests; configs/demo.py, the
  `make demo` model, widens it) that trains in a few minutes on 2 cores. max_latent_ratio 0 (auto, ModelConfig.latent_ratio) sizes the latent stack from the
  boundary prior (0.5 slots per byte at T 128; learned groups average ~3 bytes)."""
  kw = dict(
    d_model=64,
    d_inner=192,
    n_heads=4,
    n_kv_heads=2,
    dropout=0.0,
    vocab_size=384,
    max_latent_ratio=0.0,
  )
  kw.update(overrides)
  return model_config(**kw)


def paper_config(model: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The paper's training setup (§4.2, §4.3, appendix A and its yaml,
  configs/train/modern_fxt_priors_0.3_en_lca_prev_group_self_256_scale_bp_dualhead.yaml in
  skai-research/lca-multibyte; docs/training.md compares them field by field).

  Schedule: linear warmup over 2,000 steps, then a cosine to 0 at step 48,500 (transformers'
  get_cosine_schedule_with_warmup(2000, 48500)); 48,500 steps x 1,048,576 bytes = 50.9B bytes,
  the paper's 50B.
  """
  c = base_config()
  c.model = model
  c.data.format = "parquet"
  c.data.seq_len = 4096  # yaml train.seq_len / model.seq_len; paper §4.2 "context window of 4096"
  # bytes per optimizer step: paper §4.3 "total batch size of 1048576 bytes per gradient step"
  # (the yaml's train.batch_size 32 per GPU x train.gradient_accumulation_steps 4 x the 2 GPUs
  # of the paper code's scripts/run_train.sh x seq_len 4096)
  c.train.global_batch_bytes = 1_048_576
  c.train.steps = 48_500  # yaml train.max_train_steps (x 1,048,576 bytes = 50.9B: §4.3's 50B)
  c.train.lambda_ntp = 1.0  # paper §4.3 lambda_0 = 1 (the code adds the NT loss unscaled)
  c.train.lambda_mbp = 1.0  # yaml model.scale_loss2; paper §4.3 lambda_1 = 1
  c.train.lambda_bp = 10.0  # yaml model.scale_bp; paper §4.3 lambda_2 = 10
  c.optim.lr = 3e-4  # yaml optim.lr; paper §4.3
  c.optim.warmup_steps = 2000  # yaml train.num_warmup_steps; paper §4.3 "warmup of 2000 steps"
  # yaml optim.scheduler "cosine": train.py's get_scheduler("cosine"), transformers'
  # get_cosine_schedule_with_warmup, whose cosine ends at 0 ...
  c.optim.final_lr_ratio = 0.0
  # ... at num_training_steps = max_train_steps: the horizon is train.steps
  c.optim.decay_steps = 0
  c.optim.b1 = 0.9  # yaml optim.adam_b1; paper §4.3
  c.optim.b2 = 0.999  # yaml optim.adam_b2; paper §4.3
  c.optim.eps = 1e-8  # yaml optim.adam_eps; paper §4.3
  c.optim.weight_decay = 0.0  # yaml optim.weight_decay (torch Adam, no decoupled decay)
  c.optim.clip_norm = 0.25  # yaml optim.clip (global norm); paper §4.3
  # 16 rows of 4096 bytes per forward/backward fit one 80 GB GPU without remat (32 do not:
  # `lca-train --config C --aot h100:1` prints both); on N GPUs pass 16 * N.
  c.train.micro_batch_size = 16
  return c


def tiny_config(model: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """CPU-sized training (~1M bytes in a few minutes on 2 cores; configs/demo.py starts here).

  * 4 rows x 128 bytes per step, 2000 steps (~1M bytes): per byte, 4x128 costs about what
    8x128 does on CPU (longer rows cost more per byte), and at equal bytes the smaller, more
    frequent updates reach a lower bpb. Contexts much longer than 128 bytes are outside what
    this model has seen (decoding far past that degrades). Four rows do not divide over
    8 devices: raise train.micro_batch_size there.
  * train.lambda_bp 0.3 instead of the paper's 10: with 10, the rate loss (active on every row
    whose sampled rate leaves [beta, alpha]) drowns the boundary predictor's other gradient, so
    it only learns the rate: sigmoid(logit) ~0.30 on every byte, which never crosses 0.5 at
    inference (no group ever closes there), and it slows the whole tiny model down. With 0.3
    the predictor becomes content-dependent (closes at spaces / word pieces at inference) and
    held-out bpb improves; the training rate still sits near the prior.
  """
  c = base_config()
  c.model = model
  c.data.seq_len = 128
  c.train.steps = 2000
  c.train.micro_batch_size = 4
  c.train.global_batch_bytes = 4 * 128
  c.train.log_every = 50
  c.train.eval_every = 500
  c.train.eval_batches = 16
  c.train.checkpoint_every = 500
  c.train.lambda_bp = 0.3
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 50
  return c
