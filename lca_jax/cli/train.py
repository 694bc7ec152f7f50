"""lca-train: pretrain / fine-tune a model from a config file.

    lca-train --config configs/tiny_lca_mbp.py --workdir workdirs/demo [--config.train.steps=600 ...]
    lca-train --config configs/lca_mbp.py --aot h100:8    # will it fit on 8 H100s? (no GPU needed)

A work directory that already holds a checkpoint is resumed from its latest one. SIGTERM
checkpoints and exits 0, Ctrl-C (SIGINT) checkpoints and exits 130 (a second Ctrl-C quits at
once without the checkpoint); rerun the same command to continue. A work directory in use by
another live run is refused (its pid and host named). Problems with the config, the data, the
work directory or the batch layout are reported in one line (exit status 2), among them a
config file with a syntax error, an unknown data.format / data.packing, train.steps < 1 and an
optim.lr that is not a positive number; a non-finite loss exits with status 1. Multi-host:
jax.distributed.initialize() runs when ``--distributed`` / ``--coordinator`` is given or the
environment looks like a multi-process launch (SLURM with more than one task,
JAX_COORDINATOR_ADDRESS or JAX_NUM_PROCESSES > 1 set); see lca_jax/train/distributed.py and
launch/. A process of a multi-process run that dies makes the others exit (status 134,
"Terminating process because the JAX distributed service detected fatal errors") within
--heartbeat-timeout seconds; --watchdog ends a stuck one (status 3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from lca_jax import configs_io, hostmem
from lca_jax.cli.common import one_line_warnings
from lca_jax.errors import LcaError, LoadError
from lca_jax.model.config import ConfigError
from lca_jax.train.errors import NonFiniteLossError, TrainError


def _fail(msg: str, code: int = 2) -> int:
  print(f"lca-train: error: {msg}", file=sys.stderr, flush=True)
  return code


def _fail_multi(exit_now, msg: str, code: int = 2) -> int:
  """``_fail``; in a multi-process run (``exit_now``: ``distributed.exit_now``, None in a
  single-process one) the process then leaves, with the others if they shut down with it
  within ``distributed.EXIT_GRACE_S`` seconds, else alone (an error seen by only some
  processes would otherwise hold them in jax's shutdown barrier while the rest wait in a
  collective)."""
  if msg:
    _fail(msg, code)
  if exit_now is not None:
    exit_now(code)
  return code


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="lca-train",
    description=__doc__.split("\n\n")[0],
    epilog="Config overrides: --config.SECTION.KEY=VALUE (e.g. --config.train.steps=600).",
  )
  parser.add_argument("--config", required=True, help="config file, e.g. configs/lca_mbp.py")
  parser.add_argument("--workdir", default="", help="checkpoints, metrics and logs go here")
  parser.add_argument(
    "--aot",
    default="",
    metavar="TARGET[:N]",
    help="do not train: compile the train and eval steps for N GPUs of a kind (h100, h200, "
    "b200) or a TPU slice (v5e, v5p, v6e: v5p:8, v5p:2x2x2, v5p:8*2 for two slices) on this "
    "host, without one, and print what each needs per device (memory against the device's, "
    "compile time, kernels, estimated time); exit status 1 when one does not fit. Needs jax's "
    "CUDA plugin (make gpu-aot) or libtpu (make tpu-aot)",
  )
  parser.add_argument("--json", action="store_true", help="with --aot: print the reports as JSON")
  dist = parser.add_argument_group(
    "multi-process",
    "values default to JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
    "JAX_PROCESS_ID, JAX_LOCAL_DEVICE_IDS, then SLURM (see launch/)",
  )
  dist.add_argument(
    "--distributed", action="store_true", help="call jax.distributed.initialize() (multi-host)"
  )
  dist.add_argument(
    "--coordinator",
    default="",
    metavar="HOST:PORT",
    help="address of process 0's coordination service",
  )
  dist.add_argument("--num-processes", type=int, default=None, metavar="N")
  dist.add_argument("--process-id", type=int, default=None, metavar="I")
  dist.add_argument(
    "--local-device-ids",
    default=None,
    metavar="0,1,...",
    help="devices of this host this process uses (default: all it sees)",
  )
  dist.add_argument(
    "--heartbeat-timeout",
    type=int,
    default=None,
    metavar="S",
    help="a process silent this long is dead and the others exit "
    "(default LCA_HEARTBEAT_TIMEOUT or 60)",
  )
  dist.add_argument(
    "--init-timeout",
    type=int,
    default=None,
    metavar="S",
    help="wait this long for every process to connect (default 300)",
  )
  parser.add_argument(
    "--watchdog",
    type=float,
    default=None,
    metavar="S",
    help="exit (status 3) when no step / eval / checkpoint completes for S "
    "seconds after the first step (default LCA_WATCHDOG or 0 = off)",
  )
  return parser


def _checked_config(args, rest):
  """The run config (file + overrides), checked before the work directory is created or
  locked: a bad value never touches it. Raises ValueError (ConfigFileError, ConfigError)."""
  from lca_jax.train import run_config  # pylint: disable=g-import-not-at-top

  config = configs_io.load_config(args.config)
  configs_io.apply_overrides(config, configs_io.split_overrides(rest))
  run_config.validate_run_config(config, min_steps=1)
  if os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
    raise ValueError(f"--workdir {args.workdir} exists and is not a directory")
  # a work directory to resume whose train_config.json is damaged: named, not a traceback
  run_config.read_run_config(args.workdir)
  return config


def _watchdog_s(args) -> float:
  v = args.watchdog if args.watchdog is not None else os.environ.get("LCA_WATCHDOG", "0") or 0
  try:
    return float(v)
  except ValueError:
    raise ValueError(f"LCA_WATCHDOG must be a number of seconds, got {v!r}") from None


def _start(args, config):
  """Join the other processes of a multi-process run (returns ``distributed.exit_now``), or set
  up this process's CPU devices before anything starts a backend (returns None). Raises
  MeshError / DistributedError."""
  from lca_jax.train import distributed, sharding  # pylint: disable=g-import-not-at-top

  if not distributed.wanted(os.environ, flag=args.distributed, coordinator=args.coordinator):
    sharding.use_cpu_devices(sharding.cpu_device_count(config.mesh))
    return None
  dcfg = distributed.resolve(
    args.coordinator or None,
    args.num_processes,
    args.process_id,
    args.local_device_ids,
    args.heartbeat_timeout,
    args.init_timeout,
  )
  distributed.initialize(dcfg)
  print(f"lca-train: joined: {distributed.local_process_info()}", file=sys.stderr, flush=True)
  return distributed.exit_now


def _summary(result) -> str:
  """The run's last line: where it stopped, its last loss / eval, the records it skipped."""
  msg = f"lca-train: done at step {result.step}"
  if result.stopped:
    how = "interrupted" if result.interrupted else "stopped"
    msg = f"lca-train: {how} at step {result.step} (checkpoint saved; rerun to resume)"
  if result.last_train:
    msg += f", loss {result.last_train.get('loss', float('nan')):.4f}"
  if result.last_eval:
    msg += f", eval bpb_ntp {result.last_eval['bpb_ntp']:.4f}"
  if result.skipped:
    msg += (
      f", {sum(result.skipped.values())} bad records skipped ("
      + ", ".join(f"{k} {v}" for k, v in sorted(result.skipped.items()))
      + ")"
    )
  return msg + f" ({result.workdir})"


def _aot(args, rest) -> int:
  """``--aot TARGET[:N]``: the run's train and eval steps compiled for that target (GPUs or a
  TPU slice), reported."""
  from lca_jax import aot  # pylint: disable=g-import-not-at-top

  aot.import_jax_for_gpu_targets()
  from lca_jax.aot import check, targets, text  # pylint: disable=g-import-not-at-top

  try:
    config = configs_io.load_config(args.config)
    configs_io.apply_overrides(config, configs_io.split_overrides(rest))
    target = targets.parse(args.aot)
    targets.require_compiler(target)
    reports = check.train_reports(config, target)
  except (LcaError, ValueError) as e:
    return _fail(str(e))
  if args.json:
    print(json.dumps(reports, indent=1))
  else:
    print(f"lca-train --aot {target}: {args.config}")
    print(text.header(reports[0]))
    for r in reports:
      print("\n".join(text.program_lines(r)))
  return 0 if all(r["memory"]["fits"] for r in reports) else 1


def main(argv=None) -> int:
  args, rest = _parser().parse_known_args(argv)
  if args.aot:
    one_line_warnings("lca-train")
    return _aot(args, rest)
  if argv is None:  # run as a program: large host buffers on huge pages (lca_jax/hostmem.py)
    hostmem.use_huge_pages()
  if not args.workdir:
    return _fail("the following arguments are required: --workdir (or --aot GPU[:N])")
  one_line_warnings("lca-train")
  # deferred: jax, then (once the config is valid) flax, orbax, grain and the training loop take
  # seconds to import, which --help and usage errors skip
  try:
    config = _checked_config(args, rest)
    watchdog = _watchdog_s(args)
  except ValueError as e:  # ConfigFileError, ConfigError, RunConfigError are ValueErrors
    return _fail(str(e))

  from lca_jax import xla_cache  # pylint: disable=g-import-not-at-top
  from lca_jax.data.errors import DataError  # pylint: disable=g-import-not-at-top
  from lca_jax.train import distributed, loop, run_config, sharding  # pylint: disable=g-import-not-at-top
  from lca_jax.workdir.manifest import CorruptCheckpointError  # pylint: disable=g-import-not-at-top
  from lca_jax.workdir.params import CheckpointModelError  # pylint: disable=g-import-not-at-top

  try:
    exit_now = _start(args, config)
  except (sharding.MeshError, distributed.DistributedError) as e:
    return _fail(str(e))
  try:
    xla_cache.enable()  # before anything compiles (LCA_JAX_XLA_CACHE)
  except xla_cache.XlaCacheError as e:
    return _fail_multi(exit_now, str(e))
  try:
    result = loop.train_and_evaluate(config, args.workdir, watchdog=watchdog)
  except NonFiniteLossError as e:
    return _fail_multi(exit_now, str(e), 1)
  except (
    ConfigError,
    DataError,
    TrainError,
    run_config.ConfigMismatchError,
    CorruptCheckpointError,
    CheckpointModelError,
    sharding.MeshError,
    LoadError,
  ) as e:
    return _fail_multi(exit_now, str(e))
  except KeyboardInterrupt:
    print("lca-train: interrupted", file=sys.stderr)
    return _fail_multi(exit_now, "", 130)
  print(_summary(result), file=sys.stderr, flush=True)
  return 130 if result.interrupted else 0


if __name__ == "__main__":
  sys.exit(main())
