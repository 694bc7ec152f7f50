"""The decode-time cache of an attention layer and how one call reads and writes it.

Shapes: B rows, K kv heads, S cache slots, E head dim, T new positions of the call, W slots
of a window.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import flax.struct
import jax


class KVCache(NamedTuple):
  """One attention layer's keys and values, in the layouts a decode step reads without moving
  them (``layers.cached_attention``): k [B, K, S, E], v transposed [B, K, E, S]. The entries of
  one call, before ``layers.write_kv`` stores them, have the same layouts with T slots."""

  k: jax.Array
  v: jax.Array


@flax.struct.dataclass
class CacheAccess:
  """How one decode call uses the cache of every layer of a stack.

  The T new keys and values go to slots ``write_B`` [B] of each row (clamped so that they
  fit). The queries attend every slot under the call's mask [B, T, S], or with ``window_B``
  [B] only the W = mask width slots starting there (clamped likewise; the caller guarantees no
  allowed key lies outside). ``old_slots`` (static, no window): only the first that many slots
  can hold keys written before this call (0: none, the first block of empty caches; None:
  any), the only ones read. ``defer_write`` (static): the layers return the new entries
  instead of the written caches, for ``layers.write_kv`` to store later (a caller that runs
  the step under ``lax.cond`` writes after it: writes inside both branches make XLA copy the
  caches). ``causal`` (static): the call's mask is ``masks.cache_causal_mask`` of the queries'
  positions (decoding's byte and latent stacks), which the decode attention kernel compares
  with the slots instead of reading the mask. ``read_slots`` ([], traced): at run time, how many
  first slots can hold earlier keys (as ``old_slots``); the decode attention kernel reads no
  block past them, the XLA path reads as ``old_slots`` says (the rest is masked out anyway).
  """

  write_B: jax.Array
  window_B: Optional[jax.Array] = None
  read_slots: Optional[jax.Array] = None
  old_slots: Optional[int] = flax.struct.field(pytree_node=False, default=None)
  defer_write: bool = flax.struct.field(pytree_node=False, default=False)
  causal: bool = flax.struct.field(pytree_node=False, default=False)
