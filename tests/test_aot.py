"""Deviceless GPU compilation (lca_jax/aot, `lca-train --aot`, tools/gpu_aot.py).

The tests of the report's parsers, the targets and the error paths run everywhere; those that
compile for a GPU need jax's CUDA plugin and skip without it (`make gpu-aot` installs it into
.venv-cuda and runs this file there):

    JAX_PLATFORMS=cpu .venv-cuda/bin/python -m pytest -q tests/test_aot.py
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from lca_jax import backend, xla_options
from lca_jax.aot import report, targets
from lca_jax.model import incremental, layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "gpu_aot.py")
TINY = os.path.join(ROOT, "configs", "tiny_lca_mbp.py")
HAS_PLUGIN = targets.plugin_available()
needs_plugin = pytest.mark.skipif(
  not HAS_PLUGIN, reason="jax's CUDA plugin is not installed (make gpu-aot runs these)"
)
no_plugin = pytest.mark.skipif(HAS_PLUGIN, reason="the CUDA plugin is installed here")


def _run(args, **env):
  return subprocess.run(
    [sys.executable] + args,
    capture_output=True,
    text=True,
    env=dict(os.environ, **env),
    timeout=600,
  )


# ---- targets -----------------------------------------------------------------------------
def test_targets_parse_names_and_counts():
  assert targets.parse("h100") == targets.Target("h100", 1)
  assert targets.parse("H200:8") == targets.Target("h200", 8)
  for bad in ("a100", "h100:0", "h100:x", "h100:-2", ""):
    with pytest.raises(targets.AotError):
      targets.parse(bad)


def test_target_configs_describe_the_devices():
  h100, h200, b200 = (targets.Target(n, 1) for n in ("h100", "h200", "b200"))
  assert h100.device_name == "NVIDIA H100 80GB HBM3" and 80e9 < h100.memory_bytes < 90e9
  assert 140e9 < h200.memory_bytes < 160e9 and 180e9 < b200.memory_bytes < 200e9
  assert "B200" in b200.device_name


# ---- the platform a program is traced for ------------------------------------------------
def test_backend_target_switches_the_cpu_choices():
  assert backend.platform() == "cpu" and backend.is_cpu()
  assert xla_options.decode_options() == xla_options.cpu_options()
  with backend.target("gpu"):
    assert backend.platform() == "gpu" and backend.cpu_threads() == 1
    assert not layers._matvec_cache_products(2, 1)  # pylint: disable=protected-access
    assert incremental.lm_widths(1024, backend.platform()) == (1024,)
    assert xla_options.decode_options() == xla_options.GPU_OPTIONS
    os.environ["LCA_JAX_GPU_GRAPHS"] = "0"
    try:
      assert xla_options.decode_options() is None
    finally:
      del os.environ["LCA_JAX_GPU_GRAPHS"]
  assert backend.platform() == "cpu"
  with pytest.raises(ValueError):
    with backend.target("gpu0"):
      pass


# ---- report: memory, HLO, thunk sequences ------------------------------------------------
class _Stats:
  def __init__(self, arg, out, alias, temp):
    self.argument_size_in_bytes, self.output_size_in_bytes = arg, out
    self.alias_size_in_bytes, self.temp_size_in_bytes = alias, temp
    self.generated_code_size_in_bytes = 0


class _Compiled:
  def __init__(self, stats):
    self.stats = stats

  def memory_analysis(self):
    return self.stats


def test_memory_counts_donated_outputs_once_and_says_by_how_much_it_misses():
  m = report.memory(_Compiled(_Stats(10e9, 10e9, 9.5e9, 40e9)), int(80e9), int(9e9), 0.75)
  assert m["total_gb"] == pytest.approx(50.5) and m["fits"] and m["fits_default_pool"]
  assert m["verdict"].startswith("fits in JAX's memory pool (75%")
  assert m["usable_gb"] == pytest.approx(60 - report.RUNTIME_MARGIN / 1e9)
  # over the default pool, under the device: the fraction it needs
  m = report.memory(_Compiled(_Stats(10e9, 10e9, 9.5e9, 60e9)), int(80e9), int(9e9), 0.75)
  assert m["fits"] and not m["fits_default_pool"]
  assert (
    m["mem_fraction"] == pytest.approx(0.9)
    and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.90" in m["verdict"]
  )
  m = report.memory(_Compiled(_Stats(10e9, 10e9, 10e9, 75e9)), int(80e9), int(9e9), 0.75)
  assert not m["fits"] and m["verdict"] == "does not fit by 10.50 GB"  # 85 > 0.95 x 80 - 1.5


def test_the_memory_pool_follows_jax_s_environment_variables():
  assert report.pool_fraction({}) == 0.75
  assert report.pool_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"}) == 0.9
  assert report.pool_fraction({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}) == 1.0
  assert report.pool_fraction({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}) == 1.0


def test_hlo_summary_finds_a_dense_attention_matrix():
  t = 256

  def f(q, k):
    with jax.named_scope("attn"):
      s = jnp.einsum("td,sd->ts", q, k)
      return jnp.sum(jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)) @ k)

  x = jnp.ones((t, 16), jnp.float32)
  text = jax.jit(f).lower(x, x).compile().as_text()
  s = report.hlo_summary(text, t)
  assert s["attention_buffers_TT"] >= 1
  assert any(b["attention"] and "256,256" in b["shape"] for b in s["large_buffers"])
  assert report.hlo_summary(text, t + 1)["large_buffers"] == []


LOOP_ON_HOST = """\
000: kCommandBuffer      [source       | next=002 (1) ]
    001: kCustomKernel [source | sink] prefill_fusion grid: [1, 1, 1]
002: kWhile              [prev=000 (1) | next=009 (1)]
condition:
    003: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1]
  body:
    000: kCommandBuffer [source | sink]
        004: kCustomKernel [source | next=005 (1)] a grid: [1, 1, 1]
        005: kCopy         [prev=004 (1) | sink] kCopy
        006: kConditional  [source | sink]
          branch_0:
            007: kCustomKernel [source | sink] idle grid: [1, 1, 1]
          branch_1:
            007: kCustomKernel [source | next=008 (1)] lm_a grid: [1, 1, 1]
            008: kCustomKernel [prev=007 (1) | sink] lm_b grid: [1, 1, 1]
009: kCustomKernel       [prev=002 (1) | sink] tail grid: [1, 1, 1]
"""

LOOP_IN_GRAPH = """\
000: kCommandBuffer      [source       | sink ]
    001: kCustomKernel [source | next=002 (1)] prefill_fusion grid: [1, 1, 1]
    002: kWhile        [prev=001 (1) | sink]
condition:
        003: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1]
      body:
        004: kCustomKernel [source | next=005 (1)] a grid: [1, 1, 1]
        005: kConditional  [source | sink]
          branch_0:
            006: kCustomKernel [source | sink] b grid: [1, 1, 1]
"""


def test_decode_step_counts_kernels_launches_and_syncs():
  s = report.decode_step(LOOP_ON_HOST, 2)
  # condition 1 + body: kernel, copy, the larger branch (2)
  assert s["kernels"] == 5 and s["body_is_one_graph"] and not s["loop_in_graph"]
  assert s["kernels_least"] == 4  # the idle branch
  assert (s["host_launches"], s["host_syncs"]) == (2, 1)  # condition kernel + body graph
  assert s["kernel_bound_bytes_per_s"] == pytest.approx(2 / (5 * report.LAUNCH_US * 1e-6), 1e-3)
  g = report.decode_step(LOOP_IN_GRAPH, 1)
  assert g["kernels"] == 3 and g["loop_in_graph"]
  assert (g["host_launches"], g["host_syncs"]) == (0, 0) and g["host_bound_bytes_per_s"] is None
  with pytest.raises(ValueError):
    report.decode_step("000: kCustomKernel [source | sink] x\n", 1)


# XLA prints an empty branch as "No thunks." with the next label on the same line, and a
# conditional on a predicate with true / false labels
EMPTY_AND_PRED_BRANCHES = """\
000: kWhile              [source | sink]
condition:
    001: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1]
  body:
    000: kCommandBuffer [source | sink]
        002: kCustomKernel [source | next=003 (1)] a grid: [1, 1, 1]
        003: kConditional  [source | sink]
          branch_0:
            No thunks.          branch_1:
            004: kCustomKernel [source | next=005 (1)] lm_a grid: [1, 1, 1]
            005: kCustomKernel [prev=004 (1) | sink] lm_b grid: [1, 1, 1]
        006: kConditional  [source | sink]
          false_branch:
            007: kCustomKernel [source | sink] narrow grid: [1, 1, 1]
          true_branch:
            008: kCustomKernel [source | next=009 (1)] wide_a grid: [1, 1, 1]
            009: kCustomKernel [prev=008 (1) | sink] wide_b grid: [1, 1, 1]
"""


def test_empty_branches_and_predicate_branches_are_branches_of_their_conditional():
  s = report.decode_step(EMPTY_AND_PRED_BRANCHES, 1)
  # condition 1 + body: a, the LM branch (2) or nothing, the wide (2) or narrow (1) branch
  assert (s["kernels"], s["kernels_least"]) == (6, 3)


def test_a_tpu_program_xla_will_not_compile_for_lack_of_hbm_is_reported_as_not_fitting():
  """XLA:TPU refuses a program whose temporaries exceed the HBM (RESOURCE_EXHAUSTED): the
  report says it does not fit, with the compiler's figures, instead of stopping the tool."""
  from lca_jax.aot import programs, tpu_check  # pylint: disable=g-import-not-at-top

  message = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (44.26G) exceeds available HBM (15.75G).\nmore"
  )

  class Lowered:
    def compile(self):
      raise jax.errors.JaxRuntimeError(message)

  target = targets.parse("v5e")
  prog = programs.Program("train_step", Lowered(), 4096, 4 * report.GB, dict(micro_batch=16))
  r = tpu_check.check(prog, target, work=None)
  m = r["memory"]
  assert not m["fits"] and m["temp_gb"] == 44.26 and m["total_gb"] == 48.26
  assert "44.26 GB" in m["verdict"] and "15.75 GB" in m["verdict"]
  assert r["compile_error"].startswith("RESOURCE_EXHAUSTED") and "estimate" not in r
  assert r["micro_batch"] == 16

  class Broken:
    def compile(self):
      raise jax.errors.JaxRuntimeError("INTERNAL: something else")

  with pytest.raises(jax.errors.JaxRuntimeError):
    tpu_check.check(programs.Program("p", Broken(), 16, 0, {}), target, work=None)


# ---- error paths without the plugin ------------------------------------------------------
@no_plugin
def test_lca_train_aot_without_the_plugin_is_one_line_exit_2():
  r = _run(["-m", "lca_jax.cli.train", "--config", TINY, "--aot", "h100:8"])
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and "CUDA plugin" in lines[0] and "make gpu-aot" in lines[0]


def test_lca_train_aot_unknown_target_is_one_line_exit_2():
  r = _run(["-m", "lca_jax.cli.train", "--config", TINY, "--aot", "tpu7"])
  assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
  assert "unknown target 'tpu7'" in r.stderr


@no_plugin
def test_tool_without_the_plugin_is_one_line_exit_2():
  r = _run([TOOL, "--targets", "h100", "--config", TINY])
  assert r.returncode == 2 and "CUDA plugin" in r.stderr and r.stdout == ""


# ---- with the plugin: real GPU executables -----------------------------------------------
@pytest.fixture
def optimized():
  """XLA's normal optimization (the suite turns most of it off to compile faster): the GPU
  passes these tests read (command buffers, fusion) run as they do for users."""
  old = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", old)


def _tiny_config(impl, seq_len=512):
  from lca_jax import configs_io  # pylint: disable=g-import-not-at-top

  c = configs_io.load_config(TINY)
  c.model.attention_impl = impl
  c.data.seq_len = seq_len
  c.train.micro_batch_size = 2
  c.train.global_batch_bytes = 2 * seq_len
  return c


@needs_plugin
def test_pallas_train_step_runs_the_triton_kernels_without_a_dense_matrix(optimized):
  from lca_jax.aot import check  # pylint: disable=g-import-not-at-top

  (pallas,) = check.train_reports(_tiny_config("pallas"), targets.parse("h100:2"), ("train_step",))
  assert pallas["custom_calls"].get("__gpu$xla.gpu.triton", 0) >= 6  # 3 stacks + the LCA head
  assert pallas["attention_buffers_TT"] == 0 and pallas["memory"]["fits"]
  assert pallas["mesh"]["data"] == 2 and pallas["micro_batch_per_device"] == 1
  e = pallas["estimate"]  # the Pallas kernels priced from the keys they visit
  assert e["split_s"]["attention"] > 0 and e["step_s"] >= e["floor_s"] > 0
  assert 0 < e["mfu"] < e["floor_mfu"] < 1 and e["unknown_loops"] == 0
  (dense,) = check.train_reports(_tiny_config("dense"), targets.parse("h100:2"), ("train_step",))
  assert dense["attention_buffers_TT"] > 0  # the check sees a [T, T] matrix where there is one


@needs_plugin
def test_the_default_config_compiles_the_triton_kernels_for_a_gpu():
  """No attention_impl override: "auto" resolves to the GPU's Pallas kernels in a deviceless
  GPU compile on this CPU host, and the report and its header say so."""
  from lca_jax import configs_io  # pylint: disable=g-import-not-at-top
  from lca_jax.aot import check, text  # pylint: disable=g-import-not-at-top

  c = configs_io.load_config(TINY)
  assert c.model.attention_impl == "auto"
  c.data.seq_len, c.train.micro_batch_size, c.train.global_batch_bytes = 256, 1, 256
  (r,) = check.train_reports(c, targets.parse("h100:1"), ("train_step",))
  assert r["attention_impl"] == "pallas" and r["attention_requested"] == "auto"
  assert r["custom_calls"].get("__gpu$xla.gpu.triton", 0) >= 6  # 3 stacks + the LCA head
  assert ", attention pallas (auto), " in text.header(r)


@needs_plugin
def test_decode_loop_is_one_cuda_graph(optimized, monkeypatch):
  from lca_jax.aot import check  # pylint: disable=g-import-not-at-top
  from lca_jax.model.config import ModelConfig  # pylint: disable=g-import-not-at-top

  cfg = ModelConfig.from_dict(_tiny_config("xla").model.to_dict())
  (r,) = check.decode_reports(cfg, targets.parse("h100"), [dict(batch=1, mode="ntp")], 32, 32)
  step = r["step"]
  assert step["loop_in_graph"] and step["host_syncs"] == 0 and step["kernels"] > 10
  e = r["estimate"]  # one graph: every kernel of a step at the in-graph launch cost
  assert e["idle_step"]["launches"] == step["kernels_least"]
  assert e["lm_step"]["launches"] == step["kernels"] and e["lm_step"]["host_syncs"] == 0
  assert e["floor_bytes_per_s"] >= e["bytes_per_s"] > 0 and e["estimate_over_floor"] >= 1
  monkeypatch.setenv("LCA_JAX_GPU_GRAPHS", "0")
  (r0,) = check.decode_reports(cfg, targets.parse("h100"), [dict(batch=1, mode="ntp")], 32, 32)
  assert not r0["step"]["loop_in_graph"] and r0["step"]["host_syncs"] >= 1
  assert r0["estimate"]["lm_step"]["host_syncs"] >= 1
  assert r0["estimate"]["lm_step"]["step_s"] > e["lm_step"]["step_s"]  # host launches, syncs
  assert r0["step"]["kernels"] == step["kernels"]


@needs_plugin
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("fused", ["1", "0"])
def test_a_decode_step_that_runs_no_latent_lm_only_writes_the_lm_caches(
  optimized, batch, fused, monkeypatch
):
  """The latent LM runs under a conditional: with the fused decode kernels (GPUs' default) its
  branch writes the caches in place and the idle branch passes them through, so more LM layers
  add nothing to a step where no group closes (the smallest branch); without them
  (LCA_JAX_FUSED_DECODE=0) the branches return every layer's new entries as one stacked pair,
  written after it: each LM layer adds only the two writes of its keys and values (no zero
  entries per layer in the idle branch, no select per write). A step that runs the LM launches
  each layer's own kernels: with the fused kernels exactly five (norm + q/k/v, attention,
  output + residual, norm + gate/up, down + residual)."""
  from lca_jax.aot import check  # pylint: disable=g-import-not-at-top
  from lca_jax.model.config import ModelConfig  # pylint: disable=g-import-not-at-top

  monkeypatch.setenv("LCA_JAX_FUSED_DECODE", fused)
  steps, more = [], 3  # LM layers added
  for n_lm in (1, 1 + more):
    c = _tiny_config("xla")
    c.model.n_lm = n_lm
    cfg = ModelConfig.from_dict(c.model.to_dict())
    (r,) = check.decode_reports(cfg, targets.parse("h100"), [dict(batch=batch, mode="ntp")], 32, 32)
    steps.append(r["step"])
  per_layer = 0 if fused == "1" else 2
  assert steps[1]["kernels_least"] - steps[0]["kernels_least"] == per_layer * more, steps
  if fused == "1":  # (+ at most the loop bookkeeping of a stack long enough to be scanned)
    assert 5 * more <= steps[1]["kernels"] - steps[0]["kernels"] <= 5 * more + 2, steps
  else:
    assert steps[1]["kernels"] - steps[0]["kernels"] > 8 * more, steps


@needs_plugin
@pytest.mark.parametrize("batch", [1, 2])
def test_the_fused_decode_kernels_replace_xla_s_kernels_of_each_layer(
  optimized, batch, monkeypatch
):
  """A decode step compiled for an H100 runs each layer's dense parts as the Pallas kernels of
  kernels/decode_fused.py, its attention (RoPE, scores, softmax, values, cache write) as the
  kernel of kernels/decode_attention.py, the LM's cache writes inside it: fewer kernels
  in both the idle and the LM step than with LCA_JAX_FUSED_DECODE=0, and no copy of a cache."""
  from lca_jax.aot import check  # pylint: disable=g-import-not-at-top
  from lca_jax.model.config import ModelConfig  # pylint: disable=g-import-not-at-top

  cfg = ModelConfig.from_dict(_tiny_config("xla").model.to_dict())
  case = [dict(batch=batch, mode="ntp")]
  (fused,) = check.decode_reports(cfg, targets.parse("h100"), case, 32, 32)
  monkeypatch.setenv("LCA_JAX_FUSED_DECODE", "0")
  (plain,) = check.decode_reports(cfg, targets.parse("h100"), case, 32, 32)
  calls = fused["custom_calls"].get("__gpu$xla.gpu.triton", 0)
  layers_ = cfg.n_enc + cfg.n_lm + cfg.n_dec
  assert calls >= 5 * layers_ and plain["custom_calls"].get("__gpu$xla.gpu.triton", 0) == 0
  assert fused["step"]["kernels_least"] < plain["step"]["kernels_least"]
  assert fused["step"]["kernels"] < plain["step"]["kernels"]
  assert fused["memory"]["temp_gb"] <= plain["memory"]["temp_gb"] + 1e-3  # no cache copies
  assert fused["estimate"]["bytes_per_s"] > plain["estimate"]["bytes_per_s"]


@needs_plugin
def test_lca_train_aot_and_the_tool_as_a_user_runs_them():
  r = _run(
    ["-m", "lca_jax.cli.train", "--config", TINY, "--aot", "h200:2", "--json"],
    JAX_PLATFORMS="cpu",
  )
  assert r.returncode == 0, r.stderr[-2000:]
  reports = json.loads(r.stdout)
  assert [x["program"] for x in reports] == ["train_step", "eval_step"]
  assert reports[0]["device"].startswith("NVIDIA H200") and reports[0]["memory"]["fits"]
  assert all(0 < x["estimate"]["mfu"] < 1 for x in reports)
  r = _run(["-m", "lca_jax.cli.train", "--config", TINY, "--aot", "h100"], JAX_PLATFORMS="cpu")
  assert r.returncode == 0 and "estimated step" in r.stdout and "MFU" in r.stdout, r.stdout
  r = _run(
    [TOOL, "--config", TINY, "--targets", "b200", "--gpus", "1", "--impls", "pallas"]
    + ["--decode", "none", "--micro-per-gpu", "2"],
    JAX_PLATFORMS="cpu",
  )
  assert r.returncode == 0, r.stderr[-2000:]
  out = json.loads(r.stdout)
  assert [p["program"] for p in out["programs"]] == ["train_step", "eval_step"]
  assert out["programs"][0]["target"] == "b200:1" and out["programs"][0]["compile_s"] > 0
