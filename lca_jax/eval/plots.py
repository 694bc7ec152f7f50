"""Sweep plots (matplotlib, Agg backend): the paper's Fig. 3, 6 and 7 from a list of run dicts.

* ``quality_vs_throughput.png`` (Fig. 3): quality vs bytes/s, one colour per checkpoint, one
  marker per mode, the Pareto front (no other run has both higher quality and higher
  throughput) drawn as a step line with ringed markers.
* ``throughput_vs_n.png`` (Fig. 6): bytes/s vs n for every (checkpoint, mode, tau) series; ntp
  runs as dashed horizontal lines.
* ``accepted_hist.png`` (Fig. 7): share of decoding steps accepting k multi-byte candidates, for
  the largest-n run of every (checkpoint, mode), with the mean in the legend.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence

MARKERS = {"ntp": "o", "threshold": "*", "verify": "s", "drafter": "D"}


def _plt():
  # lazy: matplotlib is optional (the eval extra), and its backend must be chosen before pyplot
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  return plt


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x)


def pareto_front(points: Sequence[tuple]) -> List[int]:
  """Indices of the (throughput, quality) points no other point dominates (>= in both and >
  in one), sorted by throughput."""
  front = []
  for i, (x, y) in enumerate(points):
    dominated = any(
      (x2 >= x and y2 >= y) and (x2 > x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i
    )
    if not dominated:
      front.append(i)
  return sorted(front, key=lambda i: points[i][0])


def _label(r: Dict) -> str:
  s = r["mode"]
  if r["mode"] == "threshold":
    s += f" τ={r['tau']:g} n={r['n']}"
  elif r["mode"] != "ntp":
    s += f" n={r['n']}"
  return s


def _empty(ax, msg):
  ax.text(0.5, 0.5, msg, ha="center", va="center", transform=ax.transAxes)
  ax.set_xticks([])
  ax.set_yticks([])


def quality_vs_throughput(runs: Sequence[Dict], path: str, title: str = "") -> str:
  plt = _plt()
  runs = [r for r in runs if _finite(r.get("bytes_per_s")) and _finite(r.get("quality"))]
  fig, ax = plt.subplots(figsize=(7, 5))
  if not runs:
    _empty(ax, "no finished runs")
  else:
    labels = list(dict.fromkeys(r["label"] for r in runs))
    colors = {lab: plt.cm.tab10(i % 10) for i, lab in enumerate(labels)}
    pts = [(r["bytes_per_s"], r["quality"]) for r in runs]
    for r, (x, y) in zip(runs, pts):
      ax.scatter(
        [x],
        [y],
        marker=MARKERS.get(r["mode"], "o"),
        s=120 if r["mode"] == "threshold" else 60,
        color=colors[r["label"]],
        zorder=3,
      )
      ax.annotate(_label(r), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    front = pareto_front(pts)
    fx, fy = [pts[i][0] for i in front], [pts[i][1] for i in front]
    ax.step(fx, fy, where="post", color="black", lw=1, ls="--", zorder=2, label="Pareto front")
    ax.scatter(fx, fy, s=260, facecolors="none", edgecolors="black", zorder=4)
    for lab in labels:
      ax.scatter([], [], color=colors[lab], label=lab)
    for mode in dict.fromkeys(r["mode"] for r in runs):
      ax.scatter([], [], color="gray", marker=MARKERS.get(mode, "o"), label=mode)
    ax.legend(fontsize=8)
    ax.set_xlabel("throughput (bytes/s)")
    ax.set_ylabel(runs[0].get("metric", "quality"))
    ax.grid(alpha=0.3)
  ax.set_title(title or "quality vs throughput")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def throughput_vs_n(runs: Sequence[Dict], path: str, title: str = "") -> str:
  plt = _plt()
  fig, ax = plt.subplots(figsize=(7, 5))
  runs = [r for r in runs if _finite(r.get("bytes_per_s"))]
  series: Dict[tuple, List] = {}
  for r in runs:
    if r["mode"] != "ntp":
      key = (r["label"], r["mode"], r.get("tau") if r["mode"] == "threshold" else None)
      series.setdefault(key, []).append((r["n"], r["bytes_per_s"]))
  if not series:
    _empty(ax, "no multi-byte runs")
  else:
    for (lab, mode, tau), pts in series.items():
      pts.sort()
      name = f"{lab} {mode}" + (f" τ={tau:g}" if tau is not None else "")
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=MARKERS.get(mode, "o"), label=name)
    for r in runs:
      if r["mode"] == "ntp":
        ax.axhline(r["bytes_per_s"], ls="--", lw=1, color="gray")
        ax.annotate(
          f"{r['label']} ntp",
          (ax.get_xlim()[0], r["bytes_per_s"]),
          fontsize=7,
          textcoords="offset points",
          xytext=(2, 2),
        )
    ax.set_xlabel("candidate bytes n")
    ax.set_ylabel("throughput (bytes/s)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  ax.set_title(title or "throughput vs n")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def accepted_hist(runs: Sequence[Dict], path: str, title: str = "") -> str:
  plt = _plt()
  fig, ax = plt.subplots(figsize=(7, 5))
  best: Dict[tuple, Dict] = {}
  for r in runs:
    if r["mode"] == "ntp" or not r.get("accepted_hist"):
      continue
    key = (r["label"], r["mode"])
    if key not in best or r["n"] > best[key]["n"]:
      best[key] = r
  if not best:
    _empty(ax, "no multi-byte runs")
  else:
    width = 0.8 / len(best)
    for i, ((lab, mode), r) in enumerate(best.items()):
      hist = {int(k): v for k, v in r["accepted_hist"].items()}
      total = sum(hist.values())
      ks = list(range(0, max(max(hist), r["max_candidates"]) + 1))
      frac = [hist.get(k, 0) / total for k in ks]
      mean = sum(k * v for k, v in hist.items()) / total
      name = f"{lab} {_label(r)} (mean {mean:.2f})"
      ax.bar([k + (i - (len(best) - 1) / 2) * width for k in ks], frac, width=width, label=name)
    ax.set_xlabel("accepted candidate bytes per step")
    ax.set_ylabel("share of steps")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
  ax.set_title(title or "accepted bytes per step")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
