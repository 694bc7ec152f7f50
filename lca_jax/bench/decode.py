"""Decode throughput of one model: the cached engine per mode and batch size, timed in
alternating rounds, its steps against the weight-streaming bound, the ops of a compiled step,
and a naive loop that reruns the full forward for every byte."""

from __future__ import annotations

import collections
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from lca_jax.bench import report
from lca_jax.bench.models import model_info, n_params, prompt_ids
from lca_jax.decode import engine
from lca_jax.perf import bounds, hlo_stats, xla_profile

MODES = ("ntp", "threshold", "verify", "threshold_tau0")


def _progress(msg: str):
  report.progress("bench_decode", msg)


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


def timed_decodes(model, prompts, kws: dict, repeats: int) -> dict:
  """For each mode of ``kws`` (name -> ``generate`` keywords), after a warm-up of them all
  (compiles): the fastest of ``repeats`` calls (``best``), the fastest prefill + one step call
  (``prefill``: ``max_bytes=1`` in the same executable), and the decode steps' own figures
  (``ms_per_step``, ``decode_bytes_per_s``): the call minus the prefill, or the whole call when
  too few new bytes rise above the timing noise (``separable`` False). The modes are timed in
  alternating rounds (each round calls every mode once, then its prefill), so a ratio between
  two modes compares calls made in the same minutes of this (shared, noisy) machine."""
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
    # the unrounded ratio to 2 decimals would not be)
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
  optimized HLO ``text``, ``hlo_stats.step_op_kinds``) and summed by kind, per step. Times are
  thread time summed over XLA's executor threads (ops run side by side, so the sum may exceed
  the step's wall time). XLA:CPU only (other backends name their events after kernels): None
  elsewhere."""
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


def _row(model, prompts, mode, kw, t, n, new_bytes, stream_bps, profile) -> dict:
  """The printed figures of one mode at one batch size (``t``: its ``timed_decodes`` entry)."""
  bsz = len(prompts)
  best, pre, separable = t["best"], t["prefill"], t["separable"]
  width = 1 if kw["mode"] == "ntp" else n
  length = bounds.cache_len([p.size for p in prompts], new_bytes, width, model.cfg.max_seq_len)
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
  row.update(step_bound(model, kw["mode"], bsz, width, length, best, stream_bps, t["ms_per_step"]))
  text = engine.compiled_decode(model, prompts, **kw).as_text()  # the executable timed
  row["step_hlo"] = hlo_step(model, prompts, text, length)
  if profile:
    row["step_profile"] = step_profile(model, prompts, kw, text)
  return row


def ratios(res: dict, naive) -> dict:
  """Cached ntp against the naive loop; each multi-byte mode against ntp at its batch size, in
  bytes/s and in ms per step."""
  out = {}
  if "ntp_b1" in res and naive:  # absent when there is no batch 1 or no ntp
    out["ntp_b1_vs_naive"] = res["ntp_b1"]["bytes_per_s"] / naive
  for key in res:
    ntp_key = "ntp_" + key.split("_")[-1]
    if key.startswith(("threshold", "verify")) and ntp_key in res:
      out[f"{key}_vs_{ntp_key}"] = res[key]["bytes_per_s"] / res[ntp_key]["bytes_per_s"]
      # what one step costs against an ntp step
      out[f"{key}_step_vs_{ntp_key}_step"] = res[key]["ms_per_step"] / res[ntp_key]["ms_per_step"]
  return {k: round(v, 2) for k, v in out.items()}


def run(
  model,
  *,
  checkpoint=None,
  batch=(1,),
  modes=MODES,
  prompt_bytes=256,
  new_bytes=512,
  tau=0.9,
  n=3,
  naive_bytes=64,
  repeats=2,
  profile=False,
  stream_mb=0.0,
  stream_repeats=5,
) -> dict:
  """The benchmark's JSON object for ``model`` (``checkpoint``: where it came from, or None)."""
  # threshold_tau0 accepts every candidate (n bytes per step whatever the model): the engine's
  # ceiling for this n, i.e. what threshold mode delivers once the MBP head is confident
  modes = [m for m in MODES if m in modes and (m == "ntp" or model.cfg.has_mbp)]
  _progress(f"model of {n_params(model)} parameters ready")
  stream = bounds.stream_bandwidth(stream_mb or bounds.stream_mb_for(model.cfg), stream_repeats)
  _progress(f"streaming bandwidth {stream['gb_s']:.1f} GB/s")
  out = {
    "checkpoint": checkpoint,
    "model": model_info(model),
    "device": str(jax.devices()[0]),
    "prompt_bytes": prompt_bytes,
    "new_bytes": new_bytes,
    "tau": tau,
    "n": n,
    "stream_gb_s": round(stream["gb_s"], 2),
    "stream": {k: v for k, v in stream.items() if k not in ("gb_s", "bytes_per_s")},
    "results": {},
  }
  for bsz in batch:
    prompts = [prompt_ids(prompt_bytes, seed=i) for i in range(bsz)]
    kws = {
      mode: dict(
        mode=mode.split("_")[0],
        tau=0.0 if mode.endswith("tau0") else tau,
        n=n,
        max_bytes=new_bytes,
        ignore_eos=True,
      )
      for mode in modes
    }
    timed = timed_decodes(model, prompts, kws, repeats)
    for mode, kw in kws.items():
      row = _row(
        model, prompts, mode, kw, timed[mode], n, new_bytes, stream["bytes_per_s"], profile
      )
      out["results"][f"{mode}_b{bsz}"] = row
      _progress(json.dumps({f"{mode}_b{bsz}": row}))
  naive = None
  if naive_bytes:
    total = prompt_bytes + max(new_bytes, naive_bytes)
    naive = naive_bytes_per_s(model, prompt_ids(prompt_bytes), naive_bytes, total)
    out["results"]["naive_full_forward_b1"] = {
      "bytes_per_s": round(naive, 1),
      "timed_bytes": naive_bytes,
    }
  out["ratios"] = ratios(out["results"], naive)
  return out
