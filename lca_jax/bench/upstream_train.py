"""Training steps of the paper's PyTorch code and of lca-jax on the same rows of real text, in
alternating blocks of timed steps per side (``bench_pair``).

* upstream: ``FxTTransformerLM``, float32, train mode, eager; a step is
  ``model(batch, task="LM", script_id)`` then loss + mtp_loss + 10 * loss_boundaries[0]
  (``LAMBDAS``), backward, clip_grad_norm_, Adam (src/train/train.py's step), in this process
  (``UpstreamSide``) or in a child process with the environment this program was started with
  (``UpstreamProcess``).
* lca_jax: configs/lca_mbp.py with ``lca_overrides`` (the same shape, float32, the same loss
  weights, Adam with the same clip and constant learning rate), ``loop.prepare`` /
  ``setup.init_state`` / ``setup.train_step`` exactly as lca-train, on the same mesh.
"""

from __future__ import annotations

import math
import os
import time

import jax
import numpy as np
import torch

from lca_jax import configs_io, vocab
from lca_jax.bench import args as bargs
from lca_jax.bench import machine, report
from lca_jax.bench.args import BenchError
from lca_jax.bench.models import BASE_CONFIG, ROOT
from lca_jax.bench.timing import timed
from lca_jax.bench.upstream import (
  check_upstream_src,
  import_upstream,
  torch_device,
  upstream_params,
  upstream_script_id,
)
from lca_jax.bench.upstream_side import LAMBDAS, UpstreamProcess, UpstreamSide
from lca_jax.data.errors import DataError
from lca_jax.interop.upstream import config_to_upstream
from lca_jax.model.config import ConfigError
from lca_jax.train import inputs, loop
from lca_jax.train import sharding as shd
from lca_jax.train.errors import TrainError

PROG = "bench_vs_upstream"
SHAPE_KEYS = ("data.seq_len=", "train.micro_batch_size=", "train.global_batch_bytes=")


def parse_shapes(s: str):
  """'4x1024,1x4096' -> [(4, 1024), (1, 4096)]."""
  out = []
  for part in (p.strip() for p in str(s).split(",")):
    try:
      b, t = (int(x) for x in part.lower().split("x"))
    except ValueError:
      raise BenchError(f"--shapes: {part!r} is not ROWSxBYTES (e.g. 4x1024)") from None
    if b < 1 or t < 4:
      raise BenchError(f"--shapes: {part!r} needs at least 1 row of at least 4 bytes")
    out.append((b, t))
  if len(set(out)) != len(out):
    raise BenchError(f"--shapes: {s!r} repeats a shape")
  return out


# ---- lca_jax side ---------------------------------------------------------------------------
def lca_overrides(args, layers, b: int, t: int, data: str, max_seq_len: int):
  """``key=value`` overrides of configs/lca_mbp.py for this model and shape (lca-train's
  ``--config.key=value``)."""
  enc, lm, dec, mbp = layers
  kv = args.n_kv_heads or args.n_heads
  return [
    "model.kind=hierarchical",
    "model.boundaries=learned",
    f"model.d_model={args.d_model}",
    f"model.d_inner={args.d_inner}",
    f"model.n_heads={args.n_heads}",
    f"model.n_kv_heads={kv}",
    f"model.n_enc={enc}",
    f"model.n_lm={lm}",
    f"model.n_dec={dec}",
    f"model.n_mbp={mbp}",
    "model.n_mlp_mbp=0",
    f"model.max_latent_ratio={args.max_latent_ratio}",
    f"model.dropout={args.dropout}",
    "model.dtype=float32",
    "model.attention_impl=xla",
    f"model.max_seq_len={max_seq_len}",
    "data.format=text",
    f"data.train_files={data}",
    "data.packing=concat",
    "data.worker_count=0",
    f"optim.lr={args.lr}",
    "optim.weight_decay=0.0",
    "optim.b1=0.9",
    "optim.b2=0.999",
    "optim.eps=1e-08",
    f"optim.clip_norm={args.clip}",
    # a constant learning rate, as the upstream side's torch Adam has no scheduler (the base
    # config's 2000 warmup steps would keep lca_jax's lr near 0 for the whole benchmark: its
    # boundary rate would not move while upstream's falls from 0.5 towards the prior)
    "optim.warmup_steps=0",
    "optim.final_lr_ratio=1.0",
    f"train.seed={args.seed}",
    f"train.lambda_ntp={LAMBDAS[0]}",
    f"train.lambda_mbp={LAMBDAS[1]}",
    f"train.lambda_bp={LAMBDAS[2]}",
    "train.progress_bar=False",
    "train.tensorboard=False",
    f"train.steps={args.warmup + args.steps}",
    # the shape
    f"data.seq_len={t}",
    f"train.micro_batch_size={b}",
    f"train.global_batch_bytes={b * t}",
  ]


def lca_config(args, layers, b: int, t: int, data: str, max_seq_len: int):
  """(configs/lca_mbp.py with the overrides applied, the overrides)."""
  overrides = lca_overrides(args, layers, b, t, data, max_seq_len)
  config = configs_io.apply_overrides(configs_io.load_config(BASE_CONFIG), overrides)
  loop.model_config_of(config)  # a ConfigError here, not inside prepare
  return config, overrides


def jax_devices_for(config, rows: int):
  """All devices when they are this host's CPU split (rows that do not divide over it split the
  heads instead, ``sharding.cpu_mesh``), else the first gcd(#devices, rows)."""
  devs = jax.devices()
  return devs if shd.is_cpu_split(config.mesh, devs) else devs[: math.gcd(len(devs), rows)]


def read_rows(config, plan, n: int):
  """``n`` host batches ({'ids', 'segment_ids', 'positions'} [B, T] int32) of the training data."""
  pipe = inputs.make_train_pipeline(config, plan)
  try:
    return [next(pipe) for _ in range(n)]
  finally:
    pipe.close()


def n_params_jax(params) -> int:
  return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))


class LcaSide:
  """lca-train's step on host batches, one call at a time: the state lives here."""

  def __init__(self, setup):
    self.setup = setup
    t0 = time.perf_counter()
    self.state = jax.block_until_ready(setup.init_state())
    self.init_s = time.perf_counter() - t0
    self.metrics = []

  def step(self, host_batch) -> None:
    s = self.setup
    with shd.mesh_context(s.mesh):
      self.state, m = s.train_step(self.state, s.device_batch(host_batch))
      jax.block_until_ready((self.state, m))
    self.metrics.append(m)

  def timed_step(self, host_batch) -> float:
    return timed(self.step, host_batch)

  def summary(self, step_s: float, n_timed: int) -> dict:
    ms = jax.device_get(self.metrics[-n_timed:])
    bpl = [float(x["bytes_per_latent"]) for x in ms if "bytes_per_latent" in x]
    return dict(
      bytes_per_s=self.setup.plan.bytes_per_step / step_s,
      step_s=step_s,
      init_s=self.init_s,
      devices=int(self.setup.mesh.devices.size),
      mesh={k: int(v) for k, v in self.setup.mesh.shape.items()},
      bytes_per_latent=(sum(bpl) / len(bpl)) if bpl else None,
      final_loss=float(ms[-1]["loss"]),
    )


def bench_pair(up, ours: LcaSide, host, warmup: int, rounds: int) -> dict:
  """Both sides (``up``: an ``UpstreamSide`` or ``UpstreamProcess``) on the same batches:
  ``warmup`` untimed steps each (lca_jax's first compiles), then ``rounds`` rounds of [one
  untimed step, the timed steps] of upstream, then the same of lca_jax. Alternating blocks put
  a slow spell of a shared machine on both sides, and the untimed step that opens each block
  keeps the cost of switching sides (the other side's threads going idle, its freed memory
  mapped anew) out of both figures: each side is timed in its steady state, as a training
  run is. Step time = median over all timed steps of a side; also the median and range of the
  ratios of the rounds' mean step times."""
  up.step(host[0])
  first_s = ours.timed_step(host[0])  # compiles
  for b in host[1:warmup]:
    up.step(b)
    ours.step(b)
  steps = host[warmup:]
  t_up, t_ours, per_round = [], [], []
  for _ in range(rounds):
    means = []
    for side, acc in ((up, t_up), (ours, t_ours)):
      side.step(host[0])  # opens the block, untimed
      ts = [side.timed_step(b) for b in steps]
      acc.extend(ts)
      means.append(sum(ts) / len(ts))
    per_round.append(means[0] / means[1])
  rows, t = host[0]["ids"].shape
  n = len(steps)
  a = up.summary(float(np.median(t_up)), n, rows, t)
  o = ours.summary(float(np.median(t_ours)), n)
  o["compile_s"] = first_s
  a["step_s_all"] = [round(x, 4) for x in t_up]
  o["step_s_all"] = [round(x, 4) for x in t_ours]
  return dict(
    upstream=a,
    lca_jax=o,
    ratio=o["bytes_per_s"] / a["bytes_per_s"],
    ratio_rounds_median=float(np.median(per_round)),
    ratio_rounds_range=[float(min(per_round)), float(max(per_round))],
  )


# ---- the run --------------------------------------------------------------------------------
def validate(args):
  """(upstream checkout, shapes, layers, torch device) of ``train``'s arguments; BenchError."""
  src = check_upstream_src(args.upstream_src)
  shapes = parse_shapes(args.shapes)
  layers = bargs.parse_layers(args.layers)
  bargs.check_min(args, ("d_model", "d_inner", "n_heads"))
  if args.n_kv_heads < 0:
    raise BenchError(f"--n-kv-heads must be >= 0 (0 = --n-heads), got {args.n_kv_heads}")
  bargs.check_min(args, ("steps", "rounds"))
  if args.warmup < 1:
    raise BenchError(f"--warmup must be >= 1 (the first lca_jax step compiles), got {args.warmup}")
  for f in (p.strip() for p in args.data.split(",") if p.strip()):
    if not os.path.isfile(f):
      raise BenchError(f"--data {f}: no such file")
  return src, shapes, layers, torch_device(args.torch_device)


def use_cpu_devices() -> None:
  """As lca-train: a CPU host split into ``mesh.cpu_devices`` devices (the base config's rule),
  fixed once per process before any backend starts; a shape whose rows do not divide over
  them splits heads and MLP over them instead (``sharding.cpu_mesh``)."""
  mesh = configs_io.load_config(BASE_CONFIG).mesh
  try:
    shd.use_cpu_devices(shd.cpu_device_count(mesh))
  except shd.MeshError as e:
    raise BenchError(str(e)) from None


def run_train(args) -> dict:
  """``train``'s JSON object for its parsed ``args``; BenchError on bad input."""
  use_cpu_devices()
  src, shapes, layers, device = validate(args)
  data = ",".join(os.path.abspath(p.strip()) for p in args.data.split(",") if p.strip())
  torch.set_num_threads(os.cpu_count() or 1)
  cls = import_upstream(src)

  # One model for every shape (max_seq_len covers the longest); upstream gets its config dict.
  max_seq_len = max(4096, max(t for _, t in shapes))
  try:
    config0, overrides0 = lca_config(args, layers, *shapes[0], data, max_seq_len)
  except (ConfigError, configs_io.ConfigFileError) as e:
    raise BenchError(str(e)) from None
  model_cfg = loop.model_config_of(config0)
  uc = config_to_upstream(model_cfg)
  n_up = upstream_params(cls, uc)

  results, n_ours, own, up_env = {}, None, args.upstream_env == "own", None
  for b, t in shapes:
    key = f"{b}x{t}"
    try:
      config, _ = lca_config(args, layers, b, t, data, max_seq_len)
      setup = loop.prepare(config, jax_devices_for(config, b))
      host = read_rows(config, setup.plan, args.warmup + args.steps)
    except (ConfigError, configs_io.ConfigFileError, TrainError, DataError, shd.MeshError) as e:
      raise BenchError(f"shape {key}: {e}") from None
    top = max(int(np.max(h["ids"])) for h in host)
    if top >= uc["lm_vocab_size"]:  # the same ids must mean the same bytes on both sides
      raise BenchError(
        f"shape {key}: id {top} is outside upstream's vocabulary ({uc['lm_vocab_size']} ByT5 ids)"
      )
    if n_ours is None:
      n_ours = n_params_jax(setup.abstract.params)
    report.progress(PROG, f"{key}: upstream and lca_jax, rounds of steps ...")
    up = UpstreamProcess(src, uc, device, args) if own else UpstreamSide(cls, uc, device, args)
    try:
      results[key] = bench_pair(up, LcaSide(setup), host, args.warmup, args.rounds)
    finally:
      up.close()
    up_env = up.env

  pad = (model_cfg.vocab_size - model_cfg.n_tokens) * model_cfg.d_model * 2  # embedding + head rows
  enc, lm, dec, mbp = layers
  return dict(
    machine=machine.machine_info(torch, device),
    upstream_env=dict(
      mode=args.upstream_env, glibc_tunables=up_env["glibc_tunables"] if up_env else None
    ),
    model=dict(
      d_model=model_cfg.d_model,
      d_inner=model_cfg.d_inner,
      n_heads=model_cfg.n_heads,
      n_kv_heads=model_cfg.n_kv_heads,
      layers=dict(enc=enc, lm=lm, dec=dec, mbp=mbp),
      upstream_model_config=uc["model_config"],
      max_latent_ratio=args.max_latent_ratio,
      dropout=args.dropout,
      dtype="float32",
      n_tokens=model_cfg.n_tokens,
      vocab_size=model_cfg.vocab_size,
      upstream_lm_vocab_size=uc["lm_vocab_size"],
      upstream_script_id=upstream_script_id(uc),
      eos_id=vocab.EOS_ID,
      lambdas=dict(ntp=LAMBDAS[0], mbp=LAMBDAS[1], bp=LAMBDAS[2]),
      optimizer=dict(name="adam", lr=args.lr, b1=0.9, b2=0.999, eps=1e-8, clip=args.clip),
    ),
    params=dict(
      upstream=n_up,
      lca_jax=n_ours,
      lca_jax_vocab_padding=pad,
      lca_jax_without_padding=n_ours - pad,
      match=(n_ours - pad) == n_up,
    ),
    data=data or "bundled demo corpus (lca_jax/data/corpus, train split)",
    upstream_src=src,
    base_config=os.path.relpath(BASE_CONFIG, ROOT),
    lca_train_overrides=[f"--config.{o}" for o in overrides0 if not o.startswith(SHAPE_KEYS)],
    steps=args.steps,
    warmup=args.warmup,
    shapes=results,
  )
