"""Print parameter counts of config files as JSON (no weights are materialised).

python tools/count_params.py configs/lca_mbp.py configs/fxt.py ...   (default: the 5 paper configs)
"""

import json
import sys

import jax

from lca_jax import configs_io
from lca_jax.model.config import ModelConfig
from lca_jax.model.hierarchical import count_params, init_params

PAPER = [
  "configs/llamabyte.py",
  "configs/spacebyte.py",
  "configs/fxt.py",
  "configs/mlp_mbp.py",
  "configs/lca_mbp.py",
]


def main(argv):
  paths = argv or PAPER
  counts = {}
  for p in paths:
    cfg = ModelConfig.from_dict(configs_io.load_config(p).model.to_dict())
    shapes = jax.eval_shape(lambda c=cfg: init_params(c, jax.random.PRNGKey(0)))
    counts[p] = count_params(shapes)
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


if __name__ == "__main__":
  main(sys.argv[1:])
