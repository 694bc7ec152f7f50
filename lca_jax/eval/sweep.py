"""Quality / throughput sweeps: every checkpoint x mode x tau x n on the same data and machine.

``run_sweep`` writes ``OUT/sweep.json`` (runs, skipped combinations, machine, arguments) and
the plots of :mod:`lca_jax.eval.plots`.  The grid: ``ntp`` runs once per checkpoint;
``threshold`` runs every (tau, n); ``verify`` and ``drafter`` every n (tau does not apply).  A
combination the checkpoint cannot serve (e.g. threshold on a model without a multi-byte head,
n beyond an MLP-MBP model's heads) is recorded under ``skipped`` with the reason.
In ``drafter`` mode the checkpoint verifies and ``--drafter`` drafts (paper Fig. 8).
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
from typing import Any, Dict, List, Optional, Sequence

from lca_jax.eval import plots, tasks

MODES = ("ntp", "threshold", "verify", "drafter")


def grid(modes: Sequence[str], taus: Sequence[float], ns: Sequence[int]) -> List[tuple]:
  """(mode, tau, n) combinations, in a stable order."""
  out = []
  for mode in modes:
    if mode not in MODES:
      raise tasks.TaskError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if mode == "ntp":
      out.append(("ntp", None, 1))
    elif mode == "threshold":
      out += [("threshold", float(t), int(n)) for t in taus for n in ns]
    else:
      out += [(mode, None, int(n)) for n in ns]
  return out


def machine_info() -> Dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  dev = jax.devices()[0]
  return {"backend": jax.default_backend(), "device_kind": dev.device_kind,
          "device_count": jax.device_count(), "python": platform.python_version(),
          "jax": jax.__version__, "machine": platform.machine()}


def _labels(paths: Sequence[str]) -> List[str]:
  base = [os.path.basename(os.path.normpath(p)) or p for p in paths]
  return [b if base.count(b) == 1 else f"{b}#{i}" for i, b in enumerate(base)]


def _jsonable(x):
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  return x


def write_json(obj, path: str) -> str:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(_jsonable(obj), f, indent=1, ensure_ascii=False)
  os.replace(tmp, path)
  return path


def run_sweep(checkpoints: Sequence[str], task: str, data: str, out_dir: str,
              modes: Sequence[str] = ("ntp", "threshold"), taus: Sequence[float] = (0.9,),
              ns: Sequence[int] = (3,), drafter: Optional[str] = None, limit: Optional[int] = None,
              max_bytes: Optional[int] = None, batch_size: int = 1, metric: Optional[str] = None,
              seed: int = 0, progress: bool = True, loader=None) -> Dict[str, Any]:
  """Run the grid and write ``sweep.json`` and the PNGs into ``out_dir``; returns the table."""
  import lca_jax  # pylint: disable=g-import-not-at-top
  from lca_jax.decode.engine import DecodeError  # pylint: disable=g-import-not-at-top
  tasks.check_task(task)
  combos = grid(modes, taus, ns)
  load = loader or lca_jax.load
  models = [load(p) for p in checkpoints]  # fail early on a bad path
  drafter_model = load(drafter) if drafter else None
  max_bytes = int(max_bytes or tasks.DEFAULT_MAX_BYTES[task])
  ctx = min(m.cfg.max_seq_len for m in models + ([drafter_model] if drafter_model else []))
  examples = tasks.load_examples(task, data, limit=limit, max_prompt_bytes=max(16, ctx - max_bytes))
  os.makedirs(out_dir, exist_ok=True)
  runs, skipped = [], []
  bar = None
  if progress:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=len(models) * len(combos), desc=f"sweep {task}", unit="run")
  for path, label, model in zip(checkpoints, _labels(checkpoints), models):
    for mode, tau, n in combos:
      info = {"checkpoint": path, "label": label, "mode": mode, "tau": tau, "n": n}
      if bar is not None:
        bar.set_postfix_str(f"{label} {mode} n={n}" + (f" tau={tau}" if tau is not None else ""))
      if mode == "drafter" and drafter_model is None:
        skipped.append(dict(info, reason="drafter mode needs --drafter"))
      else:
        try:
          r = tasks.run_task(model, task, examples, mode=mode, tau=0.9 if tau is None else tau, n=max(n, 2),
                             max_bytes=max_bytes, batch_size=batch_size,
                             drafter=drafter_model if mode == "drafter" else None, seed=seed, metric=metric,
                             keep_outputs=False)
          r.update(info, tau=tau, n=n)
          runs.append(r)
        except DecodeError as e:
          skipped.append(dict(info, reason=str(e)))
      if bar is not None:
        bar.update(1)
  if bar is not None:
    bar.close()
  result = {
      "task": task, "data": os.path.abspath(data), "examples": len(examples),
      "metric": metric or tasks.HEADLINE[task], "checkpoints": list(checkpoints), "drafter": drafter,
      "grid": {"modes": list(modes), "taus": list(taus), "ns": list(ns)},
      "max_bytes": max_bytes, "batch_size": batch_size, "seed": seed, "machine": machine_info(),
      "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs": runs, "skipped": skipped,
  }
  title = f"{task} ({len(examples)} examples)"
  result["plots"] = {
      "quality_vs_throughput": plots.quality_vs_throughput(
          runs, os.path.join(out_dir, "quality_vs_throughput.png"), title),
      "throughput_vs_n": plots.throughput_vs_n(runs, os.path.join(out_dir, "throughput_vs_n.png"), title),
      "accepted_hist": plots.accepted_hist(runs, os.path.join(out_dir, "accepted_hist.png"), title),
  }
  write_json(result, os.path.join(out_dir, "sweep.json"))
  return result
