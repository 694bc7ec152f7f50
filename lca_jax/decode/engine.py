"""The decode engine: prefill, then one ``jax.lax.while_loop`` whose body is one decode step.

The step is the same for every mode: the mode's policy (``decode.policies``: ntp, threshold,
verify, drafter, or a registered one) drafts and feeds bytes through the incremental forward
(``model.incremental``) and says how many each row accepts; the loop cuts them at eos and the
byte budget, lets the policy commit them, streams them and counts. ``generate`` is the API.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, List, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from lca_jax import backend, vocab
from lca_jax.decode import weights
from lca_jax.decode.executables import Executable, ExecutableCache, compile_lowered
from lca_jax.decode.policies import POLICIES, Ctx, LoopState, Plan
from lca_jax.decode.request import (
  MAX_N,
  DecodeError,
  check_options,
  check_request,
  encode_prompts,
)
from lca_jax.decode.sampling import SamplingParams
from lca_jax.decode.step import advance
from lca_jax.model import incremental
from lca_jax.model.config import ModelConfig

__all__ = [
  "MAX_N",
  "DecodeError",
  "GenerateResult",
  "check_options",
  "compile_lowered",
  "compiled_count",
  "clear_compiled",
  "compiled_decode",
  "generate",
  "lower_abstract",
]
# the prompt encoding of ``request`` under its former name (tests call it)
_encode_prompts = encode_prompts
STOP_REASONS = ("eos", "max_bytes", "context", "steps")


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
  nxt, prop, a = advance(ctx, loop, k_draft, k_acc, plan.ignore_eos)
  if emit is not None:
    jax.debug.callback(emit, prop.d_BK, a, ordered=True)
  return nxt.replace(step=loop.step + 1, per_step=loop.per_step.at[loop.step].set(a))


def _run(cfgs, plan: Plan, length: int, emit, params, prompt_BP, plen_B, key, tau, budget, sp):
  """Prefill + while_loop. Everything here is traced once per (cfgs, plan, shapes)."""
  cfg, dcfg = cfgs
  p_t = weights.in_program(plan, params[0], cfg.dtype)
  p_d = weights.in_program(plan, params[1], dcfg.dtype) if dcfg is not None else None
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


# 16 signatures (~15k mappings) cover a sweep's modes x widths x prompt buckets in turn.
_EXECUTABLES = ExecutableCache(capacity=16)


def _compiled(cfgs, plan, length, args) -> Executable:
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
    return Executable(exe, time.perf_counter() - t0, sink)

  # the cache adds whether the step runs the fused decode kernels
  return _EXECUTABLES.get((cfgs, plan, length, shapes), build)


def compiled_count() -> int:
  """Executables compiled by this process so far (a new signature adds one)."""
  return _EXECUTABLES.built


def clear_compiled():
  """Drop the kept executables (a long-lived process that is done decoding, the tests)."""
  _EXECUTABLES.clear()


@dataclasses.dataclass
class GenerateResult:
  """What ``generate`` returns. ``acceptance_rate``, ``latent_steps_per_byte`` and
  ``bytes_per_s`` are the batch's (every row together); ``row_acceptance_rates`` and
  ``row_latent_steps_per_byte`` hold each row's own, and ``row_bytes_per_s`` its share of the
  batch's throughput."""

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
  # per row: its accepted / proposed candidates (NaN in ntp mode), its latent steps per byte
  row_acceptance_rates: List[float] = dataclasses.field(default_factory=list)
  row_latent_steps_per_byte: List[float] = dataclasses.field(default_factory=list)

  def row_bytes_per_s(self, i: int) -> float:
    """Row ``i``'s generated bytes / the batch's decode wall-clock ``elapsed_s``: the rows
    decode together, so this is the row's share of ``bytes_per_s`` (the rows' sum to it)."""
    return len(self.ids[i]) / self.elapsed_s if self.elapsed_s > 0 else float("inf")

  def to_dict(self):
    d = dataclasses.asdict(self)
    d["ids"] = [x.tolist() for x in self.ids]
    d["prompt_boundaries"] = [x.tolist() for x in self.prompt_boundaries]
    d["boundaries"] = [x.tolist() for x in self.boundaries]
    return d


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
  ex.extra.fn = on_bytes
  try:
    t0 = time.perf_counter()
    res = jax.device_get(ex.exe(*req.args))
    elapsed = time.perf_counter() - t0
  finally:
    ex.extra.fn = None
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
  enc = encode_prompts(prompts)
  check_request(model, opts["mode"], opts["n"], drafter, enc)
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
    weights.for_model(model, plan),
    weights.for_model(drafter, plan) if dcfg is not None else None,
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
  rows = range(len(enc))
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
    row_acceptance_rates=[_ratio(res["n_acc"][i], res["n_cand"][i], float("nan")) for i in rows],
    row_latent_steps_per_byte=[_ratio(res["latents"][i], res["gen"][i], 0.0) for i in rows],
  )


def _ratio(num, den, empty: float) -> float:
  """num / den as a float; ``empty`` for a zero ``den``."""
  return float(num) / float(den) if den else empty
