"""The data package's error types and its bad-record marker, shared by readers and sources.

``DataError`` is a clear, user-facing data problem (missing files, corrupt shard, malformed
example); ``SourceNotFoundError`` is the one raised when the data source itself does not exist
(never skipped as a bad shard); ``BadShardWarning`` names a shard skipped because it could not
be read. A bad record is not raised: readers return a ``Skipped`` marker (its reason one of
``SKIP_REASONS``) that the pipelines drop and count. Kept apart so that
:mod:`lca_jax.data.readers` and :mod:`lca_jax.data.sources` share them without importing each
other.
"""

from __future__ import annotations

import dataclasses

from lca_jax.errors import LcaError

SKIP_REASONS = ("not_string", "empty", "undecodable", "bad_json", "unreadable")


class DataError(LcaError, RuntimeError):
  """Clear, user-facing data problem (missing files, corrupt shard, ...)."""


class SourceNotFoundError(DataError):
  """The data source itself does not exist (never skipped, whatever on_bad_shard says)."""


class BadShardWarning(UserWarning):
  """A shard was skipped because it could not be read."""


@dataclasses.dataclass(frozen=True)
class Skipped:
  """Marker standing in for a bad record; ``reason`` is one of SKIP_REASONS."""

  reason: str
