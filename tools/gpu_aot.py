"""Compile every production program for H100 / H200 / B200 GPUs on this host, without a GPU.

    make gpu-aot                                   # installs .venv-cuda, runs this and the tests
    .venv-cuda/bin/python tools/gpu_aot.py         # configs/lca_mbp.py, all targets
    .venv-cuda/bin/python tools/gpu_aot.py --targets h100 --gpus 1 --impls pallas --decode none

Prints one JSON object: for each target, the train step (per attention implementation and GPU
count, ``--micro-per-gpu`` rows per GPU in a micro-batch), the eval step and the decode
programs (batch 1 and 32; ntp, threshold tau 0 n 3, verify n 3): compile seconds, memory per
device against the device's ("fits" / "does not fit by X GB"), fusions, Triton GEMM fusions,
custom calls, buffers with two dimensions >= T, and for decode the kernels and host launches of
one step with the bytes/s that launching them allows (``lca_jax/aot``). Each program has an
``estimate`` (``lca_jax.perf``, docs/gpu.md "Estimated time"): train and eval steps the
estimated step time, bytes/s, MFU, the split by kind and the costliest kernels; decode programs
the idle and LM step times and bytes/s at ``--bytes-per-group`` and ``--accepted`` next to the
memory floor. Progress and a readable summary of each program go to stderr. Needs jax's CUDA
plugin (``make gpu-aot`` installs it into .venv-cuda); without it, one line of error and exit
status 2. ``tools/tpu_aot.py`` runs the same for TPU targets (``main(kind="tpu")``).
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
from lca_jax.aot import check, rates, targets, text  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.errors import LcaError  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.perf import hardware  # noqa: E402  pylint: disable=g-import-not-at-top

DECODE_SETS = {"all": check.DECODE_CASES, "b1": check.DECODE_CASES[:3], "none": ()}
PLATFORMS = {  # tool name, target names, device counts, what a device is called
  "gpu": ("gpu_aot", targets.TARGETS, "1,8", "GPU"),
  "tpu": ("tpu_aot", targets.TPU_TARGETS, "1", "chip"),
}


def _list(s: str) -> list:
  return [x.strip() for x in s.split(",") if x.strip()]


def _parser(kind: str, description: str):
  _, names, counts, unit = PLATFORMS[kind]
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "lca_mbp.py"))
  p.add_argument("--targets", default=",".join(names), help=",".join(names))
  p.add_argument(
    "--gpus",
    "--chips",
    dest="counts",
    default=counts,
    help=f"{unit} counts of the train step, e.g. {counts}"
    + (" (or topologies, 2x2x2, and slices, 8*2)" if kind == "tpu" else ""),
  )
  p.add_argument("--impls", default="xla,pallas", help="attention implementations")
  p.add_argument(
    "--micro-per-gpu",
    "--micro-per-chip",
    dest="micro",
    type=int,
    default=16,
    help=f"rows per {unit} per micro-batch",
  )
  p.add_argument(
    "--fit",
    action="store_true",
    help="after a train step that does not fit, compile the micro-batch / remat settings that "
    "might (check.fit_search)",
  )
  p.add_argument("--decode", default="all", choices=sorted(DECODE_SETS), help="decode programs")
  p.add_argument("--out", default="", help="also write the JSON here")
  p.add_argument("--hlo-dir", default="", help="also write each program's optimized HLO here")
  p.add_argument(
    "--bytes-per-group", type=float, default=0.0, help="estimate: bytes per group (0: 1/bp_prior)"
  )
  p.add_argument(
    "--accepted",
    type=float,
    default=0.0,
    help=f"estimate: bytes a row commits per verify/threshold step (0: {rates.DEFAULT_ACCEPTED:g})",
  )
  p.add_argument("--launch-graph-us", type=float, default=hardware.Launch.graph_s * 1e6)
  p.add_argument("--launch-host-us", type=float, default=hardware.Launch.host_s * 1e6)
  return p


def main(argv=None, kind: str = "gpu", description: str = "") -> int:
  tool, known, _, _ = PLATFORMS[kind]
  args, rest = _parser(kind, description or __doc__.split("\n\n")[0]).parse_known_args(argv)
  try:
    config = configs_io.load_config(args.config)
    configs_io.apply_overrides(config, configs_io.split_overrides(rest))
    names = _list(args.targets)
    counts = _list(args.counts)
    for name in names:
      if name.lower() not in known:
        raise ValueError(f"unknown target {name!r}: {tool} compiles for {', '.join(known)}")
      for n in counts:
        targets.parse(f"{name}:{n}")
      targets.require_compiler(targets.parse(name))
    if (
      args.bytes_per_group < 0
      or args.accepted < 0
      or min(args.launch_graph_us, args.launch_host_us) < 0
    ):
      raise ValueError("--bytes-per-group, --accepted and the launch costs must be >= 0")
  except (LcaError, ValueError) as e:
    print(f"{tool}: error: {e}", file=sys.stderr)
    return 2
  work = check.Workload(
    bytes_per_group=args.bytes_per_group or None,
    accepted=args.accepted or None,
    launch=hardware.Launch(args.launch_graph_us * 1e-6, args.launch_host_us * 1e-6),
  )
  t0 = time.perf_counter()

  def log(r):
    print(
      f"{tool}: {r['target']} {r['program']} {r.get('attention_impl', r.get('mode', ''))}"
      f"{text.setting(r)}: "
      f"compile {r['compile_s']} s, {r['memory']['total_gb']} GB ({r['memory']['verdict']})",
      file=sys.stderr,
    )
    print("\n".join(text.estimate_lines(r.get("estimate"))), file=sys.stderr, flush=True)

  try:
    reports = check.suite(
      config,
      names,
      counts,
      _list(args.impls),
      args.micro,
      DECODE_SETS[args.decode],
      log,
      work,
      fit=args.fit,
      hlo_dir=args.hlo_dir or None,
    )
  except (LcaError, ValueError) as e:
    print(f"{tool}: error: {e}", file=sys.stderr)
    return 2
  out = dict(
    tool=tool,
    config=os.path.relpath(args.config, ROOT),
    jax=jax.__version__,
    host=dict(machine=platform.machine(), cores=os.cpu_count()),
    wall_s=round(time.perf_counter() - t0, 1),
    programs=reports,
  )
  doc = json.dumps(out, indent=1)
  if args.out:
    with open(args.out, "w") as f:
      f.write(doc + "\n")
  print(doc)
  return 0


if __name__ == "__main__":
  sys.exit(main())
