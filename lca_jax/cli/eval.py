"""lca-eval: bits per byte, generative tasks and quality/throughput sweeps.

    lca-eval bpb   --checkpoint DIR --data FILES... [--format jsonl] [--seq-len N] [--json]
    lca-eval tasks --checkpoint DIR --task summarization|translation|qa|ifeval --data FILE
                   [--mode ntp|threshold|verify|drafter] [--drafter DIR] [--tau 0.9 --n 3]
                   [--max-bytes N --limit N --batch-size 1] [--json] [--out FILE]
    lca-eval sweep --checkpoints DIR [DIR ...] --task T --data FILE --out DIR
                   [--taus 0.7,0.8,0.9] [--ns 3,4,5,6,7,8] [--modes ntp,threshold,verify,drafter]

tasks and sweep generate translation, qa (CoQA) and ifeval through lm-evaluation-harness (its
scorers, lca_jax/eval/lm_eval_tasks) and summarization directly (ROUGE); every run also reports
the acceptance rate and bytes/s of its decoding.

Each command takes --dtype float32|bfloat16: the compute dtype to evaluate in (default: the
checkpoint's; on a CPU, float32 for a bfloat16 checkpoint). bpb's rows default to the length
a work directory trained at (its data.seq_len; a line on stderr says so), else the model's
max_seq_len; --seq-len overrides it.

Problems with paths, data or arguments are reported in one line (exit status 2): a
--batch-size, --seq-len, --max-bytes, --limit or --max-batches below 1, an unknown --format,
a data file without a usable document, a sweep --out that is an existing file, a tasks --out
that is a directory. --json prints strict JSON (a value that is not a number, such as
acceptance_rate in ntp mode, is null); bpb reports the bad records its pipeline skipped
(skipped_records, and skipped by reason).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from lca_jax import api, hostmem, jsonio
from lca_jax.cli.common import add_dtype_option, fail, length_default, one_line_warnings
from lca_jax.data.errors import DataError
from lca_jax.data.pipeline import make_eval_pipeline
from lca_jax.data.readers import FORMATS
from lca_jax.data.sft import make_sft_eval_pipeline
from lca_jax.data.sft_format import SFT_FORMATS
from lca_jax.decode import engine
from lca_jax.errors import LcaError
from lca_jax.eval import tasks
from lca_jax.eval.bpb import evaluate_bpb
from lca_jax.eval.sweep import check_out_dir, check_out_file, run_sweep, write_json


def _fail(msg: str, code: int = 2) -> int:
  print(f"lca-eval: error: {msg}", file=sys.stderr, flush=True)
  return code


def _floats(s: str):
  try:
    return [float(x) for x in s.split(",") if x.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _ints(s: str):
  try:
    return [int(x) for x in s.split(",") if x.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _names(s: str):
  return [x.strip() for x in s.split(",") if x.strip()]


def _parser():
  p = argparse.ArgumentParser(prog="lca-eval", description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="command", required=True)

  b = sub.add_parser(
    "bpb", help="bits per byte of every head, bytes per latent, boundary statistics"
  )
  b.add_argument("--checkpoint", required=True, help="upstream dir or lca-train workdir")
  b.add_argument(
    "--step", type=int, default=None, help="checkpoint step of a workdir (default: latest)"
  )
  b.add_argument("--data", required=True, nargs="+", help="held-out files (globs)")
  b.add_argument(
    "--format", default=None, help="parquet|jsonl|text|array_record|tfds (default: from extension)"
  )
  b.add_argument("--text-key", default="text", help="text field of jsonl/parquet records")
  b.add_argument(
    "--sft-format",
    default=None,
    help="score SFT data (loss-masked targets only): chat|translation|summarization",
  )
  b.add_argument(
    "--seq-len",
    type=int,
    default=None,
    help="bytes per row (default: the length a work directory trained at, data.seq_len; "
    "else the model's max_seq_len)",
  )
  b.add_argument("--batch-size", type=int, default=8)
  b.add_argument("--packing", default="segmented", choices=("segmented", "concat"))
  b.add_argument("--max-batches", type=int, default=None)
  b.add_argument("--json", action="store_true", help="print one JSON object")
  b.add_argument("--no-progress", action="store_true")
  add_dtype_option(b, "evaluate")

  t = sub.add_parser(
    "tasks", help="generate on a task, report quality, acceptance rate and bytes/s"
  )
  t.add_argument("--checkpoint", required=True)
  t.add_argument("--task", required=True, help="|".join(tasks.TASKS))
  t.add_argument("--data", required=True, help="jsonl file")
  t.add_argument("--mode", default="ntp", help="ntp|threshold|verify|drafter")
  add_dtype_option(t, "evaluate")
  t.add_argument(
    "--drafter", default=None, help="drafting checkpoint for --mode drafter (this one verifies)"
  )
  t.add_argument("--tau", type=float, default=0.9)
  t.add_argument("--n", type=int, default=3)
  t.add_argument(
    "--max-bytes", type=int, default=None, help="generation budget per prompt (default per task)"
  )
  t.add_argument("--limit", type=int, default=None, help="first N examples")
  t.add_argument("--batch-size", type=int, default=1, help="prompts per generate call (paper: 1)")
  t.add_argument("--metric", default=None, help="headline metric (default per task)")
  t.add_argument(
    "--temperature", type=float, default=None, help="override (default: greedy; ifeval 0.7)"
  )
  t.add_argument("--top-p", type=float, default=None, help="override (default: 1; ifeval 0.9)")
  t.add_argument("--seed", type=int, default=0)
  t.add_argument(
    "--out", default=None, help="also write the full result (with outputs) to this JSON file"
  )
  t.add_argument("--json", action="store_true")
  t.add_argument("--no-progress", action="store_true")

  s = sub.add_parser("sweep", help="checkpoints x modes x taus x ns; JSON table and plots")
  s.add_argument("--checkpoints", required=True, nargs="+")
  add_dtype_option(s, "evaluate")
  s.add_argument("--task", required=True, help="|".join(tasks.TASKS))
  s.add_argument("--data", required=True)
  s.add_argument("--out", required=True, help="output directory")
  s.add_argument("--taus", type=_floats, default=[0.9])
  s.add_argument("--ns", type=_ints, default=[3])
  s.add_argument("--modes", type=_names, default=["ntp", "threshold", "verify"])
  s.add_argument("--drafter", default=None)
  s.add_argument("--max-bytes", type=int, default=None)
  s.add_argument("--limit", type=int, default=None)
  s.add_argument("--batch-size", type=int, default=1)
  s.add_argument("--metric", default=None)
  s.add_argument("--seed", type=int, default=0)
  s.add_argument("--no-progress", action="store_true")
  return p


def _at_least(name: str, value, low: int = 1):
  if value is not None and value < low:
    fail(f"{name} must be >= {low}, got {value}")


def _host_memory() -> int:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, ValueError, OSError):  # not POSIX: no check
    return 0


def _check_batch_fits(batch_size: int, seq_len: int, vocab_size: int):
  """A batch whose float32 logits alone exceed this machine's memory is a typo (an extra digit
  in --batch-size), not a run: refused before the pipeline allocates it (a MemoryError from
  inside grain otherwise, or an out-of-memory crash)."""
  need, have = batch_size * seq_len * vocab_size * 4, _host_memory()
  if have and need > have:
    fail(
      f"--batch-size {batch_size} x --seq-len {seq_len} needs {need / 2**30:.1f} GiB for the "
      f"logits alone, more than this machine's {have / 2**30:.1f} GiB; use a smaller --batch-size"
    )


def _data_format(fmt):
  if fmt is None:
    return None
  fmt = {"arrayrecord": "array_record"}.get(fmt, fmt)
  if fmt not in FORMATS:
    fail(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
  return fmt


def _cmd_bpb(a) -> int:
  _at_least("--batch-size", a.batch_size)
  _at_least("--seq-len", a.seq_len)
  _at_least("--max-batches", a.max_batches)
  _at_least("--step", a.step, 0)
  fmt = _data_format(a.format)
  if a.sft_format:
    if a.sft_format not in SFT_FORMATS:
      fail(f"unknown --sft-format {a.sft_format!r}; choose one of {', '.join(SFT_FORMATS)}")
  model = api.load(a.checkpoint, step=a.step, dtype=a.dtype)
  seq_len = a.seq_len
  if seq_len is None:
    seq_len = length_default("lca-eval", "--seq-len", a.checkpoint, model.cfg.max_seq_len)
  if seq_len > model.cfg.max_seq_len:
    fail(
      f"--seq-len {seq_len} is longer than the model context (max_seq_len {model.cfg.max_seq_len})"
    )
  _check_batch_fits(a.batch_size, seq_len, model.cfg.vocab_size)
  if a.sft_format:
    packing = "segmented" if a.packing == "segmented" else "single"
    batches = make_sft_eval_pipeline(
      a.data, a.sft_format, seq_len, a.batch_size, max_batches=a.max_batches, packing=packing
    )
  else:
    batches = make_eval_pipeline(
      a.data,
      fmt,
      seq_len,
      a.batch_size,
      a.packing,
      max_batches=a.max_batches,
      text_key=a.text_key,
      shard_index=0,
      shard_count=1,
      on_bad_shard="error",
    )
  res = evaluate_bpb(model, batches, max_batches=a.max_batches, progress=not a.no_progress)
  if not res["batches"]:
    raise DataError(f"no batch to score in {' '.join(a.data)} (no usable document)")
  res.update(checkpoint=a.checkpoint, seq_len=seq_len, batch_size=a.batch_size)
  if a.json:
    print(jsonio.dumps(res))
    return 0
  print(f"checkpoint {a.checkpoint}: {res['batches']} batches of {a.batch_size} x {seq_len}")
  heads = sorted((k for k in res if k.startswith("bpb_")), key=lambda k: (k != "bpb_ntp", k))
  for k in heads:
    n = res.get("targets_" + k[4:])
    print(f"  {k:22s} {res[k]:.4f}" + (f"  ({n} targets)" if n is not None else ""))
  for k in (
    "bytes_per_latent",
    "boundary_rate",
    "group_len_mean",
    "group_len_p10",
    "group_len_p50",
    "group_len_p90",
    "group_len_p99",
    "group_len_max",
    "overflow",
  ):
    if k in res:
      print(f"  {k:22s} {res[k]:.4f}" if isinstance(res[k], float) else f"  {k:22s} {res[k]}")
  if res.get("skipped_records"):
    by = ", ".join(f"{k} {v}" for k, v in res["skipped"].items())
    print(f"  {'skipped_records':22s} {res['skipped_records']} ({by})")
  return 0


def _check_gen_args(a, modes=None, taus=None, ns=None):
  """The generation arguments of tasks / sweep, checked before any checkpoint is loaded."""
  _at_least("--batch-size", a.batch_size)
  _at_least("--limit", a.limit)
  _at_least("--max-bytes", a.max_bytes)
  temperature = getattr(a, "temperature", None)
  top_p = getattr(a, "top_p", None)
  for mode in modes or [a.mode]:
    if modes is not None and mode not in engine.POLICIES:
      continue  # the sweep grid reports it with the list of its modes
    for tau in taus or [getattr(a, "tau", 0.9)]:
      for n in ns or [getattr(a, "n", 3)]:
        engine.check_options(
          mode,
          tau=tau,
          n=n,  # a sweep's --ns too: 0 or 1 in a multi-byte mode is an error, not a silent 2
          max_bytes=a.max_bytes or 1,
          temperature=0.0 if temperature is None else temperature,
          top_p=1.0 if top_p is None else top_p,
          seed=a.seed,
        )


def _cmd_tasks(a) -> int:
  tasks.check_task(a.task)
  _check_gen_args(a)
  if a.out:
    check_out_file(a.out)
  model = api.load(a.checkpoint, dtype=a.dtype)
  drafter = api.load(a.drafter, dtype=a.dtype) if a.drafter else None
  max_bytes = tasks.DEFAULT_MAX_BYTES[a.task] if a.max_bytes is None else a.max_bytes
  ctx = min(model.cfg.max_seq_len, drafter.cfg.max_seq_len if drafter else model.cfg.max_seq_len)
  examples = tasks.load_examples(
    a.task, a.data, limit=a.limit, max_prompt_bytes=max(16, ctx - max_bytes)
  )
  r = tasks.run_task(
    model,
    a.task,
    examples,
    mode=a.mode,
    tau=a.tau,
    n=a.n,
    max_bytes=max_bytes,
    batch_size=a.batch_size,
    drafter=drafter,
    seed=a.seed,
    metric=a.metric,
    progress=not a.no_progress,
    temperature=a.temperature,
    top_p=a.top_p,
  )
  r.update(checkpoint=a.checkpoint, drafter=a.drafter, data=a.data)
  if a.out:
    write_json(r, a.out)
  if a.json:
    print(jsonio.dumps({k: v for k, v in r.items() if k != "outputs"}))
  else:
    print(tasks.summary_line(r))
  return 0


def _cmd_sweep(a) -> int:
  tasks.check_task(a.task)
  check_out_dir(a.out)
  if not a.taus or not a.ns or not a.modes:
    fail("--taus, --ns and --modes each need at least one value")
  _check_gen_args(a, modes=a.modes, taus=a.taus, ns=a.ns)
  res = run_sweep(
    a.checkpoints,
    a.task,
    a.data,
    a.out,
    modes=a.modes,
    taus=a.taus,
    ns=a.ns,
    drafter=a.drafter,
    limit=a.limit,
    max_bytes=a.max_bytes,
    batch_size=a.batch_size,
    metric=a.metric,
    seed=a.seed,
    progress=not a.no_progress,
    loader=functools.partial(api.load, dtype=a.dtype),
  )
  for r in res["runs"]:
    print(f"{r['label']}: {tasks.summary_line(r)}")
  for s in res["skipped"]:
    print(f"{s['label']}: skipped {s['mode']} n={s['n']}: {s['reason']}")
  print(f"wrote {a.out}/sweep.json and {len(res['plots'])} plots")
  return 0


def main(argv=None) -> int:
  if argv is None:  # run as a program: large host buffers on huge pages (lca_jax/hostmem.py)
    hostmem.use_huge_pages()
  a = _parser().parse_args(argv)
  one_line_warnings("lca-eval")
  try:
    from lca_jax import xla_cache  # pylint: disable=g-import-not-at-top

    xla_cache.enable()  # before anything compiles (LCA_JAX_XLA_CACHE)
    return {"bpb": _cmd_bpb, "tasks": _cmd_tasks, "sweep": _cmd_sweep}[a.command](a)
  except LcaError as e:  # every user-facing error of the package (lca_jax/errors.py)
    return _fail(str(e))
  except OSError as e:  # a path that cannot be read or written (not a bug: one line)
    return _fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
  except KeyboardInterrupt:
    return _fail("interrupted", 130)


if __name__ == "__main__":
  sys.exit(main())
