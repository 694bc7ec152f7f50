"""lca-train: pretrain / fine-tune a model from a config file.

    lca-train --config configs/tiny_lca_mbp.py --workdir workdirs/demo [--config.train.steps=600 ...]

A work directory that already holds a checkpoint is resumed from its latest one. SIGTERM
checkpoints and exits 0 (rerun the same command to continue). Problems with the config, the
data, the work directory or the batch layout are reported in one line (exit status 2); a
non-finite loss exits with status 1. Multi-host: jax.distributed.initialize() runs when
``--distributed`` is given or the environment looks like a multi-process launch (SLURM with
more than one task, or JAX_COORDINATOR_ADDRESS set).
"""
from __future__ import annotations

import argparse
import os
import sys


def _split_overrides(rest):
  """['--config.a.b=1', '--config.c', '2'] -> ['a.b=1', 'c=2']; anything else is an error."""
  out, i = [], 0
  while i < len(rest):
    arg = rest[i]
    if not arg.startswith("--config."):
      raise ValueError(f"unrecognized argument {arg!r} (overrides look like --config.train.steps=100)")
    key = arg[len("--config."):]
    if "=" in key:
      out.append(key)
      i += 1
    elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
      out.append(f"{key}={rest[i + 1]}")
      i += 2
    else:
      raise ValueError(f"override {arg!r} has no value (use --config.{key}=VALUE)")
  return out


def _want_distributed(flag: bool) -> bool:
  if flag:
    return True
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return True
  try:
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1
  except ValueError:
    return False


def _fail(msg: str, code: int = 2) -> int:
  print(f"lca-train: error: {msg}", file=sys.stderr, flush=True)
  return code


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="lca-train", description=__doc__.split("\n\n")[0],
      epilog="Config overrides: --config.SECTION.KEY=VALUE (e.g. --config.train.steps=600).")
  parser.add_argument("--config", required=True, help="config file, e.g. configs/lca_mbp.py")
  parser.add_argument("--workdir", required=True, help="checkpoints, metrics and logs go here")
  parser.add_argument("--distributed", action="store_true",
                      help="call jax.distributed.initialize() (multi-host)")
  args, rest = parser.parse_known_args(argv)

  from lca_jax import configs_io  # pylint: disable=g-import-not-at-top
  from lca_jax.model.config import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    overrides = _split_overrides(rest)
    config = configs_io.load_config(args.config)
    configs_io.apply_overrides(config, overrides)
  except (ValueError, configs_io.ConfigFileError, ConfigError) as e:
    return _fail(str(e))

  import jax  # pylint: disable=g-import-not-at-top
  from lca_jax.api import LoadError  # pylint: disable=g-import-not-at-top
  from lca_jax.data.sources import DataError  # pylint: disable=g-import-not-at-top
  from lca_jax.train import checkpoint, loop, sharding  # pylint: disable=g-import-not-at-top

  if _want_distributed(args.distributed):
    jax.distributed.initialize()

  try:
    result = loop.train_and_evaluate(config, args.workdir)
  except loop.NonFiniteLossError as e:
    return _fail(str(e), 1)
  except (ConfigError, DataError, loop.TrainError, checkpoint.ConfigMismatchError,
          sharding.MeshError, LoadError) as e:
    return _fail(str(e))
  except KeyboardInterrupt:
    print("lca-train: interrupted", file=sys.stderr)
    return 130
  msg = f"lca-train: done at step {result.step}"
  if result.stopped:
    msg = f"lca-train: stopped at step {result.step} (checkpoint saved; rerun to resume)"
  if result.last_train:
    msg += f", loss {result.last_train.get('loss', float('nan')):.4f}"
  if result.last_eval:
    msg += f", eval bpb_ntp {result.last_eval['bpb_ntp']:.4f}"
  print(msg + f" ({result.workdir})", file=sys.stderr, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
