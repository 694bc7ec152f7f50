"""Decode requests that end at stop strings, a fixed batch of slots at a time.

``decode_until`` runs ``Model.generate`` on up to ``batch`` rows at once, ``chunk`` bytes per
call: after each call a row whose decoded text contains one of its stop strings (or that hit
eos, its byte budget or the context) is finished, and its slot takes the next waiting request,
so a row that stops early costs at most one chunk past its stop string, not its whole budget.
A call continues a row from its prompt plus the bytes it has so far (a fresh prefill). Rows
without stop strings decode their whole budget in one call. The text of a row is cut before the
first stop string it contains.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, List, Optional, Sequence

import numpy as np

from lca_jax import vocab


@dataclasses.dataclass
class Request:
  """One generation: prompt ids, stop strings and byte budget; filled in by ``decode_until``."""

  prompt: np.ndarray
  until: Sequence[str]
  budget: int
  generated: List[int] = dataclasses.field(default_factory=list)
  done: bool = False
  text: str = ""

  def stop_at(self, text: str) -> Optional[int]:
    """Where the first stop string in ``text`` starts (None if none)."""
    hits = [text.find(s) for s in self.until if s and s in text]
    return min(hits) if hits else None

  def take(self, ids: np.ndarray, stopped: bool) -> None:
    """Append the bytes of one call (``stopped``: the engine ended the row: eos or context)."""
    ids = [int(x) for x in ids[: self.budget - len(self.generated)]]
    if vocab.EOS_ID in ids:
      ids = ids[: ids.index(vocab.EOS_ID) + 1]
      stopped = True
    self.generated.extend(ids)
    text = vocab.decode(np.asarray(self.generated, np.int32), stop_at_eos=True)
    cut = self.stop_at(text)
    self.text = text if cut is None else text[:cut]
    self.done = stopped or cut is not None or len(self.generated) >= self.budget or not ids


def decode_until(
  generate: Callable,
  requests: Sequence[Request],
  batch: int,
  chunk: int,
) -> Sequence[Request]:
  """Fill in ``requests`` (in place; also returned). ``generate(prompts, max_bytes, real)``
  runs one ``Model.generate`` call on a list of exactly ``batch`` prompts, of which the first
  ``real`` are requests (the rest copies of the first)."""
  waiting = collections.deque(r for r in requests if not r.done)
  active: List[Request] = []
  while waiting or active:
    while waiting and len(active) < batch:
      active.append(waiting.popleft())
    left = max(r.budget - len(r.generated) for r in active)
    step = min(chunk, left) if any(r.until for r in active) else left
    prompts = [np.concatenate([r.prompt, np.asarray(r.generated, np.int32)]) for r in active]
    prompts += [prompts[0]] * (batch - len(prompts))
    res = generate(prompts, step, len(active))
    reasons = getattr(res, "stop_reasons", None) or [""] * len(active)
    for r, req in enumerate(active):
      req.take(res.ids[r], reasons[r] in ("eos", "context"))
    active = [r for r in active if not r.done]
  return requests
