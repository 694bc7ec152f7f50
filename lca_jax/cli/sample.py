"""lca-sample: generate from a checkpoint (an lca-train workdir or the paper's PyTorch layout).

    lca-sample --checkpoint workdirs/demo --prompt "The hacker" --mode threshold --tau 0.9 --n 3
    lca-sample --checkpoint DIR --prompt-file prompts.txt --mode verify --json
    lca-sample --checkpoint FXT_DIR --mode drafter --drafter LCA_DIR --prompt "..."

Prompts are bytes: a --prompt-file line (lines split at \\n, \\r\\n or \\r; blank lines
skipped) is fed to the model as the bytes in the file, valid UTF-8 or not, and so is a
--prompt whose bytes are not UTF-8; such a prompt is printed with U+FFFD for its invalid
bytes, and --json adds its exact vocabulary ids as "prompt_ids". Options are checked before
the checkpoint is loaded: --tau in [0, 1], --n in [2, 64] in multi-byte modes, --max-bytes
>= 1, --temperature >= 0, --top-k >= 0, --top-p in (0, 1], each finite. Generation stops
at eos, after --max-bytes bytes, or when the context is full (the budget is capped so that
the longest prompt + generation fits the model's max_seq_len): the summary line says which
("stopped: ..."), and --json gives "stop_reason" per prompt. --json is strict JSON
(acceptance_rate is null in ntp mode). Errors are one line, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Union

from lca_jax import jsonio, vocab
from lca_jax.cli.common import (
  add_dtype_option,
  fail,
  one_line_warnings,
  option_message,
  run_main,
)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="lca-sample", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--checkpoint", required=True, help="workdir or upstream dir (config.json + model.safetensors)"
  )
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="prompt text")
  src.add_argument("--prompt-file", help="file with one prompt per line (batched)")
  p.add_argument("--mode", default="ntp", choices=["ntp", "threshold", "verify", "drafter"])
  p.add_argument("--drafter", help="drafter checkpoint for --mode drafter (LCA-MBP or MLP-MBP)")
  p.add_argument("--tau", type=float, default=0.9, help="threshold mode acceptance probability")
  p.add_argument("--n", type=int, default=3, help="bytes proposed per step in multi-byte modes")
  p.add_argument("--max-bytes", type=int, default=256)
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--ignore-eos", action="store_true")
  add_dtype_option(p, "decode")
  p.add_argument(
    "--show-boundaries",
    action="store_true",
    help="print the prompt and output with '|' after each byte that closes a group",
  )
  p.add_argument("--stream", action="store_true", help="print text as it is decoded")
  p.add_argument("--json", action="store_true", help="print one JSON record per prompt")
  return p


def _as_prompt(b: bytes) -> Union[str, bytes]:
  """A prompt's bytes as str when they are UTF-8 (the common case), else the bytes themselves
  (the model is byte-level: generate() takes them as they are)."""
  try:
    return b.decode("utf-8")
  except UnicodeDecodeError:
    return b


def _read_prompts(args) -> List[Union[str, bytes]]:
  if args.prompt is not None:
    # argv holds bytes; Python decodes them with surrogateescape: give back the bytes
    try:
      return [_as_prompt(os.fsencode(args.prompt))]
    except UnicodeEncodeError:  # a str with other lone surrogates (main(argv) from Python)
      return [args.prompt]
  try:
    with open(args.prompt_file, "rb") as f:
      data = f.read()
  except OSError as e:
    fail(f"cannot read prompt file {args.prompt_file}: {e.strerror}")
  prompts = [_as_prompt(line) for line in data.splitlines() if line.strip()]
  if not prompts:
    fail(f"prompt file {args.prompt_file} has no prompts")
  return prompts


def _prompt_ids(prompt) -> list:
  from lca_jax.decode import request  # pylint: disable=g-import-not-at-top

  return request.encode_prompts([prompt])[0].tolist()


def _shown(prompt) -> str:
  return prompt if isinstance(prompt, str) else prompt.decode("utf-8", errors="replace")


def _stop_summary(res, max_bytes: int, prompts, context: int) -> str:
  counts = {}
  for r in res.stop_reasons:
    counts[r] = counts.get(r, 0) + 1
  if not counts:
    return ""
  out = "; stopped: " + ", ".join(
    (f"{k} {v}" if len(res.stop_reasons) > 1 else k) for k, v in sorted(counts.items())
  )
  if "context" in counts:
    longest = max(len(_prompt_ids(p)) for p in prompts)
    out += (
      f" (the context of {context} bytes left {res.budget} of --max-bytes {max_bytes} "
      f"after the {longest}-byte prompt)"
    )
  return out


def with_boundaries(ids, boundaries) -> str:
  """Text with '|' after every byte whose boundary is 1 (never splits a UTF-8 character)."""
  out, buf = [], []
  for i, b in zip(ids, boundaries):
    buf.append(int(i))
    if b:
      out.append(vocab.decode(buf) + "|")
      buf = []
  out.append(vocab.decode(buf))
  return "".join(out)


class _Streamer:
  """Prints row 0's bytes as each decode step commits them, never splitting a character."""

  def __init__(self, out=sys.stdout):
    self.dec, self.out = vocab.StreamDecoder(), out

  def __call__(self, rows):
    self.out.write(self.dec.push(rows[0]))
    self.out.flush()

  def close(self):
    self.out.write(self.dec.flush() + "\n")


def main(argv: Optional[List[str]] = None) -> int:
  args = build_parser().parse_args(argv)
  one_line_warnings("lca-sample")
  return run_main(lambda: _main(args))


_OPTIONS = ("n", "tau", "max_bytes", "temperature", "top_k", "top_p", "seed")


def _main(args) -> int:
  # deferred: jax, flax and the model take seconds to import, which --help and usage errors skip
  from lca_jax import api, xla_cache  # pylint: disable=g-import-not-at-top
  from lca_jax.decode import request  # pylint: disable=g-import-not-at-top

  xla_cache.enable()  # before anything compiles (LCA_JAX_XLA_CACHE)
  prompts = _read_prompts(args)
  try:  # before the (slow) load; the messages are rewritten to name the CLI options
    request.check_options(
      args.mode,
      tau=args.tau,
      n=args.n,
      max_bytes=args.max_bytes,
      temperature=args.temperature,
      top_k=args.top_k,
      top_p=args.top_p,
      seed=args.seed,
    )
  except request.DecodeError as e:
    fail(option_message(str(e), _OPTIONS))
  if args.mode == "drafter" and not args.drafter:
    fail("--mode drafter needs --drafter DIR")
  if args.stream and (len(prompts) > 1 or args.json or args.show_boundaries):
    fail("--stream prints one prompt as text; drop --json/--show-boundaries or use --prompt")
  model = api.load(args.checkpoint, dtype=args.dtype)
  drafter = api.load(args.drafter, dtype=args.dtype) if args.mode == "drafter" else None
  streamer = None
  if args.stream:
    streamer = _Streamer()
    sys.stdout.write(_shown(prompts[0]))
  res = model.generate(
    prompts,
    mode=args.mode,
    tau=args.tau,
    n=args.n,
    max_bytes=args.max_bytes,
    temperature=args.temperature,
    top_k=args.top_k,
    top_p=args.top_p,
    seed=args.seed,
    ignore_eos=args.ignore_eos,
    drafter=drafter,
    on_bytes=streamer,
  )
  if streamer is not None:
    streamer.close()
  for i, prompt in enumerate(prompts):
    if args.json:
      rec = dict(
        prompt=_shown(prompt),
        text=res.texts[i],
        ids=res.ids[i].tolist(),
        accepted_per_step=res.accepted_per_step[i],
        acceptance_rate=res.acceptance_rate,
        bytes_per_s=res.bytes_per_s,
        latent_steps_per_byte=res.latent_steps_per_byte,
        mode=args.mode,
        tau=args.tau,
        n=args.n,
        stop_reason=res.stop_reasons[i],
        budget=res.budget,
      )
      if isinstance(prompt, bytes):
        rec["prompt_ids"] = _prompt_ids(prompt)
      if args.show_boundaries and model.cfg.hierarchical:
        rec["segmented"] = with_boundaries(
          _prompt_ids(prompt) + res.ids[i].tolist(),
          list(res.prompt_boundaries[i]) + list(res.boundaries[i]),
        )
      print(jsonio.dumps(rec, ensure_ascii=False))
      continue
    if args.show_boundaries and model.cfg.hierarchical:
      print(
        with_boundaries(
          _prompt_ids(prompt) + res.ids[i].tolist(),
          list(res.prompt_boundaries[i]) + list(res.boundaries[i]),
        )
      )
    elif not args.stream:
      print(_shown(prompt) + res.texts[i])
  if not args.json:
    acc = "" if args.mode == "ntp" else f", acceptance {res.acceptance_rate:.3f}"
    context = min(
      model.cfg.max_seq_len, drafter.cfg.max_seq_len if drafter else model.cfg.max_seq_len
    )
    print(
      f"[{args.mode}: {sum(len(x) for x in res.ids)} bytes in {res.steps} steps, "
      f"{res.bytes_per_s:.1f} bytes/s{acc}{_stop_summary(res, args.max_bytes, prompts, context)}]",
      file=sys.stderr,
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
