"""What a trained checkpoint does, as text: the held-out bits per byte of its training run,
the learned segmentation of a sentence and of held-out text, greedy next-byte and multi-byte
decoding (``model.generate``, or a reference loop that reruns the full forward for every
byte) with bytes/s timed in alternating rounds, a sampled continuation, and the loss curve.

``run(args)`` prints it all for the options of tools/demo_sample.py (``args``: its parsed
namespace). Heavy modules (jax, the decode engine) are imported on first use.
"""

from __future__ import annotations

import importlib.util
import os
import time

import numpy as np


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


def _last_row(path: str, name: str):
  """The last JSON row of WORKDIR/name (None if missing or unreadable)."""
  import json  # pylint: disable=g-import-not-at-top

  f = os.path.join(path, name)
  if not os.path.isfile(f):
    return None
  rows = [ln for ln in open(f, encoding="utf-8") if ln.strip()]
  try:
    return json.loads(rows[-1]) if rows else None
  except ValueError:
    return None


def gzip_bpb() -> float:
  """Bits per byte of the bundled corpus as gzip -9 stores it (compressed bits / text bytes),
  a reference point for the model's figures (NaN when the corpus is unavailable)."""
  import gzip  # pylint: disable=g-import-not-at-top

  try:
    from lca_jax.data import demo  # pylint: disable=g-import-not-at-top

    path = demo.demo_corpus_path()
    with gzip.open(path, "rb") as f:
      n = len(f.read())
    return 8.0 * os.path.getsize(path) / max(n, 1)
  except Exception:  # pylint: disable=broad-except
    return float("nan")


def training_summary(path: str) -> str:
  """The held-out section from an lca-train work directory ('' when it has no eval.jsonl): the
  last eval (inference-mode boundaries, no Gumbel noise) of both heads, bytes per latent, the
  last logged training-time boundary rate, and one sentence on what the numbers mean."""
  ev, tr = _last_row(path, "eval.jsonl"), _last_row(path, "metrics.jsonl")
  if not ev or ev.get("bpb_ntp") is None:
    return ""
  lines = [
    f"== held-out bits per byte (eval.jsonl @ step {ev.get('step')}, "
    f"{int(ev.get('bytes') or 0)} held-out bytes) =="
  ]
  txt = f"next-byte head {ev['bpb_ntp']:.3f} bpb"
  if ev.get("bpb_mbp") is not None:
    txt += f", multi-byte head {ev['bpb_mbp']:.3f} bpb"
  if ev.get("bytes_per_latent") is not None:
    txt += f", {ev['bytes_per_latent']:.2f} bytes per latent at inference"
  if tr and tr.get("bytes_per_latent") is not None:
    txt += f" ({tr['bytes_per_latent']:.2f} in training, Gumbel-sampled boundaries)"
  lines.append(txt)
  data = (_train_config(path).get("config") or {}).get("data") or {}
  if data and not data.get("train_files") and not data.get("eval_files"):
    gz = gzip_bpb()
    ref = f"; gzip -9 stores this corpus at {gz:.2f} bpb" if gz == gz else ""
    sentence = (
      f"-- Scored on paragraphs of the bundled corpus the model never trained on (every "
      f"{_holdout_every()}th); 8 bpb is a uniform guess over bytes{ref}."
    )
  else:
    sentence = "-- Scored on the run's eval data; 8 bpb is a uniform guess over bytes."
  if ev.get("bpb_mbp") is not None:
    sentence += (
      f" The multi-byte head predicts the byte after next from closed groups only, so it is "
      f"{ev['bpb_mbp'] - ev['bpb_ntp']:+.2f} bpb from the next-byte head."
    )
  lines.append(sentence)
  return "\n".join(lines)


def _train_config(path: str) -> dict:
  import json  # pylint: disable=g-import-not-at-top

  try:
    with open(os.path.join(path, "train_config.json"), encoding="utf-8") as f:
      d = json.load(f)
    return d if isinstance(d, dict) else {}
  except (OSError, ValueError):
    return {}


def _holdout_every() -> int:
  try:
    from lca_jax.data import demo  # pylint: disable=g-import-not-at-top

    return int(demo.DEMO_HOLDOUT_EVERY)
  except Exception:  # pylint: disable=broad-except
    return 20


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


WORD_EDGE = frozenset(b" \n\t.,;:!?()\"'-")


def word_edge_share(sentence: str, boundaries) -> tuple:
  """(groups, groups closing at a word edge): a group closes at byte t; it is at a word edge when
  byte t or byte t+1 is a space or punctuation (the group ends a word or a space run)."""
  raw = sentence.encode("utf-8")
  b = np.asarray(boundaries).reshape(-1)[: len(raw)]
  closes = [t for t in range(len(raw)) if b[t]]
  edge = sum(
    1 for t in closes if raw[t] in WORD_EDGE or (t + 1 < len(raw) and raw[t + 1] in WORD_EDGE)
  )
  return len(closes), edge


def first_difference(a, b) -> int:
  """Index of the first differing id of two id sequences (-1 when identical)."""
  a, b = list(map(int, a)), list(map(int, b))
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return -1 if len(a) == len(b) else min(len(a), len(b))


def timed_generate(model, prompt: str, repeats: int, *kws):
  """``model.generate`` with each keyword dict of ``kws``: one untimed call each (it compiles),
  then ``repeats`` rounds calling each in turn, so that a change in the machine's load affects
  every mode alike. Returns one (last result, median bytes/s) per dict (bytes/s never counts
  compilation)."""
  for kw in kws:
    model.generate([prompt], **kw)
  res, rates = [None] * len(kws), [[] for _ in kws]
  for _ in range(max(1, repeats)):
    for i, kw in enumerate(kws):
      res[i] = model.generate([prompt], **kw)
      rates[i].append(res[i].bytes_per_s)
  return [(r, float(np.median(x))) for r, x in zip(res, rates)]


def _stats_line(res, bps: float, repeats: int) -> str:
  steps = len(res.accepted_per_step[0])
  nbytes = len(res.ids[0])
  acc = res.acceptance_rate
  acc_txt = "acceptance n/a (nothing proposed)" if acc != acc else f"acceptance {_rate(acc)}"
  return (
    f"-- {nbytes} bytes in {steps} steps: {bps:.0f} bytes/s (median of {max(1, repeats)}), "
    f"{nbytes / max(steps, 1):.2f} bytes/step, {acc_txt}, bytes/step histogram {res.histogram}"
  )


def _rate(x: float) -> str:
  """A rate in [0, 1] to 2 decimals, or to 3 when it is above 0 but below 0.01 (so a rate
  that is not zero never reads 0.00)."""
  return f"{x:.3f}" if 0 < x < 0.01 else f"{x:.2f}"


# A small model's multi-byte head is rarely sure: between "accepts nothing" and "accepts every
# guess" lie a few hundredths of tau, so the ladder's steps are 0.05.
TAU_STEPS = (0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05, 0.0)


def _tau_ladder(tau: float) -> list:
  """tau, then the lower of ``TAU_STEPS``: tried in turn until threshold accepts something."""
  return [tau] + [t for t in TAU_STEPS if t < tau]


def run(args):
  import lca_jax  # pylint: disable=g-import-not-at-top
  from lca_jax import xla_cache  # pylint: disable=g-import-not-at-top

  xla_cache.enable()  # a rerun of make demo loads its programs (LCA_JAX_XLA_CACHE)
  model = lca_jax.load(args.checkpoint)
  cfg = model.cfg
  print(
    f"model: {cfg.kind}, d={cfg.d_model}, layers enc/lm/dec/mbp = "
    f"{cfg.n_enc}/{cfg.n_lm}/{cfg.n_dec}/{cfg.n_mbp} ({args.checkpoint})"
  )

  # 1. held-out bits per byte (from the training run's own eval)
  summary = training_summary(args.checkpoint)
  if summary:
    print("\n" + summary)

  # 2. learned segmentation
  print("\n== learned segmentation ('|' after a byte that closes its group) ==")
  print(segmentation(model, args.sentence))
  if cfg.hierarchical:
    b = model.forward(lca_jax.vocab.encode(args.sentence))["boundaries"]
    n_g, n_edge = word_edge_share(args.sentence, b)
    if n_g:
      rest = "none splits a word" if n_edge == n_g else f"the other {n_g - n_edge} split words"
      print(
        f"-- Nobody told it where words are: {n_edge} of its {n_g} groups end at a word edge "
        f"(a space or punctuation at or right after the closing byte); {rest}."
      )
  held = heldout_snippet(args.heldout_bytes)
  if held and cfg.hierarchical:
    print(
      f"\n== segmentation of held-out text (first {len(held.encode())} bytes of a held-out paragraph) =="
    )
    print(segmentation(model, held).replace("\n", "\\n", held.count("\n")))

  print(f"\nprompt: {_visible(args.prompt)!r}\n")
  use_engine = (
    not args.reference
    and importlib.util.find_spec("lca_jax.decode") is not None
    and importlib.util.find_spec("lca_jax.decode.engine") is not None
  )
  if use_engine:
    rc = _engine_sections(model, args)
    if rc is not None:
      return rc
  else:
    _reference_sections(model, args)

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

  curve = args.curve
  if curve is None:
    has_metrics = os.path.isfile(os.path.join(args.checkpoint, "metrics.jsonl"))
    curve = os.path.join(args.checkpoint, "loss_curve.png") if has_metrics else ""
  if curve:
    from lca_jax.eval import curves  # pylint: disable=g-import-not-at-top

    try:
      path = curves.write_loss_curve(args.checkpoint, curve)
      print(f"== loss curve (bits per byte vs step, both heads) ==\n{path}")
    except (OSError, ImportError) as e:
      print(f"(loss curve not written: {type(e).__name__}: {e})")
  return 0


def _engine_sections(model, args):
  """ntp, verify (with the identity check) and threshold through ``model.generate``."""
  cfg = model.cfg
  kw = dict(max_bytes=args.max_bytes, temperature=0.0)
  try:
    ntp_kw = dict(mode="ntp", **kw)
    if cfg.has_mbp:  # ntp and verify timed in alternation
      (ntp, ntp_bps), (ver, ver_bps) = timed_generate(
        model, args.prompt, args.repeats, ntp_kw, dict(mode="verify", n=args.n, **kw)
      )
    else:
      ((ntp, ntp_bps),) = timed_generate(model, args.prompt, args.repeats, ntp_kw)
  except Exception as e:  # pylint: disable=broad-except
    print(f"(model.generate failed: {type(e).__name__}: {e}; using the reference loop)")
    _reference_sections(model, args)
    return None
  print("== next-byte (ntp) [model.generate] ==")
  print(args.prompt + ntp.texts[0])
  print(_stats_line(ntp, ntp_bps, args.repeats))
  print(
    "-- Greedy next-byte decoding, one byte per step: the reference text and speed the "
    "multi-byte modes below are measured against.\n"
  )
  if not cfg.has_mbp:
    print("(no multi-byte head in this model: verify and threshold decoding skipped)\n")
    return None

  print(f"== multi-byte (verify, n={args.n}) [model.generate] ==")
  print(args.prompt + ver.texts[0])
  print(_stats_line(ver, ver_bps, args.repeats))
  diff = first_difference(ntp.ids[0], ver.ids[0])
  if diff < 0:
    print(f"ntp and verify texts identical: yes (all {len(ntp.ids[0])} bytes compared)")
  else:
    print(f"ntp and verify texts identical: NO (first difference at generated byte {diff})")
  ratio = ver_bps / ntp_bps if ntp_bps > 0 else float("nan")
  ver_bpstep = len(ver.ids[0]) / max(len(ver.accepted_per_step[0]), 1)
  step_cost = ver_bpstep / ratio if ratio > 0 else float("nan")
  print(
    f"-- verify drafts {args.n} bytes per step with the multi-byte head and keeps those the "
    f"next-byte head agrees with, so its greedy text must equal ntp's; here it ran at "
    f"{ratio:.2f}x ntp's bytes/s, {'faster' if ratio > 1 else 'slower'} because "
    f"{ver.acceptance_rate:.0%} of the drafted candidates were kept, "
    f"{ver_bpstep:.2f} bytes per step, and a "
    f"verify step costs {step_cost:.1f} ntp steps.\n"
  )

  thr = None
  for tau in _tau_ladder(args.tau):
    try:
      (_, thr_ntp_bps), (thr, thr_bps) = timed_generate(
        model, args.prompt, args.repeats, ntp_kw, dict(mode="threshold", tau=tau, n=args.n, **kw)
      )
    except Exception as e:  # pylint: disable=broad-except
      print(f"(model.generate failed in threshold mode: {type(e).__name__}: {e})\n")
      return None
    print(f"== multi-byte (threshold, tau={tau}, n={args.n}) [model.generate] ==")
    if thr.acceptance_rate > 0:
      print(args.prompt + thr.texts[0])
      print(_stats_line(thr, thr_bps, args.repeats))
      break
    print(
      f"-- At tau {tau} the multi-byte head was never that sure: nothing accepted, so the text "
      f"is ntp's ({len(thr.ids[0])} bytes in {len(thr.accepted_per_step[0])} steps).\n"
    )
  if thr is not None and thr.acceptance_rate > 0:
    diff = first_difference(ntp.ids[0], thr.ids[0])
    where = "never differs from ntp's" if diff < 0 else f"leaves ntp's at byte {diff}"
    ratio = thr_bps / thr_ntp_bps if thr_ntp_bps > 0 else float("nan")
    thr_bpstep = len(thr.ids[0]) / max(len(thr.accepted_per_step[0]), 1)
    speed = (
      "faster than ntp here"
      if ratio > 1
      else f"still slower than ntp here (a threshold step costs {thr_bpstep / ratio:.1f} ntp steps)"
    )
    print(
      f"-- threshold takes the multi-byte head's guesses unchecked when p >= {tau}: it accepted "
      f"{thr.acceptance_rate:.1%} of them, {thr_bpstep:.2f} bytes per step at {ratio:.2f}x ntp's "
      f"bytes/s, {speed}, and its text {where}: approximate by design, and only as good as "
      "guesses that sure.\n"
    )
  return None


def _reference_sections(model, args):
  """The full-forward reference loop: ntp and threshold (n = 2); verify needs the engine."""
  modes = [("next-byte (ntp)", None)]
  if model.cfg.has_mbp:
    modes.append((f"multi-byte (threshold, tau={args.tau}, n=2)", args.tau))
  for title, tau in modes:
    res = reference_loop(model, args.prompt, args.max_bytes, tau)
    print(f"== {title} [reference loop: full forward per step] ==")
    print(args.prompt + res["text"])
    print(
      f"-- {res['bytes']} bytes in {res['steps']} steps "
      f"({res['bytes'] / max(res['steps'], 1):.2f} bytes/step)\n"
    )
  if model.cfg.has_mbp:
    print("(verify decoding needs the cached engine, lca_jax.decode: skipped)\n")
