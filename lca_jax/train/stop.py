"""Stopping a running ``train_and_evaluate`` at the end of a step, with a checkpoint.

``Stop`` is the flag the loop polls once per step: SIGTERM (preemption, scancel, the
launchers), SIGINT (Ctrl-C) or ``request_stop`` sets it, and in a multi-process run
``Stop.agreed`` makes every process stop at the same step when any of them was asked to. A
second Ctrl-C quits at once (exit status 130) without waiting for the step or the checkpoint:
a checkpoint not yet committed is never restored, the previous one stays.
"""

from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stop:
  """SIGTERM / SIGINT -> flag; the loop checkpoints and returns at the end of the current step."""

  def __init__(self):
    self.flag = False
    self.reason = ""
    self.signum = 0  # the first signal that set the flag (0: none)
    self._prev = {}

  def install(self):
    if threading.current_thread() is threading.main_thread():
      for s in SIGNALS:
        # an ignored SIGINT (`lca-train ... &` in a script) stays ignored
        if s != signal.SIGINT or signal.getsignal(s) is not signal.SIG_IGN:
          self._prev[s] = signal.signal(s, self._handler)

  def uninstall(self):
    for s, prev in self._prev.items():
      signal.signal(s, prev)
    self._prev = {}

  def _handler(self, signum, frame):
    del frame
    if signum == signal.SIGINT:
      # os.write: print() may be in the middle of writing stderr when the handler runs
      if self.signum == signal.SIGINT:
        os.write(2, b"\nlca-train: interrupted again: quitting without a checkpoint\n")
        os._exit(130)  # pylint: disable=protected-access
      os.write(
        2,
        b"\nlca-train: Ctrl-C: stopping after this step with a checkpoint "
        b"(Ctrl-C again quits at once without it)\n",
      )
    self.signum = self.signum or signum
    self.set(f"signal {signal.Signals(signum).name}")

  def set(self, reason: str = "stop requested"):
    self.flag = True
    self.reason = self.reason or reason

  def agreed(self) -> bool:
    if jax.process_count() == 1:
      return self.flag
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
