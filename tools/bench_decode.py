"""Decode throughput of one model, all numbers from one run on this machine (JSON).

    python tools/bench_decode.py --checkpoint workdirs/demo [--prompt-bytes 256] [--new-bytes 512]
        [--batch 1,8,32] [--tau 0.9] [--n 3] [--naive-bytes 64] [--modes ntp,threshold]
    python tools/bench_decode.py --d-model 1024 --d-inner 4096 --n-heads 8 --layers 2,16,2,2
    python tools/bench_decode.py --config configs/lca_mbp.py --config.model.dtype=float32

The model is a checkpoint (``--checkpoint DIR``: an lca-train work directory or the paper's
layout) or random weights (``init_params``, ``--seed``) of a shape: a config file (``--config
FILE`` with ``--config.model.key=value`` overrides) and / or the shape flags ``--d-model
--d-inner --n-heads --n-kv-heads --layers ENC,LM,DEC,MBP`` (without ``--config`` they apply to
configs/lca_mbp.py in float32, as tools/bench_vs_upstream.py builds its models; missing flags
take the 11M shape d 256 / inner 1024 / 4 heads / 2,4,2,2).

Measures, after warm-up (compilation excluded and reported separately), the cached engine in
ntp, threshold and verify modes at each batch size (plus threshold with tau 0, which accepts
all n bytes per step: the engine's ceiling once the MBP head is confident): bytes/s (all rows
together, the call's time: prefill included), ``decode_bytes_per_s`` and ``ms_per_step`` of the
decode steps alone (the call minus a call with ``max_bytes=1``, i.e. prefill + one step, timed
separately as ``prefill_s``: the same executable, its byte budget an argument (``generate``'s
``budget_pad_to``), so one compile per mode and batch size; at batch 32 with 256-byte prompts
the prefill is most of the call), bytes per step per row,
acceptance, and from the optimized HLO of the compiled decode loop the ops of one step
(``decode.hlo_stats.step_stats``: ops, dots, fusions, and the copies of at least the smallest
KV-cache buffer, count and bytes; there should be none). And the weight-streaming bound
(``lca_jax.decode.bounds``, formula in its docstring): the matvec streaming bandwidth of this
machine (``stream_gb_s``, measured once, with a matrix the size of the model's parameters unless
``--stream-mb`` says otherwise), per mode and batch the bytes one step must read
(parameters it uses: embedding rows, encoder, boundary predictor, decoder, head every step, the
latent LM in the measured fraction of steps that close a group, the MBP stack / MLP heads in
threshold and verify; plus the KV caches its attention reads), ``bound_ms_per_step`` = bytes /
bandwidth and ``ms_per_step_over_bound`` = measured / bound. Last, a naive loop that reruns the
full forward over the whole (fixed-size, so compiled once) sequence for every byte, as the
paper's code does. The modes of a batch size are timed in alternating rounds (``--repeats``
of them), so their ratios compare calls made in the same minutes. Ratios are against the naive
loop and against cached ntp (bytes/s, and ``*_step_vs_ntp_*_step``: ms per step). With ``--profile``
each result also gets ``step_profile``: one more call traced by the XLA profiler, the thread
time of the loop body's ops per step by kind (``cache_dot``: the attention products over
the KV caches; ``dot``: the weight products; ``fusion``; others by op name), XLA:CPU only.
Bad input: an argparse error (exit status 2).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import lca_jax  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax import configs_io, vocab, xla_profile  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.api import Model  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.decode import bounds, engine, hlo_stats  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.model.config import ConfigError, ModelConfig  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.model.hierarchical import init_params  # noqa: E402  pylint: disable=g-import-not-at-top

BASE_CONFIG = os.path.join(ROOT, "configs", "lca_mbp.py")
# the shape flags' defaults without --config (the 11M model of tools/bench_vs_upstream.py)
SHAPE_DEFAULTS = dict(d_model=256, d_inner=1024, n_heads=4, n_kv_heads=0, layers="2,4,2,2")
# what tools/bench_vs_upstream.py sets besides the shape (float32, plain XLA attention, LCA-MBP)
FLAG_BASE = (
  "model.kind=hierarchical",
  "model.boundaries=learned",
  "model.n_mlp_mbp=0",
  "model.max_latent_ratio=0.0",
  "model.dropout=0.0",
  "model.dtype=float32",
  "model.attention_impl=xla",
)


def prompt_ids(n_bytes: int, seed: int = 0):
  """A real-text prompt from the bundled corpus (held-out part), cut to n_bytes."""
  from lca_jax.data import demo_corpus_path, read_documents  # pylint: disable=g-import-not-at-top

  docs = [d for i, d in enumerate(read_documents([demo_corpus_path()], "text")) if i % 20 == 19]
  text = "\n\n".join(docs[seed:])
  return vocab.encode(text)[:n_bytes]


def naive_bytes_per_s(model, prompt, n_new, total_len):
  """Greedy next-byte decoding that reruns the whole model for every byte (no caches)."""
  fwd = jax.jit(lambda p, ids: model.module.apply({"params": p}, ids)["ntp_logits"])
  buf = np.zeros((1, total_len), np.int32)
  buf[0, : prompt.size] = prompt
  length = prompt.size
  jax.block_until_ready(fwd(model.params, jnp.asarray(buf)))  # compile
  t0 = time.perf_counter()
  for _ in range(n_new):
    logits = fwd(model.params, jnp.asarray(buf))
    buf[0, length] = int(jnp.argmax(logits[0, length - 1]))
    length += 1
  return n_new / (time.perf_counter() - t0)


MODES = ("ntp", "threshold", "verify", "threshold_tau0")


# ---- the model --------------------------------------------------------------------------------
def parse_layers(s: str):
  """'2,4,2,2' -> (enc, lm, dec, mbp); ValueError naming --layers otherwise."""
  return configs_io.parse_layers(s)


def shape_overrides(d_model=None, d_inner=None, n_heads=None, n_kv_heads=None, layers=None):
  """``model.key=value`` overrides for the given shape values (None = not given; n_kv_heads 0
  = n_heads)."""
  out = []
  for key, v in (("d_model", d_model), ("d_inner", d_inner), ("n_heads", n_heads)):
    if v is not None:
      if int(v) < 1:
        raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {v}")
      out.append(f"model.{key}={int(v)}")
  kv = int(n_kv_heads or 0)
  if kv < 0:
    raise ValueError(f"--n-kv-heads must be >= 0 (0 = --n-heads), got {kv}")
  if kv or n_heads is not None:  # a new head count brings its kv heads (the config's may not fit)
    out.append(f"model.n_kv_heads={kv or int(n_heads)}")
  if layers is not None:
    names = ("n_enc", "n_lm", "n_dec", "n_mbp")
    out += [f"model.{k}={v}" for k, v in zip(names, parse_layers(layers))]
  return out


def model_config(config_path=None, overrides=(), **shape) -> ModelConfig:
  """The ModelConfig of ``config_path`` (default configs/lca_mbp.py in float32 with the
  SHAPE_DEFAULTS for missing shape values) with ``overrides`` (``model.key=value``) and the
  shape flags applied. ConfigError / ConfigFileError / ValueError on bad input."""
  if config_path is None:
    shape = {k: (SHAPE_DEFAULTS[k] if shape.get(k) is None else shape[k]) for k in SHAPE_DEFAULTS}
    base = list(FLAG_BASE)
  else:
    base = []
  config = configs_io.load_config(config_path or BASE_CONFIG)
  ov = base + list(overrides) + shape_overrides(**shape)
  configs_io.apply_overrides(config, ov)
  return ModelConfig.from_dict(config.model.to_dict())


def random_model(cfg: ModelConfig, seed: int = 0) -> Model:
  """A Model of random weights (the model's own init) of ``cfg``."""
  params = jax.tree_util.tree_map(np.asarray, init_params(cfg, jax.random.PRNGKey(seed)))
  return Model(cfg, params, source=f"random(seed={seed})")


def n_params(model) -> int:
  return int(sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(model.params)))


def model_info(model) -> dict:
  c = model.cfg
  return dict(
    source=model.source,
    kind=c.kind,
    d_model=c.d_model,
    d_inner=c.d_inner,
    n_heads=c.n_heads,
    n_kv_heads=c.n_kv_heads,
    layers=dict(enc=c.n_enc, lm=c.n_lm, dec=c.n_dec, mbp=c.n_mbp, mlp_mbp=c.n_mlp_mbp),
    dtype=c.dtype,
    max_seq_len=c.max_seq_len,
    params=n_params(model),
  )


def _progress(msg: str):
  """A line on stderr as each phase ends: a run cut short by a timeout shows how far it got."""
  print(f"bench_decode: {msg}", file=sys.stderr, flush=True)


# ---- one measurement --------------------------------------------------------------------------
def timed_decodes(model, prompts, kws: dict, repeats: int) -> dict:
  """For each mode of ``kws`` (name -> ``generate`` keywords), after a warm-up of them all
  (compiles): the fastest of ``repeats`` calls (``best``), the fastest prefill + one step call
  (``prefill``: ``max_bytes=1`` in the same executable), and the decode steps' own figures
  (``ms_per_step``, ``decode_bytes_per_s``): the call minus the prefill, or the whole call when too few new
  bytes rise above the timing noise (``separable`` False). The modes are timed in alternating
  rounds (each round calls every mode once, then its prefill), so a ratio between two modes
  compares calls made in the same minutes of this (shared, noisy) machine."""
  one = lambda kw: dict(kw, max_bytes=1, budget_pad_to=kw["max_bytes"])
  first = {}
  for m, kw in kws.items():  # warm-up (compiles)
    first[m] = model.generate(prompts, **kw)
    model.generate(prompts, **one(kw))
    _progress(f"{m} at batch {len(prompts)}: compiled in {first[m].compile_s:.1f} s")
  runs, pres = collections.defaultdict(list), collections.defaultdict(list)
  for _ in range(repeats):
    for m, kw in kws.items():
      runs[m].append(model.generate(prompts, **kw))
      pres[m].append(model.generate(prompts, **one(kw)))
  out = {}
  for m in kws:
    best = max(runs[m], key=lambda r: r.bytes_per_s)
    pre = min(pres[m], key=lambda r: r.elapsed_s)
    dec_s, dec_steps = best.elapsed_s - pre.elapsed_s, best.steps - pre.steps
    dec_bytes = sum(len(x) for x in best.ids) - sum(len(x) for x in pre.ids)
    separable = dec_s > 0 and dec_steps > 0 and dec_bytes > 0
    if not separable:
      dec_s, dec_steps = best.elapsed_s, max(best.steps, 1)
      dec_bytes = sum(len(x) for x in best.ids)
    out[m] = dict(
      best=best,
      prefill=pre,
      first=first[m],
      separable=separable,
      ms_per_step=dec_s / dec_steps * 1e3,
      decode_bytes_per_s=dec_bytes / dec_s,
    )
  return out


def step_bound(model, mode, bsz, width, length, res, stream_bps, ms) -> dict:
  """Bytes one step must read and the streaming bound for a measured result ``res`` whose
  decode steps took ``ms`` each."""
  bps_row = sum(len(x) for x in res.ids) / bsz / max(res.steps, 1)
  read = bounds.step_read_bytes(
    model.cfg, mode, bsz, width, length, res.latent_steps_per_byte, bps_row
  )
  bound = bounds.bound_ms(read["total"], stream_bps)
  ms, bound = round(ms, 4), round(bound, 5)  # as printed
  return dict(
    ms_per_step=ms,
    cache_len=length,
    read_bytes_per_step=int(read["total"]),
    read_param_bytes=int(read["params"]),
    read_kv_bytes=int(read["kv"]),
    lm_fraction=round(read["lm_fraction"], 4),
    bound_ms_per_step=bound,
    # from the printed figures, 3 significant digits: a ratio a reader can recompute (rounding
    # the unrounded ratio to 2 decimals moved a 0.0013 ms step's 0.104 to 0.11)
    ms_per_step_over_bound=float(f"{ms / bound:.3g}") if bound > 0 else None,
  )


def hlo_step(model, prompts, text, length) -> dict:
  """Ops of one compiled decode step (the loop body of the optimized HLO ``text``) and its
  cache-sized copies."""
  min_copy = bounds.min_cache_bytes(model.cfg, len(prompts), length)
  try:
    st = hlo_stats.step_stats(text, min_copy)
  except ValueError as e:  # another backend's HLO whose decode loop is not found: the timings stand
    return {"error": str(e)}
  return dict(
    ops=st["ops"],
    dots=st["dots"],
    fusions=st["fusions"],
    cache_copies=len(st["copies"]),
    cache_copy_bytes=int(sum(c["bytes"] for c in st["copies"])),
    min_cache_bytes=int(min_copy),
  )


def step_profile(model, prompts, kw, text) -> dict:
  """Where a decode step's time goes, from the XLA profiler: one more ``generate`` call traced
  (``jax.profiler``), its per-op events matched to the ops of the compiled loop body (in its
  optimized HLO ``text``, ``hlo_stats.step_op_kinds``) and summed by kind, per step. Times are thread time summed
  over XLA's executor threads (ops run side by side, so the sum may exceed the step's wall
  time). XLA:CPU only (other backends name their events after kernels): None elsewhere."""
  if jax.default_backend() != "cpu":
    return None
  kinds = hlo_stats.step_op_kinds(text)
  res, by_name = xla_profile.trace_thread_ns(lambda: model.generate(prompts, **kw), kinds)
  ns = collections.Counter()
  for name, t in by_name.items():
    ns[kinds[name]] += t
  steps = max(res.steps, 1)
  per_step = {k: round(v / steps / 1e6, 4) for k, v in ns.most_common()}
  return dict(
    steps=res.steps,
    thread_ms_per_step=round(sum(ns.values()) / steps / 1e6, 4),
    thread_ms_per_step_by_kind=per_step,
  )


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  src = ap.add_argument_group("model (one of --checkpoint, or a random model of a shape)")
  src.add_argument("--checkpoint", default=None, help="lca-train workdir or the paper's layout")
  src.add_argument("--config", default=None, metavar="FILE", help="config file (random weights)")
  src.add_argument("--d-model", type=int, default=None)
  src.add_argument("--d-inner", type=int, default=None)
  src.add_argument("--n-heads", type=int, default=None)
  src.add_argument("--n-kv-heads", type=int, default=None, help="0 = --n-heads")
  src.add_argument("--layers", default=None, help="ENC,LM,DEC,MBP layer counts")
  src.add_argument("--seed", type=int, default=0, help="random init seed")
  ap.add_argument("--prompt-bytes", type=int, default=256)
  ap.add_argument("--new-bytes", type=int, default=512)
  ap.add_argument("--batch", default="1,8,32")
  ap.add_argument("--tau", type=float, default=0.9)
  ap.add_argument("--n", type=int, default=3)
  ap.add_argument("--naive-bytes", type=int, default=64, help="bytes timed for the naive loop")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument(
    "--modes",
    default=",".join(MODES),
    help="comma-separated subset of %(default)s (those without a multi-byte head "
    "are skipped for a model that has none)",
  )
  ap.add_argument(
    "--profile",
    action="store_true",
    help="add each result's step profile (XLA profiler: thread ms per step by op kind)",
  )
  ap.add_argument(
    "--stream-mb",
    type=float,
    default=0.0,
    help="W of the bandwidth matvec, MB (0 = the model's float32 parameters, at least 16 MB: "
    "the probe then streams from where a step of the model does)",
  )
  ap.add_argument("--stream-repeats", type=int, default=5)
  a, rest = ap.parse_known_args(argv)
  a.modes = [m for m in a.modes.split(",") if m]
  if not a.modes or set(a.modes) - set(MODES):
    ap.error(f"--modes: choose among {','.join(MODES)}, got {','.join(a.modes) or 'none'}")
  try:
    a.batch = [int(x) for x in a.batch.split(",") if x.strip()]
  except ValueError:
    a.batch = []
  if not a.batch or min(a.batch) < 1:
    ap.error(f"--batch: give comma-separated batch sizes >= 1 (e.g. 1,8,32), got {a.batch!r}")
  for name in ("prompt_bytes", "new_bytes", "repeats", "stream_repeats"):
    if getattr(a, name) < 1:
      ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
  if a.naive_bytes < 0:
    ap.error(f"--naive-bytes must be >= 0 (0 = skip the naive loop), got {a.naive_bytes}")
  if not (math.isfinite(a.stream_mb) and a.stream_mb >= 0):
    ap.error(f"--stream-mb must be >= 0 (0 = the model's size), got {a.stream_mb}")
  shape = dict(
    d_model=a.d_model,
    d_inner=a.d_inner,
    n_heads=a.n_heads,
    n_kv_heads=a.n_kv_heads,
    layers=a.layers,
  )
  given = any(v is not None for v in shape.values())
  try:
    overrides = configs_io.split_overrides(rest)
  except configs_io.ConfigFileError as e:
    ap.error(str(e))
  if a.checkpoint is not None and (a.config or given or overrides):
    ap.error("--checkpoint takes the model as it is: no --config, overrides or shape flags")
  if overrides and not a.config:
    ap.error("--config.KEY=VALUE overrides need --config FILE")
  if a.checkpoint is None and not a.config and not given:
    ap.error("give a model: --checkpoint DIR, --config FILE or the shape flags (--d-model ...)")
  a.cfg = None
  if a.checkpoint is None:
    try:
      a.cfg = model_config(a.config, overrides, **shape)
    except (ConfigError, configs_io.ConfigFileError, ValueError) as e:
      ap.error(str(e))
  return a


def main(argv=None):
  a = parse_args(argv)
  if a.cfg is None:
    model = lca_jax.load(a.checkpoint)
  else:
    model = random_model(a.cfg, a.seed)
  # threshold_tau0 accepts every candidate (n bytes per step whatever the model): the engine's
  # ceiling for this n, i.e. what threshold mode delivers once the MBP head is confident
  modes = [m for m in MODES if m in a.modes and (m == "ntp" or model.cfg.has_mbp)]
  _progress(f"model of {n_params(model)} parameters ready")
  stream = bounds.stream_bandwidth(a.stream_mb or bounds.stream_mb_for(model.cfg), a.stream_repeats)
  _progress(f"streaming bandwidth {stream['gb_s']:.1f} GB/s")
  out = {
    "checkpoint": a.checkpoint,
    "model": model_info(model),
    "device": str(jax.devices()[0]),
    "prompt_bytes": a.prompt_bytes,
    "new_bytes": a.new_bytes,
    "tau": a.tau,
    "n": a.n,
    "stream_gb_s": round(stream["gb_s"], 2),
    "stream": {k: v for k, v in stream.items() if k not in ("gb_s", "bytes_per_s")},
    "results": {},
  }
  for bsz in a.batch:
    prompts = [prompt_ids(a.prompt_bytes, seed=i) for i in range(bsz)]
    kws = {
      mode: dict(
        mode=mode.split("_")[0],
        tau=0.0 if mode.endswith("tau0") else a.tau,
        n=a.n,
        max_bytes=a.new_bytes,
        ignore_eos=True,
      )
      for mode in modes
    }
    timed = timed_decodes(model, prompts, kws, a.repeats)
    for mode, kw in kws.items():
      t = timed[mode]
      best, pre, separable = t["best"], t["prefill"], t["separable"]
      width = 1 if kw["mode"] == "ntp" else a.n
      length = bounds.cache_len(
        [p.size for p in prompts], a.new_bytes, width, model.cfg.max_seq_len
      )
      row = dict(
        bytes_per_s=round(best.bytes_per_s, 1),
        decode_bytes_per_s=round(t["decode_bytes_per_s"], 1),
        prefill_s=round(pre.elapsed_s, 4),
        step_time_from="decode steps" if separable else "whole call (prefill not separable)",
        steps=best.steps,
        bytes_per_step=round(sum(len(x) for x in best.ids) / bsz / max(best.steps, 1), 3),
        acceptance_rate=None if mode == "ntp" else round(best.acceptance_rate, 4),
        latent_steps_per_byte=round(best.latent_steps_per_byte, 4),
        compile_s=round(t["first"].compile_s, 1),
      )
      ms = t["ms_per_step"]
      row.update(step_bound(model, kw["mode"], bsz, width, length, best, stream["bytes_per_s"], ms))
      text = engine.compiled_decode(model, prompts, **kw).as_text()  # the executable timed
      row["step_hlo"] = hlo_step(model, prompts, text, length)
      if a.profile:
        row["step_profile"] = step_profile(model, prompts, kw, text)
      out["results"][f"{mode}_b{bsz}"] = row
      _progress(json.dumps({f"{mode}_b{bsz}": row}))
  naive = None
  if a.naive_bytes:
    naive = naive_bytes_per_s(
      model,
      prompt_ids(a.prompt_bytes),
      a.naive_bytes,
      a.prompt_bytes + max(a.new_bytes, a.naive_bytes),
    )
    out["results"]["naive_full_forward_b1"] = {
      "bytes_per_s": round(naive, 1),
      "timed_bytes": a.naive_bytes,
    }
  res = out["results"]
  ratios = {}
  if "ntp_b1" in res and naive:  # absent when --batch has no 1 or --modes no ntp
    ratios["ntp_b1_vs_naive"] = res["ntp_b1"]["bytes_per_s"] / naive
  for key in res:
    ntp_key = "ntp_" + key.split("_")[-1]
    if key.startswith(("threshold", "verify")) and ntp_key in res:
      ratios[f"{key}_vs_{ntp_key}"] = res[key]["bytes_per_s"] / res[ntp_key]["bytes_per_s"]
      # what one step costs against an ntp step (the decode engine issue's step targets)
      ratios[f"{key}_step_vs_{ntp_key}_step"] = (
        res[key]["ms_per_step"] / res[ntp_key]["ms_per_step"]
      )
  out["ratios"] = {k: round(v, 2) for k, v in ratios.items()}
  print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main()
