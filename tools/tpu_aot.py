"""Compile every production program for TPU v5e / v5p / v6e slices on this host, without a TPU.

    make tpu-aot                                   # installs .venv-tpu, runs this and the tests
    .venv-tpu/bin/python tools/tpu_aot.py          # configs/lca_mbp.py, one chip of each kind
    .venv-tpu/bin/python tools/tpu_aot.py --targets v5p --chips 8 --impls pallas --decode none \\
        --config.mesh.data=1 --config.mesh.fsdp=8 # a v5p slice of 8 chips, parameters over 8

Prints one JSON object: for each target, the train step (per attention implementation, ``xla``
the blockwise XLA attention, ``pallas`` the Mosaic kernel of ``kernels.tpu_attention``; per chip
count, ``--micro-per-chip`` rows per chip in a micro-batch), the eval step and the decode
programs (batch 1 and 32; ntp, threshold tau 0 n 3, verify n 3): compile seconds, memory per
chip against its HBM ("fits" / "does not fit by X GB"), fusions, custom calls, buffers with two
dimensions >= T, and the ``estimate`` (docs/tpu.md): XLA's own where it holds, else the per-op
model of ``lca_jax.perf.tpu`` (``source`` says which), MFU for train and eval steps, idle and LM
step times for decode programs. ``--fit`` compiles the micro-batch / remat settings that might
fit after a train step that does not. Chip counts take topologies (``2x2x2``) and slices
(``8*2``: two slices of 8). The same tool as ``tools/gpu_aot.py`` (``main(kind="tpu")``). Needs
libtpu (``make tpu-aot`` installs it into .venv-tpu); without it, one line of error and exit
status 2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_aot  # noqa: E402  pylint: disable=g-import-not-at-top

if __name__ == "__main__":
  sys.exit(gpu_aot.main(kind="tpu", description=__doc__.split("\n\n")[0]))
