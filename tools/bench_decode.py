"""Decode throughput on one checkpoint, all numbers from one run on this machine (JSON).

    python tools/bench_decode.py --checkpoint workdirs/demo [--prompt-bytes 256] [--new-bytes 512]
        [--batch 1,8] [--tau 0.9] [--n 3] [--naive-bytes 64] [--modes ntp,threshold]

Measures bytes/s after warm-up (compilation excluded and reported separately) for the cached
engine in ntp, threshold and verify modes at each batch size (plus threshold with tau 0, which
accepts all n bytes per step: the engine's ceiling once the MBP head is confident), and a
naive loop that reruns the full forward over the whole (fixed-size, so compiled once) sequence
for every byte, as the paper's code does. Ratios are against the naive loop and against cached ntp.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import lca_jax  # pylint: disable=g-import-not-at-top
from lca_jax import vocab  # pylint: disable=g-import-not-at-top


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


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", required=True)
  ap.add_argument("--prompt-bytes", type=int, default=256)
  ap.add_argument("--new-bytes", type=int, default=512)
  ap.add_argument("--batch", default="1,8")
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
  a = ap.parse_args(argv)
  a.modes = [m for m in a.modes.split(",") if m]
  if not a.modes or set(a.modes) - set(MODES):
    ap.error(f"--modes: choose among {','.join(MODES)}, got {','.join(a.modes) or 'none'}")
  return a


def main(argv=None):
  a = parse_args(argv)
  model = lca_jax.load(a.checkpoint)
  # threshold_tau0 accepts every candidate (n bytes per step whatever the model): the engine's
  # ceiling for this n, i.e. what threshold mode delivers once the MBP head is confident
  modes = [m for m in MODES if m in a.modes and (m == "ntp" or model.cfg.has_mbp)]
  out = {
    "checkpoint": a.checkpoint,
    "device": str(jax.devices()[0]),
    "prompt_bytes": a.prompt_bytes,
    "new_bytes": a.new_bytes,
    "tau": a.tau,
    "n": a.n,
    "results": {},
  }
  for bsz in [int(x) for x in a.batch.split(",")]:
    prompts = [prompt_ids(a.prompt_bytes, seed=i) for i in range(bsz)]
    for mode in modes:
      kw = dict(
        mode=mode.split("_")[0],
        tau=0.0 if mode.endswith("tau0") else a.tau,
        n=a.n,
        max_bytes=a.new_bytes,
        ignore_eos=True,
      )
      model.generate(prompts, **kw)  # warm-up (compiles)
      runs = [model.generate(prompts, **kw) for _ in range(a.repeats)]
      best = max(runs, key=lambda r: r.bytes_per_s)
      out["results"][f"{mode}_b{bsz}"] = dict(
        bytes_per_s=round(best.bytes_per_s, 1),
        steps=best.steps,
        bytes_per_step=round(sum(len(x) for x in best.ids) / bsz / max(best.steps, 1), 3),
        acceptance_rate=None if mode == "ntp" else round(best.acceptance_rate, 4),
        latent_steps_per_byte=round(best.latent_steps_per_byte, 4),
        compile_s=round(runs[0].compile_s, 1),
      )
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
  if "ntp_b1" in res:  # absent when --batch has no 1 or --modes no ntp
    ratios["ntp_b1_vs_naive"] = res["ntp_b1"]["bytes_per_s"] / naive
  for key in res:
    ntp_key = "ntp_" + key.split("_")[-1]
    if key.startswith(("threshold", "verify")) and ntp_key in res:
      ratios[f"{key}_vs_{ntp_key}"] = res[key]["bytes_per_s"] / res[ntp_key]["bytes_per_s"]
  out["ratios"] = {k: round(v, 2) for k, v in ratios.items()}
  print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main()
