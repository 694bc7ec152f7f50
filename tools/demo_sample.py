"""Show what a trained checkpoint does: greedy next-byte and multi-byte decoding, and the learned
segmentation of a sentence.

    python tools/demo_sample.py --checkpoint workdirs/demo [--prompt "..."] [--max-bytes 120]
        [--tau 0.5] [--n 3] [--sentence "..."] [--temperature 0.7] [--seed 0] [--heldout-bytes 160]

``--checkpoint``: an lca-train work directory or an upstream checkpoint (anything lca_jax.load
reads). Decoding uses ``model.generate`` (lca_jax.decode) when it is installed, else a plain
reference loop that reruns the full forward for every byte (labelled as such).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # lca_jax from this checkout, installed or not
  sys.path.insert(0, ROOT)

from lca_jax import demo_report as demo  # noqa: E402
from lca_jax.bench import report  # noqa: E402
from lca_jax.demo_report import _rate, _tau_ladder, first_difference, word_edge_share  # noqa: E402,F401

DEFAULT_PROMPT = "A hacker is a person who "
DEFAULT_SENTENCE = "The hacker wrote a program that hacks the kernel of the system."


def _bad_option(args):
  """The first option no run can use, as a message naming it (None when all are usable); the
  decoding options are checked by the engine's own ``check_options``."""
  from lca_jax.cli.common import option_message  # pylint: disable=g-import-not-at-top
  from lca_jax.decode import engine  # pylint: disable=g-import-not-at-top

  for name in ("prompt", "sentence"):
    if not getattr(args, name):
      return f"--{name} is empty; give at least one byte"
  if args.repeats < 1:
    return f"--repeats must be >= 1, got {args.repeats}"
  if args.heldout_bytes < 0:
    return f"--heldout-bytes must be >= 0 (0: skip), got {args.heldout_bytes}"
  try:
    engine.check_options(
      "threshold",
      tau=args.tau,
      n=args.n,
      max_bytes=args.max_bytes,
      temperature=args.temperature,
      seed=args.seed,
    )
  except engine.DecodeError as e:
    return option_message(str(e), ("tau", "n", "max_bytes", "temperature", "seed"))
  return None


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--checkpoint", required=True)
  ap.add_argument("--prompt", default=DEFAULT_PROMPT)
  ap.add_argument("--sentence", default=DEFAULT_SENTENCE)
  ap.add_argument("--max-bytes", type=int, default=120)
  ap.add_argument(
    "--tau",
    type=float,
    default=0.5,
    help="threshold's tau; when it accepts nothing, 0.3, 0.1 and 0 are tried in turn",
  )
  ap.add_argument("--n", type=int, default=3, help="bytes proposed per step (threshold, verify)")
  ap.add_argument(
    "--repeats",
    type=int,
    default=5,
    help="timed runs per mode, alternating with ntp (bytes/s: their median)",
  )
  ap.add_argument("--reference", action="store_true", help="force the reference loop")
  ap.add_argument(
    "--temperature",
    type=float,
    default=0.7,
    help="also show a sampled next-byte continuation at this temperature (0: skip)",
  )
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument(
    "--heldout-bytes",
    type=int,
    default=160,
    help="also segment this many bytes of held-out demo-corpus text (0: skip)",
  )
  ap.add_argument(
    "--curve",
    default=None,
    help="loss-curve PNG to write (default CHECKPOINT/loss_curve.png when the checkpoint is a "
    "work directory with metrics; '' to skip)",
  )
  args = ap.parse_args(argv)
  problem = _bad_option(args)
  if problem:  # before the (slow) load, and never a silent fallback to the reference loop
    return report.error("demo_sample", problem)
  from lca_jax.errors import LcaError  # pylint: disable=g-import-not-at-top

  try:
    return demo.run(args)
  except LcaError as e:  # a bad checkpoint, a --sentence longer than the model context, ...
    return report.error("demo_sample", e)


if __name__ == "__main__":
  sys.exit(main())
