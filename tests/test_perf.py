"""The time estimate of compiled GPU programs (lca_jax/perf).

On hand-written HLO and thunk sequences with known FLOPs and bytes (everywhere), and on a small
program compiled for an H100 without a GPU (needs jax's CUDA plugin: `make gpu-aot`).
"""

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from lca_jax.aot import targets
from lca_jax.model.config import ModelConfig
from lca_jax.perf import estimate, hardware, hlo, workload

needs_plugin = pytest.mark.skipif(
  not targets.plugin_available(), reason="jax's CUDA plugin is not installed (make gpu-aot)"
)

HLO = """\
HloModule m, is_scheduled=true

%fused_dot (p0: bf16[64,128], p1: bf16[128,256]) -> bf16[64,256] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,256]{1,0} parameter(1)
  ROOT %d = bf16[64,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_slice (p1.1: s32[], p0.1: f32[16,1024]) -> f32[1,1024] {
  %p1.1 = s32[] parameter(1)
  %p0.1 = f32[16,1024]{1,0} parameter(0)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,1024]{1,0} dynamic-slice(%p0.1, %p1.1, %z), dynamic_slice_sizes={1,1024}
}

%fused_dus (p0.2: f32[16,1024], p1.2: f32[1,1024], p2.2: s32[]) -> f32[16,1024] {
  %p0.2 = f32[16,1024]{1,0} parameter(0)
  %p1.2 = f32[1,1024]{1,0} parameter(1)
  %p2.2 = s32[] parameter(2)
  %z.2 = s32[] constant(0)
  ROOT %u = f32[16,1024]{1,0} dynamic-update-slice(%p0.2, %p1.2, %p2.2, %z.2)
}

%fused_scatter (p0.5: f32[16,1024], p1.5: s32[2,1], p2.5: f32[2,1024]) -> f32[16,1024] {
  %p0.5 = f32[16,1024]{1,0} parameter(0)
  %p1.5 = s32[2,1]{1,0} parameter(1)
  %p2.5 = f32[2,1024]{1,0} parameter(2)
  ROOT %sc = f32[16,1024]{1,0} scatter(%p0.5, %p1.5, %p2.5), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%fused_tanh
}

%fused_tanh (p0.3: f32[1024]) -> f32[1024] {
  %p0.3 = f32[1024]{0} parameter(0)
  ROOT %t = f32[1024]{0} tanh(%p0.3)
}

%fused_lt (p0.4: s32[]) -> pred[] {
  %p0.4 = s32[] parameter(0)
  %ten = s32[] constant(10)
  ROOT %lt = pred[] compare(%p0.4, %ten), direction=LT
}

%body (arg: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %arg = (s32[], f32[1024]{0}) parameter(0)
  %x = f32[1024]{0} get-tuple-element(%arg), index=1
  %inner = f32[1024]{0} fusion(%x), kind=kLoop, calls=%fused_tanh
  %i = s32[] get-tuple-element(%arg), index=0
  ROOT %tup = (s32[], f32[1024]{0}) tuple(%i, %inner)
}

%cond (arg.1: (s32[], f32[1024])) -> pred[] {
  %arg.1 = (s32[], f32[1024]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  ROOT %cond_k = pred[] fusion(%i.1), kind=kLoop, calls=%fused_lt
}

ENTRY %main (a: bf16[64,128], b: bf16[128,256], c: f32[16,1024], i: s32[], v: f32[1024], q: bf16[2,128,4,64]) -> f32[16,1024] {
  %a = bf16[64,128]{1,0} parameter(0)
  %b = bf16[128,256]{1,0} parameter(1)
  %c = f32[16,1024]{1,0} parameter(2)
  %i.2 = s32[] parameter(3)
  %v = f32[1024]{0} parameter(4)
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(5)
  %gemm = bf16[64,256]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot
  %slice = f32[1,1024]{1,0} fusion(%c, %i.2), kind=kLoop, calls=%fused_slice
  %upd = f32[16,1024]{1,0} fusion(%c, %slice, %i.2), kind=kLoop, calls=%fused_dus
  %cp = f32[16,1024]{1,0} copy(%upd)
  %rows = s32[2,1]{1,0} parameter(6)
  %two = f32[2,1024]{1,0} parameter(7)
  %scat = f32[16,1024]{1,0} fusion(%cp, %rows, %two), kind=kLoop, calls=%fused_scatter
  %init = (s32[], f32[1024]{0}) tuple(%i.2, %v)
  %w = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body, metadata={op_name="jit(f)/encoder/attn/while"}, backend_config={"known_trip_count":{"n":"10"}}
  %ar = f32[1024]{0} all-reduce(%v), replica_groups={{0,1,2,3}}, to_apply=%fused_tanh
  %pallas = bf16[2,128,4,64]{3,2,1,0} custom-call(%i.2, %q), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/mbp/attn/lca_attention_fwd/pallas_call"}
  %fmha = (bf16[2,4,128,64]{3,1,2,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"mask_type": "CAUSAL"}}
  %fmha.full = (bf16[2,4,128,64]{3,1,2,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"mask_type":"NO_MASK"}}
  %dec = (bf16[2,128,4,64]{3,2,1,0}, f32[16,1024]{1,0}) custom-call(%q, %c), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{1}: (1, {})}, metadata={op_name="jit(f)/layer_0/attn/jit(cache_attention)/decode_cache_attention/pallas_call"}
  %wr = f32[16,1024]{1,0} custom-call(%q, %c), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{}: (1, {})}, metadata={op_name="jit(f)/jit(write_slots)/decode_write_slots/pallas_call"}
  ROOT %out = f32[16,1024]{1,0} copy(%cp)
}
"""

NAMES = {1: "gemm", 2: "slice", 3: "upd", 4: "cp", 5: "w", 6: "cond_k", 7: "inner"}
THUNKS = """\
000: kCommandBuffer [source | next=005 (1)]
    001: kCustomKernel [source | next=002 (1)] gemm grid: [1, 1, 1]
    002: kCustomKernel [prev=001 (1) | next=003 (1)] slice grid: [1, 1, 1]
    003: kCustomKernel [prev=002 (1) | next=004 (1)] upd grid: [1, 1, 1]
    004: kCopy         [prev=003 (1) | sink] kCopy
005: kWhile        [prev=000 (1) | sink]
condition:
    006: kCustomKernel [source | sink] loop_compare grid: [1, 1, 1]
  body:
    007: kCustomKernel [source | sink] inner grid: [1, 1, 1]
"""
GPU = hardware.gpu("h100")
LAUNCH = hardware.Launch(graph_s=1e-6, host_s=2e-6, sync_s=10e-6)


def _metadata(names):
  return "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{n}"\n    thunk_id: {i}\n'
    '  }\n  thunk_kind: "kCustomKernel"\n}\n'
    for i, n in names.items()
  )


def _roofline(flops, nbytes, gpu=GPU, dtype="bf16"):
  return max(
    flops / (gpu.dot_peak(dtype) * gpu.dot_efficiency),
    nbytes / (gpu.memory_bytes_per_s * gpu.memory_efficiency),
  )


def test_the_parser_reads_shapes_operands_and_trip_counts():
  m = hlo.parse(HLO)
  assert m.entry == "main" and m.by_name["gemm"].called == ["fused_dot"]
  assert m.by_name["w"].trip_count == 10 and m.by_name["w"].called == ["cond", "body"]
  assert m.by_name["init"].type == "(s32[], f32[1024]{0})"
  assert hlo.nbytes(m.by_name["init"].type) == 4 + 4096
  assert m.by_name["p1.1"].args == "1" and "fused_dot" in m.fusion_bodies
  assert hlo.arrays("(bf16[2,3]{1,0}, pred[4])") == [("bf16", (2, 3)), ("pred", (4,))]


def test_kernels_are_priced_from_their_flops_and_bytes():
  m = hlo.parse(HLO)
  cost = lambda name, **kw: estimate.kernel_cost(m, name, GPU, estimate.Hints(**kw))
  gemm = cost("gemm")
  assert gemm.flops == 2 * 64 * 256 * 128 and gemm.category == "gemm"
  assert gemm.bytes == (64 * 128 + 128 * 256 + 64 * 256) * 2
  assert gemm.floor_s == pytest.approx(max(gemm.flops / GPU.bf16_flops, gemm.bytes / 3.35e12))
  # a fusion that slices a parameter reads the slice, not the buffer
  assert cost("slice").bytes == 4096 + 4 + 4096
  # an in-place update reads and writes the update, not the buffer it updates
  assert cost("upd").bytes == 4096 + 4 + 4096
  assert cost("scat").bytes == 8 + 2 * 8192  # a scatter in place: indices, updates read and written
  assert cost("cp").bytes == 2 * 16 * 1024 * 4 and cost("cp").category == "copy"
  ar = cost("ar")  # ring all-reduce over 4 devices: 2 (n - 1) / n of the bytes over NVLink
  assert ar.category == "collective" and ar.bytes == 4096 * 2 * 3 / 4
  assert ar.memory_s == pytest.approx(ar.bytes / GPU.link_bytes_per_s)
  # a Pallas attention kernel: 2 products of D per (query, key) pair, keys from the hints
  p = cost("pallas", keys_per_query=(("/mbp/", 32.0),))
  assert p.flops == 2 * 2 * (2 * 128 * 4 * 64) * 32 and p.category == "attention"
  assert cost("pallas").flops == 0  # without the hint its FLOPs are unknown
  # cuDNN attention: QK^T and PV over every (query, key) pair, half of them under a causal mask
  assert cost("fmha.full").flops == 2 * 2 * 2 * 4 * 128 * 128 * 64
  assert cost("fmha").flops == cost("fmha.full").flops / 2 and cost("fmha").category == "attention"
  assert estimate.kernel_cost(m, "not_there", GPU, estimate.Hints()) is None
  # an in-place write reads and writes its other operands; the decode attention kernel also
  # reads the cache it writes into, and writes its output
  q_bytes, cache_bytes = 2 * 128 * 4 * 64 * 2, 16 * 1024 * 4
  assert cost("wr").bytes == 2 * q_bytes
  assert cost("dec").bytes == q_bytes + cache_bytes + q_bytes
  assert cost("dec").category == "attention"


NESTED = """\
HloModule n, is_scheduled=true

%inner_slice (q0: f32[16,1024], q1: s32[]) -> f32[1024] {
  %q0 = f32[16,1024]{1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = f32[1,1024]{1,0} dynamic-slice(%q0, %q1, %zero), dynamic_slice_sizes={1,1024}
  ROOT %b = f32[1024]{0} bitcast(%ds)
}

%outer (p0: f32[16,1024], p1: s32[], p2: f32[1024]) -> f32[1024] {
  %p0 = f32[16,1024]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[1024]{0} parameter(2)
  %nested = f32[1024]{0} fusion(%p0, %p1), kind=kLoop, calls=%inner_slice
  ROOT %sum = f32[1024]{0} add(%nested, %p2)
}

%outer_full (r0: f32[16,1024]) -> f32[16,1024] {
  %r0 = f32[16,1024]{1,0} parameter(0)
  %nested.1 = f32[16,1024]{1,0} fusion(%r0), kind=kLoop, calls=%inner_negate
  ROOT %neg = f32[16,1024]{1,0} negate(%nested.1)
}

%inner_negate (s0: f32[16,1024]) -> f32[16,1024] {
  %s0 = f32[16,1024]{1,0} parameter(0)
  ROOT %n = f32[16,1024]{1,0} negate(%s0)
}

ENTRY %main (a: f32[16,1024], i: s32[], v: f32[1024]) -> f32[1024] {
  %a = f32[16,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %v = f32[1024]{0} parameter(2)
  %whole = f32[16,1024]{1,0} fusion(%a), kind=kLoop, calls=%outer_full
  ROOT %sliced = f32[1024]{0} fusion(%a, %i, %v), kind=kLoop, calls=%outer
}
"""


def test_a_fusion_nested_in_a_fusion_reads_only_the_slices_it_takes():
  m = hlo.parse(NESTED)
  cost = lambda name: estimate.kernel_cost(m, name, GPU, estimate.Hints())
  # the nested fusion slices one row of the [16, 1024] operand: 4096 bytes, not 65536
  assert cost("sliced").bytes == 4096 + 4 + 4096 + 4096
  # a nested fusion that reads its operand whole reads all of it
  assert cost("whole").bytes == 2 * 16 * 1024 * 4


def test_the_walk_runs_loops_by_trip_count_and_launches_in_graphs_cheaply():
  s = estimate.estimate(HLO, THUNKS, _metadata(NAMES), GPU, launch=LAUNCH)
  m = hlo.parse(HLO)
  costs = {n: estimate.kernel_cost(m, n, GPU, estimate.Hints()) for n in NAMES.values()}
  device = sum(max(costs[n].compute_s, costs[n].memory_s) for n in ("gemm", "slice", "upd", "cp"))
  device += 10 * sum(max(costs[n].compute_s, costs[n].memory_s) for n in ("cond_k", "inner"))
  # the graph: one host launch and 4 nodes; the loop on the host: 10 x (2 launches + a sync)
  launch = LAUNCH.host_s + 4 * LAUNCH.graph_s + 10 * (2 * LAUNCH.host_s + LAUNCH.sync_s)
  assert s["launch_s"] == pytest.approx(launch) and s["device_s"] == pytest.approx(device)
  assert s["step_s"] == pytest.approx(device + launch)
  assert s["launches"] == 1 + 4 + 20 and s["host_syncs"] == 10 and s["unknown_loops"] == 0
  assert s["flops"] == 2 * 64 * 256 * 128
  assert s["step_s"] >= s["floor_s"] > 0  # never below the roofline floor
  assert sum(s["split_s"].values()) == pytest.approx(s["step_s"])
  assert s["top_kernels"][0]["total_s"] >= s["top_kernels"][-1]["total_s"]


def test_loops_of_unknown_trip_count_take_the_hint_of_their_source_path():
  text = HLO.replace(', backend_config={"known_trip_count":{"n":"10"}}', "")
  meta = _metadata(NAMES)
  once = estimate.estimate(text, THUNKS, meta, GPU, launch=LAUNCH)
  assert once["unknown_loops"] == 1 and once["host_syncs"] == 1
  hinted = estimate.estimate(
    text, THUNKS, meta, GPU, launch=LAUNCH, hints=estimate.Hints(trips=(("/encoder/", 4.0),))
  )
  assert hinted["unknown_loops"] == 0 and hinted["host_syncs"] == 4


DECODE = """\
000: kCommandBuffer [source | sink]
    001: kCustomKernel [source | next=002 (1)] gemm grid: [1, 1, 1]
    002: kWhile        [prev=001 (1) | sink]
condition:
        003: kCustomKernel [source | sink] loop_compare grid: [1, 1, 1]
      body:
        004: kCustomKernel [source | next=005 (1)] inner grid: [1, 1, 1]
        005: kConditional  [source | sink]
          branch_0:
            006: kCustomKernel [source | sink] slice grid: [1, 1, 1]
          branch_1:
            007: kCustomKernel [source | next=008 (1)] gemm grid: [1, 1, 1]
            008: kCopy         [prev=007 (1) | sink] kCopy
"""


def test_a_decode_step_is_priced_at_its_cheapest_and_costliest_branch():
  names = {1: "gemm", 3: "cond_k", 4: "inner", 6: "slice", 7: "gemm", 8: "cp"}
  idle, lm = estimate.decode_steps(HLO, DECODE, _metadata(names), GPU, launch=LAUNCH)
  m = hlo.parse(HLO)
  t = lambda n: _roofline(
    *(lambda c: (c.flops, c.bytes))(estimate.kernel_cost(m, n, GPU, estimate.Hints()))
  )
  assert idle["launches"] == 3 and lm["launches"] == 4 and idle["host_syncs"] == 0
  assert idle["step_s"] == pytest.approx(t("cond_k") + t("inner") + t("slice") + 3 * LAUNCH.graph_s)
  assert lm["step_s"] == pytest.approx(
    t("cond_k") + t("inner") + t("gemm") + t("cp") + 4 * LAUNCH.graph_s
  )


def _small_cfg():
  return ModelConfig(
    d_model=64,
    n_heads=2,
    n_kv_heads=2,
    d_inner=128,
    n_lm=1,
    n_mbp=1,
    max_seq_len=256,
    bp_prior=0.25,
  )


def test_decode_rates_weigh_the_lm_step_by_how_often_a_group_closes():
  cfg = _small_cfg()
  r = workload.decode_rates(
    cfg, GPU, 1e-4, 5e-4, mode="ntp", batch=1, width=1, prompt_len=32, max_bytes=32
  )
  assert r["bytes_per_group"] == 4.0 and r["lm_fraction"] == pytest.approx(0.25)
  assert r["step_s"] == pytest.approx(0.75e-4 + 0.25 * 5e-4)
  assert r["bytes_per_s"] == pytest.approx(1 / r["step_s"])
  assert r["floor_bytes_per_s"] == pytest.approx(1 / (r["read_bytes"] / GPU.memory_bytes_per_s))
  v = workload.decode_rates(
    cfg,
    GPU,
    1e-4,
    5e-4,
    mode="verify",
    batch=2,
    width=3,
    prompt_len=32,
    max_bytes=32,
    accepted=2.0,
  )
  assert v["accepted_per_step"] == 2.0 and v["bytes_per_s"] == pytest.approx(4 / v["step_s"])


def test_train_hints_count_the_tiles_and_keys_the_mask_allows():
  cfg = _small_cfg()
  h = workload.train_hints(cfg, 256)
  keys = dict(h.keys_per_query)
  # causal over 256 bytes in 64-blocks: query block n visits n + 1 blocks of 64 keys
  assert keys["/encoder/"] == pytest.approx(sum((n + 1) * 64 * 64 for n in range(4)) / 256)
  assert keys["/mbp/"] < keys["/encoder/"]  # the LCA mask skips older groups
  assert all(v > 0 for _, v in h.trips)


@needs_plugin
def test_a_compiled_matmul_is_estimated_at_its_flops_and_never_below_the_roofline():
  from lca_jax.aot import check  # pylint: disable=g-import-not-at-top

  dev = targets.devices(targets.parse("h100"))[0]
  s = SingleDeviceSharding(dev)
  a = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=s)
  m, k, n = 512, 1024, 2048
  lowered = jax.jit(lambda x, w: jax.nn.relu(x @ w)).lower(a(m, k), a(k, n))
  compiled, _, seq, meta = check.compile_with_dump(lowered, {})
  assert seq and meta
  e = estimate.estimate(compiled.as_text(), seq, meta, GPU)
  assert e["flops"] == pytest.approx(2 * m * n * k)
  assert e["bytes"] >= (m * k + k * n + m * n) * 2
  assert e["floor_s"] >= max(2 * m * n * k / GPU.bf16_flops, (m * k + k * n) * 2 / 3.35e12)
  assert e["step_s"] >= e["floor_s"] and e["launches"] >= 1 and e["unknown_loops"] == 0
  assert math.isclose(sum(e["split_s"].values()), e["step_s"], rel_tol=1e-9)
