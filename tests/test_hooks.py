"""The training loop's hooks (lca_jax/train/hooks.py) on fake inputs: no model, no compile."""

import math
import types

import numpy as np
import pytest

from lca_jax.train import hooks
from lca_jax.train.errors import NonFiniteLossError


def metrics(loss=1.0, **kw):
  m = dict(loss=loss, grad_norm=0.5, lr=1e-3, bpb_ntp=2.0)
  m.update(kw)
  return m


class FakeClock:
  """Time in seconds; ``tick``: added after each reading."""

  def __init__(self, tick=0.0):
    self.t, self.tick = 100.0, tick

  def __call__(self):
    self.t += self.tick
    return self.t - self.tick


class FakeProgress:
  def __init__(self, log=None, has_bar=True):
    self.calls, self.log, self.has_bar = [], log, has_bar

  def update(self, n=1, **postfix):
    self.calls.append(("update", n, postfix))

  def write(self, msg):
    self.calls.append(("write", msg))
    if self.log is not None:
      self.log.append(("console", msg))


class FakeDog:
  def __init__(self):
    self.calls = []

  def arm(self, what="armed"):
    self.calls.append(("arm", what))

  def suspend(self, what=""):
    self.calls.append(("suspend", what))

  def beat(self, what=""):
    self.calls.append(("beat", what))


# ---- LateFetch --------------------------------------------------------------------------------
def test_late_fetch_hands_each_step_on_one_step_late_as_floats():
  got = []
  fetch = hooks.LateFetch([lambda s, m: got.append(("a", s, m)), lambda s, m: got.append(("b", s))])
  fetch.push(1, {"loss": np.float32(2.5)})
  assert got == []  # the step just dispatched is not waited on
  fetch.push(2, {"loss": np.float32(1.5)})
  assert got == [("a", 1, {"loss": 2.5}), ("b", 1)]
  assert type(got[0][2]["loss"]) is float
  fetch.flush()
  assert got[-2:] == [("a", 2, {"loss": 1.5}), ("b", 2)]
  fetch.flush()  # nothing held any more
  assert len(got) == 4


# ---- FiniteCheck ------------------------------------------------------------------------------
def test_finite_check_raises_naming_the_step_and_the_last_checkpoint():
  last = [None]
  check = hooks.FiniteCheck(lambda: last[0])
  check(1, metrics())
  with pytest.raises(NonFiniteLossError, match=r"step 3 \(loss=nan.*last checkpoint: none\)"):
    check(3, metrics(loss=float("nan")))
  last[0] = 2
  with pytest.raises(NonFiniteLossError, match=r"grad_norm=inf.*last checkpoint: step 2\)"):
    check(4, metrics(grad_norm=float("inf")))


# ---- MetricsWindow ----------------------------------------------------------------------------
def make_window(clock, lines, *, start=0, total=5, log_every=2, peak=1e12):
  return hooks.MetricsWindow(
    start=start,
    total=total,
    log_every=log_every,
    bytes_per_step=1000,
    flops=lambda bpl: 8e12 * (bpl or 1.0),
    n_devices=4,
    peak_flops=peak,
    skipped_records=lambda: 7,
    sinks=[lambda s, avg: lines.append((s, dict(avg)))],
    clock=clock,
  )


def test_metrics_window_logs_means_throughput_and_mfu_at_its_cadence():
  clock, lines = FakeClock(), []
  window = make_window(clock, lines)
  for step, loss in zip(range(1, 6), (5.0, 4.0, 3.0, 2.0, 1.0)):
    clock.t += 2.0  # 2 s per step
    window(step, metrics(loss=loss, lr=step * 1e-3, bytes_per_latent=2.0))
  assert [s for s, _ in lines] == [1, 2, 4, 5]  # step 1, every 2nd step, the last step
  s, avg = lines[2]  # steps 3 and 4
  assert avg["loss"] == 2.5 and avg["lr"] == 4e-3 and avg["bytes_per_latent"] == 2.0
  assert avg["step_time"] == 2.0 and avg["bytes_per_s"] == 500.0
  assert avg["tflops_per_device"] == pytest.approx(16e12 / 2.0 / 4 / 1e12)
  assert avg["mfu"] == pytest.approx(16e12 / 2.0 / (4 * 1e12))
  assert avg["skipped_records"] == 7
  assert window.last == dict(lines[-1][1], step=5)


def test_metrics_window_first_step_is_not_timed():
  """The run's first step compiles: its line has no throughput, and the clock starts after
  it (the next line's bytes/s is that of the steps after it)."""
  clock, lines = FakeClock(), []
  window = make_window(clock, lines, start=0, total=10, log_every=3)
  clock.t += 60.0  # compile + first run
  window(1, metrics(loss=4.0))
  for step in (2, 3):
    clock.t += 2.0
    window(step, metrics(loss=3.0))
  (_, first), (_, second) = lines
  assert first["loss"] == 4.0 and first["bytes_per_s"] is None and first["step_time"] is None
  assert first["mfu"] is None and first["tflops_per_device"] is None
  assert second["step_time"] == 2.0 and second["bytes_per_s"] == 500.0


def test_metrics_window_clock_reset_and_unknown_peak():
  clock, lines = FakeClock(), []
  window = make_window(clock, lines, start=10, total=100, log_every=4, peak=None)
  clock.t += 3.0
  window(11, metrics(loss=1.0))
  clock.t += 50.0  # e.g. an eval after step 11: not step time
  window.reset_clock(11)
  clock.t += 1.0
  window(13, metrics(loss=3.0))
  assert lines == [] and window.last == {}
  clock.t += 1.0
  window(16, metrics(loss=5.0))
  ((step, avg),) = lines
  assert step == 16 and avg["mfu"] is None and avg["tflops_per_device"] > 0
  assert avg["loss"] == 3.0  # steps 11, 13, 16: every step since the previous line
  assert avg["step_time"] == pytest.approx(2.0 / (16 - 11))  # 2 s since the reset at 11


def test_metrics_window_means_only_where_a_key_is_present():
  clock, lines = FakeClock(tick=1.0), []
  window = make_window(clock, lines, log_every=3, total=9)
  window(1, metrics(overflow=1.0))  # logged alone
  window(2, metrics(overflow=4.0))
  window(3, metrics())
  assert "overflow" not in lines[-1][1]  # the keys of the logged step
  window(4, metrics(overflow=4.0))
  window(5, metrics())
  window(6, metrics(overflow=2.0))
  assert lines[-1][1]["overflow"] == 3.0


# ---- Console ----------------------------------------------------------------------------------
def test_console_ticks_shows_postfix_and_eval_lines():
  progress = FakeProgress()
  console = hooks.Console(progress, 10)
  console.step_done(3, metrics())
  console.train_line(3, dict(loss=1.5, bpb_ntp=2.0, bpb_mbp=None, bytes_per_s=2500.0))
  console.train_line(4, dict(loss=1.0, bpb_ntp=1.9, bpb_mbp=2.2, bytes_per_s=1000.0))
  console.eval_line(4, dict(bpb_ntp=1.23456))
  console.eval_line(5, dict(bpb_ntp=1.5, bpb_mbp=1.75))
  assert progress.calls == [
    ("update", 1, {}),
    ("update", 0, {"loss": 1.5, "bpb": 2.0, "kB/s": 2.5}),
    ("update", 0, {"loss": 1.0, "bpb": 1.9, "bpb2": 2.2, "kB/s": 1.0}),
    ("write", "eval @ 4: bpb_ntp 1.2346"),
    ("write", "eval @ 5: bpb_ntp 1.5000, bpb_mbp 1.7500"),
  ]


def test_console_without_a_bar_prints_a_plain_line_per_log_line():
  """A batch job's log (stderr not a terminal, or train.progress_bar false): text lines."""
  progress = FakeProgress(has_bar=False)
  console = hooks.Console(progress, 200)
  console.train_line(1, dict(loss=5.5, bpb_ntp=7.9, lr=1e-4, bytes_per_s=None))
  console.train_line(50, dict(loss=2.25, bpb_ntp=3.1, lr=3e-3, bytes_per_s=12345.6))
  assert progress.calls == [
    (
      "write",
      "lca-train: step 1/200: loss 5.5000, bpb 7.9000, lr 0.0001 (first step: compile, not timed)",
    ),
    ("write", "lca-train: step 50/200: loss 2.2500, bpb 3.1000, lr 0.003, 12,346 bytes/s"),
  ]


# ---- PeriodicEval -----------------------------------------------------------------------------
def test_periodic_eval_cadence_sinks_and_first_label():
  results = {3: None, 6: {"bpb_ntp": 1.0}, 7: {"bpb_ntp": 0.9}}
  seen, got = [], []

  def evaluate(params):
    seen.append(params)
    return results[params]

  ev = hooks.PeriodicEval(every=3, total=7, evaluate=evaluate, sinks=[lambda s, r: got.append(s)])
  assert [n for n in range(1, 8) if ev.due(n, False)] == [3, 6, 7]
  assert not ev.due(6, True)  # stopping: the checkpoint goes first, no eval
  for n in (3, 6, 7):
    pause_for, done = ev.watch_labels(n)
    assert done == f"eval @ {n}"
    assert (pause_for is not None) == (n in (3, 6))  # until an eval has returned results
    ev(n, types.SimpleNamespace(params=n))
  assert seen == [3, 6, 7] and got == [6, 7] and ev.last == {"bpb_ntp": 0.9, "step": 7}
  assert ev.watch_labels(9)[0] is None
  never = hooks.PeriodicEval(every=0, total=7, evaluate=evaluate, sinks=[])
  assert not any(never.due(n, False) for n in range(1, 8))


# ---- PeriodicCheckpoint -----------------------------------------------------------------------
class FakeCkpt:
  def __init__(self, log=None):
    self.saved, self.log = [], log

  def save(self, state, data_state=None, meta=None):
    self.saved.append((state.step, data_state, meta))
    if self.log is not None:
      self.log.append(("save", state.step))


def test_periodic_checkpoint_cadence_stop_and_what_it_saves():
  ckpt = FakeCkpt()
  saves = hooks.PeriodicCheckpoint(
    ckpt,
    every=4,
    total=10,
    data_state=lambda: "data@pos",
    meta=lambda n: {"bytes_seen": n * 100},
    last_saved=4,
  )
  assert [n for n in range(1, 11) if saves.due(n, False)] == [8, 10]  # 4: resumed from it
  assert saves.due(5, True)  # stopping
  assert saves.watch_labels(8) == ("first checkpoint 8", "checkpoint 8")
  saves(8, types.SimpleNamespace(step=8))
  assert ckpt.saved == [(8, "data@pos", {"bytes_seen": 800})]
  assert saves.last_saved == 8 and not saves.due(8, True)
  assert saves.watch_labels(10) == (None, "checkpoint 10")
  only_end = hooks.PeriodicCheckpoint(ckpt, every=0, total=10, data_state=str, meta=dict)
  assert [n for n in range(1, 11) if only_end.due(n, False)] == [10]


# ---- WatchdogHook -----------------------------------------------------------------------------
def test_watchdog_hook_arms_after_the_first_step_and_pauses_first_actions():
  dog = FakeDog()
  wd = hooks.WatchdogHook(dog)
  with wd.paused("first eval @ 0", "eval @ 0"):  # before the first step: untouched
    pass
  assert dog.calls == []
  wd.after_step(5)
  wd.after_step(6)
  with wd.paused("first checkpoint 6", "checkpoint 6"):
    dog.calls.append(("work",))
  with wd.paused(None, "eval @ 6"):
    dog.calls.append(("work",))
  assert dog.calls == [
    ("arm", "step 5"),
    ("beat", "step 6"),
    ("suspend", "first checkpoint 6"),
    ("work",),
    ("arm", "checkpoint 6"),
    ("work",),
    ("arm", "eval @ 6"),
  ]


# ---- StepHooks: the order of one step -----------------------------------------------------------
class FakeStop:
  def __init__(self, at=None):
    self.at, self.step, self.reason = at, 0, ""

  def agreed(self):
    self.step += 1
    if self.at is not None and self.step >= self.at:
      self.reason = "signal SIGTERM"
      return True
    return False


def make_step_hooks(log, *, total=6, ckpt_every=2, eval_every=3, stop_at=None):
  clock = FakeClock(tick=1.0)
  console = hooks.Console(FakeProgress(log), total)
  window = make_window(clock, [], total=total, log_every=1)
  window.sinks.append(lambda s, avg: log.append(("line", s, avg["loss"])))
  reset = window.reset_clock
  window.reset_clock = lambda s: (log.append(("reset", s)), reset(s))
  evals = hooks.PeriodicEval(
    every=eval_every,
    total=total,
    evaluate=lambda params: {"bpb_ntp": float(params)},
    sinks=[lambda s, r: log.append(("eval", s))],
  )
  ckpt = FakeCkpt(log)
  saves = hooks.PeriodicCheckpoint(
    ckpt, every=ckpt_every, total=total, data_state=lambda: None, meta=lambda n: {}
  )
  dog = FakeDog()
  step_hooks = hooks.StepHooks(
    fetch=hooks.LateFetch([hooks.FiniteCheck(lambda: saves.last_saved), window]),
    stop=FakeStop(stop_at),
    actions=[evals, saves],
    window=window,
    watchdog=hooks.WatchdogHook(dog),
    console=console,
  )
  step_hooks.dog = dog  # for the test
  return step_hooks, ckpt


def run_steps(step_hooks, losses, log):
  for n, loss in enumerate(losses, 1):
    log.append(("step", n))
    state = types.SimpleNamespace(step=n, params=n)
    if step_hooks.after_step(n, state, metrics(loss=loss)):
      return n
  step_hooks.flush()
  return len(losses)


def test_step_hooks_order_metrics_late_flushed_before_eval_and_checkpoint():
  log = []
  step_hooks, ckpt = make_step_hooks(log)
  assert run_steps(step_hooks, [6.0, 5.0, 4.0, 3.0, 2.0, 1.0], log) == 6
  assert log == [
    ("step", 1),
    ("step", 2),
    ("line", 1, 6.0),
    ("line", 2, 5.0),  # flushed: a checkpoint is due
    ("save", 2),
    ("reset", 2),  # checkpoint time is not step time
    ("step", 3),
    ("line", 3, 4.0),
    ("eval", 3),
    ("reset", 3),
    ("step", 4),
    ("line", 4, 3.0),
    ("save", 4),
    ("reset", 4),
    ("step", 5),
    ("step", 6),
    ("line", 5, 2.0),  # one step late
    ("line", 6, 1.0),
    ("eval", 6),  # the last step: eval, then its checkpoint
    ("reset", 6),
    ("save", 6),
    ("reset", 6),
  ]
  assert [s for s, _, _ in ckpt.saved] == [2, 4, 6]
  assert step_hooks.dog.calls[:7] == [
    ("arm", "step 1"),  # after the first step: its compile is not timed
    ("suspend", "first checkpoint 2"),
    ("arm", "checkpoint 2"),
    ("beat", "step 2"),
    ("suspend", "first eval @ 3 (compiling)"),
    ("arm", "eval @ 3"),
    ("beat", "step 3"),
  ]
  assert step_hooks.dog.calls[7:9] == [("arm", "checkpoint 4"), ("beat", "step 4")]


def test_step_hooks_non_finite_loss_raises_before_its_step_is_saved():
  log = []
  step_hooks, ckpt = make_step_hooks(log, eval_every=0)
  with pytest.raises(
    NonFiniteLossError, match="non-finite loss at step 4 .*last checkpoint: step 2"
  ):
    run_steps(step_hooks, [3.0, 2.0, 1.0, math.nan, 1.0, 1.0], log)
  assert [s for s, _, _ in ckpt.saved] == [2]


def test_step_hooks_stop_saves_skips_eval_and_says_so():
  log = []
  step_hooks, ckpt = make_step_hooks(log, ckpt_every=0, eval_every=1, stop_at=2)
  assert run_steps(step_hooks, [3.0, 2.0, 1.0], log) == 2
  assert log[-5:] == [
    ("step", 2),
    ("line", 2, 2.0),
    ("save", 2),
    ("reset", 2),
    (
      "console",
      "lca-train: stopping at step 2 (signal SIGTERM); checkpoint saved, "
      "run the same command to resume",
    ),
  ]
  assert ("eval", 1) in log and ("eval", 2) not in log
  assert [s for s, _, _ in ckpt.saved] == [2]
