"""LCA-masked attention kernels (depends only on ``jax``).

Public API:

* ``lca_attention(q, k, v, segment_ids, *, doc_ids=None, impl="xla"|"pallas", ...)``
  (``impl="pallas"`` under a multi-device ``jax.set_mesh`` runs per device in a
  ``jax.shard_map``: see ``sharded``)
* ``lca_mask(segment_ids, doc_ids=None)`` -> bool [B, T, T] (set definition)
* ``lca_key_start(segment_ids, doc_ids=None)`` -> int32 [B, T]
* ``lca_attention_reference(...)``: the dense XLA oracle.
"""

from .lca_attention import lca_attention
from .reference import lca_attention_reference, lca_key_start, lca_mask

__all__ = ["lca_attention", "lca_attention_reference", "lca_key_start", "lca_mask"]
