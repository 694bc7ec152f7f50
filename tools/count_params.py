"""Print parameter counts of config files as JSON (no weights are materialised).

python tools/count_params.py configs/lca_mbp.py configs/fxt.py ...   (default: the 5 paper configs)

A config file that cannot be loaded or whose model cannot be built is reported in one line
(exit status 2).
"""

import argparse
import json
import os
import sys

import jax

from lca_jax import configs_io
from lca_jax.errors import LcaError
from lca_jax.model.config import ModelConfig
from lca_jax.model.hierarchical import count_params, init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PAPER = [
  "configs/llamabyte.py",
  "configs/spacebyte.py",
  "configs/fxt.py",
  "configs/mlp_mbp.py",
  "configs/lca_mbp.py",
]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("configs", nargs="*", help="config files (default: the 5 paper configs)")
  args = ap.parse_args(argv)
  try:
    counts = _counts(args.configs) if args.configs else _counts(PAPER, root=ROOT)
  except LcaError as e:  # a config file that does not load, a model that cannot be built
    print(f"count_params: error: {e}", file=sys.stderr)
    return 2
  ref = max(counts.values())
  print(
    json.dumps(
      {
        "params": counts,
        "millions": {k: round(v / 1e6, 2) for k, v in counts.items()},
        "max_rel_diff": round((ref - min(counts.values())) / ref, 4),
      },
      indent=1,
    )
  )
  return 0


def _counts(paths, root: str = "") -> dict:
  """{path: parameter count}; ``root``: the folder ``paths`` are relative to (the paper configs
  are named relative to the repository root, wherever this runs from)."""
  counts = {}
  for p in paths:
    config = configs_io.load_config(os.path.join(root, p))
    if "model" not in config:
      raise configs_io.ConfigFileError(f"{p}: the config has no model section")
    cfg = ModelConfig.from_dict(config.model.to_dict())
    shapes = jax.eval_shape(lambda c=cfg: init_params(c, jax.random.PRNGKey(0)))
    counts[p] = count_params(shapes)
  return counts


if __name__ == "__main__":
  sys.exit(main())
