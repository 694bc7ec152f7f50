"""Stopping a running ``train_and_evaluate`` at the end of a step, with a checkpoint.

``Stop`` is the flag the loop polls once per step: SIGTERM (preemption, scancel, the
launchers) or ``request_stop`` sets it, and in a multi-process run ``Stop.agreed`` makes every
process stop at the same step when any of them was asked to.
"""
from __future__ import annotations

import signal
import threading

import jax
import numpy as np


class Stop:
  """SIGTERM -> flag; the loop checkpoints and returns at the end of the current step."""

  def __init__(self):
    self.flag = False
    self.reason = ""
    self._prev = None

  def install(self):
    if threading.current_thread() is threading.main_thread():
      self._prev = signal.signal(signal.SIGTERM, self._handler)

  def uninstall(self):
    if self._prev is not None:
      signal.signal(signal.SIGTERM, self._prev)
      self._prev = None

  def _handler(self, signum, frame):
    del frame
    self.set(f"signal {signal.Signals(signum).name}")

  def set(self, reason: str = "stop requested"):
    self.flag = True
    self.reason = self.reason or reason

  def agreed(self) -> bool:
    if jax.process_count() == 1:
      return self.flag
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    flags = np.asarray(multihost_utils.process_allgather(np.array([self.flag]))).reshape(-1)
    if flags.any() and not self.flag:
      who = ", ".join(str(i) for i in np.flatnonzero(flags))
      self.set(f"stop signal on process {who}")
    return bool(flags.any())


ACTIVE: list = []  # the Stop of each running train_and_evaluate


def request_stop(reason: str = "stop requested") -> None:
  """Ask the running ``train_and_evaluate`` to checkpoint and return (as SIGTERM does)."""
  for s in ACTIVE:
    s.set(reason)
