"""Load ml-collections config files (``configs/NAME.py`` with ``get_config()``) with clear errors."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys

import ml_collections

from lca_jax.errors import LcaError


class ConfigFileError(LcaError, ValueError):
  """A config file that cannot be loaded (missing, a syntax error, an exception while it runs,
  no get_config()) or an override that cannot be applied."""


def load_config(path: str) -> ml_collections.ConfigDict:
  """Execute ``path`` and return ``get_config()``. The folder above ``configs/`` joins sys.path
  so that config files can import their shared ``configs.base``."""
  if os.path.isdir(path):
    raise ConfigFileError(f"config file {path} is a directory; give a file such as configs/NAME.py")
  if not os.path.isfile(path):
    raise ConfigFileError(f"config file not found: {path}")
  root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
  if root not in sys.path:
    sys.path.insert(0, root)
  name = "_lca_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  if spec is None or spec.loader is None:
    raise ConfigFileError(f"{path}: not a Python config file (expected NAME.py with get_config())")
  mod = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(mod)
  except SyntaxError as e:  # IndentationError included
    where = f"{path}:{e.lineno}" if e.lineno else path
    raise ConfigFileError(f"{where}: syntax error in config file: {e.msg}") from None
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigFileError(
      f"{path}: the config file failed while loading: {type(e).__name__}: {_one_line(e)}"
    ) from None
  if not callable(getattr(mod, "get_config", None)):
    raise ConfigFileError(f"{path}: no get_config() function")
  try:
    config = mod.get_config()
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigFileError(
      f"{path}: get_config() failed: {type(e).__name__}: {_one_line(e)}"
    ) from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigFileError(
      f"{path}: get_config() returned {type(config).__name__}, not an ml_collections.ConfigDict"
    )
  return config


def _one_line(e: BaseException) -> str:
  return " ".join(str(e).split()) or repr(e)


def split_overrides(rest):
  """Command-line overrides -> ``key=value`` strings.

  ['--config.a.b=1', '--config.c', '2'] -> ['a.b=1', 'c=2']; anything else is an error.
  """
  out, i = [], 0
  while i < len(rest):
    arg = rest[i]
    if not arg.startswith("--config."):
      raise ConfigFileError(
        f"unrecognized argument {arg!r} (overrides look like --config.train.steps=100)"
      )
    key = arg[len("--config.") :]
    if "=" in key:
      out.append(key)
      i += 1
    elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
      out.append(f"{key}={rest[i + 1]}")
      i += 2
    else:
      raise ConfigFileError(f"override {arg!r} has no value (use --config.{key}=VALUE)")
  return out


def apply_overrides(config: ml_collections.ConfigDict, overrides) -> ml_collections.ConfigDict:
  """Apply ``a.b=value`` strings; an unknown key is an error naming it."""
  for item in overrides:
    if "=" not in item:
      raise ConfigFileError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.removeprefix("--").removeprefix("config.")
    node, parts = config, key.split(".")
    for p in parts[:-1]:
      if p not in node:
        raise ConfigFileError(f"unknown config key: {key} (no section {p!r})")
      node = node[p]
    if parts[-1] not in node:
      raise ConfigFileError(
        f"unknown config key: {key}; known in this section: {', '.join(sorted(node.keys()))}"
      )
    old = node[parts[-1]]
    try:
      val = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      val = raw
    if isinstance(old, bool) and isinstance(raw, str) and raw.lower() in ("true", "false"):
      val = raw.lower() == "true"
    if isinstance(old, float) and isinstance(val, int) and not isinstance(val, bool):
      val = float(val)
    if isinstance(old, float) and isinstance(val, str):
      try:  # nan, inf: not Python literals, but floats (validate_run_config rejects them)
        val = float(raw)
      except ValueError:
        pass
    if isinstance(old, str) and not isinstance(val, str):
      val = raw
    try:
      node[parts[-1]] = val
    except TypeError as e:
      raise ConfigFileError(f"config key {key}: cannot set {raw!r} ({e})") from e
  return config


def parse_layers(s: str) -> tuple:
  """'2,4,2,2' -> (n_enc, n_lm, n_dec, n_mbp), the benchmarks' ``--layers``; a
  ``ConfigFileError`` naming the flag otherwise."""
  try:
    layers = tuple(int(x) for x in str(s).split(","))
  except ValueError:
    layers = ()
  if len(layers) != 4 or min(layers[:3], default=0) < 1 or layers[3] < 0:
    raise ConfigFileError(
      f"--layers: {s!r} is not ENC,LM,DEC,MBP (e.g. 2,4,2,2; ENC, LM, DEC >= 1)"
    )
  return layers
