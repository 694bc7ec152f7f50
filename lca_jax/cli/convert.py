"""lca-convert: checkpoints between lca-train work directories and the paper's PyTorch layout.

    lca-convert to-torch --checkpoint DIR --out DIR [--dtype float32|bfloat16] [--step N] [--force]
    lca-convert from-torch --torch-dir DIR --out DIR [--vocab-size N] [--force]
                           [--config FILE [--config.SECTION.KEY=VALUE ...]]
    lca-convert to-hf --checkpoint DIR --out DIR [--step N] [--force]

to-torch: DIR is an lca-train work directory (latest checkpoint, or --step) or an upstream
directory; writes config.json + model.safetensors (see lca_jax/interop/upstream.py).
from-torch: writes an lca-train work directory at step 0 that lca_jax.load / lca-sample serve
and train.init_from=DIR fine-tunes from; with --config (and the same overrides lca-train would
get) it holds a full train state that `lca-train --config FILE --workdir DIR` resumes.
to-hf: writes a Hugging Face transformers directory (config.json with auto_map, the modeling and
tokenizer files, float32 model.safetensors) that AutoModelForCausalLM / AutoTokenizer load with
trust_remote_code=True (see lca_jax/interop/hf_export.py).
Errors are one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from lca_jax import configs_io
from lca_jax.cli.common import one_line_warnings
from lca_jax.errors import LcaError


def _fail(msg: str, code: int = 2) -> int:
  print(f"lca-convert: error: {msg}", file=sys.stderr, flush=True)
  return code


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, exit 2 (argparse prints usage first otherwise)
    raise SystemExit(_fail(message))


def _parser():
  p = _Parser(prog="lca-convert", description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd", metavar="{to-torch,from-torch,to-hf}", parser_class=_Parser)
  sub.required = True
  t = sub.add_parser("to-torch", help="export to config.json + model.safetensors")
  t.add_argument("--checkpoint", required=True, help="lca-train work directory or upstream dir")
  t.add_argument("--out", required=True, help="output directory (new or empty)")
  t.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  t.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
  t.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
  f = sub.add_parser("from-torch", help="import into an lca-train work directory")
  f.add_argument(
    "--torch-dir", required=True, help="directory with config.json + model.safetensors"
  )
  f.add_argument("--out", required=True, help="work directory to create (new or empty)")
  f.add_argument(
    "--vocab-size",
    type=int,
    default=None,
    help="embedding rows (default: vocabulary rounded up to a multiple of 128, "
    "or the --config model's vocab_size)",
  )
  f.add_argument(
    "--config",
    default=None,
    help="run config file: write a full train state that lca-train resumes",
  )
  f.add_argument(
    "--force",
    action="store_true",
    help="overwrite a non-empty --out (its checkpoints/ and run config)",
  )
  h = sub.add_parser("to-hf", help="export to a Hugging Face transformers directory")
  h.add_argument("--checkpoint", required=True, help="lca-train work directory or upstream dir")
  h.add_argument("--out", required=True, help="output directory (new or empty)")
  h.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
  h.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
  return p


def main(argv=None) -> int:
  try:
    args, rest = _parser().parse_known_args(argv)
  except SystemExit as e:
    return int(e.code or 0)
  if rest and (args.cmd != "from-torch" or not args.config):
    return _fail(f"unrecognized arguments: {' '.join(rest)}")
  one_line_warnings("lca-convert")
  # deferred: jax, orbax and the model take seconds to import, which --help and usage errors skip
  from lca_jax.interop import convert, hf_export  # pylint: disable=g-import-not-at-top
  from lca_jax.train import run_config  # pylint: disable=g-import-not-at-top

  config = None
  if args.cmd == "from-torch" and args.config:
    try:
      config = configs_io.load_config(args.config)
      configs_io.apply_overrides(config, configs_io.split_overrides(rest))
      run_config.validate_run_config(config)
    except ValueError as e:  # ConfigFileError, ConfigError, RunConfigError are ValueErrors
      return _fail(str(e))
  try:
    if args.cmd == "to-torch":
      out = convert.to_torch(
        args.checkpoint, args.out, args.dtype, step=args.step, force=args.force
      )
      print(
        f"lca-convert: wrote {os.path.join(out, 'config.json')} and model.safetensors "
        f"({args.dtype})",
        file=sys.stderr,
      )
    elif args.cmd == "to-hf":
      out = hf_export.to_hf(args.checkpoint, args.out, step=args.step, force=args.force)
      print(
        f"lca-convert: wrote {out} (transformers: AutoModelForCausalLM.from_pretrained"
        "(DIR, trust_remote_code=True))",
        file=sys.stderr,
      )
    else:
      out = convert.from_torch(
        args.torch_dir, args.out, vocab_size=args.vocab_size, config=config, force=args.force
      )
      how = (
        "resume with: lca-train --config " + args.config + f" --workdir {out}"
        if config is not None
        else f"fine-tune with train.init_from={out}"
      )
      print(f"lca-convert: wrote work directory {out} (step 0; {how})", file=sys.stderr)
  except (LcaError, OSError) as e:  # every user-facing error of the package (lca_jax/errors.py)
    return _fail(str(e))
  except KeyboardInterrupt:
    print("lca-convert: interrupted", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
