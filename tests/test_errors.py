"""One error hierarchy: every exception class lca_jax defines derives from LcaError."""

import importlib
import inspect
import pkgutil

import lca_jax
from lca_jax.errors import LcaError


def _modules():
  for info in pkgutil.walk_packages(lca_jax.__path__, "lca_jax."):
    yield importlib.import_module(info.name)


def test_every_error_class_derives_from_lca_error():
  found, stray = [], []
  for mod in _modules():
    for name, cls in inspect.getmembers(mod, inspect.isclass):
      if cls.__module__ != mod.__name__ or not issubclass(cls, BaseException):
        continue
      if issubclass(cls, Warning):  # warnings are not errors
        continue
      found.append(name)
      if not issubclass(cls, LcaError):
        stray.append(f"{mod.__name__}.{name}")
  assert len(found) >= 15, found
  assert not stray, f"error classes outside LcaError: {stray}"


def test_builtin_bases_kept():
  """Old `except ValueError` / `except RuntimeError` call sites keep working."""
  from lca_jax.data.errors import DataError  # pylint: disable=g-import-not-at-top
  from lca_jax.model.config import ConfigError  # pylint: disable=g-import-not-at-top

  assert issubclass(ConfigError, ValueError) and issubclass(DataError, RuntimeError)
