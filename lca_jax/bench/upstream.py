"""The paper's PyTorch code, loaded from a checkout at run time (``--upstream-src``: the folder
holding ``src/model/modern_fxt.py``); nothing of it lives in this repository. Its model is
built as src/eval/model_loader.py builds it (a plain object with one attribute per config key)
and loaded as src/eval/generate.py loads a checkpoint."""

from __future__ import annotations

import importlib
import json
import os
import sys

import jax
import numpy as np
import torch

from lca_jax.bench.args import BenchError
from lca_jax.interop.safetensors_io import read_safetensors

UPSTREAM_MODULE = "src.model.modern_fxt"


def first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0]


def check_upstream_src(path: str) -> str:
  """The absolute path of a checkout of the paper's code; BenchError otherwise."""
  if not path:
    raise BenchError("--upstream-src is empty (give the paper's code checkout)")
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise BenchError(f"--upstream-src {path}: no such directory")
  want = os.path.join(path, *UPSTREAM_MODULE.split(".")) + ".py"
  if not os.path.isfile(want):
    raise BenchError(
      f"--upstream-src {path}: not the paper's code (no {os.path.relpath(want, path)})"
    )
  return path


def add_upstream_src_arg(p):
  p.add_argument(
    "--upstream-src",
    required=True,
    metavar="DIR",
    help="checkout of the paper's code (holds src/model/modern_fxt.py)",
  )


def add_torch_device_arg(p):
  p.add_argument(
    "--torch-device",
    default="cpu",
    choices=("cpu", "cuda", "auto"),
    help="auto = cuda when jax runs on a GPU and torch sees one",
  )


def torch_device(device: str) -> str:
  """``--torch-device``'s device (``auto``: cuda when jax runs on a GPU and torch sees one)."""
  if device == "auto":
    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
  if device == "cuda" and not torch.cuda.is_available():
    raise BenchError("--torch-device cuda: torch sees no CUDA device")
  return device


def sync(device: str):
  """Waits for torch's queued work on ``device``."""
  if device == "cuda":
    torch.cuda.synchronize()


def import_upstream(src: str):
  """``FxTTransformerLM`` of the checkout at ``src`` (imported from there, never copied)."""
  have = sys.modules.get("src")
  if have is not None:
    where = [os.path.abspath(p) for p in getattr(have, "__path__", [])]
    if os.path.join(src, "src") not in where:
      raise BenchError(
        f"a different 'src' package is already imported ({where}); "
        f"cannot import the paper's code from {src}"
      )
  if src not in sys.path:
    sys.path.insert(0, src)
  try:
    mod = importlib.import_module(UPSTREAM_MODULE)
  except Exception as e:  # pylint: disable=broad-except  (any failure: one line, exit 2)
    raise BenchError(
      f"--upstream-src {src}: cannot import {UPSTREAM_MODULE} ({type(e).__name__}: {e})"
    ) from None
  cls = getattr(mod, "FxTTransformerLM", None)
  if cls is None:
    raise BenchError(f"--upstream-src {src}: {UPSTREAM_MODULE} has no FxTTransformerLM")
  return cls


class _UpstreamArgs:
  """The plain attribute bag upstream builds its model from (src/eval/model_loader.py)."""


def upstream_cfg(uc: dict):
  cfg = _UpstreamArgs()
  for k, v in uc.items():
    setattr(cfg, k, v)
  return cfg


def upstream_script_id(uc: dict) -> int:
  """train.py: ``script_id = list(args.id_to_script.keys())[0]``; config.json keys are strings
  that the model turns into ints, and forward looks the id up among those ints."""
  return int(next(iter(uc["id_to_script"])))


def build_upstream(cls, uc: dict, device: str, seed: int):
  """The paper's model of config dict ``uc`` (torch seed ``seed``), float32, train mode."""
  torch.manual_seed(seed)
  try:
    model = cls(upstream_cfg(uc))
  except Exception as e:  # pylint: disable=broad-except
    raise BenchError(
      f"the paper's FxTTransformerLM rejects this model ({type(e).__name__}: {e})"
    ) from None
  return model.to(device=device, dtype=torch.float32).train()


def upstream_params(cls, uc: dict) -> int:
  model = build_upstream(cls, uc, "cpu", 0)
  return int(sum(p.numel() for p in model.parameters()))


def load_upstream_dir(cls, path: str, device: str):
  """The paper's model from a checkpoint directory, as src/eval/generate.py loads one
  (config.json attributes, strict load_state_dict of model.safetensors), eval mode, float32."""
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    uc = json.load(f)
  model = build_upstream(cls, uc, "cpu", 0)
  sd = {
    k: torch.from_numpy(np.array(v))
    for k, v in read_safetensors(os.path.join(path, "model.safetensors")).items()
  }
  try:
    model.load_state_dict(sd, strict=True)
  except RuntimeError as e:
    raise BenchError(f"the paper's model rejects the exported weights ({first_line(e)})") from None
  return model.to(device=device, dtype=torch.float32).eval(), uc
