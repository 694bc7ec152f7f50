"""The one base class of every error lca-jax reports to a user.

Each module keeps its own error type (``ConfigError``, ``DataError``, ``CheckpointError``,
``DecodeError``, ...), and each of them derives from ``LcaError`` as well as from the builtin
it has always been (``ValueError`` or ``RuntimeError``), so ``except ValueError`` keeps working
and a CLI catches ``LcaError`` to print one line (exit status 2) instead of a traceback.
This module imports nothing, so any module can use it without an import cycle.
"""


class LcaError(Exception):
  """A problem with the user's input, files or run, reported in one line."""


class LoadError(LcaError, ValueError):
  """A path that ``lca_jax.load`` cannot serve (lives here so that ``train.checkpoint`` can
  raise it without importing ``api``)."""
