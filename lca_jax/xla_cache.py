"""The persistent XLA compilation cache of the command-line programs.

A jitted program is compiled the first time a process runs it: on CPU compiling even the demo
model's decode executable or train step takes seconds, far more than the work of a short
``lca-sample`` call or of the first steps after a resume. ``lca-train``, ``lca-sample``,
``lca-eval`` and ``tools/demo_sample.py`` therefore keep compiled programs on disk (jax's
persistent compilation cache) and load them in later runs of the same program, shapes, options,
devices and jax/jaxlib version (jax's cache key; anything else compiles anew; jax does not
store a program that calls back to the host, such as ``lca-sample --stream``), with the same
results (timings: docs/performance.md).

``LCA_JAX_XLA_CACHE``: unset = ``$XDG_CACHE_HOME/lca_jax/xla`` (``~/.cache/lca_jax/xla``),
used only if that directory can be created and written; ``DIR`` = that directory, and an
error if it cannot be used; ``0`` / ``off`` = no cache. A jax setting of the user's own
(``JAX_COMPILATION_CACHE_DIR``) wins and is left as it is. The cache is bounded
(``MAX_BYTES``, least recently used entries evicted): with a size jax reads and writes entries
under a file lock, so processes sharing the directory never read an entry half written (in a
multi-process run only process 0 writes). A read that fails anyway is a warning and a compile,
not an error. Give the cache a directory of its own: one that jax filled without a size
(``JAX_COMPILATION_CACHE_DIR`` alone) keeps being read, but jax's eviction, which needs the
access-time files it did not write there, then fails every write with a warning.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

import jax

from lca_jax.errors import LcaError

ENV = "LCA_JAX_XLA_CACHE"
MAX_BYTES = 2 * 2**30
_OFF = frozenset({"", "0", "off", "none", "false", "no"})


class XlaCacheError(LcaError):
  """``LCA_JAX_XLA_CACHE`` names a directory that cannot be used."""


def default_dir(environ: Mapping[str, str]) -> str:
  base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "lca_jax", "xla")


def _usable(path: str) -> Optional[str]:
  """Why ``path`` cannot hold the cache (created if missing), or None."""
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    return e.strerror or str(e)
  if not os.access(path, os.W_OK | os.X_OK):
    return "not writable"
  return None


def enable(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
  """Turn the persistent compilation cache on as ``LCA_JAX_XLA_CACHE`` says (module docstring)
  and return its directory (None: off). Call before the process compiles anything: jax decides
  once, at its first compilation, whether a cache is used."""
  environ = os.environ if environ is None else environ
  own = jax.config.jax_compilation_cache_dir
  if own:
    return own
  setting = environ.get(ENV)
  if setting is not None and setting.strip().lower() in _OFF:
    return None
  if setting is None:
    path = default_dir(environ)
  else:
    path = os.path.abspath(os.path.expanduser(setting.strip()))
  why = _usable(path)
  if why is not None:
    if setting is None:  # the default is best effort: run without a cache
      return None
    raise XlaCacheError(f"{ENV}={setting!r}: cannot keep compiled programs in {path} ({why})")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  return path
