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
(``perf.hlo_stats.step_stats``: ops, dots, fusions, and the copies of at least the smallest
KV-cache buffer, count and bytes; there should be none). And the weight-streaming bound
(``lca_jax.perf.bounds``, formula in its docstring): the matvec streaming bandwidth of this
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
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # lca_jax from this checkout, installed or not
  sys.path.insert(0, ROOT)

import lca_jax  # noqa: E402
from lca_jax import configs_io  # noqa: E402
from lca_jax.bench import args as bargs  # noqa: E402
from lca_jax.bench import report  # noqa: E402
from lca_jax.bench.decode import MODES, hlo_step, run, timed_decodes  # noqa: E402,F401
from lca_jax.bench.models import model_config, random_model  # noqa: E402,F401
from lca_jax.model.config import ConfigError  # noqa: E402


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  src = ap.add_argument_group("model (one of --checkpoint, or a random model of a shape)")
  src.add_argument("--checkpoint", default=None, help="lca-train workdir or the paper's layout")
  src.add_argument("--config", default=None, metavar="FILE", help="config file (random weights)")
  bargs.add_shape_args(src)
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
    a.batch = bargs.int_list(a.batch)
  except ValueError:
    a.batch = []
  if not a.batch or min(a.batch) < 1:
    ap.error(f"--batch: give comma-separated batch sizes >= 1 (e.g. 1,8,32), got {a.batch!r}")
  bargs.check_min(a, ("prompt_bytes", "new_bytes", "repeats", "stream_repeats"), error=ap.error)
  if a.naive_bytes < 0:
    ap.error(f"--naive-bytes must be >= 0 (0 = skip the naive loop), got {a.naive_bytes}")
  if not (math.isfinite(a.stream_mb) and a.stream_mb >= 0):
    ap.error(f"--stream-mb must be >= 0 (0 = the model's size), got {a.stream_mb}")
  shape = bargs.shape_of(a)
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
  model = lca_jax.load(a.checkpoint) if a.cfg is None else random_model(a.cfg, a.seed)
  out = run(
    model,
    checkpoint=a.checkpoint,
    batch=a.batch,
    modes=a.modes,
    prompt_bytes=a.prompt_bytes,
    new_bytes=a.new_bytes,
    tau=a.tau,
    n=a.n,
    naive_bytes=a.naive_bytes,
    repeats=a.repeats,
    profile=a.profile,
    stream_mb=a.stream_mb,
    stream_repeats=a.stream_repeats,
  )
  return report.print_json(out)


if __name__ == "__main__":
  main()
