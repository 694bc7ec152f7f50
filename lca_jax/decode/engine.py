"""The decode engine: prefill, then one ``jax.lax.while_loop`` whose body is one decode step.

The step is the same for every mode: the mode's policy (``decode.policies``: ntp, threshold,
verify, drafter, or a registered one) drafts and feeds bytes through the incremental forward
(``model.incremental``) and says how many each row accepts; the loop cuts them at eos and the
byte budget, lets the policy commit them, streams them and counts. ``generate`` is the API.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import numbers
import time
from typing import Any, List, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from lca_jax import backend, vocab, xla_options
from lca_jax.decode.policies import POLICIES, Ctx, LoopState, Plan
from lca_jax.decode.sampling import SamplingParams
from lca_jax.errors import LcaError
from lca_jax.model import incremental
from lca_jax.model.config import ModelConfig
from lca_jax.model.layers import decode_weights

MAX_N = 64  # most bytes proposed per step (``n``) in the multi-byte modes
STOP_REASONS = ("eos", "max_bytes", "context", "steps")


class DecodeError(LcaError, ValueError):
  """An inference request that cannot be served: a generate() or forward() call with a bad
  argument (mode, n, tau, max_bytes, a prompt longer than the context, ...)."""


def _kind(v) -> str:
  """'i' for an integer, 'f' for a real number (Python, numpy or a 0-d array), else ''."""
  if isinstance(v, (bool, np.bool_, str, bytes)):
    return ""
  if isinstance(v, numbers.Integral):
    return "i"
  if isinstance(v, numbers.Real):
    return "f"
  if getattr(v, "ndim", None) == 0 and getattr(v, "dtype", None) is not None:
    k = np.dtype(v.dtype).kind
    return "i" if k in "iu" else "f" if k == "f" else ""
  return ""


def _is_int(v) -> bool:
  return _kind(v) == "i"


def _int_arg(name: str, v) -> int:
  if not _is_int(v):
    raise DecodeError(f"{name} must be an integer, got {type(v).__name__} {v!r}")
  return int(v)


def _real_arg(name: str, v) -> float:
  if not _kind(v):
    raise DecodeError(f"{name} must be a number, got {type(v).__name__} {v!r}")
  v = float(v)
  if not math.isfinite(v):
    raise DecodeError(f"{name} must be a finite number, got {v}")
  return v


_INT32_MAX = 2**31 - 1


def check_options(
  mode: str = "ntp",
  tau: float = 0.9,
  n: int = 3,
  max_bytes: int = 256,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  pad_to: int = 32,
  budget_pad_to: int = 1,
) -> dict:
  """The decoding options of ``generate`` checked (types, ranges, NaN) without a model; returns
  them normalized (Python ints / floats). Raises ``DecodeError`` naming the first bad one.

  ``mode`` one of ``policies.POLICIES`` (ntp, threshold, verify, drafter and any added with
  ``policies.register``); ``n`` in [2, MAX_N] in the multi-byte modes (ignored in ntp);
  ``max_bytes`` >= 1; ``tau`` in [0, 1]; ``temperature`` >= 0 (0 = greedy); ``top_k`` >= 0
  (0 = off); ``top_p`` in (0, 1]; ``seed``, ``pad_to`` and ``budget_pad_to`` (>= 1) integers."""
  if not isinstance(mode, str) or mode not in POLICIES:
    raise DecodeError(f"unknown mode {mode!r}; choose one of {', '.join(POLICIES)}")
  n = _int_arg("n", n)
  if POLICIES[mode].multi_byte and not 2 <= n <= MAX_N:
    raise DecodeError(
      f"n must be >= 2 in {mode} mode (bytes proposed per step), got {n}"
      if n < 2
      else f"n must be at most {MAX_N} (bytes proposed per step), got {n}"
    )
  max_bytes = _int_arg("max_bytes", max_bytes)
  if max_bytes < 1:
    raise DecodeError(f"max_bytes must be >= 1, got {max_bytes}")
  tau = _real_arg("tau", tau)
  if not 0.0 <= tau <= 1.0:
    raise DecodeError(f"tau must be a probability in [0, 1], got {tau}")
  temperature = _real_arg("temperature", temperature)
  if temperature < 0:
    raise DecodeError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
  top_k = _int_arg("top_k", top_k)
  if not 0 <= top_k <= _INT32_MAX:  # an int32 on the device; any k past the vocabulary keeps all
    raise DecodeError(f"top_k must be in [0, {_INT32_MAX}] (0 = off), got {top_k}")
  top_p = _real_arg("top_p", top_p)
  if not 0.0 < top_p <= 1.0:
    raise DecodeError(f"top_p must be in (0, 1], got {top_p}")
  seed = _int_arg("seed", seed)
  if not -(2**63) <= seed < 2**63:  # a PRNG key takes any 64-bit integer
    raise DecodeError(f"seed must be a 64-bit integer, got {seed}")
  pad_to = _int_arg("pad_to", pad_to)
  if pad_to < 1:
    raise DecodeError(f"pad_to must be >= 1, got {pad_to}")
  budget_pad_to = _int_arg("budget_pad_to", budget_pad_to)
  if budget_pad_to < 1:
    raise DecodeError(f"budget_pad_to must be >= 1, got {budget_pad_to}")
  return dict(
    mode=mode,
    tau=tau,
    n=n,
    max_bytes=max_bytes,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    seed=seed,
    pad_to=pad_to,
    budget_pad_to=budget_pad_to,
  )


def _is_model(m) -> bool:
  return isinstance(getattr(m, "cfg", None), ModelConfig) and hasattr(m, "params")


def _finalize(ctx: Ctx, d_BK, a_B, loop: LoopState):
  """Cut each row's accepted bytes at eos (unless ignored) and at the call's byte budget."""
  a = jnp.where(loop.done, 0, a_B)
  done = loop.done
  if not ctx.plan.ignore_eos:
    is_eos = (d_BK == vocab.EOS_ID) & (jnp.arange(d_BK.shape[1])[None] < a[:, None])
    first = jnp.argmax(is_eos, axis=1)
    hit = jnp.any(is_eos, axis=1)
    a = jnp.where(hit, first + 1, a)
    done = done | hit
  a = jnp.minimum(a, ctx.budget - loop.gen)
  done = done | (loop.gen + a >= ctx.budget)
  return a, done


class _Sink:
  """Where one compiled executable's streamed bytes go (set for the duration of a call)."""

  def __init__(self):
    self.fn = None

  def emit(self, d_BK, a_B):
    if self.fn is not None:
      self.fn([row[:k].tolist() for row, k in zip(d_BK, a_B)])


def _step(ctx: Ctx, emit, loop: LoopState) -> LoopState:
  plan = ctx.plan
  # the step's two keys were split for every step before the loop (one threefry call, not one
  # per step); greedy decoding uses none
  k_draft, k_acc = loop.keys[loop.step]
  prop = plan.policy.propose(ctx, loop, k_draft, k_acc)
  a, done = _finalize(ctx, prop.d_BK, prop.a_B, loop)
  nxt = plan.policy.commit(ctx, loop, prop, a, done)
  acc = jnp.maximum(a - plan.policy.head_bytes, 0)  # candidates among the committed bytes
  if emit is not None:
    jax.debug.callback(emit, prop.d_BK, a, ordered=True)
  return nxt.replace(
    done=done,
    gen=loop.gen + a,
    step=loop.step + 1,
    per_step=loop.per_step.at[loop.step].set(a),
    n_cand=loop.n_cand + prop.n_cand_B,
    n_acc=loop.n_acc + jnp.where(prop.n_cand_B > 0, acc, 0),
  )


def _decode_params(plan: Plan, params, dtype):
  """The parameters the decode runs with: with ``plan.fuse_projections``, plus the fused
  q/k/v and gate/up kernels of ``layers.fuse_decode_params`` (3 dots fewer per layer). An
  ``api.Model`` passes them built once (``decode_params``): nothing happens here. Another model
  object gets them built here, once per call, never inside the loop, where the latent LM's and
  the MBP window's ``lax.cond`` branches would copy them every step. The weights that every
  use casts to the compute ``dtype`` are stored in it (``layers.compute_dtype_weights``): a
  bfloat16 model's steps read them at 2 bytes each."""
  return decode_weights(params, dtype, plan.fuse_projections)


def _params_of(model, plan: Plan):
  """The parameter tree a call passes: with fusion, the model's kept fused tree
  (``api.Model.decode_params``) where it has one, else its params (``_decode_params`` fuses
  those inside the call)."""
  if plan.fuse_projections and callable(getattr(model, "decode_params", None)):
    return model.decode_params()
  return model.params


def _run(cfgs, plan: Plan, length: int, emit, params, prompt_BP, plen_B, key, tau, budget, sp):
  """Prefill + while_loop. Everything here is traced once per (cfgs, plan, shapes)."""
  cfg, dcfg = cfgs
  p_t = _decode_params(plan, params[0], cfg.dtype)
  p_d = _decode_params(plan, params[1], dcfg.dtype) if dcfg is not None else None
  ctx = Ctx(cfg, dcfg, p_t, p_d, plan, tau, budget, sp)
  policy = plan.policy
  b = prompt_BP.shape[0]
  st = incremental.prefill(
    cfg, p_t, prompt_BP, plen_B, length, policy.target_mbp, plan.copies_in_extend
  )
  n_keys = 1 if plan.greedy else plan.max_steps
  keys = jax.random.split(key, n_keys * 2).reshape((n_keys, 2) + key.shape)
  if plan.greedy:
    keys = jnp.broadcast_to(keys, (plan.max_steps, 2) + key.shape)
  zeros = jnp.zeros((b,), jnp.int32)
  loop = LoopState(
    st=st,
    dst=None,
    keys=keys,
    pending=jnp.full((b,), -1, jnp.int32),
    done=jnp.zeros((b,), bool),
    gen=zeros,
    step=jnp.zeros((), jnp.int32),
    per_step=jnp.zeros((plan.max_steps, b), jnp.int32),
    n_cand=zeros,
    n_acc=zeros,
    closed0=st.n_closed,
  )
  loop = policy.init(ctx, loop, prompt_BP, plen_B)
  cond = lambda c: jnp.any(~c.done) & (c.step < plan.max_steps)
  c = jax.lax.while_loop(cond, lambda c: _step(ctx, emit, c), loop)
  return dict(
    ids=c.st.ids,
    length=c.st.length,
    boundaries=c.st.b,
    per_step=c.per_step,
    steps=c.step,
    n_cand=c.n_cand,
    n_acc=c.n_acc,
    latents=c.st.n_closed - c.closed0,
    gen=c.gen,
  )


def compile_lowered(lowered):
  """``lowered.compile`` with the decode options of ``lca_jax/xla_options.py``: on the CPU dots
  of a few rows through Eigen rather than YNNPACK, on a GPU the decode loop as one CUDA graph."""
  opts = xla_options.decode_options()
  return lowered.compile(compiler_options=opts) if opts else lowered.compile()


class _Executable(NamedTuple):
  exe: Any
  compile_s: float
  sink: _Sink


class _ExecutableCache:
  """The most recently used ``capacity`` executables, by static signature (LRU eviction).

  Bounded on purpose: the JIT code of one XLA:CPU decode executable occupies ~900 memory
  mappings, and a process may hold at most ``vm.max_map_count`` of them (65530 by default on
  Linux); the unbounded cache this replaces aborted a long process (the test suite) inside XLA
  once ~70 signatures had been compiled. ``built`` counts compilations (never decreases)."""

  def __init__(self, capacity: int):
    self.capacity = capacity
    self.built = 0
    self._entries: collections.OrderedDict = collections.OrderedDict()

  def get(self, sig, build) -> _Executable:
    if sig in self._entries:
      self._entries.move_to_end(sig)
      return self._entries[sig]
    ex = build()
    self.built += 1
    self._entries[sig] = ex
    while len(self._entries) > self.capacity:
      self._entries.popitem(last=False)
    return ex

  def clear(self):
    self._entries.clear()

  def __len__(self):
    return len(self._entries)


# 16 signatures (~15k mappings) cover a sweep's modes x widths x prompt buckets in turn.
_EXECUTABLES = _ExecutableCache(capacity=16)


def _compiled(cfgs, plan, length, args) -> _Executable:
  """One XLA executable per static signature; reused across calls (no retracing)."""
  # the tree's structure too: decode weights of one shape can be laid out two ways
  # (``layers.transpose_kernels``)
  shapes = (
    jax.tree_util.tree_structure(args),
    tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(args)),
  )

  def build():
    t0 = time.perf_counter()
    sink = _Sink()
    emit = sink.emit if plan.stream else None
    fn = jax.jit(lambda *a: _run(cfgs, plan, length, emit, *a))
    exe = compile_lowered(fn.lower(*args))
    return _Executable(exe, time.perf_counter() - t0, sink)

  # and whether the step runs the fused decode kernels (``backend.fused_decode_kernels``)
  return _EXECUTABLES.get((cfgs, plan, length, shapes, backend.fused_decode_kernels()), build)


def compiled_count() -> int:
  """Executables compiled by this process so far (a new signature adds one)."""
  return _EXECUTABLES.built


def clear_compiled():
  """Drop the kept executables (a long-lived process that is done decoding, the tests)."""
  _EXECUTABLES.clear()


@dataclasses.dataclass
class GenerateResult:
  texts: List[str]
  ids: List[np.ndarray]  # generated vocabulary ids per row (docs/design.md §1)
  prompt_boundaries: List[np.ndarray]
  boundaries: List[np.ndarray]  # boundaries of the generated bytes (hierarchical models)
  accepted_per_step: List[List[int]]
  histogram: dict  # bytes committed per step -> count
  acceptance_rate: float  # accepted candidates / proposed candidates (NaN in ntp mode)
  latent_steps_per_byte: float
  bytes_per_s: float
  elapsed_s: float
  compile_s: float
  steps: int
  # why each row stopped: "eos", "max_bytes" (the requested budget), "context" (the budget was
  # cut so that the longest prompt + generation fits the model context), "steps" (never expected)
  stop_reasons: List[str] = dataclasses.field(default_factory=list)
  budget: int = 0  # bytes each row could generate: max_bytes, capped by the context

  def to_dict(self):
    d = dataclasses.asdict(self)
    d["ids"] = [x.tolist() for x in self.ids]
    d["prompt_boundaries"] = [x.tolist() for x in self.prompt_boundaries]
    d["boundaries"] = [x.tolist() for x in self.boundaries]
    return d


def _encode_prompts(prompts) -> List[np.ndarray]:
  """Prompts -> int32 id arrays. A str is encoded as UTF-8, bytes as they are; anything else
  is vocabulary ids (byte b is id b + 3, lca_jax.vocab). A flat list of ints is ONE prompt of
  ids (``[123]`` is the byte 'x'), a list of str / bytes / id sequences is a batch."""
  if isinstance(prompts, (str, bytes)) or (isinstance(prompts, np.ndarray) and prompts.ndim <= 1):
    prompts = [prompts]
  elif isinstance(prompts, (list, tuple)) and prompts and all(_is_int(x) for x in prompts):
    prompts = [np.asarray(prompts, np.int64)]
  try:
    prompts = list(prompts)
  except TypeError:
    raise DecodeError(
      f"prompts must be a str, bytes, an id array or a list of them, got {type(prompts).__name__}"
    ) from None
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      out.append(vocab.encode(p))
    elif isinstance(p, (bytes, bytearray)):
      out.append(vocab.encode_bytes(bytes(p)))
    else:
      try:
        a = np.asarray(p)
      except (TypeError, ValueError):
        a = np.asarray(None)
      if a.size and a.dtype.kind not in "iu":
        raise DecodeError(
          f"prompt {i} must be a str, bytes or integer vocabulary ids, got "
          f"{type(p).__name__} of {a.dtype}"
        )
      a = a.reshape(-1).astype(np.int64)
      if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max):
        raise DecodeError(f"prompt {i} has ids outside [0, {vocab.NUM_BASE_TOKENS})")
      out.append(a.astype(np.int32))
  return out


def _validate(model, mode, n, drafter, prompts):
  if not _is_model(model):
    raise DecodeError(f"generate needs a model from lca_jax.load(...), got {type(model).__name__}")
  cfg = model.cfg
  policy = POLICIES[mode]
  if policy.uses_drafter and drafter is None:
    raise DecodeError(f"{mode} mode needs a drafter model (an LCA-MBP or MLP-MBP checkpoint)")
  if policy.uses_drafter and not _is_model(drafter):
    raise DecodeError(
      "drafter must be a model loaded with lca_jax.load(...) (an LCA-MBP or "
      f"MLP-MBP checkpoint), got {type(drafter).__name__} {drafter!r:.60}"
    )
  drafting = drafter.cfg if policy.uses_drafter else cfg
  if policy.multi_byte and not drafting.has_mbp:
    who = "the drafter" if policy.uses_drafter else "this model"
    raise DecodeError(
      f"{mode} mode needs a multi-byte head, and {who} has none "
      f"({drafting.kind}, n_mbp={drafting.n_mbp}); use --mode ntp"
    )
  if policy.multi_byte and drafting.n_mlp_mbp and n - 1 > drafting.n_mlp_mbp:
    raise DecodeError(
      f"an MLP-MBP model with {drafting.n_mlp_mbp} heads drafts at most "
      f"{drafting.n_mlp_mbp + 1} bytes per step; got n={n}"
    )
  if policy.uses_drafter and drafter.cfg.n_tokens != cfg.n_tokens:
    raise DecodeError(
      f"the drafter's vocabulary ({drafter.cfg.n_tokens} ids) differs from the "
      f"verifier's ({cfg.n_tokens} ids); both must use the same byte vocabulary"
    )
  if not prompts:
    raise DecodeError("no prompt given")
  limit = min(cfg.max_seq_len, drafting.max_seq_len)
  for i, p in enumerate(prompts):
    if p.size == 0:
      raise DecodeError(f"prompt {i} is empty; give at least one byte")
    if p.size > limit:
      raise DecodeError(
        f"prompt {i} is {p.size} bytes, longer than the model context ({limit} bytes)"
      )
    if p.size == limit:
      raise DecodeError(
        f"prompt {i} is {p.size} bytes and fills the model context ({limit} "
        f"bytes): no room to generate; give at most {limit - 1} bytes"
      )
    if p.min() < 0 or p.max() >= cfg.n_tokens:
      raise DecodeError(f"prompt {i} has ids outside [0, {cfg.n_tokens})")


def generate(
  model,
  prompts: Union[str, Sequence[Any]],
  mode: str = "ntp",
  tau: float = 0.9,
  n: int = 3,
  max_bytes: int = 256,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  ignore_eos: bool = False,
  drafter=None,
  pad_to: int = 32,
  budget_pad_to: int = 1,
  on_bytes=None,
) -> GenerateResult:
  """Decode continuations of ``prompts`` (a str, bytes, id array, or a list of them).

  A str is encoded as UTF-8 and bytes are taken as they are (any bytes, valid UTF-8 or not);
  ids are vocabulary ids (``lca_jax.vocab``: byte b is id b + 3, so ``[123]`` is the one-byte
  prompt "x"); a flat list of ints is one prompt. ``temperature == 0`` is greedy. Generation
  stops per row at eos (unless ``ignore_eos``) or after ``max_bytes`` bytes; it is also capped
  so that the longest prompt + generation fits ``max_seq_len`` (a prompt must leave at least
  one byte). ``GenerateResult.stop_reasons`` says per row which of these ended it ("eos",
  "max_bytes", "context") and ``budget`` what the cap left. ``n`` is at most ``MAX_N`` (64).
  The options are checked by :func:`check_options`; every bad argument raises ``DecodeError``.
  ``drafter`` is used only in drafter mode (a model from ``lca_jax.load`` with the same
  vocabulary). ``on_bytes(list of per-row id lists)`` is called after every step with the bytes
  it committed (streaming; one host callback per step, so only use it when you want to watch).

  One executable is compiled per (model shape, mode, n, sampling kind, batch size, prompt length
  rounded up to ``pad_to``, byte room): the room is ``max_bytes`` rounded up to
  ``budget_pad_to``, and ``max_bytes`` itself is an argument of the executable, so calls whose
  budgets round to the same room share one program (``budget_pad_to=256``: every budget up to
  256 bytes in one). A larger room costs a longer cache (each step reads its slots) and nothing
  else: its extra slots are masked, and each step's PRNG keys do not depend on the room.
  """
  if on_bytes is not None and not callable(on_bytes):
    raise DecodeError(f"on_bytes must be callable, got {type(on_bytes).__name__}")
  req = _request(
    model,
    prompts,
    ignore_eos,
    drafter,
    stream=on_bytes is not None,
    mode=mode,
    tau=tau,
    n=n,
    max_bytes=max_bytes,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    seed=seed,
    pad_to=pad_to,
    budget_pad_to=budget_pad_to,
  )
  ex = _compiled(req.cfgs, req.plan, req.length, req.args)
  ex.sink.fn = on_bytes
  try:
    t0 = time.perf_counter()
    res = jax.device_get(ex.exe(*req.args))
    elapsed = time.perf_counter() - t0
  finally:
    ex.sink.fn = None
  return _collect(res, req.enc, req.plan, elapsed, ex.compile_s, req.budget, req.requested)


def compiled_decode(model, prompts, **kw):
  """The compiled executable ``generate(model, prompts, **kw)`` runs (prefill + decode loop),
  compiled if needed; ``.as_text()`` is its optimized HLO (see ``perf.hlo_stats``)."""
  req = _request(model, prompts, **kw)
  return _compiled(req.cfgs, req.plan, req.length, req.args).exe


def cache_length(longest: int, max_bytes: int, width: int, limit: int, pad_to: int = 32) -> int:
  """Cache slots a call allocates: the longest prompt padded to ``pad_to``, the byte budget
  (``max_bytes`` capped so that prompt + generation fits ``limit``), and room for a block of
  ``width`` bytes and its copies past the end."""
  return -(-longest // pad_to) * pad_to + byte_budget(max_bytes, longest, limit) + 2 * width + 1


def byte_budget(max_bytes: int, longest: int, limit: int) -> int:
  """``max_bytes`` capped so that the longest prompt + generation fits ``limit`` (>= 1)."""
  return max(1, min(max_bytes, limit - longest))


@dataclasses.dataclass(frozen=True)
class _Request:
  cfgs: tuple
  plan: Plan
  length: int
  args: tuple
  enc: list
  requested: int  # max_bytes as asked
  budget: int  # max_bytes capped by the context: what each row may generate


def _layout(cfg, dcfg, opts: dict, longest: int, ignore_eos, stream, fuse_projections):
  """(plan, cache length, byte budget, padded prompt length) of a call whose longest prompt
  has ``longest`` ids, with the options of ``check_options``."""
  mode, n, requested = opts["mode"], opts["n"], opts["max_bytes"]
  policy = POLICIES[mode]
  source = ""
  if policy.multi_byte:
    source = "mlp" if (dcfg or cfg).n_mlp_mbp else "lca"
  limit = min(cfg.max_seq_len, (dcfg or cfg).max_seq_len)
  budget = byte_budget(requested, longest, limit)
  room = -(-requested // opts["budget_pad_to"]) * opts["budget_pad_to"]  # the program's budget
  plan = Plan(
    mode,
    n if policy.multi_byte else 1,
    opts["temperature"] == 0,
    bool(ignore_eos),
    byte_budget(room, longest, limit),
    source,
    stream=stream,
    fuse_projections=bool(fuse_projections),
  )
  pad_to = opts["pad_to"]
  p_len = -(-longest // pad_to) * pad_to
  return plan, cache_length(longest, room, plan.width, limit, pad_to), budget, p_len


def _sampling(opts: dict) -> SamplingParams:
  return SamplingParams(
    jnp.float32(max(opts["temperature"], 1e-6)),
    jnp.int32(opts["top_k"]),
    jnp.float32(opts["top_p"]),
  )


def _request(
  model, prompts, ignore_eos=False, drafter=None, stream=False, fuse_projections=True, **options
) -> _Request:
  """Checked options (those of ``check_options``), encoded prompts and the static plan + device
  arguments of one call. ``fuse_projections=False``: the separate q/k/v and gate/up dots
  (``Plan.fuse_projections``; for tests and measurements)."""
  opts = check_options(**options)
  enc = _encode_prompts(prompts)
  _validate(model, opts["mode"], opts["n"], drafter, enc)
  cfg = model.cfg
  dcfg = drafter.cfg if POLICIES[opts["mode"]].uses_drafter else None
  longest = max(p.size for p in enc)
  plan, length, budget, p_len = _layout(
    cfg, dcfg, opts, longest, ignore_eos, stream, fuse_projections
  )
  prompt = np.zeros((len(enc), p_len), np.int32)
  for i, p in enumerate(enc):
    prompt[i, : p.size] = p
  plen = np.array([p.size for p in enc], np.int32)
  params = (
    _params_of(model, plan),
    _params_of(drafter, plan) if dcfg is not None else None,
  )
  args = (
    params,
    jnp.asarray(prompt),
    jnp.asarray(plen),
    jax.random.PRNGKey(opts["seed"]),
    jnp.float32(opts["tau"]),
    jnp.int32(budget),
    _sampling(opts),
  )
  return _Request((cfg, dcfg), plan, length, args, enc, opts["max_bytes"], budget)


def lower_abstract(cfg: ModelConfig, params, batch: int, prompt_len: int, sharding, **options):
  """The decode program ``generate`` runs for ``batch`` prompts of ``prompt_len`` bytes on a
  model of config ``cfg``, lowered from abstract arguments (nothing is allocated or run):
  ``params`` is a tree of ``jax.ShapeDtypeStruct`` (the model's params, or the tree of
  ``layers.decode_weights`` an ``api.Model`` passes), ``sharding`` where every argument lives
  (a device of another platform for a deviceless compile, see ``lca_jax.aot``); ``options``
  those of ``check_options`` (not the drafter mode). Returns jax's ``Lowered``."""
  opts = check_options(**options)
  if POLICIES[opts["mode"]].uses_drafter:
    raise DecodeError(f"mode {opts['mode']!r} needs a drafter model; lower it with generate()")
  if prompt_len < 1 or prompt_len >= cfg.max_seq_len:
    raise DecodeError(f"prompt_len must be in [1, {cfg.max_seq_len}), got {prompt_len}")
  plan, length, _, p_len = _layout(cfg, None, opts, prompt_len, False, False, True)
  key = jax.random.PRNGKey(opts["seed"])
  concrete = (
    np.zeros((batch, p_len), np.int32),
    np.full((batch,), prompt_len, np.int32),
    key,
    jnp.float32(opts["tau"]),
    jnp.int32(0),
    _sampling(opts),
  )
  spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
  args = jax.tree_util.tree_map(spec, ((params, None),) + concrete)
  fn = jax.jit(lambda *a: _run((cfg, None), plan, length, None, *a))
  with backend.lowering_device(sharding):
    return fn.lower(*args)


def _stop_reason(g: np.ndarray, plan: Plan, budget: int, requested: int) -> str:
  if not plan.ignore_eos and g.size and int(g[-1]) == vocab.EOS_ID:
    return "eos"
  if g.size >= budget:
    return "max_bytes" if budget >= requested else "context"
  return "steps"


def _collect(
  res, enc, plan: Plan, elapsed, compile_s, budget: int, requested: int
) -> GenerateResult:
  ids, texts, bds, pbds, per_step, reasons = [], [], [], [], [], []
  steps = int(res["steps"])
  hist = {}
  for i, p in enumerate(enc):
    g = res["ids"][i, p.size : res["length"][i]]
    ids.append(g)
    reasons.append(_stop_reason(g, plan, budget, requested))
    texts.append(vocab.decode(g))
    pbds.append(res["boundaries"][i, : p.size])
    bds.append(res["boundaries"][i, p.size : res["length"][i]])
    row = [int(x) for x in res["per_step"][:steps, i] if x > 0]
    per_step.append(row)
    for x in row:
      hist[x] = hist.get(x, 0) + 1
  total = int(np.sum(res["gen"]))
  n_cand = int(np.sum(res["n_cand"]))
  return GenerateResult(
    texts=texts,
    ids=ids,
    prompt_boundaries=pbds,
    boundaries=bds,
    accepted_per_step=per_step,
    histogram=dict(sorted(hist.items())),
    acceptance_rate=float(np.sum(res["n_acc"]) / n_cand) if n_cand else float("nan"),
    latent_steps_per_byte=float(np.sum(res["latents"]) / max(total, 1)),
    bytes_per_s=total / elapsed if elapsed > 0 else float("inf"),
    elapsed_s=elapsed,
    compile_s=compile_s,
    steps=steps,
    stop_reasons=reasons,
    budget=budget,
  )
