"""The hooks of the training loop (train/loop.py): small objects with one job each.

The loop dispatches a step and hands ``(step, state, device metrics)`` to ``StepHooks``, which
runs the hooks in a fixed order (``step`` counts completed optimizer steps, from 1):

  1. ``LateFetch`` keeps the step's device metrics and fetches the previous step's, so the host
     never waits on the step it just dispatched; it hands ``(step, host metrics)`` to
     ``FiniteCheck`` (a non-finite loss or grad norm raises ``NonFiniteLossError``),
     ``Console.step_done`` (the progress bar) and ``MetricsWindow`` (averages since the last
     log line, throughput and MFU, handed to ``MetricsWriter.write_train`` and
     ``Console.train_line``).
  2. ``stop.agreed()``: whether any process was asked to stop (train/stop.py).
  3. The periodic actions due at this step, ``PeriodicEval`` then ``PeriodicCheckpoint`` (also
     at the last step and when stopping); before them the held metrics are fetched, so a
     non-finite loss at this step raises before the step is checkpointed. ``WatchdogHook``
     pauses the watchdog during the first eval and the first checkpoint (compiles, one-time
     setup), and their time is not counted as step time (``MetricsWindow.reset_clock``).
  4. ``WatchdogHook.after_step``: arms the watchdog after the first step (its compile is not
     counted) and records progress after every later one.
  5. When stopping: the console says so and ``after_step`` returns True (the loop ends).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import jax
import numpy as np

from lca_jax.train.errors import NonFiniteLossError

Sink = Callable[[int, dict], Any]  # (step, values) -> ignored


# ---- train metrics --------------------------------------------------------------------------
class LateFetch:
  """Holds each step's device metrics until the next step is dispatched (or ``flush``), then
  fetches them as floats and hands ``(step, metrics)`` to ``consumers`` in order."""

  def __init__(self, consumers: Sequence[Sink]):
    self.consumers = list(consumers)
    self._pending = None

  def push(self, step: int, device_metrics) -> None:
    self.flush()
    self._pending = (step, device_metrics)

  def flush(self) -> None:
    if self._pending is None:
      return
    step, device_metrics = self._pending
    self._pending = None
    m = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    for consumer in self.consumers:
      consumer(step, m)


class FiniteCheck:
  """Raises ``NonFiniteLossError`` at the first step whose loss or grad norm is not finite;
  ``last_checkpoint()``: the step of the newest checkpoint (None: none), for the message."""

  def __init__(self, last_checkpoint: Callable[[], Optional[int]]):
    self.last_checkpoint = last_checkpoint

  def __call__(self, step: int, m: dict) -> None:
    if math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]):
      return
    last = self.last_checkpoint()
    raise NonFiniteLossError(
      f"non-finite loss at step {step} (loss={m['loss']}, grad_norm={m['grad_norm']}); "
      f"stopped without checkpointing it (last checkpoint: "
      f"{'step ' + str(last) if last is not None else 'none'}). "
      "Try a lower optim.lr, more optim.warmup_steps or float32 compute."
    )


class MetricsWindow:
  """Collects each step's metrics; at step 1, every ``log_every`` steps and at ``total`` hands
  their mean since the previous log line (``lr``: this step's) plus ``step_time``,
  ``bytes_per_s``, ``tflops_per_device``, ``mfu`` (None without a peak) and
  ``skipped_records`` to ``sinks``. Step time is wall time since the previous log line or
  ``reset_clock`` (eval and checkpoint time is not step time) over the steps in between. The
  run's first step (``start + 1``: compile and first run) is not step time: the clock starts
  after it, and a line at it has None for the four timing figures.

  ``flops(bytes_per_latent)``: model FLOPs of one step; ``peak_flops``: per device (None or 0:
  unknown); ``skipped_records()``: bad records skipped so far."""

  def __init__(
    self,
    *,
    start: int,
    total: int,
    log_every: int,
    bytes_per_step: int,
    flops: Callable[[Optional[float]], float],
    n_devices: int,
    peak_flops: Optional[float],
    skipped_records: Callable[[], int],
    sinks: Sequence[Sink],
    clock: Callable[[], float] = time.perf_counter,
  ):
    self.total, self.log_every = total, max(1, log_every)
    self.bytes_per_step, self.flops = bytes_per_step, flops
    self.n_devices, self.peak_flops = n_devices, peak_flops
    self.skipped_records, self.sinks, self.clock = skipped_records, list(sinks), clock
    self.last: dict = {}  # the last line handed to the sinks, with its step
    self._window: list = []
    self._first = start + 1
    self.reset_clock(start)

  def reset_clock(self, step: int) -> None:
    self._t_mark, self._n_mark = self.clock(), step

  def __call__(self, step: int, m: dict) -> None:
    self._window.append(m)
    first = step == self._first
    if first:  # compile + first run: the clock starts after it
      self._t_mark, self._n_mark = self.clock(), step
    if not (step == 1 or step % self.log_every == 0 or step == self.total):
      return
    now = self.clock()
    window = self._window
    avg = {k: float(np.mean([w[k] for w in window if k in w])) for k in window[-1] if k != "lr"}
    avg["lr"] = m["lr"]
    timing = dict.fromkeys(("step_time", "bytes_per_s", "tflops_per_device", "mfu"))
    avg.update(timing if first else self._timing(now, step, avg.get("bytes_per_latent")))
    avg["skipped_records"] = self.skipped_records()
    for sink in self.sinks:
      sink(step, avg)
    self.last = dict(avg, step=step)
    self._window = []
    self._t_mark, self._n_mark = now, step

  def _timing(self, now: float, step: int, bytes_per_latent: Optional[float]) -> dict:
    """Step time, bytes/s, TFLOP/s per device and MFU since the clock's mark."""
    step_time = (now - self._t_mark) / max(step - self._n_mark, 1)
    flops = self.flops(bytes_per_latent)
    return dict(
      step_time=step_time,
      bytes_per_s=self.bytes_per_step / step_time,
      tflops_per_device=flops / step_time / self.n_devices / 1e12,
      mfu=(flops / step_time / (self.n_devices * self.peak_flops)) if self.peak_flops else None,
    )


class Console:
  """What a run shows on the console (process 0): a ``metrics.Progress`` bar ticked per step
  with the last log line's loss / bpb / throughput as its postfix, eval results and messages
  (printed above the bar, or to stderr without one). Without a bar (``train.progress_bar``
  false, or stderr not a terminal: a batch job's log) every log line is a plain line of text,
  ``lca-train: step S/TOTAL: loss L, bpb B, lr LR, N bytes/s``."""

  def __init__(self, progress, total: int):
    self.progress, self.total = progress, total

  def write(self, msg: str) -> None:
    self.progress.write(msg)

  def step_done(self, step: int, m: dict) -> None:
    del step, m
    self.progress.update(1)

  def train_line(self, step: int, avg: dict) -> None:
    if not self.progress.has_bar:
      self.write(plain_train_line(step, self.total, avg))
      return
    post = {"loss": avg["loss"], "bpb": avg.get("bpb_ntp")}
    if avg.get("bpb_mbp") is not None:
      post["bpb2"] = avg["bpb_mbp"]
    if avg["bytes_per_s"] is not None:
      post["kB/s"] = avg["bytes_per_s"] / 1e3
    self.progress.update(0, **post)

  def eval_line(self, step: int, res: dict) -> None:
    self.write(
      f"eval @ {step}: bpb_ntp {res['bpb_ntp']:.4f}"
      + (f", bpb_mbp {res['bpb_mbp']:.4f}" if "bpb_mbp" in res else "")
    )


def plain_train_line(step: int, total: int, avg: dict) -> str:
  """A log line as text: step, loss, bpb, lr and bytes/s (the first step: its compile)."""
  out = f"lca-train: step {step}/{total}: loss {avg['loss']:.4f}"
  if avg.get("bpb_ntp") is not None:
    out += f", bpb {avg['bpb_ntp']:.4f}"
  out += f", lr {avg['lr']:.3g}"
  if avg["bytes_per_s"] is None:
    return out + " (first step: compile, not timed)"
  return out + f", {avg['bytes_per_s']:,.0f} bytes/s"


# ---- periodic actions -----------------------------------------------------------------------
class PeriodicAction(Protocol):
  def due(self, step: int, stopping: bool) -> bool: ...

  def watch_labels(self, step: int) -> tuple:
    """(what the watchdog is paused for while this runs, None: not paused; what it did)."""

  def __call__(self, step: int, state) -> None: ...


class PeriodicEval:
  """Every ``every`` steps and at ``total`` (not when stopping; ``every`` 0: never):
  ``evaluate(params)`` and, when it returns results (None: no eval data), hands them to
  ``sinks``. The watchdog is paused until one eval has returned results (its compile)."""

  def __init__(
    self,
    *,
    every: int,
    total: int,
    evaluate: Callable[[Any], Optional[dict]],
    sinks: Sequence[Sink],
  ):
    self.every, self.total, self.evaluate, self.sinks = every, total, evaluate, list(sinks)
    self.last: dict = {}  # the last results, with their step

  def due(self, step: int, stopping: bool) -> bool:
    return self.every > 0 and (step % self.every == 0 or step == self.total) and not stopping

  def watch_labels(self, step: int) -> tuple:
    return (f"first eval @ {step} (compiling)" if not self.last else None), f"eval @ {step}"

  def __call__(self, step: int, state) -> None:
    res = self.evaluate(state.params)
    if res is None:
      return
    for sink in self.sinks:
      sink(step, res)
    self.last = dict(res, step=step)


class PeriodicCheckpoint:
  """Saves ``state`` with ``data_state()`` (the data iterator position) and ``meta(step)``
  every ``every`` steps (0: never), at ``total`` and when stopping, unless that step is
  already saved (``last_saved``: the step of the checkpoint the run resumed from). The
  watchdog is paused during the first save."""

  def __init__(
    self,
    ckpt,
    *,
    every: int,
    total: int,
    data_state: Callable[[], Any],
    meta: Callable[[int], dict],
    last_saved: Optional[int] = None,
  ):
    self.ckpt, self.every, self.total = ckpt, every, total
    self.data_state, self.meta = data_state, meta
    self.last_saved = last_saved
    self.saved_once = False

  def due(self, step: int, stopping: bool) -> bool:
    scheduled = (self.every > 0 and step % self.every == 0) or step == self.total or stopping
    return scheduled and self.last_saved != step

  def watch_labels(self, step: int) -> tuple:
    return (f"first checkpoint {step}" if not self.saved_once else None), f"checkpoint {step}"

  def __call__(self, step: int, state) -> None:
    self.ckpt.save(state, self.data_state(), meta=self.meta(step))
    self.last_saved = step
    self.saved_once = True


# ---- stall detection ------------------------------------------------------------------------
class WatchdogHook:
  """Drives a ``watchdog.Watchdog``: armed after the first step (compiling it is not
  counted), a beat after every later step, paused while a first-time action runs and armed
  again when it is done."""

  def __init__(self, dog):
    self.dog = dog
    self.armed = False

  def after_step(self, step: int) -> None:
    if self.armed:
      self.dog.beat(f"step {step}")
    else:
      self.dog.arm(f"step {step}")
      self.armed = True

  @contextlib.contextmanager
  def paused(self, pause_for: Optional[str], done: str):
    """Around an eval / checkpoint: suspended for ``pause_for`` (None: not suspended), armed
    with ``done`` after it (only once the first step has armed it)."""
    if pause_for is not None and self.armed:
      self.dog.suspend(pause_for)
    yield
    if self.armed:
      self.dog.arm(done)


# ---- the hooks of one step, in order ----------------------------------------------------------
class StepHooks:
  """Runs the hooks after each dispatched step, in the order of the module docstring."""

  def __init__(
    self,
    *,
    fetch: LateFetch,
    stop,
    actions: Sequence[PeriodicAction],
    window: MetricsWindow,
    watchdog: WatchdogHook,
    console: Console,
  ):
    self.fetch, self.stop, self.actions = fetch, stop, list(actions)
    self.window, self.watchdog, self.console = window, watchdog, console

  def after_step(self, step: int, state, device_metrics) -> bool:
    """Hooks of ``step`` (completed steps, from 1); True: stop the loop (checkpoint saved)."""
    self.fetch.push(step, device_metrics)
    stopping = self.stop.agreed()
    due = [a for a in self.actions if a.due(step, stopping)]
    if due:
      self.fetch.flush()  # raises on a non-finite loss before the step is checkpointed
    for action in due:
      with self.watchdog.paused(*action.watch_labels(step)):
        action(step, state)
      self.window.reset_clock(step)
    self.watchdog.after_step(step)
    if stopping:
      self.console.write(
        f"lca-train: stopping at step {step} ({self.stop.reason}); checkpoint saved, "
        "run the same command to resume"
      )
    return stopping

  def flush(self) -> None:
    """At the end of the loop: the last step's metrics."""
    self.fetch.flush()
