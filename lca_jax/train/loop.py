"""The training loop: ``train_and_evaluate(config, workdir)``.

One optimizer step consumes ``train.global_batch_bytes`` bytes = ``rows`` sequences of
``data.seq_len`` bytes, processed as ``accum`` micro-batches of ``train.micro_batch_size`` rows
(split over the ('data', 'fsdp') mesh axes). Every ``train.checkpoint_every`` steps, at the end
and on SIGTERM or SIGINT (Ctrl-C) the state and the data iterator position are checkpointed;
a work directory that holds a checkpoint is resumed from its latest one, exactly (same params
and batches as an uninterrupted run); a corrupt latest checkpoint is skipped for the previous
one (see train/checkpoint.py), and in a multi-process run SIGTERM on any process stops all of
them at the same step. Metrics are fetched one step late so the host never waits on the step it
just dispatched; a non-finite loss stops the run (``NonFiniteLossError``) and no checkpoint of
that step or later is written. Batch layout and data pipelines come from train/inputs.py,
the stop flag (SIGTERM, SIGINT, ``request_stop``) from train/stop.py; one run per work
directory (a lock, train/workdir_lock.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lca_jax.model.config import ModelConfig
from lca_jax.train import checkpoint as ckpt_lib
from lca_jax.train import inputs, optim, run_config, workdir_lock
from lca_jax.train import metrics as met
from lca_jax.train import sharding as shd
from lca_jax.train import state as st
from lca_jax.train import step as step_lib
from lca_jax.train import stop as stop_lib
from lca_jax.train.errors import NonFiniteLossError, TrainError
from lca_jax.train.manifest import CorruptCheckpointError
from lca_jax.train.stop import request_stop  # noqa: F401  (public API: loop.request_stop)


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
  for d in (workdir, os.path.join(workdir, ckpt_lib.CKPT_DIR)):
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


_SETUP_CACHE: dict = {}


def prepare(config, devices: Optional[Sequence[Any]] = None) -> Setup:
  """Mesh, batch plan, optimizer, shardings and the jitted steps for ``config``.

  Memoised per process on everything the compiled functions depend on, so a second run with
  the same model / optimizer / mesh / batch layout (a resume, a test) does not recompile.
  """
  model_cfg = model_config_of(config)
  mesh = shd.make_mesh(config.mesh, devices)
  plan = inputs.plan_batches(config, mesh)
  horizon = optim.decay_horizon(config.optim, int(config.train.steps))
  key = (
    model_cfg,
    tuple(sorted(config.optim.to_dict().items())),
    horizon,
    lambdas(config),
    int(config.train.seed),
    tuple(d.id for d in mesh.devices.flat),
    tuple(mesh.shape.items()),
    plan,
    jax.process_count(),
  )
  if key in _SETUP_CACHE:
    return dataclasses.replace(_SETUP_CACHE[key], config=config)
  tx, schedule = optim.make_optimizer(config.optim, int(config.train.steps))
  seed = int(config.train.seed)
  abstract, shardings = st.state_shardings(model_cfg, tx, mesh, seed)
  step_fn = step_lib.make_train_step(
    model_cfg, tx, schedule, lambdas(config), grad_shardings=shardings.params
  )
  rep = shd.replicated(mesh)
  train_step = jax.jit(
    step_fn,
    in_shardings=(shardings, shd.batch_sharding(mesh, True)),
    out_shardings=(shardings, rep),
    donate_argnums=(0,),
  )
  eval_step = jax.jit(
    step_lib.make_eval_step(model_cfg, lambdas(config)),
    in_shardings=(shardings.params, shd.batch_sharding(mesh, False)),
    out_shardings=rep,
  )
  init_fn = st.make_init_fn(model_cfg, tx, seed, shardings)
  setup = Setup(
    config, model_cfg, mesh, plan, tx, schedule, abstract, shardings, train_step, eval_step, init_fn
  )
  if len(_SETUP_CACHE) > 8:
    _SETUP_CACHE.pop(next(iter(_SETUP_CACHE)))
  _SETUP_CACHE[key] = setup
  return setup


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
  if ckpt_lib.is_workdir(source):
    src_cfg = ckpt_lib.model_config(source)
    src_abs = st.abstract_params(src_cfg)
    bad = _shape_mismatches(want, src_abs)
    if bad:
      raise TrainError(
        f"train.init_from={source}: its model does not match this config's ({'; '.join(bad[:6])})"
      )
    try:
      return ckpt_lib.restore_params(source, want)
    except (FileNotFoundError, CorruptCheckpointError) as e:
      raise TrainError(f"train.init_from: {e}") from None
  import lca_jax  # pylint: disable=g-import-not-at-top

  try:
    model = lca_jax.load(source)
  except lca_jax.LoadError as e:
    raise TrainError(f"train.init_from: {e}") from None
  bad = _shape_mismatches(want, model.params)
  if bad:
    raise TrainError(
      f"train.init_from={source}: its model does not match this config's ({'; '.join(bad[:6])})"
    )
  return jax.tree_util.tree_map(lambda a, s: jnp.asarray(a, s.dtype), model.params, want)


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
  seconds after the first step (a stuck process or collective; ``distributed.Watchdog``)."""
  cfg_dict = config.to_dict()
  model_cfg = model_config_of(config)
  workdir = prepare_workdir(workdir)
  # before anything in the workdir is read or written (the Checkpointer removes tmp dirs)
  lock = workdir_lock.acquire(workdir, jax.process_index())
  ckpt = writer = progress = pipeline = dog = None
  stop = stop_lib.Stop()
  try:
    inputs.check_data_files(config)
    setup = prepare(config, devices)
    plan, mesh = setup.plan, setup.mesh
    total = int(config.train.steps)
    log_every = max(1, int(config.train.log_every))
    eval_every = int(config.train.eval_every)
    ckpt_every = int(config.train.checkpoint_every)

    ckpt = ckpt_lib.Checkpointer(
      workdir,
      keep=int(config.train.keep_checkpoints),
      async_save=bool(inputs.cfg_get(config.train, "async_checkpointing", True)),
    )
    from lca_jax.train import distributed  # pylint: disable=g-import-not-at-top

    dog = distributed.Watchdog(float(watchdog or 0))
    # From here on SIGTERM (preemption, scancel, the launchers) and SIGINT (Ctrl-C) stop at
    # the end of the first step that completes and checkpoint it.
    stop.install()
    stop_lib.ACTIVE.append(stop)
    latest = ckpt.latest_step()
    if latest is not None:
      run_config.check_resume_config(workdir, cfg_dict)
    run_config.write_run_config(workdir, cfg_dict, model_cfg)
    pipeline = inputs.make_train_pipeline(config, plan)

    with shd.mesh_context(mesh):
      state, latest = (
        ckpt.restore_latest(setup.abstract, pipeline) if latest is not None else (None, None)
      )
      if latest is not None:
        origin = f"resumed from step {latest}"
      elif str(config.train.init_from or ""):
        params = load_init_params(setup, str(config.train.init_from))
        state = st.state_from_params(params, setup.tx, int(config.train.seed), setup.shardings)
        origin = f"params from {config.train.init_from}"
      else:
        state = setup.init_state()
        origin = "fresh start"
    start = int(jax.device_get(state.step))

    n_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(setup.abstract.params))
    flops_fn = lambda bpl: met.train_flops_per_step(
      model_cfg, setup.abstract.params, plan.rows, plan.seq_len, bpl
    )
    peak = met.peak_flops_per_device(
      override_tflops=float(inputs.cfg_get(config.train, "peak_tflops", 0.0))
    )
    n_dev = mesh.devices.size
    writer = met.MetricsWriter(
      workdir, bool(inputs.cfg_get(config.train, "tensorboard", True)), start_step=start
    )
    progress = met.Progress(total, start, bool(config.train.progress_bar))
    progress.write(
      f"lca-train: {model_cfg.kind} model, {n_params / 1e6:.2f}M params, mesh "
      f"{dict(mesh.shape)}, {plan.rows} rows x {plan.seq_len} bytes per step "
      f"({plan.accum} x {plan.micro}-row micro-batches), steps {start}->{total} ({origin})"
    )

    last_train, last_eval = {}, {}
    window: list = []
    t_mark, n_mark = time.perf_counter(), start
    pending = None
    last_saved = latest
    dog_armed = saved_once = False

    def process(item):
      nonlocal t_mark, n_mark, window, last_train
      n, m_dev = item
      m = {k: float(v) for k, v in jax.device_get(m_dev).items()}
      if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
        raise NonFiniteLossError(
          f"non-finite loss at step {n} (loss={m['loss']}, grad_norm={m['grad_norm']}); "
          f"stopped without checkpointing it (last checkpoint: "
          f"{'step ' + str(last_saved) if last_saved is not None else 'none'}). "
          "Try a lower optim.lr, more optim.warmup_steps or float32 compute."
        )
      window.append(m)
      progress.update(1)
      if n == 1 or n % log_every == 0 or n == total:
        now = time.perf_counter()
        step_time = (now - t_mark) / max(n - n_mark, 1)
        avg = {k: float(np.mean([w[k] for w in window if k in w])) for k in window[-1] if k != "lr"}
        avg["lr"] = m["lr"]
        avg["step_time"] = step_time
        avg["bytes_per_s"] = plan.bytes_per_step / step_time
        bpl = avg.get("bytes_per_latent")
        avg["tflops_per_device"] = flops_fn(bpl) / step_time / n_dev / 1e12
        avg["mfu"] = (flops_fn(bpl) / step_time / (n_dev * peak)) if peak else None
        avg["skipped_records"] = pipeline.stats.skipped_records
        writer.write_train(n, avg)
        last_train = dict(avg, step=n)
        post = {"loss": avg["loss"], "bpb": avg.get("bpb_ntp")}
        if avg.get("bpb_mbp") is not None:
          post["bpb2"] = avg["bpb_mbp"]
        post["kB/s"] = avg["bytes_per_s"] / 1e3
        progress.update(0, **post)
        window = []
        t_mark, n_mark = now, n

    def reset_clock(n):
      nonlocal t_mark, n_mark
      t_mark, n_mark = time.perf_counter(), n

    with shd.mesh_context(mesh):
      for step in range(start, total):
        host = next(pipeline)
        if on_step is not None:
          on_step(step, host)
        state, m = setup.train_step(state, setup.device_batch(host))
        if pending is not None:
          process(pending)
        n = step + 1
        pending = (n, m)
        stopping = stop.agreed()
        do_eval = eval_every > 0 and (n % eval_every == 0 or n == total)
        do_ckpt = (ckpt_every > 0 and n % ckpt_every == 0) or n == total or stopping
        if do_eval or do_ckpt:
          process(pending)
          pending = None
        if do_eval and not stopping:
          if last_eval == {} and dog_armed:
            dog.suspend(f"first eval @ {n} (compiling)")
          res = evaluate(setup, state.params, config)
          if res is not None:
            writer.write_eval(n, res)
            last_eval = dict(res, step=n)
            progress.write(
              f"eval @ {n}: bpb_ntp {res['bpb_ntp']:.4f}"
              + (f", bpb_mbp {res['bpb_mbp']:.4f}" if "bpb_mbp" in res else "")
            )
          if dog_armed:
            dog.arm(f"eval @ {n}")
          reset_clock(n)
        if do_ckpt and last_saved != n:
          if not saved_once and dog_armed:
            dog.suspend(f"first checkpoint {n}")
          ckpt.save(
            state,
            pipeline.get_state(),
            meta={"model": model_cfg.to_dict(), "bytes_seen": n * plan.bytes_per_step},
          )
          last_saved = n
          if dog_armed:
            dog.arm(f"checkpoint {n}")
          saved_once = True
          reset_clock(n)
        if step == start:
          dog.arm(f"step {n}")  # compiling the first step is not counted
          dog_armed = True
        else:
          dog.beat(f"step {n}")
        if stopping:
          progress.write(
            f"lca-train: stopping at step {n} ({stop.reason}); checkpoint saved, "
            "run the same command to resume"
          )
          break
      if pending is not None:
        process(pending)
    final = int(jax.device_get(state.step))
    stopped = stop.flag and final < total
    return TrainResult(
      step=final,
      stopped=stopped,
      state=state,
      last_train=last_train,
      last_eval=last_eval,
      workdir=workdir,
      skipped=pipeline.stats.skipped,
      interrupted=stopped and stop.signum == signal.SIGINT,
    )
  finally:
    if dog is not None:
      dog.close()
    stop.uninstall()
    if stop in stop_lib.ACTIVE:
      stop_lib.ACTIVE.remove(stop)
    if progress is not None:
      progress.close()
    if ckpt is not None:
      ckpt.close()
    if writer is not None:
      writer.close()
    if pipeline is not None:
      pipeline.close()
    lock.release()
