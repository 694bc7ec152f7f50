"""Batch-1 decoding of the paper's PyTorch code and of lca-jax, same random weights.

For each size, random lca_jax weights are written in the paper's checkpoint layout and loaded
by both sides: upstream's ``FxTTransformerLM`` with a strict ``load_state_dict`` (eval mode,
float32) decodes with ``generate_group_cached`` at threshold 2 (``UPSTREAM_THRESHOLD``: one NT
byte per step, its MBP stage still run every step); lca_jax through the converter decodes in
ntp mode. Both continue the same prompt of real text, sampling at the same temperature with a
fixed seed; lca_jax's step is also set against the weight-streaming bound.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
import warnings

import jax
import numpy as np
import torch

from lca_jax import configs_io
from lca_jax.api import Model
from lca_jax.bench import args as bargs
from lca_jax.bench import machine, report
from lca_jax.bench import models as bmodels
from lca_jax.bench.args import BenchError
from lca_jax.bench.decode import step_bound, timed_decodes
from lca_jax.bench.upstream import (
  check_upstream_src,
  first_line,
  import_upstream,
  load_upstream_dir,
  sync,
  torch_device,
)
from lca_jax.interop import upstream as up_io
from lca_jax.model.config import ConfigError
from lca_jax.perf import bounds

PROG = "bench_vs_upstream"
# the sizes by name (None = configs/lca_mbp.py's own shape: d 1024, 2/16/2/2)
SIZES = {
  "11m": dict(d_model=256, d_inner=1024, n_heads=4, n_kv_heads=4, layers="2,4,2,2"),
  "60m": dict(d_model=512, d_inner=2048, n_heads=8, n_kv_heads=8, layers="2,8,2,2"),
  "374m": None,
}
# upstream's generate_group_cached accepts an MBP candidate when its probability >= threshold:
# above 1 it accepts none, so every step commits the one NT byte (ntp's output)
UPSTREAM_THRESHOLD = 2.0

_CUSTOM_SIZE = re.compile(r"d(\d+):(\d+):(\d+)(?::(\d+))?:(\d+(?:,\d+){3})")


def parse_sizes(s: str):
  """'11m,60m,d64:128:4:1,1,1,1' -> [(name, shape kwargs or None)] (None: configs/lca_mbp.py)."""
  out = []
  parts = re.findall(r"d\d+:\d+:\d+(?::\d+)?:\d+(?:,\d+){3}|[^,]+", str(s))
  for part in (p.strip() for p in parts):
    if not part:
      continue
    key = part.lower()
    if key in SIZES:
      out.append((key, SIZES[key]))
      continue
    m = _CUSTOM_SIZE.fullmatch(key)
    if not m:
      raise BenchError(
        f"--sizes: {part!r} is neither one of {', '.join(SIZES)} nor "
        "dD:INNER:HEADS[:KV]:ENC,LM,DEC,MBP (e.g. d64:128:4:1,1,1,1)"
      )
    d, inner, heads, kv, layers = m.groups()
    bargs.parse_layers(layers)
    shape = dict(
      d_model=int(d), d_inner=int(inner), n_heads=int(heads), n_kv_heads=int(kv or 0), layers=layers
    )
    if min(shape["d_model"], shape["d_inner"], shape["n_heads"]) < 1:
      raise BenchError(f"--sizes: {part!r}: d, inner and heads must be >= 1")
    out.append((key, shape))
  if not out:
    raise BenchError(f"--sizes: {s!r} names no size")
  if len({k for k, _ in out}) != len(out):
    raise BenchError(f"--sizes: {s!r} repeats a size")
  return out


def decode_model_config(shape):
  """lca_jax's ModelConfig of a --sizes entry (configs/lca_mbp.py in float32, plain XLA)."""
  try:
    if shape is None:
      return bmodels.model_config(bmodels.BASE_CONFIG, bmodels.FLAG_BASE)
    return bmodels.model_config(None, (), **shape)
  except (ConfigError, configs_io.ConfigFileError, ValueError) as e:
    raise BenchError(f"--sizes: {e}") from None


def write_random_dir(path: str, cfg, seed: int):
  """Random lca_jax weights of ``cfg`` (``init_params``) written in the paper's checkpoint
  layout at ``path``, for both sides to load."""
  up_io.write_dir(path, bmodels.random_params(cfg, seed), cfg)


def load_lca_dir(path: str, cfg):
  """lca_jax's model of the same checkpoint directory: its weights through the converter
  (``interop.upstream.load_dir``), the embedding and head zero-padded to ``cfg.vocab_size`` rows
  as lca_jax's own configs hold them (``lca_jax.load`` would keep the 261 rows of the paper's
  layout), under ``cfg`` (config.json carries neither max_latent_ratio, unused in decoding, nor
  attention_impl, which reads back as the default)."""
  try:
    got, params = up_io.load_dir(path, vocab_size=cfg.vocab_size)
  except ValueError as e:  # CheckpointError
    raise BenchError(f"{path}: {e}") from None
  if got.replace(max_latent_ratio=cfg.max_latent_ratio, attention_impl=cfg.attention_impl) != cfg:
    raise BenchError(f"{path}: config.json does not give back the model written")
  return Model(cfg, jax.tree_util.tree_map(jax.numpy.asarray, params), source=path)


def upstream_decode(model, prompt, new_bytes: int, temperature: float, seed: int, device: str):
  """Upstream's KV-cached decoding, batch 1, one NT byte per step (UPSTREAM_THRESHOLD)."""
  ids = torch.from_numpy(np.asarray(prompt, np.int64))[None].to(device)
  kw = dict(
    temperature=temperature,
    top_k=None,
    top_p=None,
    stop_token_id=None,
    threshold=UPSTREAM_THRESHOLD,
    candidates=1,
  )
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      torch.manual_seed(seed)
      model.generate_group_cached(ids, max_tokens=min(4, new_bytes), **kw)  # warm-up
      sync(device)
      torch.manual_seed(seed)
      t0 = time.perf_counter()
      out, acceptance = model.generate_group_cached(ids, max_tokens=new_bytes, **kw)
      sync(device)
      elapsed = time.perf_counter() - t0
    except Exception as e:  # pylint: disable=broad-except  (one line, exit 2)
      raise BenchError(
        f"upstream generate_group_cached failed ({type(e).__name__}: {first_line(e)})"
      ) from None
  n = len(out)
  return dict(
    bytes_per_s=n / elapsed,
    ms_per_step=elapsed / max(n, 1) * 1e3,
    bytes=n,
    steps=n,
    elapsed_s=elapsed,
    # upstream's own measure: bytes committed / logits read per step (NT, MBP, copies), so
    # 1 / (candidates + 2) when no candidate is accepted
    acceptance_rate=float(acceptance),
  )


def lca_decode(model, prompt, args, stream_bps: float):
  """lca_jax ntp decoding, batch 1, after one untimed (compiling) call; best of --repeats."""
  kw = dict(
    mode="ntp",
    temperature=args.temperature,
    max_bytes=args.new_bytes,
    ignore_eos=True,
    seed=args.seed,
  )
  t = timed_decodes(model, [prompt], {"ntp": kw}, args.repeats)["ntp"]
  best = t["best"]
  length = bounds.cache_len([prompt.size], args.new_bytes, 1, model.cfg.max_seq_len)
  row = dict(
    bytes_per_s=best.bytes_per_s,
    bytes=int(sum(len(x) for x in best.ids)),
    steps=best.steps,
    elapsed_s=best.elapsed_s,
    latent_steps_per_byte=best.latent_steps_per_byte,
    compile_s=t["first"].compile_s,
    decode_bytes_per_s=t["decode_bytes_per_s"],
    prefill_s=t["prefill"].elapsed_s,
  )
  row.update(step_bound(model, "ntp", 1, 1, length, best, stream_bps, t["ms_per_step"]))
  return row


def validate(args):
  """(upstream checkout, [(size name, ModelConfig)], torch device) of ``decode``'s arguments;
  BenchError."""
  src = check_upstream_src(args.upstream_src)
  sizes = parse_sizes(args.sizes)
  bargs.check_min(args, ("prompt_bytes", "new_bytes", "repeats", "stream_repeats"))
  t = args.temperature
  if not (math.isfinite(t) and t > 0):
    raise BenchError(f"--temperature must be a finite number > 0 (both sides sample), got {t}")
  if t == 1.0:
    raise BenchError(
      "--temperature 1.0 is upstream's greedy path (argmax) but lca_jax's plain sampling; "
      "choose another value (e.g. 0.99)"
    )
  if args.torch_threads < 0:
    raise BenchError(f"--torch-threads must be >= 0 (0 = all cores), got {args.torch_threads}")
  if not (math.isfinite(args.stream_mb) and args.stream_mb >= 0):
    raise BenchError(f"--stream-mb must be >= 0 (0 = each size's parameters), got {args.stream_mb}")
  cfgs = [(name, decode_model_config(shape)) for name, shape in sizes]
  for name, cfg in cfgs:
    if args.prompt_bytes + args.new_bytes > cfg.max_seq_len:
      raise BenchError(
        f"size {name}: --prompt-bytes + --new-bytes ({args.prompt_bytes + args.new_bytes}) "
        f"exceed the model context ({cfg.max_seq_len} bytes)"
      )
  return src, cfgs, torch_device(args.torch_device)


def _size_result(cls, name, cfg, prompt, args, device) -> dict:
  """Size ``name``: both sides on the same random weights, and the bound of lca_jax's step."""
  with tempfile.TemporaryDirectory(prefix="bench_vs_upstream_") as ckpt:
    report.progress(PROG, f"{name}: random weights -> {ckpt} ...")
    write_random_dir(ckpt, cfg, args.seed)
    report.progress(PROG, f"{name}: upstream ...")
    up_model, uc = load_upstream_dir(cls, ckpt, device)
    n_up = int(sum(p.numel() for p in up_model.parameters()))
    up = upstream_decode(up_model, prompt, args.new_bytes, args.temperature, args.seed, device)
    del up_model
    report.progress(PROG, f"{name}: lca_jax ...")
    model = load_lca_dir(ckpt, cfg)
  # the probe streams a matrix of this model's size (bounds.stream_mb_for), from where its
  # steps stream their weights (a cache level on small models, DRAM on large ones)
  stream = bounds.stream_bandwidth(
    args.stream_mb or bounds.stream_mb_for(model.cfg), args.stream_repeats
  )
  ours = lca_decode(model, prompt, args, stream["bytes_per_s"])
  n_ours = bmodels.n_params(model)
  pad = (model.cfg.vocab_size - model.cfg.n_tokens) * model.cfg.d_model * 2  # padding rows
  return dict(
    model=dict(
      d_model=cfg.d_model,
      d_inner=cfg.d_inner,
      n_heads=cfg.n_heads,
      n_kv_heads=cfg.n_kv_heads,
      layers=dict(enc=cfg.n_enc, lm=cfg.n_lm, dec=cfg.n_dec, mbp=cfg.n_mbp),
      upstream_model_config=uc["model_config"],
    ),
    params=dict(
      upstream=n_up,
      lca_jax=n_ours,
      lca_jax_without_padding=n_ours - pad,
      match=(n_ours - pad) == n_up,
    ),
    upstream=up,
    lca_jax=ours,
    ratio=ours["bytes_per_s"] / up["bytes_per_s"],
    stream_gb_s=round(stream["gb_s"], 2),
    stream={k: v for k, v in stream.items() if k not in ("gb_s", "bytes_per_s")},
  )


def run_decode(args) -> dict:
  """``decode``'s JSON object for its parsed ``args``; BenchError on bad input."""
  src, cfgs, device = validate(args)
  torch.set_num_threads(args.torch_threads or os.cpu_count() or 1)
  cls = import_upstream(src)
  prompt = bmodels.prompt_ids(args.prompt_bytes)
  results = {}
  for name, cfg in cfgs:
    results[name] = _size_result(cls, name, cfg, prompt, args, device)
  return dict(
    machine=machine.machine_info(torch, device),
    upstream_src=src,
    base_config=os.path.relpath(bmodels.BASE_CONFIG, bmodels.ROOT),
    prompt_bytes=int(prompt.size),
    new_bytes=args.new_bytes,
    temperature=args.temperature,
    seed=args.seed,
    upstream_call=dict(
      method="generate_group_cached", threshold=UPSTREAM_THRESHOLD, candidates=1, batch=1
    ),
    lca_jax_call=dict(mode="ntp", ignore_eos=True, batch=1, repeats=args.repeats),
    sizes=results,
  )
