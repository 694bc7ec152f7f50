"""Loss curve of an lca-train work directory: bits per byte vs step, both heads (PNG).

    from lca_jax.eval import curves
    path = curves.write_loss_curve("workdirs/demo")  # -> workdirs/demo/loss_curve.png

Reads ``metrics.jsonl`` (training: each line is the mean since the previous logged step, with
Gumbel-sampled boundaries) and ``eval.jsonl`` (held-out, inference boundaries) as written by
``lca_jax.train.metrics``, and draws ``bpb_ntp`` (next-byte head) and ``bpb_mbp`` (multi-byte
head) of both: training as lines, held-out as markers. matplotlib (Agg backend) is imported
only when a plot is drawn.
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional

HEADS = (
  ("bpb_ntp", "next-byte (NT) head", "tab:blue"),
  ("bpb_mbp", "multi-byte (MBP) head", "tab:orange"),
)


def read_jsonl(path: str) -> List[Dict]:
  """The JSON objects of a jsonl file, skipping blank or unreadable lines ([] if missing)."""
  if not os.path.isfile(path):
    return []
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        row = json.loads(line)
      except ValueError:
        continue  # a line cut by an interrupted writer
      if isinstance(row, dict) and "step" in row:
        rows.append(row)
  return rows


def _series(rows: List[Dict], key: str):
  pts = [
    (int(r["step"]), float(r[key]))
    for r in rows
    if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
  ]
  pts.sort()
  return [p[0] for p in pts], [p[1] for p in pts]


def write_loss_curve(workdir: str, out: Optional[str] = None) -> str:
  """Draws the curve of ``workdir`` into ``out`` (default WORKDIR/loss_curve.png); returns the
  path. Raises FileNotFoundError when the directory has no metrics.jsonl / eval.jsonl rows."""
  train = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  held = read_jsonl(os.path.join(workdir, "eval.jsonl"))
  if not train and not held:
    raise FileNotFoundError(f"no metrics.jsonl or eval.jsonl rows in {workdir}")
  out = out or os.path.join(workdir, "loss_curve.png")

  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
  for key, name, color in HEADS:
    x, y = _series(train, key)
    if x:
      ax.plot(x, y, color=color, alpha=0.6, lw=1.2, label=f"{name}, training")
    x, y = _series(held, key)
    if x:
      ax.plot(x, y, color=color, marker="o", lw=2, label=f"{name}, held-out")
      ax.annotate(f"{y[-1]:.2f}", (x[-1], y[-1]), textcoords="offset points", xytext=(4, 4))
  ax.set_xlabel("optimizer step")
  ax.set_ylabel("bits per byte")
  ax.set_title(f"{os.path.basename(os.path.normpath(workdir))}: bits per byte vs step")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out)
  plt.close(fig)
  return out
