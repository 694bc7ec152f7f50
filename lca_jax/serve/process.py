"""``lca-serve`` as a child process on a free loopback port (for tests and the load tool)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Optional, Sequence

from lca_jax.errors import LcaError

LOOPBACK = "127.0.0.1"


class ServerError(LcaError, RuntimeError):
  """The server process did not come up (its log tail is in the message)."""


def free_port() -> int:
  """A TCP port of the loopback interface that nothing listens on now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((LOOPBACK, 0))
    return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0):
  """(status, decoded JSON body) of a GET; status 0 when nothing answers."""
  try:
    with urllib.request.urlopen(url, timeout=timeout) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read() or b"null")
  except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
    return 0, None


class ServerProcess:
  """``python -m lca_jax.cli.serve --checkpoint DIR --port P ARGS`` with its log in a temp file;
  ``start`` waits until ``/health`` answers 200. A context manager: ``stop`` on exit. ``cwd``:
  the directory it runs in (``python -m`` imports ``lca_jax`` from there first)."""

  def __init__(
    self,
    checkpoint: str,
    args: Sequence[str] = (),
    env: Optional[dict] = None,
    cwd: Optional[str] = None,
  ):
    self.port = free_port()
    self.url = f"http://{LOOPBACK}:{self.port}"
    self.cmd = [sys.executable, "-m", "lca_jax.cli.serve", "--checkpoint", checkpoint]
    self.cmd += ["--host", LOOPBACK, "--port", str(self.port), *args]
    self.env, self.cwd = env, cwd
    self.proc: Optional[subprocess.Popen] = None
    self.log = tempfile.NamedTemporaryFile(prefix="lca-serve-", suffix=".log", delete=False)

  def start(self, timeout: float = 300.0) -> "ServerProcess":
    self.launch()
    return self.wait(timeout)

  def launch(self):
    """Start the process (``wait`` for it to answer)."""
    self.proc = subprocess.Popen(
      self.cmd,
      stdout=self.log,
      stderr=subprocess.STDOUT,
      env=self.env or dict(os.environ),
      cwd=self.cwd,
    )

  def wait(self, timeout: float = 300.0) -> "ServerProcess":
    """Wait until ``/health`` answers 200; ``ServerError`` if the process exits first."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
      if self.proc.poll() is not None:
        raise ServerError(f"lca-serve exited with {self.proc.returncode}: {self.log_tail()}")
      status, _ = get_json(self.url + "/health", timeout=2.0)
      if status == 200:
        return self
      time.sleep(0.2)
    self.stop()
    raise ServerError(f"lca-serve did not answer /health in {timeout:.0f} s: {self.log_tail()}")

  def log_tail(self, n: int = 4000) -> str:
    self.log.flush()
    with open(self.log.name, encoding="utf-8", errors="replace") as f:
      return f.read()[-n:]

  def stop(self):
    if self.proc is not None and self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=20)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self.log.close()

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc):
    self.stop()
    try:
      os.unlink(self.log.name)
    except OSError:
      pass
