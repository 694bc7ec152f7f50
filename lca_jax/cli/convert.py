"""lca-convert: checkpoints between lca-train work directories and the paper's PyTorch layout.

    lca-convert to-torch --checkpoint DIR --out DIR [--dtype float32|bfloat16] [--step N] [--force]
    lca-convert from-torch --torch-dir DIR --out DIR [--vocab-size N] [--force]
                           [--config FILE [--config.SECTION.KEY=VALUE ...]]
    lca-convert to-hf --checkpoint DIR --out DIR [--dtype float32|bfloat16] [--step N] [--force]
    lca-convert from-hf --hf-dir DIR --out DIR [--vocab-size N] [--force]
                        [--config FILE [--config.SECTION.KEY=VALUE ...]]

to-torch: DIR is an lca-train work directory (latest checkpoint, or --step) or an upstream
directory; writes config.json + model.safetensors (see lca_jax/interop/upstream.py).
from-torch: writes an lca-train work directory at step 0 that lca_jax.load / lca-sample serve
and train.init_from=DIR fine-tunes from; with --config (and the same overrides lca-train would
get) it holds a full train state that `lca-train --config FILE --workdir DIR` resumes.
to-hf: writes a Hugging Face transformers directory (config.json with auto_map, the modeling and
tokenizer files, model.safetensors in --dtype) that AutoModelForCausalLM / AutoTokenizer load with
trust_remote_code=True (see lca_jax/interop/hf_export.py).
from-hf: from-torch of such a transformers directory (from-torch, lca_jax.load and lca-sample
read either kind); the work directory holds the exported parameters.
Errors are one line on stderr, exit status 2.

The same operations on paths from Python: ``to_torch``, ``to_hf`` and ``from_torch`` below (they
load a checkpoint with ``lca_jax.load`` or write a work directory, and hand the model or params
to ``lca_jax.interop``, which imports neither ``lca_jax.api`` nor the training stack).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from lca_jax import configs_io
from lca_jax.cli.common import one_line_warnings
from lca_jax.errors import LcaError, LoadError
from lca_jax.interop.errors import CheckpointError
from lca_jax.model.config import ConfigError


# The functions below defer their imports of jax, orbax and the model (seconds), which
# ``lca-convert --help`` and usage errors skip.
def _load(src, out: str, step: Optional[int], force: bool):
  """The model at ``src`` for an export to ``out``; ``out`` is checked first (not the source,
  empty or ``force``), before the slow load."""
  from lca_jax import api  # pylint: disable=g-import-not-at-top
  from lca_jax.interop import convert  # pylint: disable=g-import-not-at-top

  src = os.fspath(src)
  out_abs = os.path.abspath(os.path.expanduser(os.fspath(out)))
  if os.path.exists(src) and convert.same_path(src, out_abs):
    raise convert.ConvertError(f"output directory {out_abs} is the source; choose another --out")
  convert.check_out_free(out_abs, force)
  try:
    return api.load(src, step=step)
  except (LoadError, CheckpointError, ConfigError, FileNotFoundError) as e:
    raise convert.ConvertError(str(e)) from None


def to_torch(
  src, out: str, dtype: str = "float32", *, step: Optional[int] = None, force: bool = False
) -> str:
  """Export the checkpoint at ``src`` (a path ``lca_jax.load`` accepts: a work directory, its
  latest checkpoint or ``step``, or an upstream directory) to ``out`` (config.json +
  model.safetensors). Returns the absolute output path."""
  from lca_jax.interop import convert, upstream  # pylint: disable=g-import-not-at-top

  upstream.export_dtype(dtype)  # checked before anything is loaded
  return convert.to_torch(_load(src, out, step, force), out, dtype, force=force)


def to_hf(
  src, out: str, dtype: str = "float32", *, step: Optional[int] = None, force: bool = False
) -> str:
  """Export the checkpoint at ``src`` (a path ``lca_jax.load`` accepts) to the transformers
  directory ``out``, weights in ``dtype`` (float32 or bfloat16). Returns the absolute output
  path."""
  from lca_jax.interop import hf_export, upstream  # pylint: disable=g-import-not-at-top

  upstream.export_dtype(dtype)  # checked before anything is loaded
  return hf_export.to_hf(_load(src, out, step, force), out, dtype=dtype, force=force)


def from_torch(
  src,
  out: str,
  *,
  vocab_size: Optional[int] = None,
  config=None,
  force: bool = False,
  devices=None,
) -> str:
  """Import the upstream directory ``src`` (config.json + model.safetensors, float32 or bf16;
  or a transformers export of ``to_hf``, which holds the same tensors) into a new lca-train work directory ``out`` at step 0 (``lca_jax.workdir.write``).
  ``config``: a run config (ml_collections, as ``lca-train --config`` loads) that makes ``out``
  resumable by ``lca-train`` with it (``lca_jax.train.loop.write_resumable_workdir``); its model
  must describe the checkpoint (its training-only fields, such as dtype, dropout, remat, are
  the config's) and its ``model.vocab_size`` sets the padding. The source's extra tensors
  (``rotary_embd.inv_freq``) are kept for exports. Returns the absolute output path."""
  from lca_jax.interop import convert, upstream  # pylint: disable=g-import-not-at-top
  from lca_jax.workdir import write  # pylint: disable=g-import-not-at-top

  src = os.fspath(src)
  out = os.path.abspath(os.path.expanduser(os.fspath(out)))
  if os.path.exists(src) and convert.same_path(src, out):
    raise convert.ConvertError(f"output directory {out} is the source; choose another --out")
  convert.check_out_free(out, force, workdir=True)
  model_cfg = None
  if config is not None:
    # the training stack needs grain (the data / train extras); the plain import does not
    from lca_jax.train import loop  # pylint: disable=g-import-not-at-top

    model_cfg = loop.model_config_of(config)
    if vocab_size is None:
      vocab_size = model_cfg.vocab_size
  try:
    cfg, params, _, extras = convert.read_torch_dir(src, vocab_size, with_extras=True)
  except CheckpointError as e:
    raise convert.ConvertError(str(e)) from None
  if model_cfg is not None:
    params = convert.params_for_config(params, cfg, model_cfg)
  meta = {"imported_from": os.path.abspath(src)}
  out = convert.prepare_out(out, force, src, workdir=True)
  if config is None:
    write.write_workdir(out, params, cfg, meta=meta)
  else:
    loop.write_resumable_workdir(out, params, config, meta=meta, devices=devices)
  try:
    upstream.write_extras(out, extras)
  except CheckpointError as e:
    raise convert.ConvertError(str(e)) from None
  return out


def _fail(msg: str, code: int = 2) -> int:
  print(f"lca-convert: error: {msg}", file=sys.stderr, flush=True)
  return code


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, exit 2 (argparse prints usage first otherwise)
    raise SystemExit(_fail(message))


def _parser():
  p = _Parser(prog="lca-convert", description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(
    dest="cmd", metavar="{to-torch,from-torch,to-hf,from-hf}", parser_class=_Parser
  )
  sub.required = True
  _export_options(sub.add_parser("to-torch", help="export to config.json + model.safetensors"))
  f = sub.add_parser("from-torch", help="import into an lca-train work directory")
  f.add_argument(
    "--torch-dir", dest="src", required=True, help="directory with config.json + model.safetensors"
  )
  _import_options(f)
  _export_options(sub.add_parser("to-hf", help="export to a Hugging Face transformers directory"))
  i = sub.add_parser("from-hf", help="import a to-hf export into an lca-train work directory")
  i.add_argument("--hf-dir", dest="src", required=True, help="directory written by to-hf")
  _import_options(i)
  return p


def _export_options(p):
  """The options of to-torch and to-hf."""
  p.add_argument("--checkpoint", required=True, help="lca-train work directory or upstream dir")
  p.add_argument("--out", required=True, help="output directory (new or empty)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
  p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")


def _import_options(p):
  """The options of from-torch and from-hf after the source directory."""
  p.add_argument("--out", required=True, help="work directory to create (new or empty)")
  p.add_argument(
    "--vocab-size",
    type=int,
    default=None,
    help="embedding rows (default: vocabulary rounded up to a multiple of 128, "
    "or the --config model's vocab_size)",
  )
  p.add_argument(
    "--config",
    default=None,
    help="run config file: write a full train state that lca-train resumes",
  )
  p.add_argument(
    "--force",
    action="store_true",
    help="overwrite a non-empty --out (its checkpoints/ and run config)",
  )


def main(argv=None) -> int:
  try:
    args, rest = _parser().parse_known_args(argv)
  except SystemExit as e:
    return int(e.code or 0)
  importing = args.cmd in ("from-torch", "from-hf")
  if rest and (not importing or not args.config):
    return _fail(f"unrecognized arguments: {' '.join(rest)}")
  one_line_warnings("lca-convert")
  # deferred: jax, orbax and the model take seconds to import, which --help and usage errors skip
  from lca_jax.train import run_config  # pylint: disable=g-import-not-at-top

  config = None
  if importing and args.config:
    try:
      config = configs_io.load_config(args.config)
      configs_io.apply_overrides(config, configs_io.split_overrides(rest))
      run_config.validate_run_config(config)
    except ValueError as e:  # ConfigFileError, ConfigError, RunConfigError are ValueErrors
      return _fail(str(e))
  try:
    if args.cmd == "to-torch":
      out = to_torch(args.checkpoint, args.out, args.dtype, step=args.step, force=args.force)
      print(
        f"lca-convert: wrote {os.path.join(out, 'config.json')} and model.safetensors "
        f"({args.dtype})",
        file=sys.stderr,
      )
    elif args.cmd == "to-hf":
      out = to_hf(args.checkpoint, args.out, args.dtype, step=args.step, force=args.force)
      print(
        f"lca-convert: wrote {out} ({args.dtype}; transformers: "
        "AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True))",
        file=sys.stderr,
      )
    else:
      out = from_torch(
        args.src, args.out, vocab_size=args.vocab_size, config=config, force=args.force
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
