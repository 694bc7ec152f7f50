"""The training loop: ``train_and_evaluate(config, workdir)``.

One optimizer step consumes ``train.global_batch_bytes`` bytes = ``rows`` sequences of
``data.seq_len`` bytes, processed as ``accum`` micro-batches of ``train.micro_batch_size`` rows
(split over the ('data', 'fsdp') mesh axes). Every ``train.checkpoint_every`` steps, at the end
and on SIGTERM or SIGINT (Ctrl-C) the state and the data iterator position are checkpointed;
a work directory that holds a checkpoint is resumed from its latest one, exactly (same params
and batches as an uninterrupted run) on the learning-rate schedule it was trained with
(``run_config.resume_schedule``: a larger ``train.steps`` does not stretch it unless
``optim.decay_steps`` says so); a corrupt latest checkpoint is skipped for the previous
one (see train/checkpoint.py), and in a multi-process run SIGTERM on any process stops all of
them at the same step. Metrics are fetched one step late so the host never waits on the step it
just dispatched; a non-finite loss stops the run (``NonFiniteLossError``) and no checkpoint of
that step or later is written. What happens after each step (metrics, console, eval,
checkpoints, the watchdog) is done by the hooks of train/hooks.py; batch layout and data
pipelines come from train/inputs.py, the stop flag (SIGTERM, SIGINT, ``request_stop``) from
train/stop.py; one run per work directory (a lock, train/workdir_lock.py).

``prepare(config)`` builds a run's ``Setup`` (the batch plan and the mesh laid out for it come
from ``inputs.plan_and_mesh``); its compiled parts are built from a ``CompileSpec`` alone and
shared by equal specs (so a resume or a test in the same process does not compile again).
``write_resumable_workdir`` writes a work directory that a run resumes at step 0 around given
params (``lca-convert from-torch --config``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import signal
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lca_jax import api, backend
from lca_jax.model.config import ModelConfig
from lca_jax.param_tree import abstract_params
from lca_jax.train import checkpoint as ckpt_lib
from lca_jax.train import hooks as hooks_lib
from lca_jax.train import inputs, optim, run_config, workdir_lock
from lca_jax.train import metrics as met
from lca_jax.train import sharding as shd
from lca_jax.train import state as st
from lca_jax.train import step as step_lib
from lca_jax.train import stop as stop_lib
from lca_jax.train import watchdog as watchdog_lib
from lca_jax.train.errors import TrainError
from lca_jax.train.stop import request_stop  # noqa: F401  (public API: loop.request_stop)
from lca_jax.workdir import params as workdir_params
from lca_jax.workdir.config_file import write_run_config
from lca_jax.workdir.manifest import CorruptCheckpointError
from lca_jax.workdir.params import CKPT_DIR


# ---- configuration -------------------------------------------------------------------------
def lambdas(config):
  return (
    float(config.train.lambda_ntp),
    float(config.train.lambda_mbp),
    float(config.train.lambda_bp),
  )


def prepare_workdir(workdir: str) -> str:
  """The absolute workdir, created; a ``TrainError`` when it (or its checkpoints folder) cannot
  be written, checked on every process before anything is compiled."""
  workdir = os.path.abspath(os.path.expanduser(workdir))
  for d in (workdir, os.path.join(workdir, CKPT_DIR)):
    try:
      os.makedirs(d, exist_ok=True)
      probe = os.path.join(d, f".write_test_{os.uname().nodename}_{os.getpid()}")
      with open(probe, "w") as f:
        f.write("ok")
      os.remove(probe)
    except OSError as e:
      raise TrainError(
        f"cannot write to {'workdir' if d == workdir else 'checkpoint folder'} "
        f"{d}: {e.strerror or e}"
      ) from None
  return workdir


# ---- the pieces of a run -------------------------------------------------------------------
@dataclasses.dataclass
class Setup:
  config: Any
  model_cfg: ModelConfig
  mesh: Any
  plan: inputs.BatchPlan
  tx: Any
  schedule: Any
  abstract: Any  # abstract TrainState with shardings
  shardings: Any  # TrainState of NamedShardings
  train_step: Callable  # jitted, donates the state
  eval_step: Callable  # jitted (params, batch[rows, T]) -> sums
  init_fn: Callable  # jitted () -> fresh sharded TrainState

  def init_state(self):
    with shd.mesh_context(self.mesh):
      return self.init_fn()

  def device_batch(self, host_batch: dict) -> dict:
    """Host rows [host_rows, T] -> global [accum, micro, T] on the mesh."""
    p = self.plan
    shaped = {
      k: np.asarray(v).reshape(p.accum, p.host_micro, p.seq_len) for k, v in host_batch.items()
    }
    return shd.put_batch(shaped, shd.batch_sharding(self.mesh, True), 1)

  def device_eval_batch(self, host_batch: dict) -> dict:
    return shd.put_batch(
      {k: np.asarray(v) for k, v in host_batch.items()}, shd.batch_sharding(self.mesh, False), 0
    )


def model_config_of(config) -> ModelConfig:
  return ModelConfig.from_dict(config.model.to_dict())


@dataclasses.dataclass(frozen=True)
class CompileSpec:
  """Everything the compiled parts of a ``Setup`` are built from, and nothing else:
  ``_compile`` reads only this, so a Setup reused for an equal spec cannot be stale (a new
  input of the compiled functions has to become a field here to reach them at all)."""

  model: ModelConfig
  optim: ml_collections.FrozenConfigDict  # config.optim
  horizon: int  # warmup + cosine horizon, optim.decay_horizon(optim, train.steps)
  lambdas: tuple  # (ntp, mbp, bp) loss weights
  seed: int
  mesh: jax.sharding.Mesh  # equal meshes: same devices in the same layout, same axes

  @classmethod
  def of(cls, config, mesh) -> "CompileSpec":
    return cls(
      model=model_config_of(config),
      optim=ml_collections.FrozenConfigDict(config.optim),
      horizon=optim.decay_horizon(config.optim, int(config.train.steps)),
      lambdas=lambdas(config),
      seed=int(config.train.seed),
      mesh=mesh,
    )


@functools.lru_cache(maxsize=8)
def _compile(spec: CompileSpec) -> dict:
  """The optimizer, shardings and jitted steps of ``spec``, kept per process for the last few
  specs, so a second run of the same model / optimizer / mesh (a resume, a test) does not
  trace and compile again."""
  # decay_horizon(optim, horizon) == horizon: the same schedule as from train.steps
  tx, schedule = optim.make_optimizer(spec.optim, spec.horizon)
  abstract, shardings = st.state_shardings(spec.model, tx, spec.mesh, spec.seed)
  step_fn = step_lib.make_train_step(
    spec.model, tx, schedule, spec.lambdas, grad_shardings=shardings.params
  )
  rep = shd.replicated(spec.mesh)
  train_step = jax.jit(
    step_fn,
    in_shardings=(shardings, shd.batch_sharding(spec.mesh, True)),
    out_shardings=(shardings, rep),
    donate_argnums=(0,),
  )
  eval_step = jax.jit(
    step_lib.make_eval_step(spec.model, spec.lambdas),
    in_shardings=(shardings.params, shd.batch_sharding(spec.mesh, False)),
    out_shardings=rep,
  )
  init_fn = st.make_init_fn(spec.model, tx, spec.seed, shardings)
  return dict(
    tx=tx,
    schedule=schedule,
    abstract=abstract,
    shardings=shardings,
    train_step=train_step,
    eval_step=eval_step,
    init_fn=init_fn,
  )


def prepare(config, devices: Optional[Sequence[Any]] = None) -> Setup:
  """Mesh, batch plan, optimizer, shardings and the jitted steps for ``config``.

  The compiled parts are shared by every config with an equal ``CompileSpec`` (model,
  optimizer, schedule horizon, loss weights, seed, mesh); the mesh and batch plan are
  rebuilt from ``config`` on each call."""
  plan, mesh = inputs.plan_and_mesh(config, devices)
  spec = CompileSpec.of(config, mesh)
  return Setup(config=config, model_cfg=spec.model, mesh=mesh, plan=plan, **_compile(spec))


def _shape_mismatches(want, got) -> list:
  w = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(want)}
  g = {
    jax.tree_util.keystr(k): tuple(np.shape(v)) for k, v in jax.tree_util.tree_leaves_with_path(got)
  }
  out = [f"{k}: missing" for k in sorted(set(w) - set(g))]
  out += [f"{k}: unexpected" for k in sorted(set(g) - set(w))]
  out += [f"{k}: {g[k]} vs {w[k]}" for k in sorted(set(w) & set(g)) if tuple(w[k]) != tuple(g[k])]
  return out


def load_init_params(setup: Setup, source: str):
  """Params for ``train.init_from``: an lca-train workdir (restored straight onto the mesh) or
  anything ``lca_jax.load`` reads (e.g. the upstream PyTorch layout)."""
  want = setup.abstract.params
  if workdir_params.is_workdir(source):
    src_cfg = workdir_params.model_config(source)
    src_abs = abstract_params(src_cfg)
    bad = _shape_mismatches(want, src_abs)
    if bad:
      raise TrainError(
        f"train.init_from={source}: its model does not match this config's ({'; '.join(bad[:6])})"
      )
    try:
      return workdir_params.restore_params(source, want)
    except (FileNotFoundError, CorruptCheckpointError) as e:
      raise TrainError(f"train.init_from: {e}") from None
  try:
    model = api.load(source)
  except api.LoadError as e:
    raise TrainError(f"train.init_from: {e}") from None
  bad = _shape_mismatches(want, model.params)
  if bad:
    raise TrainError(
      f"train.init_from={source}: its model does not match this config's ({'; '.join(bad[:6])})"
    )
  return jax.tree_util.tree_map(lambda a, s: jnp.asarray(a, s.dtype), model.params, want)


def write_resumable_workdir(
  workdir: str, params, config, *, meta: Optional[dict] = None, devices=None
) -> str:
  """Write a work directory that ``lca-train --config <config> --workdir <workdir>`` resumes at
  step 0 into the prepared (empty) ``workdir``: the full TrainState around ``params`` (numpy or
  jax arrays of the config's model; fresh optimizer state, rng of ``train.seed``) and the data
  iterator's start, saved by the run's own ``Checkpointer`` with ``config`` as the run config
  (``meta``: stored with the step). ``devices``: the mesh's devices while writing (default all;
  the checkpoint restores onto any mesh). Params of another shape than the config's model are
  a ``TrainError`` naming them."""
  model_cfg = model_config_of(config)
  inputs.check_data_files(config)
  setup = prepare(config, devices)
  bad = _shape_mismatches(setup.abstract.params, params)
  if bad:
    raise TrainError(f"the params do not match the config's model ({'; '.join(bad[:6])})")
  with shd.mesh_context(setup.mesh):
    state = st.state_from_params(params, setup.tx, int(config.train.seed), setup.shardings)
  pipeline = inputs.make_train_pipeline(config, setup.plan)
  try:
    data_state = pipeline.get_state()
  finally:
    pipeline.close()
  write_run_config(workdir, config.to_dict(), model_cfg)
  ck = ckpt_lib.Checkpointer(workdir, keep=int(config.train.keep_checkpoints), async_save=False)
  try:
    ck.save(state, data_state, meta=dict(meta or {}, model=model_cfg.to_dict(), bytes_seen=0))
  finally:
    ck.close()
  return workdir


@dataclasses.dataclass
class TrainResult:
  step: int
  stopped: bool  # True when a signal / request_stop ended the run before train.steps
  state: Any
  last_train: dict
  last_eval: dict
  workdir: str
  skipped: dict = dataclasses.field(default_factory=dict)  # bad records skipped, by reason
  interrupted: bool = False  # stopped by Ctrl-C (SIGINT)


# ---- evaluation ----------------------------------------------------------------------------
def evaluate(setup: Setup, params, config=None) -> Optional[dict]:
  """Held-out bits-per-byte of both heads (None when there is no eval data)."""
  config = config or setup.config
  pipe = inputs.make_eval_pipeline(config, setup.plan)
  if pipe is None:
    return None
  total = None
  try:
    for host in pipe:
      sums = setup.eval_step(params, setup.device_eval_batch(host))
      total = sums if total is None else jax.tree_util.tree_map(jnp.add, total, sums)
  finally:
    pipe.close()
  if total is None:
    return None
  return step_lib.finish_eval(jax.device_get(total))


# ---- the loop ------------------------------------------------------------------------------
@contextlib.contextmanager
def _stop_requests():
  """A ``stop.Stop`` set by SIGTERM, SIGINT and ``request_stop`` while the block runs."""
  stop = stop_lib.Stop()
  try:
    stop.install()
    stop_lib.ACTIVE.append(stop)
    yield stop
  finally:
    stop.uninstall()
    if stop in stop_lib.ACTIVE:
      stop_lib.ACTIVE.remove(stop)


def _start_state(config, setup: Setup, ckpt, pipeline, latest: Optional[int]):
  """(state, its origin for the console, step of the checkpoint restored or None): the
  latest checkpoint (with the data position), else ``train.init_from``'s params, else a
  fresh init."""
  with shd.mesh_context(setup.mesh):
    state, latest = (
      ckpt.restore_latest(setup.abstract, pipeline) if latest is not None else (None, None)
    )
    if latest is not None:
      return state, f"resumed from step {latest}", latest
    if str(config.train.init_from or ""):
      params = load_init_params(setup, str(config.train.init_from))
      state = st.state_from_params(params, setup.tx, int(config.train.seed), setup.shardings)
      return state, f"params from {config.train.init_from}", None
    return setup.init_state(), "fresh start", None


def _open_hooks(
  config, setup: Setup, workdir, cleanup, *, ckpt, pipeline, stop, dog, start, origin, last_saved
):
  """The ``StepHooks`` of a run and its ``PeriodicEval`` (for the last results); their
  metrics writer and progress bar are closed by ``cleanup``, and the run's first console line
  is written."""
  plan, model_cfg, total = setup.plan, setup.model_cfg, int(config.train.steps)
  tensorboard = bool(config.train.tensorboard)
  writer = cleanup.enter_context(
    contextlib.closing(met.MetricsWriter(workdir, tensorboard, start_step=start))
  )
  progress = cleanup.enter_context(
    contextlib.closing(met.Progress(total, start, bool(config.train.progress_bar)))
  )
  console = hooks_lib.Console(progress, total)
  n_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(setup.abstract.params))
  console.write(
    f"lca-train: {model_cfg.kind} model, {n_params / 1e6:.2f}M params, mesh "
    f"{dict(setup.mesh.shape)}, {plan.rows} rows x {plan.seq_len} bytes per step "
    f"({plan.accum} x {plan.micro}-row micro-batches), steps {start}->{total} ({origin}), "
    f"attention {backend.attention_label(model_cfg.attention_impl)}"
  )
  console.write(f"lca-train: data: {inputs.describe_data(config)}")
  window = hooks_lib.MetricsWindow(
    start=start,
    total=total,
    log_every=int(config.train.log_every),
    bytes_per_step=plan.bytes_per_step,
    flops=lambda bpl: met.train_flops_per_step(
      model_cfg, setup.abstract.params, plan.rows, plan.seq_len, bpl
    ),
    n_devices=setup.mesh.devices.size,
    peak_flops=met.peak_flops_per_device(override_tflops=float(config.train.peak_tflops)),
    skipped_records=lambda: pipeline.stats.skipped_records,
    sinks=[writer.write_train, console.train_line],
  )
  evals = hooks_lib.PeriodicEval(
    every=int(config.train.eval_every),
    total=total,
    evaluate=lambda params: evaluate(setup, params, config),
    sinks=[writer.write_eval, console.eval_line],
  )
  saves = hooks_lib.PeriodicCheckpoint(
    ckpt,
    every=int(config.train.checkpoint_every),
    total=total,
    data_state=pipeline.get_state,
    meta=lambda n: {"model": model_cfg.to_dict(), "bytes_seen": n * plan.bytes_per_step},
    last_saved=last_saved,
  )
  fetch = hooks_lib.LateFetch(
    [hooks_lib.FiniteCheck(lambda: saves.last_saved), console.step_done, window]
  )
  step_hooks = hooks_lib.StepHooks(
    fetch=fetch,
    stop=stop,
    actions=[evals, saves],
    window=window,
    watchdog=hooks_lib.WatchdogHook(dog),
    console=console,
  )
  return step_hooks, evals


def train_and_evaluate(
  config,
  workdir: str,
  *,
  devices: Optional[Sequence[Any]] = None,
  on_step: Optional[Callable[[int, dict], Any]] = None,
  watchdog: float = 0.0,
) -> TrainResult:
  """Train ``config`` (an ml_collections ConfigDict) in ``workdir``; resume if it has a
  checkpoint. ``devices``: the devices of the mesh (default all). ``on_step(step, batch)`` is
  called with each host batch before it is trained on (step counts from 0). ``watchdog`` > 0:
  end the process (exit status 3) when no step, eval or checkpoint completes for that many
  seconds after the first step (a stuck process or collective; ``watchdog.Watchdog``)."""
  model_cfg = model_config_of(config)
  inputs.check_data_files(config)  # a data glob that matches nothing leaves no work directory
  workdir = prepare_workdir(workdir)
  with contextlib.ExitStack() as cleanup:  # unwinds in reverse order: the workdir lock last
    # before anything in the workdir is read or written (the Checkpointer removes tmp dirs)
    cleanup.callback(workdir_lock.acquire(workdir, jax.process_index()).release)
    keep, async_save = int(config.train.keep_checkpoints), bool(config.train.async_checkpointing)
    ckpt = cleanup.enter_context(
      contextlib.closing(ckpt_lib.Checkpointer(workdir, keep=keep, async_save=async_save))
    )
    latest = ckpt.latest_step()
    if latest is not None:  # checked, and on its saved schedule, before anything is compiled
      run_config.check_resume_config(workdir, config.to_dict())
      config = run_config.resume_schedule(workdir, config)
    cfg_dict = config.to_dict()
    setup = prepare(config, devices)
    plan, mesh, total = setup.plan, setup.mesh, int(config.train.steps)
    # From here on SIGTERM (preemption, scancel, the launchers) and SIGINT (Ctrl-C) stop at
    # the end of the first step that completes and checkpoint it. At the end the watchdog is
    # closed first, then the handlers removed, then the rest of ``cleanup`` closed.
    with (
      _stop_requests() as stop,
      contextlib.closing(watchdog_lib.Watchdog(float(watchdog or 0))) as dog,
    ):
      write_run_config(workdir, cfg_dict, model_cfg)
      pipeline = cleanup.enter_context(contextlib.closing(inputs.make_train_pipeline(config, plan)))
      state, origin, last_saved = _start_state(config, setup, ckpt, pipeline, latest)
      start = int(jax.device_get(state.step))
      hooks, evals = _open_hooks(
        config,
        setup,
        workdir,
        cleanup,
        ckpt=ckpt,
        pipeline=pipeline,
        stop=stop,
        dog=dog,
        start=start,
        origin=origin,
        last_saved=last_saved,
      )
      with shd.mesh_context(mesh):
        for step in range(start, total):
          host = next(pipeline)
          if on_step is not None:
            on_step(step, host)
          state, metrics = setup.train_step(state, setup.device_batch(host))
          if hooks.after_step(step + 1, state, metrics):
            break
        hooks.flush()
      final = int(jax.device_get(state.step))
      stopped = stop.flag and final < total
      return TrainResult(
        step=final,
        stopped=stopped,
        state=state,
        last_train=hooks.window.last,
        last_eval=evals.last,
        workdir=workdir,
        skipped=pipeline.stats.skipped,
        interrupted=stopped and stop.signum == signal.SIGINT,
      )
