"""Quality / throughput sweeps: every checkpoint x mode x tau x n on the same data and machine.

``run_sweep`` writes ``OUT/sweep.json`` (runs, skipped combinations, machine, arguments) and
the plots of :mod:`lca_jax.eval.plots`.  The grid: ``ntp`` runs once per checkpoint;
``threshold`` runs every (tau, n); ``verify`` and ``drafter`` every n (tau does not apply).  A
combination the checkpoint cannot serve (e.g. threshold on a model without a multi-byte head,
n beyond an MLP-MBP model's heads) is recorded under ``skipped`` with the reason.
In ``drafter`` mode the checkpoint verifies and ``--drafter`` drafts (paper Fig. 8).
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any, Dict, List, Optional, Sequence

import jax
from tqdm import tqdm

from lca_jax import api, jsonio
from lca_jax.decode.engine import DecodeError
from lca_jax.decode.policies import POLICIES
from lca_jax.eval import plots, tasks


def grid(modes: Sequence[str], taus: Sequence[float], ns: Sequence[int]) -> List[tuple]:
  """(mode, tau, n) combinations, in a stable order: one per single-byte mode, one per n for
  a multi-byte one, one per (tau, n) where the mode's policy uses tau."""
  out = []
  for mode in modes:
    if mode not in POLICIES:
      raise tasks.TaskError(f"unknown mode {mode!r}; choose from {', '.join(POLICIES)}")
    policy = POLICIES[mode]
    if not policy.multi_byte:
      out.append((mode, None, 1))
    elif policy.uses_tau:
      out += [(mode, float(t), int(n)) for t in taus for n in ns]
    else:
      out += [(mode, None, int(n)) for n in ns]
  return out


def machine_info() -> Dict[str, Any]:
  dev = jax.devices()[0]
  return {
    "backend": jax.default_backend(),
    "device_kind": dev.device_kind,
    "device_count": jax.device_count(),
    "python": platform.python_version(),
    "jax": jax.__version__,
    "machine": platform.machine(),
  }


def _labels(paths: Sequence[str]) -> List[str]:
  base = [os.path.basename(os.path.normpath(p)) or p for p in paths]
  return [b if base.count(b) == 1 else f"{b}#{i}" for i, b in enumerate(base)]


_jsonable = jsonio.jsonable  # NaN / inf -> null (strict JSON)


def check_out_file(path: str) -> str:
  """``path`` can be written as a results file: not a directory, in an existing directory."""
  if os.path.isdir(path):
    raise tasks.TaskError(f"--out {path} is a directory; give a file name for the JSON results")
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    raise tasks.TaskError(f"--out {path}: directory {parent} does not exist")
  return path


def check_out_dir(path: str) -> str:
  """``path`` can hold a sweep's outputs: a directory, or nothing yet (an existing file is
  refused: it would be neither overwritten nor usable)."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise tasks.TaskError(
      f"--out {path} exists and is not a directory (the sweep writes "
      "sweep.json and plots into a directory)"
    )
  return path


def write_json(obj, path: str) -> str:
  """Write ``obj`` as strict JSON (NaN -> null) to ``path`` atomically."""
  tmp = path + ".tmp"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      jsonio.dump(obj, f, indent=1, ensure_ascii=False)
    os.replace(tmp, path)
  except OSError as e:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise tasks.TaskError(f"cannot write {path}: {e.strerror or e}") from None
  return path


def run_sweep(
  checkpoints: Sequence[str],
  task: str,
  data: str,
  out_dir: str,
  modes: Sequence[str] = ("ntp", "threshold"),
  taus: Sequence[float] = (0.9,),
  ns: Sequence[int] = (3,),
  drafter: Optional[str] = None,
  limit: Optional[int] = None,
  max_bytes: Optional[int] = None,
  batch_size: int = 1,
  metric: Optional[str] = None,
  seed: int = 0,
  progress: bool = True,
  loader=None,
) -> Dict[str, Any]:
  """Run the grid and write ``sweep.json`` and the PNGs into ``out_dir``; returns the table."""
  tasks.check_task(task)
  check_out_dir(out_dir)
  combos = grid(modes, taus, ns)
  load = loader or api.load
  models = [load(p) for p in checkpoints]  # fail early on a bad path
  drafter_model = load(drafter) if drafter else None
  max_bytes = int(max_bytes or tasks.DEFAULT_MAX_BYTES[task])
  ctx = min(m.cfg.max_seq_len for m in models + ([drafter_model] if drafter_model else []))
  examples = tasks.load_examples(task, data, limit=limit, max_prompt_bytes=max(16, ctx - max_bytes))
  try:
    os.makedirs(out_dir, exist_ok=True)
  except OSError as e:
    raise tasks.TaskError(f"cannot create --out {out_dir}: {e.strerror or e}") from None
  runs, skipped = [], []
  bar = None
  if progress:
    bar = tqdm(total=len(models) * len(combos), desc=f"sweep {task}", unit="run")
  for path, label, model in zip(checkpoints, _labels(checkpoints), models):
    for mode, tau, n in combos:
      info = {"checkpoint": path, "label": label, "mode": mode, "tau": tau, "n": n}
      if bar is not None:
        bar.set_postfix_str(f"{label} {mode} n={n}" + (f" tau={tau}" if tau is not None else ""))
      uses_drafter = POLICIES[mode].uses_drafter
      if uses_drafter and drafter_model is None:
        skipped.append(dict(info, reason=f"{mode} mode needs --drafter"))
      else:
        try:
          r = tasks.run_task(
            model,
            task,
            examples,
            mode=mode,
            tau=0.9 if tau is None else tau,
            n=n,  # a multi-byte mode refuses n < 2 (listed in skipped), never runs it as 2
            max_bytes=max_bytes,
            batch_size=batch_size,
            drafter=drafter_model if uses_drafter else None,
            seed=seed,
            metric=metric,
            keep_outputs=False,
          )
          r.update(info, tau=tau, n=n)
          runs.append(r)
        except DecodeError as e:
          skipped.append(dict(info, reason=str(e)))
      if bar is not None:
        bar.update(1)
  if bar is not None:
    bar.close()
  result = {
    "task": task,
    "data": os.path.abspath(data),
    "examples": len(examples),
    "metric": metric or tasks.HEADLINE[task],
    "checkpoints": list(checkpoints),
    "drafter": drafter,
    "grid": {"modes": list(modes), "taus": list(taus), "ns": list(ns)},
    "max_bytes": max_bytes,
    "batch_size": batch_size,
    "seed": seed,
    "machine": machine_info(),
    "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    "runs": runs,
    "skipped": skipped,
  }
  title = f"{task} ({len(examples)} examples)"
  result["plots"] = {
    "quality_vs_throughput": plots.quality_vs_throughput(
      runs, os.path.join(out_dir, "quality_vs_throughput.png"), title
    ),
    "throughput_vs_n": plots.throughput_vs_n(
      runs, os.path.join(out_dir, "throughput_vs_n.png"), title
    ),
    "accepted_hist": plots.accepted_hist(runs, os.path.join(out_dir, "accepted_hist.png"), title),
  }
  write_json(result, os.path.join(out_dir, "sweep.json"))
  return result
