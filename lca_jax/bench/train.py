"""A config's train step as lca-train runs it: what the compiled step costs (FLOPs, buffers),
timed steps on real batches, and where a step's time goes (XLA profiler)."""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp

from lca_jax import backend, hostmem
from lca_jax.bench import report
from lca_jax.bench.models import ROOT
from lca_jax.perf import costs, xla_profile
from lca_jax.train import inputs, metrics, timing
from lca_jax.train import sharding as shd


def _progress(msg: str):
  report.progress("bench_train", msg)


def abstract_batch(setup):
  """The step's batch as sharded abstract values (lowering needs no data)."""
  p = setup.plan
  shape = (p.accum, p.micro, p.seq_len)
  sharding = shd.batch_sharding(setup.mesh, True)
  spec = lambda: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
  return {"ids": spec(), "segment_ids": spec(), "positions": spec()}


def step_costs(setup, group_len=None):
  """Compile the train step (no run): (its FLOPs and buffers, the compiled executable, which
  the timed steps then run: one compile, as long as a paper-scale step takes on a GPU)."""
  p, cfg = setup.plan, setup.model_cfg
  t0 = time.perf_counter()
  with shd.mesh_context(setup.mesh):
    compiled = setup.train_step.lower(setup.abstract, abstract_batch(setup)).compile()
  compile_s = time.perf_counter() - t0
  params = setup.abstract.params
  doc, _, lplan = costs.regular_layout(cfg, p.micro, p.seq_len, group_len)
  useful = costs.useful_flops(cfg, params, doc, lplan)
  loops = costs.loop_correction(cfg, params, doc, lplan)
  # XLA's analysis is of one device's partitioned program: the whole mesh executes
  # devices x that (replicated work counts once per device that does it). The tile correction
  # is already for the whole micro-batch (all rows, all heads).
  n_dev = int(setup.mesh.devices.size)
  xla = costs.xla_flops(compiled) * n_dev
  # XLA counts the micro-batch scan body once too (accum > 1): scale the model part.
  executed = xla * p.accum + loops["flops"] * p.accum
  mem = compiled.memory_analysis()
  out = dict(
    compile_s=round(compile_s, 2),
    xla_flops=xla,
    xla_flops_per_device=xla / n_dev,
    executed_flops=executed,
    useful_flops=useful["total"] * p.accum,
    executed_over_useful=executed / (useful["total"] * p.accum),
    useful_flops_by_stage={k: v * p.accum for k, v in useful.items() if k != "total"},
    attention_tiles=loops["tiles"],
    latent_capacity=int(lplan.null_BS.shape[1]),
    latent_slots_used=int(jnp.max(jnp.sum(lplan.slot_doc_BS != 0, axis=1))),
    temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0)),
    argument_bytes=int(getattr(mem, "argument_size_in_bytes", 0)),
  )
  out.update(costs.buffers(compiled.as_text(), p.seq_len))
  out["t_by_t_check"] = costs.t_by_t_check(out["t_by_t_buffers"], params, p.seq_len)
  return out, compiled


def profile_steps(setup, host, steps: int):
  """Where ``steps`` more steps' time goes, from the XLA profiler (``lca_jax/perf/xla_profile.py``:
  thread seconds per step by op kind, model part and stage); None off XLA:CPU, whose
  events are the only ones named after the step's HLO instructions. ``setup.train_step`` is
  the compiled step (its optimized HLO names the ops)."""
  if jax.default_backend() != "cpu":
    return None
  table = xla_profile.train_op_table(setup.train_step.as_text())
  batches = [setup.device_batch(b) for b in host[:steps]]

  def run(state):  # the step donates its state: each call takes the one the last returned
    t0 = time.perf_counter()
    for b in batches:
      state, _ = setup.train_step(state, b)
    jax.block_until_ready(state)
    return time.perf_counter() - t0

  with shd.mesh_context(setup.mesh):
    state, _ = setup.train_step(setup.init_state(), batches[0])  # untimed, outside the trace
    jax.block_until_ready(state)
    wall, ns = xla_profile.trace_thread_ns(lambda: run(state), table)
  out = xla_profile.summarize(ns, table, len(batches))
  out["wall_s_per_step"] = round(wall / len(batches), 4)
  return out


def run_steps(config, setup, steps: int, warmup: int, profile: int = 0) -> dict:
  """``steps`` timed optimizer steps after ``warmup`` ones on batches read beforehand; with
  ``profile`` that many of them traced too (``step_profile``)."""
  plan = setup.plan
  pipe = inputs.make_train_pipeline(config, plan)
  host = [next(pipe) for _ in range(warmup + steps)]
  pipe.close()
  _progress(f"read {len(host)} batches")
  timed = timing.time_train_steps(setup, host, warmup)
  ms, dt, init_s, warm_s = timed["metrics"], timed["step_s"], timed["init_s"], timed["warmup_s"]
  bpl = sum(float(m.get("bytes_per_latent", 0.0)) for m in ms) / max(len(ms), 1) or None
  n_dev = setup.mesh.devices.size
  flops = metrics.train_flops_per_step(
    setup.model_cfg, setup.abstract.params, plan.rows, plan.seq_len, bpl
  )
  peak = metrics.peak_flops_per_device(override_tflops=float(config.train.peak_tflops))
  prof = {}
  if profile:
    prof["step_profile"] = profile_steps(setup, host[warmup:], profile)
    _progress("profiled the step")
  return dict(
    **prof,
    warmup_steps=warmup,
    timed_steps=steps,
    init_s=round(init_s, 3),
    warmup_s=round(warm_s, 3),
    step_time_s=dt,
    bytes_per_s=plan.bytes_per_step / dt,
    tflops_per_device=flops / dt / n_dev / 1e12,
    mfu=(flops / dt / (n_dev * peak)) if peak else None,
    bytes_per_latent=bpl,
    overflow=sum(float(m.get("overflow", 0.0)) for m in ms),
    final_loss=float(ms[-1]["loss"]) if ms else None,
  )


def describe(setup, config_path: str) -> dict:
  """The config, machine, mesh, model and batch of ``setup``."""
  plan = setup.plan
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(setup.abstract.params))
  return dict(
    config=os.path.relpath(config_path, ROOT),
    backend=jax.default_backend(),
    device_kind=jax.devices()[0].device_kind,
    **hostmem.describe(),
    devices=setup.mesh.devices.size,
    mesh=dict(setup.mesh.shape),
    params=int(n_params),
    dtype=setup.model_cfg.dtype,
    attention_impl=backend.attention_impl(setup.model_cfg.attention_impl),
    attention_requested=setup.model_cfg.attention_impl,
    seq_len=plan.seq_len,
    rows=plan.rows,
    micro_batch=plan.micro,
    accum=plan.accum,
    bytes_per_step=plan.bytes_per_step,
  )
