"""lm-evaluation-harness's command line with ``--model lca_jax`` registered.

    lca-lm-eval --model lca_jax \\
      --model_args checkpoint=DIR[,mode=verify,n=3,dtype=float32] \\
      --tasks TASKS [--include_path TASK_YAML_DIR] [any lm_eval option]

``python -m lca_jax.eval.lm_eval_cli`` is the same command.

The arguments are lm_eval's own (``lm_eval --help``); this module registers the lca-jax model
(``lca_jax.eval.lm_eval_adapter``) and runs lm_eval's CLI in the same process. The pinned
lm_eval discovers models only through its own registry, hence this wrapper. A checkpoint that
cannot be loaded or a bad model argument is one line on stderr, exit status 2. lm_eval records
the git commit of the working directory with its results by running ``git describe``, whose
"fatal: not a git repository" reached the terminal outside a checkout: here git's stderr is
kept from the terminal (``_git_commit_hash``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional
from unittest import mock

from lm_eval import evaluator
from lm_eval.__main__ import cli_evaluate
from lm_eval.loggers.utils import get_commit_from_path

from lca_jax.errors import LcaError
from lca_jax.eval import lm_eval_adapter  # noqa: F401  (registers --model lca_jax)


def _git_commit_hash() -> Optional[str]:
  """lm_eval's ``get_git_commit_hash`` (the results' ``git_hash``: ``git describe --always`` of
  the working directory, else its .git files) with git's stderr captured, not shown."""
  try:
    out = subprocess.run(
      ["git", "describe", "--always"], capture_output=True, check=True, text=True
    )
    return out.stdout.strip()
  except (subprocess.CalledProcessError, OSError):  # outside a checkout; git not installed
    return get_commit_from_path(os.getcwd())


def main(argv=None) -> int:
  """Run lm_eval's CLI on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
  saved = sys.argv
  if argv is not None:
    sys.argv = [saved[0]] + list(argv)
  try:
    with mock.patch.object(evaluator, "get_git_commit_hash", _git_commit_hash):
      cli_evaluate()
  except LcaError as e:
    print(f"lca-lm-eval: error: {e}", file=sys.stderr, flush=True)
    return 2
  finally:
    sys.argv = saved
  return 0


if __name__ == "__main__":
  sys.exit(main())
