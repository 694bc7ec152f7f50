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
import importlib.util
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

DEFAULT_PROMPT = "A hacker is a person who "
DEFAULT_SENTENCE = "The hacker wrote a program that hacks the kernel of the system."


def _visible(text: str) -> str:
  return text.replace("\n", "\\n")


def reference_loop(model, prompt: str, max_bytes: int, tau=None) -> dict:
  """Greedy decoding by rerunning the full forward on the whole sequence per step.

  ``tau is None``: next-byte only. Otherwise threshold decoding with n = 2: the NT head's byte is
  always taken, and the MBP head's guess for the byte after it (read at the last byte) is taken
  too when its probability is >= tau (docs/design.md §6.3, n = 2).
  """
  from lca_jax import vocab  # pylint: disable=g-import-not-at-top

  ids = list(vocab.encode(prompt))
  start, steps, limit = len(ids), 0, len(ids) + max_bytes
  t0 = time.perf_counter()
  while len(ids) < limit:
    # The model is causal, so bytes appended after position t do not change its outputs at t:
    # pad to a multiple of 64 (fewer shapes to compile) and read the last real position.
    t = len(ids) - 1
    padded = np.zeros(-(-len(ids) // 64) * 64, np.int32)
    padded[: len(ids)] = ids
    out = model.forward(padded)
    out = {
      k: (out[k][: t + 1] if out.get(k) is not None else None) for k in ("ntp_logits", "mbp_logits")
    }
    steps += 1
    nxt = int(np.argmax(out["ntp_logits"][-1]))
    if nxt == vocab.EOS_ID:
      break
    ids.append(nxt)
    if tau is not None and out.get("mbp_logits") is not None and len(ids) < limit:
      logits = out["mbp_logits"][-1].astype(np.float64)
      p = np.exp(logits - logits.max())
      p /= p.sum()
      cand = int(np.argmax(p))
      if p[cand] >= tau and cand != vocab.EOS_ID:
        ids.append(cand)
  gen = np.asarray(ids[start:], np.int32)
  return dict(text=vocab.decode(gen), bytes=len(gen), steps=steps, seconds=time.perf_counter() - t0)


def segmentation(model, sentence: str) -> str:
  """The sentence with '|' after every byte whose learned boundary is 1 (closes a group)."""
  from lca_jax import vocab  # pylint: disable=g-import-not-at-top

  ids = vocab.encode(sentence)
  b = model.forward(ids)["boundaries"]
  if b is None:
    return "(flat model: no segmentation)"
  raw = sentence.encode("utf-8")
  # Per character, so a boundary inside a multi-byte UTF-8 character is shown after it
  # (instead of splitting the character into replacement glyphs).
  pieces, i = [], 0
  for ch in sentence:
    n = len(ch.encode("utf-8"))
    pieces.append(ch + ("|" if np.any(b[i : i + n]) else ""))
    i += n
  text = "".join(pieces)
  n_b = int(np.sum(b))
  per = f"{len(raw) / n_b:.2f} bytes per latent" if n_b else "no group closes"
  text += f"\n-- {n_b} boundaries in {len(raw)} bytes ({per})"
  probs = boundary_probs(model, ids)
  if probs is not None:
    text += (
      f"; boundary probability min {probs.min():.2f} / mean {probs.mean():.2f} / "
      f"max {probs.max():.2f} (a byte closes its group when > 0.5"
    )
    if probs.max() - probs.min() < 0.1:
      text += "; nearly constant: the predictor has only learned its prior rate so far"
    text += ")"
  return text


def boundary_probs(model, ids):
  """sigmoid(boundary logit) per byte (learned boundaries only), for the summary line."""
  cfg = model.cfg
  if not cfg.hierarchical or cfg.boundaries != "learned":
    return None
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  x = jnp.asarray(ids, jnp.int32)[None]

  def fn(mod, x):
    h = mod.encode(x, jnp.ones_like(x), jnp.arange(x.shape[1], dtype=jnp.int32)[None])
    return mod.boundary_logits(h)

  # jitted: one compile instead of one per op (seconds on CPU)
  logits = jax.jit(lambda p, x: model.module.apply({"params": p}, x, method=fn))(model.params, x)
  return np.asarray(jax.nn.sigmoid(logits.astype(jnp.float32))).reshape(-1)


def training_summary(path: str) -> str:
  """One line from an lca-train work directory: the last held-out eval (inference-mode
  boundaries, no Gumbel noise) and the last logged training-time boundary rate."""
  import json  # pylint: disable=g-import-not-at-top

  def last(name):
    f = os.path.join(path, name)
    if not os.path.isfile(f):
      return None
    rows = [ln for ln in open(f, encoding="utf-8") if ln.strip()]
    try:
      return json.loads(rows[-1]) if rows else None
    except ValueError:
      return None

  ev, tr = last("eval.jsonl"), last("metrics.jsonl")
  parts = []
  if ev:
    txt = f"held-out @ step {ev.get('step')}: bpb ntp {ev['bpb_ntp']:.3f}"
    if ev.get("bpb_mbp") is not None:
      txt += f", mbp {ev['bpb_mbp']:.3f}"
    if ev.get("bytes_per_latent") is not None:
      txt += f", {ev['bytes_per_latent']:.2f} bytes/latent at inference"
    parts.append(txt)
  if tr and tr.get("bytes_per_latent") is not None:
    parts.append(f"training (Gumbel-sampled boundaries): {tr['bytes_per_latent']:.2f} bytes/latent")
  return "; ".join(parts)


def heldout_snippet(n_bytes: int) -> str:
  """The start of a held-out paragraph of the bundled demo corpus ('' if unavailable)."""
  if n_bytes <= 0:
    return ""
  try:
    from lca_jax.data import (
      demo,  # pylint: disable=g-import-not-at-top
      read_documents,  # pylint: disable=g-import-not-at-top
    )

    every = demo.DEMO_HOLDOUT_EVERY
    for i, doc in enumerate(read_documents([demo.demo_corpus_path()], "text")):
      if i % every == every - 1 and len(doc.encode("utf-8")) >= n_bytes:
        return doc.encode("utf-8")[:n_bytes].decode("utf-8", errors="ignore")
  except Exception:  # pylint: disable=broad-except
    return ""
  return ""


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--checkpoint", required=True)
  ap.add_argument("--prompt", default=DEFAULT_PROMPT)
  ap.add_argument("--sentence", default=DEFAULT_SENTENCE)
  ap.add_argument("--max-bytes", type=int, default=120)
  ap.add_argument("--tau", type=float, default=0.5)
  ap.add_argument("--n", type=int, default=3)
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
  args = ap.parse_args(argv)

  import lca_jax  # pylint: disable=g-import-not-at-top

  try:
    model = lca_jax.load(args.checkpoint)
  except lca_jax.LoadError as e:
    print(f"demo_sample: error: {e}", file=sys.stderr)
    return 2
  cfg = model.cfg
  print(
    f"model: {cfg.kind}, d={cfg.d_model}, layers enc/lm/dec/mbp = "
    f"{cfg.n_enc}/{cfg.n_lm}/{cfg.n_dec}/{cfg.n_mbp} ({args.checkpoint})"
  )
  summary = training_summary(args.checkpoint)
  if summary:
    print(summary)
  print(f"prompt: {_visible(args.prompt)!r}\n")

  use_engine = (
    not args.reference
    and importlib.util.find_spec("lca_jax.decode") is not None
    and importlib.util.find_spec("lca_jax.decode.engine") is not None
  )
  modes = [("next-byte (ntp)", dict(mode="ntp"), None)]
  if cfg.has_mbp:
    modes.append(
      (
        f"multi-byte (threshold, tau={args.tau}, n={args.n})",
        dict(mode="threshold", tau=args.tau, n=args.n),
        args.tau,
      )
    )
  else:
    print("(no multi-byte head in this model: threshold decoding skipped)\n")
  for title, kw, tau in modes:
    res = None
    if use_engine:
      try:
        res = model.generate([args.prompt], max_bytes=args.max_bytes, **kw)
      except Exception as e:  # pylint: disable=broad-except
        print(f"(model.generate failed: {type(e).__name__}: {e}; using the reference loop)")
    if res is not None:
      steps = len(res.accepted_per_step[0])
      nbytes = len(res.ids[0])
      print(f"== {title} [model.generate] ==")
      print(args.prompt + res.texts[0])
      extra = ""
      if kw["mode"] != "ntp":
        extra = f", acceptance {res.acceptance_rate:.2f}, bytes/step histogram {res.histogram}"
      print(
        f"-- {nbytes} bytes in {steps} steps ({nbytes / max(steps, 1):.2f} bytes/step{extra})\n"
      )
    else:
      if kw["mode"] != "ntp":
        title = f"multi-byte (threshold, tau={args.tau}, n=2)"
      res = reference_loop(model, args.prompt, args.max_bytes, tau)
      print(f"== {title} [reference loop: full forward per step] ==")
      print(args.prompt + res["text"])
      print(
        f"-- {res['bytes']} bytes in {res['steps']} steps "
        f"({res['bytes'] / max(res['steps'], 1):.2f} bytes/step)\n"
      )

  if use_engine and args.temperature > 0:
    # Greedy decoding of a model this small falls into loops; a sample shows what it learned.
    try:
      res = model.generate(
        [args.prompt],
        max_bytes=args.max_bytes,
        mode="ntp",
        temperature=args.temperature,
        seed=args.seed,
      )
      print(
        f"== sampled next-byte (temperature {args.temperature}, seed {args.seed}) [model.generate] =="
      )
      print(args.prompt + res.texts[0] + "\n")
    except Exception as e:  # pylint: disable=broad-except
      print(f"(sampling failed: {type(e).__name__}: {e})\n")

  print("== learned segmentation ('|' after a byte that closes its group) ==")
  print(segmentation(model, args.sentence))
  held = heldout_snippet(args.heldout_bytes)
  if held and cfg.hierarchical:
    print(
      f"\n== segmentation of held-out text (first {len(held.encode())} bytes of a held-out paragraph) =="
    )
    print(segmentation(model, held).replace("\n", "\\n", held.count("\n")))
  return 0


if __name__ == "__main__":
  sys.exit(main())
