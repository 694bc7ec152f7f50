"""What the time estimate of a compiled program turns into: MFU and bytes/s.

``Workload`` is what the estimate assumes of the data; ``train_estimate`` turns a train or eval
step's estimated seconds into bytes/s and MFU, ``decode_estimate`` a decode program's idle and LM
step times into bytes/s next to the memory floor. GPU (``check``) and TPU (``tpu_check``)
reports share them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from lca_jax.perf import hardware, workload


@dataclasses.dataclass(frozen=True)
class Workload:
  """What the time estimate assumes of the data: bytes per group (None: the config's
  1 / bp_prior), bytes a row commits per step in ``verify`` / ``threshold`` (None: 2, at most
  the step's width), and the launch constants."""

  bytes_per_group: Optional[float] = None
  accepted: Optional[float] = None
  launch: hardware.Launch = hardware.Launch()


DEFAULT_ACCEPTED = 2.0


def _brief(s: dict) -> dict:
  keys = ("step_s", "floor_s", "launch_s", "launches", "host_syncs", "flops", "bytes", "split_s")
  return {k: s[k] for k in keys}


def decode_estimate(program, chip, idle: dict, lm: dict, work: Workload, constants: dict):
  """A decode program's ``estimate`` from its idle and LM step summaries on ``chip``."""
  info = program.info
  mode = info["mode"]
  width = int(info.get("n", 3)) if mode != "ntp" else 1
  accepted = work.accepted or min(DEFAULT_ACCEPTED, width)
  rates = workload.decode_rates(
    program.cfg,
    chip,
    idle["step_s"],
    lm["step_s"],
    mode=mode,
    batch=info["batch"],
    width=width,
    prompt_len=info["prompt_len"],
    max_bytes=info["max_bytes"],
    bytes_per_group=work.bytes_per_group,
    accepted=accepted,
  )
  return dict(
    rates,
    idle_step=_brief(idle),
    lm_step=_brief(lm),
    top_kernels=lm["top_kernels"],
    constants=constants,
    gpu=chip.name,
  )


def train_estimate(program, n_devices: int, chip, s: dict, work: Workload, hints, constants):
  """A train or eval step's ``estimate`` from its summary ``s`` (``step_s``, ``floor_s``):
  bytes/s and MFU (useful FLOPs / devices / (seconds x ``chip``'s dense bf16 peak))."""
  info = program.info
  train = program.name == "train_step"
  accum = info["accum"] if train else 1
  useful = workload.train_useful_flops(
    program.cfg, info["micro_batch"], info["seq_len"], accum, work.bytes_per_group
  )
  useful = useful if train else useful / 3.0  # eval: the forward (2 of 6 FLOPs per weight)
  rows_bytes = accum * info["micro_batch"] * info["seq_len"]
  return dict(
    s,
    bytes_per_s=rows_bytes / s["step_s"],
    useful_flops=useful,
    mfu=useful / n_devices / (s["step_s"] * chip.bf16_flops),
    floor_mfu=useful / n_devices / (s["floor_s"] * chip.bf16_flops),
    hints=dict(trips=dict(hints.trips), keys_per_query=dict(hints.keys_per_query)),
    constants=constants,
  )
