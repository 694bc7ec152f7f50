"""Training and decoding throughput of the paper's PyTorch code vs lca-jax, same model, one run.

    python tools/bench_vs_upstream.py train --upstream-src /tmp/upstream \
        [--shapes 4x1024,1x4096] [--steps 10] [--rounds 2] [--warmup 2] \
        [--d-model 256 --d-inner 1024 --n-heads 4 --layers 2,4,2,2] [--max-latent-ratio 0] \
        [--data FILE.txt]
    python tools/bench_vs_upstream.py decode --upstream-src /tmp/upstream \
        [--sizes 11m,60m,374m] [--prompt-bytes 256] [--new-bytes 128] [--temperature 0.99]

``--upstream-src`` is a checkout of the paper's code (the folder holding ``src/model/modern_fxt.py``);
it is imported at run time, nothing of it lives in this repository. For each shape ``BxT`` (rows x
bytes) both sides train on the same rows of real text (the bundled demo corpus, or ``--data``, as
byte ids of lca_jax.vocab = the ByT5 ids upstream uses, documents ending with EOS), in ``--rounds``
alternating blocks of ``--steps`` timed steps per side (``bench_pair``: a slow spell of a shared
machine falls on both sides, each timed in its steady state):

  * upstream: ``FxTTransformerLM`` built from ``config_to_upstream(ModelConfig)`` (a plain object
    with one attribute per key, as src/eval/model_loader.py does), float32, train mode, eager;
    step = ``model(batch, task="LM", script_id=259)`` (the first key of ``id_to_script``, as
    src/train/train.py does), loss + mtp_loss + 10 * loss_boundaries[0] (train.py's weights with
    scale_loss2 1 and scale_bp 10), zero_grad / backward / clip_grad_norm_(--clip) / Adam step;
    torch uses all CPU cores.
  * lca_jax: the same shape as a configs/lca_mbp.py config with ``--config.x.y=v`` overrides
    (printed as ``lca_train_overrides``), float32, lambdas 1/1/10, Adam with the same clip and the
    same constant learning rate (no warmup);
    ``loop.prepare`` / ``setup.init_state`` / ``setup.train_step(state, setup.device_batch(b))``
    exactly as lca-train, on the same mesh (a CPU host split in two runs B rows data-parallel
    when they divide, else splits heads and MLP; other hosts use gcd(devices, B) devices).

This program starts as lca-train starts (``lca_jax/hostmem.py``: large host buffers on
transparent huge pages where the kernel's THP mode is ``madvise``, by a glibc tunable set at
start). ``--upstream-env own`` (default) runs the paper's code in a child process with the
environment this program was started with, as its users run it (``UpstreamProcess``: it
answers one step at a time and times it itself; only one side runs at a time);
``--upstream-env same`` runs it in this process, sharing lca_jax's allocator setting.
``machine`` prints ``thp_mode`` and ``glibc_tunables``, ``upstream_env`` the mode and the
paper's side's ``glibc_tunables``. ``--warmup`` steps are not timed (for lca_jax the first one
compiles: ``compile_s``). Prints one JSON object: per shape the bytes/s and seconds per optimizer step of
both sides (median over the timed steps of all rounds; every step in ``step_s_all``), ``ratio``
= lca_jax bytes/s / upstream bytes/s, and the median and range of the rounds' ratios
(``ratio_rounds_median``, ``ratio_rounds_range``), plus machine info, model shape and the parameter
counts of both sides (equal once lca_jax's vocabulary padding rows are removed).

``decode``: for each size of ``--sizes`` (``11m`` = d 256 / inner 1024 / 4 heads / layers
2,4,2,2; ``60m`` = d 512 / 2048 / 8 heads / 2,8,2,2; ``374m`` = configs/lca_mbp.py's shape,
d 1024 / 4096 / 8 heads / 2,16,2,2; or ``dD:INNER:HEADS[:KV]:ENC,LM,DEC,MBP``, e.g.
``d64:128:4:1,1,1,1``), random lca_jax weights (``init_params``, ``--seed``; configs/lca_mbp.py
in float32) are written in the paper's checkpoint layout (``interop.upstream.write_dir``) and
loaded by both sides: upstream's ``FxTTransformerLM`` from that config.json with a strict
``load_state_dict`` (as src/eval/generate.py loads a checkpoint; eval mode, float32), lca_jax
through the converter (``interop.upstream.load_dir``, embedding and head padded to its 384
rows). Both continue the same ``--prompt-bytes`` prompt of real text (the
bundled corpus, ``bench_decode.prompt_ids``) by ``--new-bytes`` bytes, batch 1, sampling at
``--temperature`` 0.99 with a fixed seed (upstream's temperature 1.0 is its greedy path, which
stops early on the repetitive output of random weights):

  * upstream: ``generate_group_cached(ids, max_tokens=new_bytes, temperature=T,
    threshold=2.0, candidates=1)``, its KV-cached decoding; threshold 2 accepts no MBP
    candidate, so it commits one NT byte per step (the output of ntp), though it still runs
    its MBP stage every step (its cached path has no NT-only mode for an LCA-MBP model). One
    untimed call of a few bytes first.
  * lca_jax: ``generate(mode="ntp", temperature=T, ignore_eos=True, seed=seed)``; one untimed
    call first (it compiles: ``compile_s``), best of ``--repeats``.

Per size: parameter counts, bytes/s and ms per step of both sides, ``ratio`` = lca_jax /
upstream bytes/s, and the weight-streaming bound of lca_jax's step (``lca_jax.decode.bounds``,
the same bandwidth measurement and formula as tools/bench_decode.py, with a matrix of that
size's float32 parameters unless ``--stream-mb`` is given: per size ``stream_gb_s`` of the
jax device, ``bound_ms_per_step``, ``ms_per_step_over_bound``).

Bad input is reported in one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import types
import warnings
from multiprocessing.connection import Connection

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import jaxlib  # noqa: E402  pylint: disable=g-import-not-at-top
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top
import torch  # noqa: E402  pylint: disable=g-import-not-at-top

from lca_jax import configs_io, hostmem, vocab  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.api import Model  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.data.errors import DataError  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.decode import bounds  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.interop import upstream as up_io  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.interop.safetensors_io import read_safetensors  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.interop.upstream import config_to_upstream  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.model.config import ConfigError  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.train import inputs, loop  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.train import sharding as shd  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.train.errors import TrainError  # noqa: E402  pylint: disable=g-import-not-at-top

PROG = "bench_vs_upstream"
BASE_CONFIG = os.path.join(ROOT, "configs", "lca_mbp.py")
UPSTREAM_MODULE = "src.model.modern_fxt"
LAMBDAS = (1.0, 1.0, 10.0)  # NTP, MBP (train.py scale_loss2), BP (train.py scale_bp)
# decode: the sizes of the issue (None = configs/lca_mbp.py's own shape: d 1024, 2/16/2/2)
SIZES = {
  "11m": dict(d_model=256, d_inner=1024, n_heads=4, n_kv_heads=4, layers="2,4,2,2"),
  "60m": dict(d_model=512, d_inner=2048, n_heads=8, n_kv_heads=8, layers="2,8,2,2"),
  "374m": None,
}
# upstream's generate_group_cached accepts an MBP candidate when its probability >= threshold:
# above 1 it accepts none, so every step commits the one NT byte (ntp's output)
UPSTREAM_THRESHOLD = 2.0


def _load_bench_decode():
  """tools/bench_decode.py as a module (shared: prompts, model shapes, step bound)."""
  name = "_lca_tools_bench_decode"
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(
      name, os.path.join(ROOT, "tools", "bench_decode.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[name] = mod
  return sys.modules[name]


bench_decode = _load_bench_decode()


class BenchError(ValueError):
  """Bad input: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
  """argparse whose usage errors are one line on stderr (exit status 2)."""

  def error(self, message):
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# ---- arguments ------------------------------------------------------------------------------
def parse_shapes(s: str):
  """'4x1024,1x4096' -> [(4, 1024), (1, 4096)]."""
  out = []
  for part in (p.strip() for p in str(s).split(",")):
    try:
      b, t = (int(x) for x in part.lower().split("x"))
    except ValueError:
      raise BenchError(f"--shapes: {part!r} is not ROWSxBYTES (e.g. 4x1024)") from None
    if b < 1 or t < 4:
      raise BenchError(f"--shapes: {part!r} needs at least 1 row of at least 4 bytes")
    out.append((b, t))
  if len(set(out)) != len(out):
    raise BenchError(f"--shapes: {s!r} repeats a shape")
  return out


def parse_layers(s: str):
  """'2,4,2,2' -> (enc, lm, dec, mbp); BenchError naming --layers otherwise."""
  try:
    return configs_io.parse_layers(s)
  except configs_io.ConfigFileError as e:
    raise BenchError(str(e)) from None


_CUSTOM_SIZE = re.compile(r"d(\d+):(\d+):(\d+)(?::(\d+))?:(\d+(?:,\d+){3})")


def parse_sizes(s: str):
  """'11m,60m,d64:128:4:1,1,1,1' -> [(name, shape kwargs or None)] (None: configs/lca_mbp.py)."""
  out = []
  parts = re.findall(r"d\d+:\d+:\d+(?::\d+)?:\d+(?:,\d+){3}|[^,]+", str(s))
  for part in (p.strip() for p in parts):
    if not part:
      continue
    key = part.lower()
    if key in SIZES:
      out.append((key, SIZES[key]))
      continue
    m = _CUSTOM_SIZE.fullmatch(key)
    if not m:
      raise BenchError(
        f"--sizes: {part!r} is neither one of {', '.join(SIZES)} nor "
        "dD:INNER:HEADS[:KV]:ENC,LM,DEC,MBP (e.g. d64:128:4:1,1,1,1)"
      )
    d, inner, heads, kv, layers = m.groups()
    parse_layers(layers)
    shape = dict(
      d_model=int(d), d_inner=int(inner), n_heads=int(heads), n_kv_heads=int(kv or 0), layers=layers
    )
    if min(shape["d_model"], shape["d_inner"], shape["n_heads"]) < 1:
      raise BenchError(f"--sizes: {part!r}: d, inner and heads must be >= 1")
    out.append((key, shape))
  if not out:
    raise BenchError(f"--sizes: {s!r} names no size")
  if len({k for k, _ in out}) != len(out):
    raise BenchError(f"--sizes: {s!r} repeats a size")
  return out


def _check_upstream_src(path: str) -> str:
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


def _upstream_src_arg(p):
  p.add_argument(
    "--upstream-src",
    required=True,
    metavar="DIR",
    help="checkout of the paper's code (holds src/model/modern_fxt.py)",
  )


def _torch_device_arg(p):
  p.add_argument(
    "--torch-device",
    default="cpu",
    choices=("cpu", "cuda", "auto"),
    help="auto = cuda when jax runs on a GPU and torch sees one",
  )


def _parser():
  ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
  sub = ap.add_subparsers(dest="cmd", required=True, metavar="{train,decode}")
  tr = sub.add_parser("train", help="training throughput (bytes/s, s per optimizer step)")
  _upstream_src_arg(tr)
  tr.add_argument("--shapes", default="4x1024,1x4096", help="ROWSxBYTES per step, comma separated")
  tr.add_argument(
    "--steps", type=int, default=10, help="timed optimizer steps per side, shape and round"
  )
  tr.add_argument(
    "--rounds", type=int, default=2, help="alternating blocks of --steps steps per side (>= 1)"
  )
  tr.add_argument(
    "--warmup", type=int, default=2, help="untimed steps first (>= 1; lca_jax compiles)"
  )
  tr.add_argument("--d-model", type=int, default=256)
  tr.add_argument("--d-inner", type=int, default=1024)
  tr.add_argument("--n-heads", type=int, default=4)
  tr.add_argument("--n-kv-heads", type=int, default=0, help="0 = --n-heads")
  tr.add_argument("--layers", default="2,4,2,2", help="ENC,LM,DEC,MBP layer counts")
  tr.add_argument(
    "--max-latent-ratio",
    type=float,
    default=0.0,
    help="lca_jax's static latent capacity per byte (0 = auto from the boundary "
    "prior, ModelConfig.latent_ratio; configs/lca_mbp.py's default)",
  )
  tr.add_argument("--dropout", type=float, default=0.0)
  tr.add_argument(
    "--clip", type=float, default=0.25, help="global grad-norm clip, both sides (0 = off)"
  )
  tr.add_argument("--lr", type=float, default=3e-4)
  tr.add_argument("--seed", type=int, default=0)
  tr.add_argument(
    "--upstream-env",
    default="own",
    choices=("own", "same"),
    help="own: the paper's code in a child process with the environment this program was "
    "started with (as its users run it); same: in this process, sharing the allocator "
    "setting lca_jax starts with (lca_jax/hostmem.py)",
  )
  tr.add_argument(
    "--data",
    default="",
    metavar="FILE",
    help="local text file(s), comma separated (default: the bundled demo corpus)",
  )
  _torch_device_arg(tr)
  de = sub.add_parser("decode", help="decoding throughput (bytes/s, ms per step, bound)")
  _upstream_src_arg(de)
  de.add_argument(
    "--sizes",
    default="11m,60m,374m",
    help=f"comma separated: {', '.join(SIZES)} or dD:INNER:HEADS[:KV]:ENC,LM,DEC,MBP",
  )
  de.add_argument("--prompt-bytes", type=int, default=256, help="prompt of real text, bytes")
  de.add_argument("--new-bytes", type=int, default=128, help="bytes generated per call")
  de.add_argument(
    "--temperature",
    type=float,
    default=0.99,
    help="sampling temperature, both sides (upstream's 1.0 is its greedy path)",
  )
  de.add_argument("--seed", type=int, default=0, help="random weights and sampling seed")
  de.add_argument("--repeats", type=int, default=2, help="timed lca_jax calls (best counts)")
  de.add_argument(
    "--stream-mb",
    type=float,
    default=0.0,
    help="W of the bandwidth matvec, MB (0 = each size's float32 parameters, at least 16 MB)",
  )
  de.add_argument("--stream-repeats", type=int, default=5)
  de.add_argument(
    "--torch-threads",
    type=int,
    default=0,
    help="torch CPU threads (0 = all cores, as train uses; on a busy machine 1 can be faster)",
  )
  _torch_device_arg(de)
  return ap


# ---- machine --------------------------------------------------------------------------------
def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      for line in f:
        if line.lower().startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine_info(torch_device: str) -> dict:
  info = dict(
    cpu_model=cpu_model(),
    cores=os.cpu_count(),
    platform=platform.platform(),
    python=platform.python_version(),
    jax=jax.__version__,
    jaxlib=getattr(jaxlib, "__version__", None),
    torch=torch.__version__,
    jax_backend=jax.default_backend(),
    jax_device_kind=jax.devices()[0].device_kind,
    jax_devices=len(jax.devices()),
    torch_device=torch_device,
    torch_threads=torch.get_num_threads(),
    **hostmem.describe(),
  )
  if torch_device == "cuda":
    info["torch_cuda_device"] = torch.cuda.get_device_name(0)
  return info


# ---- lca_jax side ---------------------------------------------------------------------------
def lca_overrides(args, layers, b: int, t: int, data: str, max_seq_len: int):
  """``key=value`` overrides of configs/lca_mbp.py for this model and shape (lca-train's
  ``--config.key=value``)."""
  enc, lm, dec, mbp = layers
  kv = args.n_kv_heads or args.n_heads
  return [
    "model.kind=hierarchical",
    "model.boundaries=learned",
    f"model.d_model={args.d_model}",
    f"model.d_inner={args.d_inner}",
    f"model.n_heads={args.n_heads}",
    f"model.n_kv_heads={kv}",
    f"model.n_enc={enc}",
    f"model.n_lm={lm}",
    f"model.n_dec={dec}",
    f"model.n_mbp={mbp}",
    "model.n_mlp_mbp=0",
    f"model.max_latent_ratio={args.max_latent_ratio}",
    f"model.dropout={args.dropout}",
    "model.dtype=float32",
    "model.attention_impl=xla",
    f"model.max_seq_len={max_seq_len}",
    "data.format=text",
    f"data.train_files={data}",
    "data.packing=concat",
    "data.worker_count=0",
    f"optim.lr={args.lr}",
    "optim.weight_decay=0.0",
    "optim.b1=0.9",
    "optim.b2=0.999",
    "optim.eps=1e-08",
    f"optim.clip_norm={args.clip}",
    # a constant learning rate, as the upstream side's torch Adam has no scheduler (the base
    # config's 2000 warmup steps would keep lca_jax's lr near 0 for the whole benchmark: its
    # boundary rate would not move while upstream's falls from 0.5 towards the prior)
    "optim.warmup_steps=0",
    "optim.final_lr_ratio=1.0",
    f"train.seed={args.seed}",
    f"train.lambda_ntp={LAMBDAS[0]}",
    f"train.lambda_mbp={LAMBDAS[1]}",
    f"train.lambda_bp={LAMBDAS[2]}",
    "train.progress_bar=False",
    "train.tensorboard=False",
    f"train.steps={args.warmup + args.steps}",
    # the shape
    f"data.seq_len={t}",
    f"train.micro_batch_size={b}",
    f"train.global_batch_bytes={b * t}",
  ]


SHAPE_KEYS = ("data.seq_len=", "train.micro_batch_size=", "train.global_batch_bytes=")


def lca_config(args, layers, b: int, t: int, data: str, max_seq_len: int):
  """(configs/lca_mbp.py with the overrides applied, the overrides)."""
  overrides = lca_overrides(args, layers, b, t, data, max_seq_len)
  config = configs_io.apply_overrides(configs_io.load_config(BASE_CONFIG), overrides)
  loop.model_config_of(config)  # a ConfigError here, not inside prepare
  return config, overrides


def jax_devices_for(config, rows: int):
  """All devices when they are this host's CPU split (rows that do not divide over it split the
  heads instead, ``sharding.cpu_mesh``), else the first gcd(#devices, rows)."""
  devs = jax.devices()
  return devs if shd.is_cpu_split(config.mesh, devs) else devs[: math.gcd(len(devs), rows)]


def read_rows(config, plan, n: int):
  """``n`` host batches ({'ids', 'segment_ids', 'positions'} [B, T] int32) of the training data."""
  pipe = inputs.make_train_pipeline(config, plan)
  try:
    return [next(pipe) for _ in range(n)]
  finally:
    pipe.close()


def n_params_jax(params) -> int:
  return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))


class LcaSide:
  """lca-train's step on host batches, one call at a time: the state lives here."""

  def __init__(self, setup):
    self.setup = setup
    t0 = time.perf_counter()
    self.state = jax.block_until_ready(setup.init_state())
    self.init_s = time.perf_counter() - t0
    self.metrics = []

  def step(self, host_batch) -> None:
    s = self.setup
    with shd.mesh_context(s.mesh):
      self.state, m = s.train_step(self.state, s.device_batch(host_batch))
      jax.block_until_ready((self.state, m))
    self.metrics.append(m)

  def timed_step(self, host_batch) -> float:
    return _timed(self.step, host_batch)

  def summary(self, step_s: float, timed: int) -> dict:
    ms = jax.device_get(self.metrics[-timed:])
    bpl = [float(x["bytes_per_latent"]) for x in ms if "bytes_per_latent" in x]
    return dict(
      bytes_per_s=self.setup.plan.bytes_per_step / step_s,
      step_s=step_s,
      init_s=self.init_s,
      devices=int(self.setup.mesh.devices.size),
      mesh={k: int(v) for k, v in self.setup.mesh.shape.items()},
      bytes_per_latent=(sum(bpl) / len(bpl)) if bpl else None,
      final_loss=float(ms[-1]["loss"]),
    )


# ---- upstream side --------------------------------------------------------------------------
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
  torch.manual_seed(seed)
  try:
    model = cls(upstream_cfg(uc))
  except Exception as e:  # pylint: disable=broad-except
    raise BenchError(
      f"the paper's FxTTransformerLM rejects this model ({type(e).__name__}: {e})"
    ) from None
  return model.to(device=device, dtype=torch.float32).train()


def _sync(device: str):
  if device == "cuda":
    torch.cuda.synchronize()


def upstream_step(model, opt, ids_BT: np.ndarray, device: str, script_id: int, clip: float):
  """One optimizer step as src/train/train.py takes it (task LM, no accumulation)."""
  x_BT = torch.from_numpy(np.asarray(ids_BT, np.int64)).to(device)
  batch = {"input_ids": x_BT, "attention_mask": torch.ones_like(x_BT)}
  loss, mtp_loss, stats, loss_boundaries, _ = model(batch, task="LM", script_id=script_id)
  total = LAMBDAS[0] * loss + LAMBDAS[1] * mtp_loss + LAMBDAS[2] * loss_boundaries[0]
  total.backward()
  if clip > 0:
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
  opt.step()
  opt.zero_grad(set_to_none=True)
  return total, stats


class UpstreamSide:
  """The paper's model and Adam, one optimizer step at a time (src/train/train.py's step)."""

  def __init__(self, cls, uc: dict, device: str, args):
    self.model = build_upstream(cls, uc, device, args.seed)
    self.opt = torch.optim.Adam(
      self.model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )
    self.sid, self.device, self.clip = upstream_script_id(uc), device, args.clip
    self.losses, self.s_len = [], []
    self.env = dict(glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""))  # what it runs under

  def step(self, host_batch) -> None:
    with warnings.catch_warnings():  # train.py ignores warnings too (var() of a 1-row batch)
      warnings.filterwarnings("ignore", message=".*degrees of freedom", category=UserWarning)
      total, stats = upstream_step(
        self.model, self.opt, host_batch["ids"], self.device, self.sid, self.clip
      )
    _sync(self.device)
    self.losses.append(float(total.detach()))
    self.s_len.append(stats.get("shortened_length"))

  def timed_step(self, host_batch) -> float:
    return _timed(self.step, host_batch)

  def close(self) -> None:
    pass

  def summary(self, step_s: float, timed: int, rows: int, t: int) -> dict:
    # shortened_length: null group + the most groups of any row in the batch
    groups = [float(x) - 1 for x in self.s_len[-timed:] if x is not None]
    return dict(
      bytes_per_s=rows * t / step_s,
      step_s=step_s,
      bytes_per_latent=(t * len(groups) / sum(groups)) if groups and sum(groups) > 0 else None,
      final_loss=self.losses[-1],
    )


def _timed(fn, arg) -> float:
  t0 = time.perf_counter()
  fn(arg)
  return time.perf_counter() - t0


class UpstreamProcess:
  """``UpstreamSide`` in a child process started with the environment this program was started
  with (``hostmem.original_environ``: without the allocator tunable lca_jax sets for itself),
  i.e. the paper's code as its users run it. Steps are timed in the child; the parent waits
  idle meanwhile (and the child while lca_jax steps)."""

  def __init__(self, src: str, uc: dict, device: str, args):
    ours, theirs = socket.socketpair()
    code = (
      f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
      f"import bench_vs_upstream as b; b.upstream_child({theirs.fileno()})"
    )
    self.proc = subprocess.Popen(
      [sys.executable, "-c", code],
      pass_fds=(theirs.fileno(),),
      env=hostmem.original_environ(),
      stdin=subprocess.DEVNULL,
    )
    theirs.close()
    self.conn = Connection(ours.detach())
    hp = dict(seed=args.seed, lr=args.lr, clip=args.clip)
    try:
      self.env = self._call("init", src, uc, device, hp)
    except BenchError:
      self.close()
      raise

  def _call(self, *msg):
    try:
      self.conn.send(msg)
      status, value = self.conn.recv()
    except (EOFError, OSError) as e:
      raise BenchError(
        f"the paper's code's process ended (exit status {self.proc.poll()}): {e or 'no reply'}"
      ) from None
    if status != "ok":
      raise BenchError(value)
    return value

  def step(self, host_batch) -> None:
    self._call("step", host_batch)

  def timed_step(self, host_batch) -> float:
    return self._call("step", host_batch)

  def summary(self, step_s: float, timed: int, rows: int, t: int) -> dict:
    return self._call("summary", step_s, timed, rows, t)

  def close(self) -> None:
    try:
      self.conn.send(("close",))
    except OSError:
      pass
    self.conn.close()
    try:
      self.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()


def upstream_child(fd: int) -> None:
  """The child of ``UpstreamProcess``: builds the side on ``init``, then answers ``step``
  (its own wall time) and ``summary`` until ``close``; any failure goes back as one line."""
  conn = Connection(fd)
  torch.set_num_threads(os.cpu_count() or 1)
  side = None
  while True:
    try:
      msg = conn.recv()
    except EOFError:
      return
    try:
      if msg[0] == "close":
        return
      if msg[0] == "init":
        src, uc, device, hp = msg[1:]
        side = UpstreamSide(import_upstream(src), uc, device, types.SimpleNamespace(**hp))
        out = side.env
      elif msg[0] == "step":
        out = side.timed_step(msg[1])
      else:
        out = side.summary(*msg[1:])
      conn.send(("ok", out))
    except Exception as e:  # pylint: disable=broad-except  (reported by the parent, one line)
      conn.send(("error", str(e) if isinstance(e, BenchError) else f"{type(e).__name__}: {e}"))


def bench_pair(up, ours: LcaSide, host, warmup: int, rounds: int) -> dict:
  """Both sides (``up``: an ``UpstreamSide`` or ``UpstreamProcess``) on the same batches:
  ``warmup`` untimed steps each (lca_jax's first compiles), then ``rounds`` rounds of [one
  untimed step, the timed steps] of upstream, then the same of lca_jax. Alternating blocks put
  a slow spell of a shared machine on both sides, and the untimed step that opens each block
  keeps the cost of switching sides (the other side's threads going idle, its freed memory
  mapped anew) out of both figures: each side is timed in its steady state, as a training
  run is. Step time = median over all timed steps of a
  side; also the median and range of the ratios of the rounds' mean step times."""
  up.step(host[0])
  first_s = ours.timed_step(host[0])  # compiles
  for b in host[1:warmup]:
    up.step(b)
    ours.step(b)
  timed = host[warmup:]
  t_up, t_ours, per_round = [], [], []
  for _ in range(rounds):
    means = []
    for side, acc in ((up, t_up), (ours, t_ours)):
      side.step(host[0])  # opens the block, untimed
      ts = [side.timed_step(b) for b in timed]
      acc.extend(ts)
      means.append(sum(ts) / len(ts))
    per_round.append(means[0] / means[1])
  rows, t = host[0]["ids"].shape
  n = len(timed)
  a = up.summary(float(np.median(t_up)), n, rows, t)
  o = ours.summary(float(np.median(t_ours)), n)
  o["compile_s"] = first_s
  a["step_s_all"] = [round(x, 4) for x in t_up]
  o["step_s_all"] = [round(x, 4) for x in t_ours]
  return dict(
    upstream=a,
    lca_jax=o,
    ratio=o["bytes_per_s"] / a["bytes_per_s"],
    ratio_rounds_median=float(np.median(per_round)),
    ratio_rounds_range=[float(min(per_round)), float(max(per_round))],
  )


def upstream_params(cls, uc: dict) -> int:
  model = build_upstream(cls, uc, "cpu", 0)
  return int(sum(p.numel() for p in model.parameters()))


# ---- decode ---------------------------------------------------------------------------------
def decode_model_config(shape):
  """lca_jax's ModelConfig of a --sizes entry (configs/lca_mbp.py in float32, plain XLA)."""
  try:
    if shape is None:
      return bench_decode.model_config(BASE_CONFIG, bench_decode.FLAG_BASE)
    return bench_decode.model_config(None, (), **shape)
  except (ConfigError, configs_io.ConfigFileError, ValueError) as e:
    raise BenchError(f"--sizes: {e}") from None


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
    raise BenchError(f"the paper's model rejects the exported weights ({_first_line(e)})") from None
  return model.to(device=device, dtype=torch.float32).eval(), uc


def write_random_dir(path: str, cfg, seed: int):
  """Random lca_jax weights of ``cfg`` (``init_params``) written in the paper's checkpoint
  layout at ``path``, for both sides to load."""
  params = bench_decode.init_params(cfg, jax.random.PRNGKey(seed))
  up_io.write_dir(path, jax.tree_util.tree_map(np.asarray, params), cfg)


def load_lca_dir(path: str, cfg):
  """lca_jax's model of the same checkpoint directory: its weights through the converter
  (``interop.upstream.load_dir``), the embedding and head zero-padded to ``cfg.vocab_size`` rows
  as lca_jax's own configs hold them (``lca_jax.load`` would keep the 261 rows of the paper's
  layout), under ``cfg`` (config.json does not carry max_latent_ratio, unused in decoding)."""
  try:
    got, params = up_io.load_dir(path, vocab_size=cfg.vocab_size)
  except ValueError as e:  # CheckpointError
    raise BenchError(f"{path}: {e}") from None
  if got.replace(max_latent_ratio=cfg.max_latent_ratio) != cfg:
    raise BenchError(f"{path}: config.json does not give back the model written")
  return Model(cfg, jax.tree_util.tree_map(jax.numpy.asarray, params), source=path)


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0]


def upstream_decode(model, prompt, new_bytes: int, temperature: float, seed: int, device: str):
  """Upstream's KV-cached decoding, batch 1, one NT byte per step (UPSTREAM_THRESHOLD)."""
  ids = torch.from_numpy(np.asarray(prompt, np.int64))[None].to(device)
  kw = dict(
    temperature=temperature,
    top_k=None,
    top_p=None,
    stop_token_id=None,
    threshold=UPSTREAM_THRESHOLD,
    candidates=1,
  )
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      torch.manual_seed(seed)
      model.generate_group_cached(ids, max_tokens=min(4, new_bytes), **kw)  # warm-up
      _sync(device)
      torch.manual_seed(seed)
      t0 = time.perf_counter()
      out, acceptance = model.generate_group_cached(ids, max_tokens=new_bytes, **kw)
      _sync(device)
      elapsed = time.perf_counter() - t0
    except Exception as e:  # pylint: disable=broad-except  (one line, exit 2)
      raise BenchError(
        f"upstream generate_group_cached failed ({type(e).__name__}: {_first_line(e)})"
      ) from None
  n = len(out)
  return dict(
    bytes_per_s=n / elapsed,
    ms_per_step=elapsed / max(n, 1) * 1e3,
    bytes=n,
    steps=n,
    elapsed_s=elapsed,
    # upstream's own measure: bytes committed / logits read per step (NT, MBP, copies), so
    # 1 / (candidates + 2) when no candidate is accepted
    acceptance_rate=float(acceptance),
  )


def lca_decode(model, prompt, args, stream_bps: float):
  """lca_jax ntp decoding, batch 1, after one untimed (compiling) call; best of --repeats."""
  kw = dict(
    mode="ntp",
    temperature=args.temperature,
    max_bytes=args.new_bytes,
    ignore_eos=True,
    seed=args.seed,
  )
  t = bench_decode.timed_decodes(model, [prompt], {"ntp": kw}, args.repeats)["ntp"]
  best = t["best"]
  length = bounds.cache_len([prompt.size], args.new_bytes, 1, model.cfg.max_seq_len)
  row = dict(
    bytes_per_s=best.bytes_per_s,
    bytes=int(sum(len(x) for x in best.ids)),
    steps=best.steps,
    elapsed_s=best.elapsed_s,
    latent_steps_per_byte=best.latent_steps_per_byte,
    compile_s=t["first"].compile_s,
    decode_bytes_per_s=t["decode_bytes_per_s"],
    prefill_s=t["prefill"].elapsed_s,
  )
  row.update(
    bench_decode.step_bound(model, "ntp", 1, 1, length, best, stream_bps, t["ms_per_step"])
  )
  return row


def _validate_decode(args):
  src = _check_upstream_src(args.upstream_src)
  sizes = parse_sizes(args.sizes)
  for name in ("prompt_bytes", "new_bytes", "repeats", "stream_repeats"):
    if getattr(args, name) < 1:
      raise BenchError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  t = args.temperature
  if not (math.isfinite(t) and t > 0):
    raise BenchError(f"--temperature must be a finite number > 0 (both sides sample), got {t}")
  if t == 1.0:
    raise BenchError(
      "--temperature 1.0 is upstream's greedy path (argmax) but lca_jax's plain sampling; "
      "choose another value (e.g. 0.99)"
    )
  if args.torch_threads < 0:
    raise BenchError(f"--torch-threads must be >= 0 (0 = all cores), got {args.torch_threads}")
  if not (math.isfinite(args.stream_mb) and args.stream_mb >= 0):
    raise BenchError(f"--stream-mb must be >= 0 (0 = each size's parameters), got {args.stream_mb}")
  cfgs = [(name, decode_model_config(shape)) for name, shape in sizes]
  for name, cfg in cfgs:
    if args.prompt_bytes + args.new_bytes > cfg.max_seq_len:
      raise BenchError(
        f"size {name}: --prompt-bytes + --new-bytes ({args.prompt_bytes + args.new_bytes}) "
        f"exceed the model context ({cfg.max_seq_len} bytes)"
      )
  return src, cfgs, torch_device(args.torch_device)


def run_decode(args) -> dict:
  src, cfgs, device = _validate_decode(args)
  torch.set_num_threads(args.torch_threads or os.cpu_count() or 1)
  cls = import_upstream(src)
  prompt = bench_decode.prompt_ids(args.prompt_bytes)
  results = {}
  for name, cfg in cfgs:
    with tempfile.TemporaryDirectory(prefix="bench_vs_upstream_") as ckpt:
      print(f"{PROG}: {name}: random weights -> {ckpt} ...", file=sys.stderr, flush=True)
      write_random_dir(ckpt, cfg, args.seed)
      print(f"{PROG}: {name}: upstream ...", file=sys.stderr, flush=True)
      up_model, uc = load_upstream_dir(cls, ckpt, device)
      n_up = int(sum(p.numel() for p in up_model.parameters()))
      up = upstream_decode(up_model, prompt, args.new_bytes, args.temperature, args.seed, device)
      del up_model
      print(f"{PROG}: {name}: lca_jax ...", file=sys.stderr, flush=True)
      model = load_lca_dir(ckpt, cfg)
    # the probe streams a matrix of this model's size (bounds.stream_mb_for), from where its
    # steps stream their weights (a cache level on small models, DRAM on large ones)
    stream = bounds.stream_bandwidth(
      args.stream_mb or bounds.stream_mb_for(model.cfg), args.stream_repeats
    )
    ours = lca_decode(model, prompt, args, stream["bytes_per_s"])
    n_ours = bench_decode.n_params(model)
    pad = (model.cfg.vocab_size - model.cfg.n_tokens) * model.cfg.d_model * 2  # padding rows
    del model
    results[name] = dict(
      model=dict(
        d_model=cfg.d_model,
        d_inner=cfg.d_inner,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        layers=dict(enc=cfg.n_enc, lm=cfg.n_lm, dec=cfg.n_dec, mbp=cfg.n_mbp),
        upstream_model_config=uc["model_config"],
      ),
      params=dict(
        upstream=n_up,
        lca_jax=n_ours,
        lca_jax_without_padding=n_ours - pad,
        match=(n_ours - pad) == n_up,
      ),
      upstream=up,
      lca_jax=ours,
      ratio=ours["bytes_per_s"] / up["bytes_per_s"],
      stream_gb_s=round(stream["gb_s"], 2),
      stream={k: v for k, v in stream.items() if k not in ("gb_s", "bytes_per_s")},
    )
  return dict(
    machine=machine_info(device),
    upstream_src=src,
    base_config=os.path.relpath(BASE_CONFIG, ROOT),
    prompt_bytes=int(prompt.size),
    new_bytes=args.new_bytes,
    temperature=args.temperature,
    seed=args.seed,
    upstream_call=dict(
      method="generate_group_cached", threshold=UPSTREAM_THRESHOLD, candidates=1, batch=1
    ),
    lca_jax_call=dict(mode="ntp", ignore_eos=True, batch=1, repeats=args.repeats),
    sizes=results,
  )


# ---- main -----------------------------------------------------------------------------------
def _validate(args):
  src = _check_upstream_src(args.upstream_src)
  shapes = parse_shapes(args.shapes)
  layers = parse_layers(args.layers)
  for name in ("d_model", "d_inner", "n_heads"):
    if getattr(args, name) < 1:
      raise BenchError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.n_kv_heads < 0:
    raise BenchError(f"--n-kv-heads must be >= 0 (0 = --n-heads), got {args.n_kv_heads}")
  if args.steps < 1:
    raise BenchError(f"--steps must be >= 1, got {args.steps}")
  if args.rounds < 1:
    raise BenchError(f"--rounds must be >= 1, got {args.rounds}")
  if args.warmup < 1:
    raise BenchError(f"--warmup must be >= 1 (the first lca_jax step compiles), got {args.warmup}")
  for f in (p.strip() for p in args.data.split(",") if p.strip()):
    if not os.path.isfile(f):
      raise BenchError(f"--data {f}: no such file")
  return src, shapes, layers, torch_device(args.torch_device)


def torch_device(device: str) -> str:
  if device == "auto":
    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
  if device == "cuda" and not torch.cuda.is_available():
    raise BenchError("--torch-device cuda: torch sees no CUDA device")
  return device


def use_cpu_devices() -> None:
  """As lca-train: a CPU host split into ``mesh.cpu_devices`` devices (the base config's rule),
  fixed once per process before any backend starts; a shape whose rows do not divide over
  them splits heads and MLP over them instead (``sharding.cpu_mesh``)."""
  mesh = configs_io.load_config(BASE_CONFIG).mesh
  try:
    shd.use_cpu_devices(shd.cpu_device_count(mesh))
  except shd.MeshError as e:
    raise BenchError(str(e)) from None


def run_train(args) -> dict:
  use_cpu_devices()
  src, shapes, layers, device = _validate(args)
  data = ",".join(os.path.abspath(p.strip()) for p in args.data.split(",") if p.strip())
  torch.set_num_threads(os.cpu_count() or 1)
  cls = import_upstream(src)

  # One model for every shape (max_seq_len covers the longest); upstream gets its config dict.
  max_seq_len = max(4096, max(t for _, t in shapes))
  try:
    config0, overrides0 = lca_config(args, layers, *shapes[0], data, max_seq_len)
  except (ConfigError, configs_io.ConfigFileError) as e:
    raise BenchError(str(e)) from None
  model_cfg = loop.model_config_of(config0)
  uc = config_to_upstream(model_cfg)
  n_up = upstream_params(cls, uc)

  results, n_ours, own, up_env = {}, None, args.upstream_env == "own", None
  for b, t in shapes:
    key = f"{b}x{t}"
    try:
      config, _ = lca_config(args, layers, b, t, data, max_seq_len)
      setup = loop.prepare(config, jax_devices_for(config, b))
      host = read_rows(config, setup.plan, args.warmup + args.steps)
    except (ConfigError, configs_io.ConfigFileError, TrainError, DataError, shd.MeshError) as e:
      raise BenchError(f"shape {key}: {e}") from None
    top = max(int(np.max(h["ids"])) for h in host)
    if top >= uc["lm_vocab_size"]:  # the same ids must mean the same bytes on both sides
      raise BenchError(
        f"shape {key}: id {top} is outside upstream's vocabulary ({uc['lm_vocab_size']} ByT5 ids)"
      )
    if n_ours is None:
      n_ours = n_params_jax(setup.abstract.params)
    print(f"{PROG}: {key}: upstream and lca_jax, rounds of steps ...", file=sys.stderr, flush=True)
    up = UpstreamProcess(src, uc, device, args) if own else UpstreamSide(cls, uc, device, args)
    try:
      results[key] = bench_pair(up, LcaSide(setup), host, args.warmup, args.rounds)
    finally:
      up.close()
    up_env = up.env

  pad = (model_cfg.vocab_size - model_cfg.n_tokens) * model_cfg.d_model * 2  # embedding + head rows
  enc, lm, dec, mbp = layers
  return dict(
    machine=machine_info(device),
    upstream_env=dict(
      mode=args.upstream_env, glibc_tunables=up_env["glibc_tunables"] if up_env else None
    ),
    model=dict(
      d_model=model_cfg.d_model,
      d_inner=model_cfg.d_inner,
      n_heads=model_cfg.n_heads,
      n_kv_heads=model_cfg.n_kv_heads,
      layers=dict(enc=enc, lm=lm, dec=dec, mbp=mbp),
      upstream_model_config=uc["model_config"],
      max_latent_ratio=args.max_latent_ratio,
      dropout=args.dropout,
      dtype="float32",
      n_tokens=model_cfg.n_tokens,
      vocab_size=model_cfg.vocab_size,
      upstream_lm_vocab_size=uc["lm_vocab_size"],
      upstream_script_id=upstream_script_id(uc),
      eos_id=vocab.EOS_ID,
      lambdas=dict(ntp=LAMBDAS[0], mbp=LAMBDAS[1], bp=LAMBDAS[2]),
      optimizer=dict(name="adam", lr=args.lr, b1=0.9, b2=0.999, eps=1e-8, clip=args.clip),
    ),
    params=dict(
      upstream=n_up,
      lca_jax=n_ours,
      lca_jax_vocab_padding=pad,
      lca_jax_without_padding=n_ours - pad,
      match=(n_ours - pad) == n_up,
    ),
    data=data or "bundled demo corpus (lca_jax/data/corpus, train split)",
    upstream_src=src,
    base_config=os.path.relpath(BASE_CONFIG, ROOT),
    lca_train_overrides=[f"--config.{o}" for o in overrides0 if not o.startswith(SHAPE_KEYS)],
    steps=args.steps,
    warmup=args.warmup,
    shapes=results,
  )


def main(argv=None):
  args = _parser().parse_args(argv)
  try:
    out = run_decode(args) if args.cmd == "decode" else run_train(args)
  except BenchError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  hostmem.use_huge_pages()  # as lca-train runs (the paper's side: --upstream-env)
  main()
