"""Row views for the model's per-row products and reductions.

XLA:CPU sends a product reduced over the last axis to a YNNPACK fusion, which runs many times
slower when the array's leading axis is 1 than over the same data with the leading axes
merged. A leading axis of 1 is the batch of a micro-batch of one row (the paper's setting) and
of every tensor-split step, and autodiff adds such reductions for every RMSNorm (the gradients
of its scale and its input), the pooling weights and the attention backward. Computing those on a view with the leading axes merged keeps XLA's
program free of them; values and gradients are the same (docs/design.md §5.3).
"""

from __future__ import annotations

import jax


def merged(x: jax.Array, keep: int = 1) -> jax.Array:
  """``x`` with every axis but its last ``keep`` merged into one: [B, T, ..., D] -> [N, D]."""
  return x.reshape((-1,) + x.shape[x.ndim - keep :])
