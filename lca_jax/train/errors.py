"""The errors training reports to its user.

``TrainError`` is a user-facing problem with a run (bad batch layout, no demo corpus, unwritable
work directory, a ``train.init_from`` that does not match the model); ``NonFiniteLossError`` is
the one ``train_and_evaluate`` raises when the loss or gradient norm stops being finite. Kept in
their own module so the data wiring (``inputs``) and the loop (``loop``) raise the same types.
"""

from __future__ import annotations

from lca_jax.errors import LcaError


class TrainError(LcaError, RuntimeError):
  """A user-facing training problem (bad batch layout, unwritable workdir, ...)."""


class NonFiniteLossError(TrainError):
  """The loss (or gradient norm) became NaN/inf; the run stopped without checkpointing it."""


class MetricsWriteError(TrainError):
  """metrics.jsonl / eval.jsonl could not be appended to (disk full, unwritable): the run stops
  in one line; the checkpoints already written stay valid and a resume drops any torn line."""
