"""The decode engine: prefill, then one ``jax.lax.while_loop`` whose body is one decode step.

Modes (docs/design.md §6.3) are small policies over the same cached ``extend``:
  * ``ntp``: one byte per step from the next-byte head.
  * ``threshold``: next byte from the NT head, then MBP candidates accepted left to right while
    their probability is >= tau (n bytes proposed per step, n chosen at call time).
  * ``verify``: the MBP head drafts, the NT head verifies in one extend of n bytes; greedy output
    equals ``ntp`` exactly; with sampling, speculative sampling keeps the NT distribution.
  * ``drafter``: a second model verifies what this (LCA-MBP or MLP-MBP) model drafts; the output
    equals the verifier's own decoding.
MLP-MBP models draft from their MLP heads in every multi-byte mode. Rows of a batch advance
independently (ragged prompts, per-row acceptance, per-row stop at eos or the byte budget).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from typing import Any, List, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from lca_jax import vocab
from lca_jax.decode import cache
from lca_jax.decode.sampling import SamplingParams, choose, log_probs, speculative_accept
from lca_jax.errors import LcaError
from lca_jax.model.config import ModelConfig

MODES = ("ntp", "threshold", "verify", "drafter")
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
) -> dict:
  """The decoding options of ``generate`` checked (types, ranges, NaN) without a model; returns
  them normalized (Python ints / floats). Raises ``DecodeError`` naming the first bad one.

  ``mode`` one of MODES; ``n`` in [2, MAX_N] in the multi-byte modes (ignored in ntp);
  ``max_bytes`` >= 1; ``tau`` in [0, 1]; ``temperature`` >= 0 (0 = greedy); ``top_k`` >= 0
  (0 = off); ``top_p`` in (0, 1]; ``seed`` and ``pad_to`` (>= 1) integers."""
  if not isinstance(mode, str) or mode not in MODES:
    raise DecodeError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
  n = _int_arg("n", n)
  if mode != "ntp" and not 2 <= n <= MAX_N:
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
  if top_k < 0:
    raise DecodeError(f"top_k must be >= 0 (0 = off), got {top_k}")
  top_p = _real_arg("top_p", top_p)
  if not 0.0 < top_p <= 1.0:
    raise DecodeError(f"top_p must be in (0, 1], got {top_p}")
  seed = _int_arg("seed", seed)
  pad_to = _int_arg("pad_to", pad_to)
  if pad_to < 1:
    raise DecodeError(f"pad_to must be >= 1, got {pad_to}")
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
  )


def _is_model(m) -> bool:
  return isinstance(getattr(m, "cfg", None), ModelConfig) and hasattr(m, "params")


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about a decode call (one compilation per Plan and shape)."""

  mode: str
  n: int
  greedy: bool
  ignore_eos: bool
  max_bytes: int
  source: str  # where candidates come from: "lca", "mlp" or "" (ntp)
  stream: bool = False  # call the host sink with each step's committed bytes

  @property
  def max_steps(self) -> int:
    return 2 * self.max_bytes + 2

  @property
  def copies_in_extend(self) -> int:
    """Threshold mode never rolls back, so each extend also reads the next step's copies."""
    return self.n - 2 if (self.mode == "threshold" and self.source == "lca") else 0

  @property
  def width(self) -> int:  # bytes fed per step
    return 1 if self.mode == "ntp" else self.n


def _leading(ok_BN):
  return jnp.sum(jnp.cumprod(ok_BN.astype(jnp.int32), axis=-1), axis=-1)


def _draft(cfg: ModelConfig, params, st, plan: Plan, key, sp, pending):
  """n drafted bytes [B, n], their probabilities and draft log-probs [B, n, V]."""
  k1, k2 = jax.random.split(key)
  t1, p1, l1 = choose(st.last_nt, k1, sp, plan.greedy)
  forced = pending >= 0
  t1 = jnp.where(forced, pending, t1)
  if plan.n == 1:
    return t1[:, None], p1[:, None], l1[:, None], forced
  if plan.source == "mlp":
    cand = st.last_mlp[:, : plan.n - 1]
  else:
    cand = st.last_mbp[:, None]
    if plan.n > 2:  # threshold mode computed the copies during the last extend
      copies = (
        st.last_copies if plan.copies_in_extend else cache.mbp_copies(cfg, params, st, plan.n - 2)
      )
      cand = jnp.concatenate([cand, copies], axis=1)
  tc, pc, lc = choose(cand, k2, sp, plan.greedy)
  return (
    jnp.concatenate([t1[:, None], tc], 1),
    jnp.concatenate([p1[:, None], pc], 1),
    jnp.concatenate([l1[:, None], lc], 1),
    forced,
  )


def _finalize(plan: Plan, d_BK, a_B, carry):
  """Cut each row's accepted bytes at eos (unless ignored) and at the byte budget."""
  a = jnp.where(carry["done"], 0, a_B)
  done = carry["done"]
  if not plan.ignore_eos:
    is_eos = (d_BK == vocab.EOS_ID) & (jnp.arange(d_BK.shape[1])[None] < a[:, None])
    first = jnp.argmax(is_eos, axis=1)
    hit = jnp.any(is_eos, axis=1)
    a = jnp.where(hit, first + 1, a)
    done = done | hit
  a = jnp.minimum(a, plan.max_bytes - carry["gen"])
  done = done | (carry["gen"] + a >= plan.max_bytes)
  return a, done


_SINK = [None]


def _emit(d_BK, a_B):
  if _SINK[0] is not None:
    _SINK[0]([row[:k].tolist() for row, k in zip(d_BK, a_B)])


def _step(cfgs, params, plan: Plan, tau, sp, carry):
  cfg, dcfg = cfgs
  p_t, p_d = params
  # the step's two keys were split for every step before the loop (one threefry call, not one
  # per step); greedy decoding uses none
  k_draft, k_acc = carry["keys"][carry["step"]]
  st, pending = carry["st"], carry["pending"]
  new_pending = jnp.full_like(pending, -1)
  width = plan.width
  n_cand = jnp.zeros_like(pending)
  if plan.mode == "drafter":
    dst = carry["dst"]
    d, _, lq, forced = _draft(dcfg, p_d, dst, plan, k_draft, sp, pending)
    full = jnp.full_like(pending, width)
    st_x, out = cache.extend(cfg, p_t, st, d, full, False)
    target = jnp.concatenate([st.last_nt[:, None], out["nt_logits"]], axis=1)  # [B, n+1, V]
    if plan.greedy:
      best = jnp.argmax(target, axis=-1).astype(jnp.int32)
      a = _leading(d == best[:, :width])
      bonus = jnp.take_along_axis(best, a[:, None], 1)[:, 0]
    else:
      lp = log_probs(target, sp)
      lq = lq.at[:, 0].set(jnp.where(forced[:, None], lp[:, 0], lq[:, 0]))
      a, repl = speculative_accept(d, lq, lp[:, :width], k_acc)
      tail = jax.random.categorical(jax.random.fold_in(k_acc, 1), lp[:, width]).astype(jnp.int32)
      bonus = jnp.where(a < width, repl, tail)
    a, done = _finalize(plan, d, a, carry)
    st = cache.rollback(st_x, st, out, a)
    dst, _ = cache.extend(dcfg, p_d, dst, d, a, True, last_only=True)
    carry = dict(carry, dst=dst)
    new_pending = jnp.where(done, -1, bonus)
    n_cand = jnp.where(carry["done"], 0, width)
    acc = a
  elif plan.mode == "verify":
    d, _, lq, forced = _draft(cfg, p_t, st, plan, k_draft, sp, pending)
    full = jnp.full_like(pending, width)
    st_x, out = cache.extend(cfg, p_t, st, d, full, True)
    check = out["nt_logits"][:, : width - 1]  # position t+1+i predicts d_{i+2}
    if plan.greedy:
      a = 1 + _leading(d[:, 1:] == jnp.argmax(check, axis=-1))
    else:
      n_acc, repl = speculative_accept(d[:, 1:], lq[:, 1:], log_probs(check, sp), k_acc)
      a = 1 + n_acc
      new_pending = jnp.where(n_acc < width - 1, repl, -1)
    a, done = _finalize(plan, d, a, carry)
    st = cache.rollback(st_x, st, out, a)
    new_pending = jnp.where(done, -1, new_pending)
    n_cand = jnp.where(carry["done"], 0, width - 1)
    acc = jnp.maximum(a - 1, 0)
  else:  # ntp / threshold
    d, p, _, _ = _draft(cfg, p_t, st, plan, k_draft, sp, pending)
    if plan.mode == "threshold":
      a = 1 + _leading(p[:, 1:] >= tau)
      n_cand = jnp.where(carry["done"], 0, width - 1)
    else:
      a = jnp.ones_like(pending)
    a, done = _finalize(plan, d, a, carry)
    st, _ = cache.extend(
      cfg, p_t, st, d, a, plan.mode == "threshold", plan.copies_in_extend, last_only=True
    )
    acc = jnp.maximum(a - 1, 0)
  if plan.stream:
    jax.debug.callback(_emit, d, a, ordered=True)
  step = carry["step"]
  return dict(
    carry,
    st=st,
    pending=new_pending,
    done=done,
    gen=carry["gen"] + a,
    step=step + 1,
    per_step=carry["per_step"].at[step].set(a),
    n_cand=carry["n_cand"] + n_cand,
    n_acc=carry["n_acc"] + jnp.where(n_cand > 0, acc, 0),
  )


def _run(cfgs, plan: Plan, length: int, params, prompt_BP, plen_B, key, tau, sp):
  """Prefill + while_loop. Everything here is traced once per (cfgs, plan, shapes)."""
  cfg, dcfg = cfgs
  p_t, p_d = params
  b = prompt_BP.shape[0]
  target_mbp = plan.mode in ("threshold", "verify")
  st = cache.init_state(cfg, p_t, b, length, target_mbp, plan.copies_in_extend)
  st, _ = cache.extend(
    cfg, p_t, st, prompt_BP, plen_B, target_mbp, plan.copies_in_extend, last_only=True
  )
  n_keys = 1 if plan.greedy else plan.max_steps
  keys = jax.random.split(key, n_keys * 2).reshape((n_keys, 2) + key.shape)
  if plan.greedy:
    keys = jnp.broadcast_to(keys, (plan.max_steps, 2) + key.shape)
  carry = dict(
    st=st,
    keys=keys,
    pending=jnp.full((b,), -1, jnp.int32),
    done=jnp.zeros((b,), bool),
    gen=jnp.zeros((b,), jnp.int32),
    step=jnp.zeros((), jnp.int32),
    per_step=jnp.zeros((plan.max_steps, b), jnp.int32),
    n_cand=jnp.zeros((b,), jnp.int32),
    n_acc=jnp.zeros((b,), jnp.int32),
    closed0=st.n_closed,
  )
  if plan.mode == "drafter":
    dst = cache.init_state(dcfg, p_d, b, length, True)
    carry["dst"], _ = cache.extend(dcfg, p_d, dst, prompt_BP, plen_B, True, last_only=True)
  cond = lambda c: jnp.any(~c["done"]) & (c["step"] < plan.max_steps)
  body = lambda c: _step(cfgs, params, plan, tau, sp, c)
  c = jax.lax.while_loop(cond, body, carry)
  st = c["st"]
  return dict(
    ids=st.ids,
    length=st.length,
    boundaries=st.b,
    per_step=c["per_step"],
    steps=c["step"],
    n_cand=c["n_cand"],
    n_acc=c["n_acc"],
    latents=st.n_closed - c["closed0"],
    gen=c["gen"],
  )


_COMPILED = {}


def _compiled(cfgs, plan, length, args):
  """One XLA executable per static signature; reused across calls (no retracing)."""
  shapes = tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(args))
  sig = (cfgs, plan, length, shapes)
  if sig not in _COMPILED:
    t0 = time.perf_counter()
    fn = jax.jit(lambda *a: _run(cfgs, plan, length, *a))
    _COMPILED[sig] = (fn.lower(*args).compile(), time.perf_counter() - t0)
  return _COMPILED[sig]


def compiled_count() -> int:
  return len(_COMPILED)


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
  if mode == "drafter" and drafter is None:
    raise DecodeError("drafter mode needs a drafter model (an LCA-MBP or MLP-MBP checkpoint)")
  if mode == "drafter" and not _is_model(drafter):
    raise DecodeError(
      "drafter must be a model loaded with lca_jax.load(...) (an LCA-MBP or "
      f"MLP-MBP checkpoint), got {type(drafter).__name__} {drafter!r:.60}"
    )
  drafting = drafter.cfg if mode == "drafter" else cfg
  if mode != "ntp" and not drafting.has_mbp:
    who = "the drafter" if mode == "drafter" else "this model"
    raise DecodeError(
      f"{mode} mode needs a multi-byte head, and {who} has none "
      f"({drafting.kind}, n_mbp={drafting.n_mbp}); use --mode ntp"
    )
  if mode != "ntp" and drafting.n_mlp_mbp and n - 1 > drafting.n_mlp_mbp:
    raise DecodeError(
      f"an MLP-MBP model with {drafting.n_mlp_mbp} heads drafts at most "
      f"{drafting.n_mlp_mbp + 1} bytes per step; got n={n}"
    )
  if mode == "drafter" and drafter.cfg.n_tokens != cfg.n_tokens:
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
  )
  exe, compile_s = _compiled(req.cfgs, req.plan, req.length, req.args)
  _SINK[0] = on_bytes
  try:
    t0 = time.perf_counter()
    res = jax.device_get(exe(*req.args))
    elapsed = time.perf_counter() - t0
  finally:
    _SINK[0] = None
  return _collect(res, req.enc, req.plan, elapsed, compile_s, req.requested)


def compiled_decode(model, prompts, **kw):
  """The compiled executable ``generate(model, prompts, **kw)`` runs (prefill + decode loop),
  compiled if needed; ``.as_text()`` is its optimized HLO (see ``decode.hlo_stats``)."""
  req = _request(model, prompts, **kw)
  return _compiled(req.cfgs, req.plan, req.length, req.args)[0]


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
  requested: int


def _request(model, prompts, ignore_eos=False, drafter=None, stream=False, **options) -> _Request:
  """Checked options (those of ``check_options``), encoded prompts and the static plan + device
  arguments of one call."""
  opts = check_options(**options)
  mode, tau, n, requested = opts["mode"], opts["tau"], opts["n"], opts["max_bytes"]
  temperature, top_k, top_p = opts["temperature"], opts["top_k"], opts["top_p"]
  seed, pad_to = opts["seed"], opts["pad_to"]
  enc = _encode_prompts(prompts)
  _validate(model, mode, n, drafter, enc)
  cfg = model.cfg
  dcfg = drafter.cfg if mode == "drafter" else None
  source = ""
  if mode != "ntp":
    source = "mlp" if (dcfg or cfg).n_mlp_mbp else "lca"
  longest = max(p.size for p in enc)
  limit = min(cfg.max_seq_len, (dcfg or cfg).max_seq_len)
  max_bytes = byte_budget(requested, longest, limit)
  plan = Plan(
    mode,
    n if mode != "ntp" else 1,
    temperature == 0,
    bool(ignore_eos),
    max_bytes,
    source,
    stream=stream,
  )
  p_len = -(-longest // pad_to) * pad_to
  length = cache_length(longest, requested, plan.width, limit, pad_to)
  prompt = np.zeros((len(enc), p_len), np.int32)
  for i, p in enumerate(enc):
    prompt[i, : p.size] = p
  plen = np.array([p.size for p in enc], np.int32)
  sp = SamplingParams(jnp.float32(max(temperature, 1e-6)), jnp.int32(top_k), jnp.float32(top_p))
  params = (model.params, drafter.params if dcfg is not None else None)
  args = (
    params,
    jnp.asarray(prompt),
    jnp.asarray(plen),
    jax.random.PRNGKey(seed),
    jnp.float32(tau),
    sp,
  )
  return _Request((cfg, dcfg), plan, length, args, enc, requested)


def _stop_reason(g: np.ndarray, plan: Plan, requested: int) -> str:
  if not plan.ignore_eos and g.size and int(g[-1]) == vocab.EOS_ID:
    return "eos"
  if g.size >= plan.max_bytes:
    return "max_bytes" if plan.max_bytes >= requested else "context"
  return "steps"


def _collect(res, enc, plan: Plan, elapsed, compile_s, requested=None) -> GenerateResult:
  requested = plan.max_bytes if requested is None else requested
  ids, texts, bds, pbds, per_step, reasons = [], [], [], [], [], []
  steps = int(res["steps"])
  hist = {}
  for i, p in enumerate(enc):
    g = res["ids"][i, p.size : res["length"][i]]
    ids.append(g)
    reasons.append(_stop_reason(g, plan, requested))
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
    budget=plan.max_bytes,
  )
