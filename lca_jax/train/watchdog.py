"""A hang watchdog: ends a process that makes no progress (a stuck step, collective or save).

A process that is alive but stuck (deadlock, hung filesystem) keeps sending heartbeats to the
coordination service, so jax's failure detection never ends it; ``Watchdog``
(``lca-train --watchdog SECONDS``) does, with exit status ``EXIT_HUNG`` and the stacks of every
thread on stderr, and the heartbeat then ends the other processes of the run.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

EXIT_HUNG = 3  # exit status of a process ended by the watchdog


class Watchdog:
  """Ends the process (exit status ``EXIT_HUNG``) when ``beat()`` has not been called for
  ``timeout`` seconds while armed. ``arm()`` (re)starts the clock, ``suspend()`` stops it (the
  loop arms it after its first step and suspends it during the first eval and the first
  checkpoint, so compiles and one-time setup are not counted); ``beat(what)`` records
  progress."""

  def __init__(self, timeout: float, name: str = "lca-train", on_expire=None):
    self.timeout = float(timeout)
    self.name = name
    self._last = time.monotonic()
    self._what = "start"
    self._armed = False
    self._stop = threading.Event()
    self._on_expire = on_expire or self._expire
    self._thread = None
    if self.timeout > 0:
      self._thread = threading.Thread(target=self._run, name="lca-watchdog", daemon=True)
      self._thread.start()

  def arm(self, what: str = "armed") -> None:
    self._armed = True
    self.beat(what)

  def suspend(self, what: str = "") -> None:
    self._armed = False
    if what:
      self._what = what

  def beat(self, what: str = "") -> None:
    self._last = time.monotonic()
    if what:
      self._what = what

  def close(self) -> None:
    self._stop.set()

  def _run(self):
    period = min(1.0, self.timeout / 4)
    while not self._stop.wait(period):
      if self._armed and time.monotonic() - self._last > self.timeout:
        self._on_expire()
        return

  def _expire(self):
    idle = time.monotonic() - self._last
    print(
      f"{self.name}: error: no progress for {idle:.0f}s (watchdog {self.timeout:.0f}s; last: "
      f"{self._what}). A process of this run is stuck or a peer is gone; exiting with "
      f"status {EXIT_HUNG}. Thread stacks follow.",
      file=sys.stderr,
      flush=True,
    )
    try:
      faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except Exception:  # noqa: BLE001 - best effort
      pass
    sys.stderr.flush()
    os._exit(EXIT_HUNG)  # pylint: disable=protected-access
