"""Deviceless TPU compilation (lca_jax/aot TPU targets, lca_jax/perf/tpu, tools/tpu_aot.py).

The tests of the targets, the estimate's loop counting and choice and the error paths run
everywhere; those that compile for a TPU need libtpu and skip without it (`make tpu-aot`
installs it into .venv-tpu and runs this file there):

    JAX_PLATFORMS=cpu .venv-tpu/bin/python -m pytest -q tests/test_tpu_aot.py
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lca_jax import configs_io
from lca_jax.aot import check, targets, text, tpu_check
from lca_jax.model.config import ModelConfig
from lca_jax.perf import hardware, hlo, tpu
from lca_jax.perf.estimate import Hints
from lca_jax.train import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "tpu_aot.py")
TINY = os.path.join(ROOT, "configs", "tiny_lca_mbp.py")
HAS_LIBTPU = targets.tpu_compiler_available()
needs_libtpu = pytest.mark.skipif(
  not HAS_LIBTPU, reason="libtpu is not installed (make tpu-aot runs these)"
)
# the smallest model and rows that still have every stack (conftest.TINY_SHAPE)
SMALL = [
  "--config.model.d_model=32",
  "--config.model.d_inner=64",
  "--config.model.n_heads=2",
  "--config.model.n_kv_heads=2",
  "--config.model.n_lm=1",
  "--config.model.n_mbp=1",
  "--config.data.seq_len=32",
]


def _run(args, **env):
  return subprocess.run(
    [sys.executable] + args,
    capture_output=True,
    text=True,
    env=dict(os.environ, **env),
    timeout=600,
  )


# ---- targets -----------------------------------------------------------------------------
def test_tpu_targets_parse_chips_topologies_and_slices():
  t = targets.parse("v5p:8")
  assert (t.chips, t.topology, t.slices, t.n_devices, str(t)) == (8, "2x2x2", 1, 8, "v5p:2x2x2")
  assert targets.parse("v5p:64").topology == "4x4x4"
  assert targets.parse("v5e:8").topology == "2x4" and targets.parse("v6e:16").topology == "4x4"
  assert targets.parse("V5E").n_devices == 1 and targets.parse("v5e:2").topology == "2x2"
  assert targets.parse("v5p:2x2x4").chips == 16
  two = targets.parse("v5p:8*2")
  assert (two.n_devices, two.slices, str(two)) == (16, 2, "v5p:2x2x2*2")
  assert str(targets.parse("v5p:4").one()) == "v5p:1" and targets.parse("v5p").platform == "tpu"
  assert targets.parse("v6e").memory_bytes == 32e9 and targets.parse("v5e").memory_bytes == 16e9
  assert targets.parse("v5p").device_name == "TPU v5" and targets.parse("h100").platform == "gpu"


@pytest.mark.parametrize(
  "bad, says",
  [
    ("v5p:6", "no standard topology"),
    ("v5p:2x2", "3 dimensions"),
    ("v5e:2x2x1", "2 dimensions"),
    ("v5p:8*0", "slice count"),
    ("v5p:x", "chip count"),
    ("v7x:8", "unknown target"),
  ],
)
def test_bad_tpu_targets_say_what_is_wrong(bad, says):
  with pytest.raises(targets.AotError, match=says):
    targets.parse(bad)


def test_tpu_peaks_are_the_datasheet_figures():
  v5e, v5p, v6e = (hardware.tpu(n) for n in ("v5e", "v5p", "v6e"))
  assert (v5e.bf16_flops, v5p.bf16_flops, v6e.bf16_flops) == (197e12, 459e12, 918e12)
  assert (v5e.memory_bytes_per_s, v5p.memory_bytes_per_s) == (0.819e12, 2.765e12)
  assert v6e.memory_bytes_per_s == 1.64e12 and v5p.hbm_bytes == 95e9
  assert v5p.dot_peak("f32", highest=True) == pytest.approx(459e12 / 6)


# ---- perf.tpu: loops, custom calls, the estimate it reports --------------------------------
COUNTED = """\
HloModule m

%body (p: (s32[], f32[128,128])) -> (s32[], f32[128,128]) {
  %p = (s32[], f32[128,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[128,128] get-tuple-element(%p), index=1
  %one = s32[] constant(2)
  %j = s32[] add(%i, %one)
  %y = f32[128,128] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[128,128]) tuple(%j, %y)
}

%cond (q: (s32[], f32[128,128])) -> pred[] {
  %q = (s32[], f32[128,128]) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(12)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

%cond2 (q2: (s32[], f32[128,128])) -> pred[] {
  %q2 = (s32[], f32[128,128]) parameter(0)
  %k2 = s32[] get-tuple-element(%q2), index=0
  %m2 = s32[] get-tuple-element(%q2), index=0
  ROOT %lt2 = pred[] compare(%k2, %m2), direction=LT
}

ENTRY %main (a: f32[128,128]) -> f32[128,128] {
  %a = f32[128,128] parameter(0)
  %zero = s32[] constant(2)
  %init = (s32[], f32[128,128]) tuple(%zero, %a)
  %w = (s32[], f32[128,128]) while(%init), condition=%cond, body=%body, metadata={op_name="jit(f)/scan/while"}
  %w2 = (s32[], f32[128,128]) while(%w), condition=%cond2, body=%body, metadata={op_name="jit(f)/attn/while"}
  ROOT %r = f32[128,128] get-tuple-element(%w2), index=1
}
"""


def test_a_counted_loop_runs_its_body_bound_minus_start_times():
  module = hlo.parse(COUNTED)
  w, w2 = module.by_name["w"], module.by_name["w2"]
  assert tpu.counted_trips(module, w) == 5  # i from 2 while i < 12, step 2
  assert tpu.counted_trips(module, w2) is None  # bound not a constant
  assert tpu.trips(module, w2, Hints(trips=(("/attn/", 3.5),))) == 3.5
  chip = hardware.tpu("v5e")
  s = tpu.program_estimate(COUNTED, chip, Hints(trips=(("/attn/", 3.0),)), op_s=0.0)
  dot = 2 * 128**3
  assert s["flops"] == pytest.approx(8 * dot) and s["unknown_loops"] == 0
  s = tpu.program_estimate(COUNTED, chip, op_s=0.0)  # the second loop counted once
  assert s["flops"] == pytest.approx(6 * dot) and s["unknown_loops"] == 1
  s = tpu.program_estimate(COUNTED, chip, op_s=1e-6)
  # the dots only: the loop counters and predicates are scalar ops
  assert s["launch_s"] == pytest.approx(s["launches"] * 1e-6) and s["launches"] == 6


def test_the_estimate_takes_the_compiler_s_only_where_it_holds():
  assert tpu.step_estimate(2.0, 1.0, loops=False)["source"] == tpu.COMPILER
  for compiler_s, loops in ((1.0, True), (-1.8, False), (None, False)):
    e = tpu.step_estimate(2.0, compiler_s, loops)
    assert e["source"] == tpu.MODEL and e["step_s"] == 2.0 and e["why"]
  assert "loops" in tpu.step_estimate(2.0, 1.0, loops=True)["why"]


def test_a_tpu_convolution_counts_its_output_features_from_its_labels():
  # a dot XLA:TPU wrote as a convolution: lhs [4 (window), 128 (in), 64 (batch)], rhs
  # [4, 128, 384 (out)], output [64, 384, 1]: 64 x 384 outputs of 4 x 128 products each
  text = """\
HloModule m

ENTRY %main (a: f32[4,128,64], b: f32[4,128,384]) -> f32[64,384,1] {
  %a = f32[4,128,64] parameter(0)
  %b = f32[4,128,384] parameter(1)
  ROOT %c = f32[64,384,1] convolution(%a, %b), window={size=4}, dim_labels=0fb_0io->bf0
}
"""
  s = tpu.program_estimate(text, hardware.tpu("v5p"), op_s=0.0)
  assert s["flops"] == pytest.approx(2 * 64 * 384 * 4 * 128)


def test_tpu_reports_print_per_chip_and_say_which_estimate():
  r = dict(
    program="train_step",
    target="v5p:1",
    device="TPU v5",
    unit="chip",
    mesh=dict(data=1, fsdp=1, tensor=1),
    micro_batch=16,
    micro_batch_per_device=16,
    accum=16,
    seq_len=4096,
    attention_impl="pallas",
    dtype="bfloat16",
    remat=False,
    compile_s=1.0,
    lower_s=1.0,
    memory=dict(
      total_gb=70.0,
      verdict="fits in HBM",
      fits=True,
      margin_gb=25.0,
      state_gb=4.5,
      temp_gb=66.0,
      argument_gb=4.5,
      output_gb=4.5,
      alias_gb=4.5,
      device_gb=95.0,
    ),
    fusions=dict(total=3, kLoop=3),
    while_loops=2,
    custom_calls={"tpu_custom_call": 3},
    large_buffers=[],
    attention_buffers_TT=0,
  )
  head = text.header(r)
  assert "(16 per chip)" in head and "95.0 GB each" in head
  lines = text.program_lines(r)
  assert "per chip: fits in HBM" in lines[0] and not any("Triton" in x for x in lines)
  assert text.setting(r) == " (16 rows per chip)"
  assert text.setting(dict(r, remat=True, micro_batch_per_device=2)) == " (2 rows per chip, remat)"
  assert text.setting(dict(r, micro_batch_per_device=1)) == " (1 row per chip)"
  assert text.setting(dict(program="decode", mode="ntp")) == ""


# ---- with libtpu: real TPU executables ---------------------------------------------------
def _on_one(name: str):
  dev = targets.devices(targets.parse(name))[0]
  return NamedSharding(Mesh(np.array([dev]), ("x",)), P())


@needs_libtpu
def test_devices_of_a_slice_and_of_two_slices():
  assert len(targets.devices(targets.parse("v5p:8"))) == 8
  devs = targets.devices(targets.parse("v5e:4*2"))
  assert len(devs) == 8 and {d.slice_index for d in devs} == {0, 1}
  assert {d.device_kind for d in devs} == {"TPU v5 lite"}


@needs_libtpu
def test_loop_free_program_keeps_the_compiler_s_estimate_and_the_model_agrees():
  sh = _on_one("v5e")
  f = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b, in_shardings=(sh, sh), out_shardings=sh)
  x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
  compiled = f.lower(x, x).compile()
  text_ = compiled.as_text()
  compiler_s = tpu.compiler_seconds(compiled)
  assert compiler_s > 0 and not tpu.has_loops(text_)
  s = tpu.program_estimate(text_, hardware.tpu("v5e"), op_s=0.0)
  flops = 2 * 2 * 4096**3
  assert s["flops"] == pytest.approx(flops, rel=0.01)
  assert compiled.cost_analysis()["flops"] == pytest.approx(flops, rel=0.01)
  # both are the roofline of the same two GEMMs (the model at 75% of the peak)
  assert s["floor_s"] == pytest.approx(compiler_s, rel=0.25)
  assert tpu.step_estimate(s["step_s"], compiler_s, False)["source"] == tpu.COMPILER


@needs_libtpu
def test_a_scanned_program_is_priced_by_the_model_with_every_trip():
  sh = _on_one("v5p")

  def f(a, b):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ b), None), a, None, length=8)[0]

  g = jax.jit(f, in_shardings=(sh, sh), out_shardings=sh)
  x = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)
  compiled = g.lower(x, x).compile()
  text_ = compiled.as_text()
  assert tpu.has_loops(text_)
  s = tpu.program_estimate(text_, hardware.tpu("v5p"))
  assert s["flops"] == pytest.approx(8 * 2 * 2048**3, rel=0.01) and s["unknown_loops"] == 0
  assert compiled.cost_analysis()["flops"] < s["flops"] / 4  # the compiler counts one trip


@needs_libtpu
def test_train_and_decode_reports_of_a_tiny_model_on_v5e():
  config = configs_io.load_config(TINY)
  configs_io.apply_overrides(config, [a[len("--config.") :] for a in SMALL])
  config.train.micro_batch_size = 2
  config.train.global_batch_bytes = 2 * 32
  # the blockwise attention's loops: the per-op model prices the step (the default, "auto", runs
  # the Mosaic kernel on a TPU: a loop-free program that the compiler's estimate prices)
  config.model.attention_impl = "xla"
  (r,) = check.train_reports(config, targets.parse("v5e"), ("eval_step",))
  assert r["unit"] == "chip" and r["memory"]["fits"] and r["memory"]["device_gb"] == 16.0
  e = r["estimate"]
  assert e["source"] == tpu.MODEL and e["step_s"] > 0 and 0 < e["mfu"] < 1
  assert e["hints"]["keys_per_query"] and e["flops"] > 0
  cfg = ModelConfig.from_dict(config.model.to_dict())
  (d,) = check.decode_reports(cfg, targets.parse("v5e:4"), [dict(batch=1, mode="ntp")], 16, 8)
  assert (
    d["target"] == "v5e:1"
    and d["estimate"]["lm_step"]["step_s"] >= d["estimate"]["idle_step"]["step_s"]
  )
  assert "per chip" in text.program_lines(d)[0]


@needs_libtpu
@pytest.mark.slow
def test_tool_prints_json_for_a_tpu_target():
  r = _run(
    [TOOL, "--config", TINY, "--targets", "v6e", "--impls", "xla", "--decode", "none"]
    + ["--micro-per-chip", "2", "--config.train.global_batch_bytes=64"]
    + SMALL
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert "v6e:1 train_step xla (2 rows per chip): compile" in r.stderr
  out = json.loads(r.stdout)
  assert out["tool"] == "tpu_aot" and [p["program"] for p in out["programs"]] == [
    "train_step",
    "eval_step",
  ]
  train = out["programs"][0]
  assert train["device"] == "TPU v6 lite" and train["estimate"]["mfu"] > 0
  assert train["estimate"]["source"] in (tpu.MODEL, tpu.COMPILER)


def test_tool_and_cli_without_libtpu_or_with_a_bad_target_are_one_line_exit_2():
  r = _run([TOOL, "--targets", "v5x", "--config", TINY])
  assert r.returncode == 2 and "unknown target 'v5x'" in r.stderr and r.stdout == ""
  r = _run(["-m", "lca_jax.cli.train", "--config", TINY, "--aot", "v5p:6"])
  assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "topology" in r.stderr
  if not HAS_LIBTPU:
    r = _run([TOOL, "--targets", "v5p", "--config", TINY])
    assert r.returncode == 2 and "libtpu" in r.stderr and r.stdout == ""


def test_memory_verdict_is_against_the_whole_hbm():
  class Stats:
    argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes = 4e9, 4e9, 4e9
    temp_size_in_bytes, generated_code_size_in_bytes = 10e9, 0

  class Compiled:
    def memory_analysis(self):
      return Stats()

  m = tpu_check.memory(Compiled(), int(16e9), int(4e9))
  assert m["fits"] and m["total_gb"] == 14.0 and m["margin_gb"] == 2.0
  Stats.temp_size_in_bytes = 13e9
  m = tpu_check.memory(Compiled(), int(16e9), int(4e9))
  assert not m["fits"] and m["verdict"] == "does not fit by 1.00 GB"


@needs_libtpu
def test_a_two_slice_mesh_puts_data_across_the_slices():
  devs = targets.devices(targets.parse("v5e:4*2"))
  cfg = dict(data=2, fsdp=4, tensor=1)
  mesh = sharding.make_mesh(cfg, devs)
  grid = np.vectorize(lambda d: d.slice_index)(mesh.devices)
  assert mesh.shape["data"] == 2 and (grid[0] == 0).all() and (grid[1] == 1).all()
  with pytest.raises(sharding.MeshError, match="multiple of the 2 TPU slices"):
    sharding.make_mesh(dict(data=1, fsdp=8, tensor=1), devs)


def test_fit_search_tries_the_predicted_micro_batch_then_halves_then_remat(monkeypatch):
  config = configs_io.load_config(TINY)
  config.train.micro_batch_size = 16
  tried = []
  per_row = {False: 4.5, True: 1.5}  # GB of temporaries per row, 16 GB chips

  def fake(c, target, which, work, hlo_dir=None):
    rows, remat = c.train.micro_batch_size, c.model.remat
    tried.append((rows, remat))
    temp = per_row[remat] * rows
    mem = dict(device_gb=16.0, total_gb=temp + 1.0, temp_gb=temp, fits=temp + 1.0 <= 16.0)
    return [dict(memory=mem, micro_batch_per_device=rows)]

  monkeypatch.setattr(check, "train_reports", fake)
  first = fake(config, None, None, None)[0]
  tried.clear()
  out = check.fit_search(config, targets.parse("v5e"), first)
  # 15 GB of room / 4.5 GB per row -> 3.3 rows -> 2 (fits: 10 GB); 16 rows with remat (25 GB)
  # do not fit: 15 / 1.5 -> 10 rows -> 8 with remat (13 GB) fit
  assert tried == [(2, False), (16, True), (8, True)] and out[-1]["memory"]["fits"]
  # with remat no better than without (4 GB a row), no remat setting below 2 rows is tried
  per_row[True] = 4.0
  tried.clear()
  check.fit_search(config, targets.parse("v5e"), first)
  assert tried == [(2, False), (16, True)]
  # the prediction too hopeful: halved until one fits
  per_row[False] = 20.0
  first = fake(config, None, None, None)[0]
  tried.clear()
  out = check.fit_search(config, targets.parse("v5e"), first)
  assert tried[:2] == [(1, False), (16, True)] and tried[-1] == (2, True)
  assert out[-1]["memory"]["fits"]


def test_a_padded_window_convolution_counts_only_the_taps_over_its_input():
  # XLA:TPU's projection to 8 heads of 128: a window of 8 over an input dimension of 1, padded
  # 7 on each side, so each output position meets the input at one tap: 1024 products each
  text = """\
HloModule m

ENTRY %main (a: bf16[16,64,1024,1], b: bf16[8,128,1024,1]) -> bf16[16,64,8,128] {
  %a = bf16[16,64,1024,1] parameter(0)
  %b = bf16[8,128,1024,1] parameter(1)
  ROOT %c = bf16[16,64,8,128] convolution(%a, %b), window={size=1x8 pad=0_0x7_7 rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f
}
"""
  s = tpu.program_estimate(text, hardware.tpu("v5p"), op_s=0.0)
  assert s["flops"] == pytest.approx(2 * 16 * 64 * 1024 * 1024)


def test_a_batched_product_written_as_a_dilated_window_counts_one_tap_in_each_window():
  # XLA:TPU's [16, 8] batch of 64 x 128 @ 128 x 64 products: the batch dimensions as a 16 x 8
  # window over a dilated input, of whose 128 taps one meets an input element
  text = """\
HloModule m

ENTRY %main (a: bf16[16,8,64,128], b: bf16[16,8,128,64]) -> f32[16,8,64,64] {
  %a = bf16[16,8,64,128] parameter(0)
  %b = bf16[16,8,128,64] parameter(1)
  ROOT %c = f32[16,8,64,64] convolution(%a, %b), window={size=16x8 stride=15x7 lhs_dilate=16x8}, dim_labels=01bf_01io->01bf
}
"""
  s = tpu.program_estimate(text, hardware.tpu("v5p"), op_s=0.0)
  assert s["flops"] == pytest.approx(2 * 16 * 8 * 64 * 64 * 128)


def test_an_async_slice_into_vmem_reads_its_slice_once():
  # XLA:TPU (v5e) prefetches a weight's rows into VMEM (S(1)) as slice-start / slice-done: its
  # type holds the whole operand, the slice and a context scalar; only the slice moves
  text = """\
HloModule m

ENTRY %main (w: bf16[1024,8192]) -> bf16[256,8192] {
  %w = bf16[1024,8192]{1,0:T(8,128)(2,1)} parameter(0)
  %slice-start.1 = ((bf16[1024,8192]{1,0:T(8,128)(2,1)}), bf16[256,8192]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:256], [0:8192]}
  ROOT %slice-done.1 = bf16[256,8192]{1,0:T(8,128)(2,1)S(1)} slice-done(%slice-start.1)
}
"""
  s = tpu.program_estimate(text, hardware.tpu("v5e"), op_s=0.0)
  assert s["bytes"] == pytest.approx(256 * 8192 * 2, rel=1e-3) and s["launches"] == 1
