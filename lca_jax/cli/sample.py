"""lca-sample: generate from a checkpoint (an lca-train workdir or the paper's PyTorch layout).

    lca-sample --checkpoint workdirs/demo --prompt "The hacker" --mode threshold --tau 0.9 --n 3
    lca-sample --checkpoint DIR --prompt-file prompts.txt --mode verify --json
    lca-sample --checkpoint FXT_DIR --mode drafter --drafter LCA_DIR --prompt "..."
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from lca_jax.cli.common import fail, run_main


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="lca-sample", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--checkpoint", required=True, help="workdir or upstream dir (config.json + model.safetensors)")
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
  p.add_argument("--show-boundaries", action="store_true",
                 help="print the prompt and output with '|' after each byte that closes a group")
  p.add_argument("--stream", action="store_true", help="print text as it is decoded")
  p.add_argument("--json", action="store_true", help="print one JSON record per prompt")
  return p


def _read_prompts(args) -> List[str]:
  if args.prompt is not None:
    return [args.prompt]
  try:
    with open(args.prompt_file, encoding="utf-8") as f:
      prompts = [line.rstrip("\n") for line in f if line.strip()]
  except OSError as e:
    fail(f"cannot read prompt file {args.prompt_file}: {e.strerror}")
  if not prompts:
    fail(f"prompt file {args.prompt_file} has no prompts")
  return prompts


def with_boundaries(ids, boundaries) -> str:
  """Text with '|' after every byte whose boundary is 1 (never splits a UTF-8 character)."""
  from lca_jax import vocab  # pylint: disable=g-import-not-at-top
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
    from lca_jax import vocab  # pylint: disable=g-import-not-at-top
    self.dec, self.out = vocab.StreamDecoder(), out

  def __call__(self, rows):
    self.out.write(self.dec.push(rows[0]))
    self.out.flush()

  def close(self):
    self.out.write(self.dec.flush() + "\n")


def main(argv: Optional[List[str]] = None) -> int:
  args = build_parser().parse_args(argv)
  return run_main(lambda: _main(args))


def _main(args) -> int:
  import lca_jax  # pylint: disable=g-import-not-at-top
  from lca_jax import vocab  # pylint: disable=g-import-not-at-top
  prompts = _read_prompts(args)
  if args.mode != "ntp" and args.n < 2:
    fail(f"--n must be >= 2 in {args.mode} mode, got {args.n}")
  if args.mode == "drafter" and not args.drafter:
    fail("--mode drafter needs --drafter DIR")
  if args.stream and (len(prompts) > 1 or args.json or args.show_boundaries):
    fail("--stream prints one prompt as text; drop --json/--show-boundaries or use --prompt")
  model = lca_jax.load(args.checkpoint)
  drafter = lca_jax.load(args.drafter) if args.mode == "drafter" else None
  streamer = None
  if args.stream:
    streamer = _Streamer()
    sys.stdout.write(prompts[0])
  res = model.generate(prompts, mode=args.mode, tau=args.tau, n=args.n, max_bytes=args.max_bytes,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, ignore_eos=args.ignore_eos, drafter=drafter,
                       on_bytes=streamer)
  if streamer is not None:
    streamer.close()
  for i, prompt in enumerate(prompts):
    if args.json:
      rec = dict(prompt=prompt, text=res.texts[i], ids=res.ids[i].tolist(),
                 accepted_per_step=res.accepted_per_step[i], acceptance_rate=res.acceptance_rate,
                 bytes_per_s=res.bytes_per_s, latent_steps_per_byte=res.latent_steps_per_byte,
                 mode=args.mode, tau=args.tau, n=args.n)
      if args.show_boundaries and model.cfg.hierarchical:
        rec["segmented"] = with_boundaries(
            list(vocab.encode(prompt)) + res.ids[i].tolist(),
            list(res.prompt_boundaries[i]) + list(res.boundaries[i]))
      print(json.dumps(rec, ensure_ascii=False))
      continue
    if args.show_boundaries and model.cfg.hierarchical:
      print(with_boundaries(list(vocab.encode(prompt)) + res.ids[i].tolist(),
                            list(res.prompt_boundaries[i]) + list(res.boundaries[i])))
    elif not args.stream:
      print(prompt + res.texts[i])
  if not args.json:
    acc = "" if args.mode == "ntp" else f", acceptance {res.acceptance_rate:.3f}"
    print(f"[{args.mode}: {sum(len(x) for x in res.ids)} bytes in {res.steps} steps, "
          f"{res.bytes_per_s:.1f} bytes/s{acc}]", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
