"""Compile every production program for H100 / H200 / B200 GPUs on this host, without a GPU.

    make gpu-aot                                   # installs .venv-cuda, runs this and the tests
    .venv-cuda/bin/python tools/gpu_aot.py         # configs/lca_mbp.py, all targets
    .venv-cuda/bin/python tools/gpu_aot.py --targets h100 --gpus 1 --impls pallas --decode none

Prints one JSON object: for each target, the train step (per attention implementation and GPU
count, ``--micro-per-gpu`` rows per GPU in a micro-batch), the eval step and the decode
programs (batch 1 and 32; ntp, threshold tau 0 n 3, verify n 3): compile seconds, memory per
device against the device's ("fits" / "does not fit by X GB"), fusions, Triton GEMM fusions,
custom calls, buffers with two dimensions >= T, and for decode the kernels and host launches of
one step with the bytes/s that launching them allows (``lca_jax/aot``). Progress goes to
stderr. Needs jax's CUDA plugin (``make gpu-aot`` installs it into .venv-cuda); without it, one
line of error and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from lca_jax import aot  # noqa: E402  pylint: disable=g-import-not-at-top

aot.import_jax_for_gpu_targets()  # JAX_PLATFORMS=cpu: compile for GPUs, start no GPU client
import jax  # noqa: E402  pylint: disable=g-import-not-at-top

from lca_jax import configs_io  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.aot import check, targets  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.errors import LcaError  # noqa: E402  pylint: disable=g-import-not-at-top

DECODE_SETS = {"all": check.DECODE_CASES, "b1": check.DECODE_CASES[:3], "none": ()}


def _list(s: str) -> list:
  return [x.strip() for x in s.split(",") if x.strip()]


def _parser():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "lca_mbp.py"))
  p.add_argument("--targets", default=",".join(targets.TARGETS), help="h100,h200,b200")
  p.add_argument("--gpus", default="1,8", help="GPU counts of the train step, e.g. 1,8")
  p.add_argument("--impls", default="xla,pallas", help="attention implementations")
  p.add_argument("--micro-per-gpu", type=int, default=16, help="rows per GPU per micro-batch")
  p.add_argument("--decode", default="all", choices=sorted(DECODE_SETS), help="decode programs")
  p.add_argument("--out", default="", help="also write the JSON here")
  return p


def main(argv=None) -> int:
  args, rest = _parser().parse_known_args(argv)
  try:
    config = configs_io.load_config(args.config)
    configs_io.apply_overrides(config, configs_io.split_overrides(rest))
    names = _list(args.targets)
    for name in names:
      targets.parse(name)
    gpus = [targets.parse(f"h100:{g}").n_devices for g in _list(args.gpus)]
    targets.require_plugin()
  except (LcaError, ValueError) as e:
    print(f"gpu_aot: error: {e}", file=sys.stderr)
    return 2
  t0 = time.perf_counter()
  log = lambda r: print(
    f"gpu_aot: {r['target']} {r['program']} {r.get('attention_impl', r.get('mode', ''))}: "
    f"compile {r['compile_s']} s, {r['memory']['total_gb']} GB ({r['memory']['verdict']})",
    file=sys.stderr,
    flush=True,
  )
  try:
    reports = check.suite(
      config, names, gpus, _list(args.impls), args.micro_per_gpu, DECODE_SETS[args.decode], log
    )
  except (LcaError, ValueError) as e:
    print(f"gpu_aot: error: {e}", file=sys.stderr)
    return 2
  out = dict(
    tool="gpu_aot",
    config=os.path.relpath(args.config, ROOT),
    jax=jax.__version__,
    host=dict(machine=platform.machine(), cores=os.cpu_count()),
    wall_s=round(time.perf_counter() - t0, 1),
    programs=reports,
  )
  text = json.dumps(out, indent=1)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
