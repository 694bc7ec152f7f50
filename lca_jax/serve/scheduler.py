"""Continuous batching: requests in and out of decode slots (``decode.batch.SlotBatch``), one
thread.

A request's choices (prompts x ``n``) become ``Job``s in a bounded FIFO queue (``submit``
refuses past ``max_queue`` waiting jobs: the app answers 429). The scheduler thread loops:
admit waiting jobs into free slots (a prefill each; a long prompt one piece per turn, see
``SlotBatch.prefill_step``), then run one decode chunk (``chunk_steps`` steps) of each batch
that has active rows, deliver the bytes each row committed, finish rows
(eos, their byte budget, a stop string, ``request_timeout``) and free the slots of finished and
cancelled jobs (a client that disconnected) before the next chunk, where new jobs join.

Rows of one batch share a ``batch.GroupKey`` (mode, n); everything else (greedy or sampled,
temperature, top-k, top-p, tau, seed, budget, stop strings, log-probabilities) is per row, so
greedy and sampled requests decode together. Requests of different groups run in separate
batches, one chunk each in turn; at most ``max_groups`` batches exist at a time (an idle one is
dropped for a new group; a job whose group cannot get a batch waits). At most ``slots`` jobs
decode at once, across all batches: each batch has that many slots. A job takes the lowest free
slot of its batch, so that a chunk decodes as few slots as it can (``batch.widths``).

A job reports to its ``sink`` (called from this thread): ``("delta", (text, logprobs))`` for
new text (never a split UTF-8 character, never the start of a stop string that may still
complete) and, when the job asked for them, the ``TokenLogprob``s of the ids that text
completes (else None), then ``("end", info)`` or ``("error", ServeError)``. A stop string ends
the row at once (its slot is freed before the next chunk), and ``info`` counts only the ids
returned (before the stop string).
"""

from __future__ import annotations

import codecs
import collections
import math
import sys
import threading
import time
import traceback
from typing import Callable, List, NamedTuple, Optional, Sequence

import numpy as np

from lca_jax import vocab
from lca_jax.decode.batch import GroupKey, RowParams, SlotBatch
from lca_jax.serve.metrics import Metrics
from lca_jax.serve.schema import ServeError


class TokenLogprob(NamedTuple):
  """One returned id, its log-probability, and the most likely ids of its step."""

  id: int
  logprob: float
  top: tuple  # ((id, logprob), ...) best first


class Job:
  """One choice of a request: a prompt decoded in one slot, its text and its counters.
  ``logprobs``: alternatives per returned id (None: no log-probabilities)."""

  def __init__(
    self,
    prompt_ids: np.ndarray,
    group: GroupKey,
    row: RowParams,
    stops: Sequence[str],
    sink: Callable,
    deadline: float = math.inf,
    logprobs: Optional[int] = None,
  ):
    self.prompt_ids, self.group, self.row = prompt_ids, group, row
    self.stops = tuple(stops)
    self.hold = max((len(s) for s in self.stops), default=1) - 1  # chars a stop may have begun
    self.sink, self.deadline, self.logprobs = sink, deadline, logprobs
    self.t0 = time.monotonic()
    self.t_last: Optional[float] = None  # when bytes were last delivered
    self.cancelled = False  # set by the app (client gone); the slot is freed before next chunk
    self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    self.text, self.sent = "", 0
    # per id pushed: the id, its TokenLogprob (or None), the text's length after it, and
    # whether that text holds all of its bytes (no UTF-8 character left open)
    self.ids: List[int] = []
    self.lps: List[Optional[TokenLogprob]] = []
    self._char_end: List[int] = []
    self._whole: List[bool] = []
    self.n_returned = 0  # ids whose text has been sent
    self.steps = self.n_cand = self.n_acc = 0
    self.first_byte_s: Optional[float] = None
    self.finished = False

  def cancel(self):
    self.cancelled = True

  def _emit(self, kind, data):
    try:
      self.sink(kind, data)
    except RuntimeError:  # the app's event loop is closed: nobody listens
      self.cancelled = True

  def _released(self, chars: int) -> int:
    """Ids whose bytes all lie within the first ``chars`` characters of the text."""
    k = self.n_returned
    for j in range(self.n_returned, len(self.ids)):
      if self._char_end[j] > chars:
        break
      if self._whole[j]:
        k = j + 1
    return k

  def push(self, ids: List[int], final: bool, lps=None) -> Optional[str]:
    """Take newly committed ids (and their ``TokenLogprob``s); emit the text that is safe to
    send. Returns "stop" when a stop string ended the text (cut before it), else None."""
    for k, i in enumerate(ids):
      self.ids.append(i)
      self.lps.append(lps[k] if lps is not None else None)
      self.text += self._utf8.decode(vocab.ids_to_bytes([i]), final=False)
      self._char_end.append(len(self.text))
      self._whole.append(self._utf8.getstate()[0] == b"")
    if final:
      self.text += self._utf8.decode(b"", final=True)
      if self.ids:
        self._char_end[-1], self._whole[-1] = len(self.text), True
    safe = len(self.text)
    hit = None
    if self.stops:
      found = [p for p in (self.text.find(s, self.sent) for s in self.stops) if p >= 0]
      if found:
        hit = min(found)
        self.text = self.text[:hit]
        safe = hit
      elif not final:
        safe = max(self.sent, len(self.text) - self.hold)
    k = len(self.ids) if final and hit is None else self._released(safe)
    if safe > self.sent or (k > self.n_returned and self.logprobs is not None):
      lps_out = self.lps[self.n_returned : k] if self.logprobs is not None else None
      self._emit("delta", (self.text[self.sent : safe], lps_out))
      self.sent = safe
    self.n_returned = k
    return "stop" if hit is not None else None

  def end(self, reason: str):
    self.finished = True
    kept = self.ids[: self.n_returned]
    info = dict(
      finish_reason=reason,
      completion_tokens=len(kept),
      completion_bytes=int(np.sum(vocab.is_byte_id(kept))) if kept else 0,
      steps=self.steps,
      candidates=self.n_cand,
      accepted=self.n_acc,
    )
    self._emit("end", info)

  def fail(self, err: ServeError):
    self.finished = True
    self._emit("error", err)


class _Group:
  def __init__(self, batch: SlotBatch):
    self.batch = batch
    self.jobs: List[Optional[Job]] = [None] * batch.batch
    self.last_used = time.monotonic()

  @property
  def n_active(self) -> int:
    return sum(j is not None for j in self.jobs)

  def active(self) -> np.ndarray:
    """The slots that decode: a job's, its prompt wholly prefilled."""
    staged = self.batch.staged
    return np.array([j is not None and i not in staged for i, j in enumerate(self.jobs)], bool)


class Scheduler:
  """The decode loop of one model; ``submit`` jobs from any thread."""

  def __init__(
    self,
    model,
    slots: int,
    context: int,
    chunk_steps: int = 8,
    max_queue: int = 64,
    max_groups: int = 4,
    metrics: Optional[Metrics] = None,
  ):
    self.model, self.slots, self.context = model, slots, context
    self.chunk_steps, self.max_queue, self.max_groups = chunk_steps, max_queue, max_groups
    self.metrics = metrics or Metrics(slots)
    self._groups: "collections.OrderedDict[GroupKey, _Group]" = collections.OrderedDict()
    self._pending: collections.deque = collections.deque()
    self._cv = threading.Condition()
    self._stop = False
    self._thread: Optional[threading.Thread] = None
    self.n_active = 0
    self.error: Optional[str] = None  # why the loop died, if it did

  # ---- public --------------------------------------------------------------------------------
  def warm(self, group: GroupKey, sampled: bool = True):
    """Build ``group``'s batch and compile its programs for every prompt bucket: the greedy
    one and (``sampled``) the sampled one."""
    self._group(group).batch.warm(self.chunk_steps, sampled)

  def start(self):
    self._thread = threading.Thread(target=self._run, name="lca-serve-decode", daemon=True)
    self._thread.start()

  def stop(self):
    with self._cv:
      self._stop = True
      self._cv.notify_all()
    if self._thread is not None:
      self._thread.join(timeout=30)

  @property
  def alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive() and not self._stop

  @property
  def queued(self) -> int:
    return len(self._pending)

  def submit(self, jobs: Sequence[Job]):
    """Queue ``jobs`` (all or none): 503 when the loop is not running, 429 when the queue
    would pass ``max_queue``."""
    with self._cv:
      if not self.alive:
        self.metrics.rejected.labels("unavailable").inc()
        raise ServeError("the server is not decoding (shutting down or failed)", 503)
      if len(self._pending) + len(jobs) > self.max_queue:
        self.metrics.rejected.labels("queue_full").inc()
        raise ServeError(
          f"the server is overloaded ({len(self._pending)} choices waiting for "
          f"{self.slots} slots); retry later",
          429,
          code="overloaded",
          kind="rate_limit_error",
        )
      self._pending.extend(jobs)
      self.metrics.waiting.set(len(self._pending))
      self._cv.notify_all()

  # ---- the loop --------------------------------------------------------------------------------
  def _run(self):
    try:
      while True:
        with self._cv:
          while not self._stop and not self._pending and not self.n_active:
            self._cv.wait(0.5)
          if self._stop:
            break
        self._admit()
        for g in list(self._groups.values()):
          if g.batch.staged:  # one piece of a long prompt between two chunks
            g.batch.prefill_step()
          if g.n_active:
            self._chunk(g)
            self._admit()
    except Exception:  # noqa: BLE001 - the loop must report, not vanish
      self.error = traceback.format_exc()
      print(f"lca-serve: decode loop failed:\n{self.error}", file=sys.stderr, flush=True)
      self._fail_all(ServeError("the decode loop failed; see the server log", 500))
      with self._cv:
        self._stop = True

  def _fail_all(self, err: ServeError):
    with self._cv:
      jobs = list(self._pending)
      self._pending.clear()
    for g in self._groups.values():
      jobs += [j for j in g.jobs if j is not None]
      g.jobs = [None] * len(g.jobs)
    self.n_active = 0
    for j in jobs:
      j.fail(err)

  def _group(self, key: GroupKey) -> Optional[_Group]:
    """``key``'s batch, built if needed (dropping an idle batch past ``max_groups``); None
    when every batch is busy."""
    g = self._groups.get(key)
    if g is None:
      if len(self._groups) >= self.max_groups:
        idle = [k for k, x in self._groups.items() if not x.n_active]
        if not idle:
          return None
        del self._groups[min(idle, key=lambda k: self._groups[k].last_used)]
      batch = SlotBatch(self.model, key, self.slots, self.context, self._compiled)
      g = self._groups[key] = _Group(batch)
    g.last_used = time.monotonic()
    return g

  def _compiled(self, group, name, seconds):
    self.metrics.compiles.inc()
    print(f"lca-serve: compiled {name} for {group} in {seconds:.1f} s", file=sys.stderr)

  def _admit(self):
    """Move waiting jobs into free slots (FIFO; a job whose group has no batch yet, with every
    batch busy, waits while later ones go), dropping cancelled and timed-out ones; the jobs of
    one batch are prefilled together (``SlotBatch.admit_many``)."""
    now = time.monotonic()
    taken = {}  # group -> [(slot, job)]
    while True:
      missing = None  # a group to build a batch for, outside the lock (it compiles)
      with self._cv:
        for j in list(self._pending):
          if j.cancelled or j.deadline <= now:
            self._pending.remove(j)
            if not j.cancelled:
              j.fail(ServeError("the request timed out waiting for a slot", 504, code="timeout"))
            continue
          if self.n_active >= self.slots:
            break
          if not self._group_room(j.group):
            continue
          if j.group not in self._groups:
            missing = j.group
            break
          g = self._group(j.group)
          self.metrics.queue_time.observe(now - j.t0)
          i = g.jobs.index(None)
          g.jobs[i] = j  # the slot is the job's from now on
          taken.setdefault(j.group, []).append((i, j))
          self.n_active += 1
          self._pending.remove(j)
        self.metrics.waiting.set(len(self._pending))
      if missing is None:
        break
      self._group(missing)
    self.metrics.running.set(self.n_active)
    for key, entries in taken.items():
      self._groups[key].batch.admit_many([(i, j.prompt_ids, j.row) for i, j in entries])

  def _group_room(self, key: GroupKey) -> bool:
    g = self._groups.get(key)
    if g is not None:
      return g.n_active < len(g.jobs)
    return len(self._groups) < self.max_groups or any(not x.n_active for x in self._groups.values())

  def _free(self, g: _Group, i: int):
    g.jobs[i] = None
    g.batch.discard(i)
    self.n_active -= 1
    self.metrics.running.set(self.n_active)

  def _chunk(self, g: _Group):
    now = time.monotonic()
    for i, j in enumerate(g.jobs):  # cancelled and timed-out rows leave before the chunk
      if j is None:
        continue
      if j.cancelled:
        self._free(g, i)
      elif j.deadline <= now:
        j.fail(ServeError("the request timed out", 504, code="timeout"))
        self._free(g, i)
    active = g.active()
    if not active.any():
      return
    c = g.batch.decode(self.chunk_steps, active)
    now = time.monotonic()
    n_bytes = cand = acc = 0
    for i, j in enumerate(g.jobs[: c.width]):
      if not active[i]:
        continue
      a = c.a_Kw[: c.steps, i]
      ids, lps = [], [] if j.logprobs is not None else None
      for k in range(c.steps):
        for x in c.d_KwW[k, i, : a[k]]:
          ids.append(int(x))
          if lps is not None:  # ntp: one byte per step
            top = zip(c.top_ids_KwT[k, i, : j.logprobs], c.top_lp_KwT[k, i, : j.logprobs])
            pairs = tuple((int(t), float(v)) for t, v in top)
            lps.append(TokenLogprob(int(x), float(c.lp_Kw[k, i]), pairs))
      n_bytes += len(ids)
      j.steps += int(np.sum(a > 0))
      cand += int(c.n_cand_w[i]) - j.n_cand
      acc += int(c.n_acc_w[i]) - j.n_acc
      j.n_cand, j.n_acc = int(c.n_cand_w[i]), int(c.n_acc_w[i])
      if ids:
        if j.first_byte_s is None:
          j.first_byte_s = now - j.t0
          self.metrics.ttfb.observe(j.first_byte_s)
          if len(ids) > 1:
            self.metrics.record_bytes(len(ids) - 1, 0.0)
        else:
          self.metrics.record_bytes(len(ids), now - j.t_last)
        j.t_last = now
      done = bool(c.done_w[i])
      if j.cancelled:
        self._free(g, i)
        continue
      stopped = j.push(ids, final=done, lps=lps)
      if stopped or done:
        eos = bool(ids) and ids[-1] == vocab.EOS_ID and not j.row.ignore_eos
        j.end("stop" if stopped or eos else "length")
        self.metrics.e2e.observe(now - j.t0)
        self._free(g, i)
    self.metrics.record_chunk(
      g.batch.group.mode,
      n_bytes,
      int(np.sum(c.a_Kw[: c.steps] > 0)),
      cand,
      acc,
      int(active.sum()),
      c.width,
    )
