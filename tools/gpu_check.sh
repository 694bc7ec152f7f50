#!/usr/bin/env bash
# One prepared check for a session that is lent a GPU (issue 15): the Pallas kernels compiled by
# Triton against the XLA reference and their speed, the paper-scale train step (xla and pallas
# attention), the paper-scale decode engine, and the decode and model tests, each part under
# its own timeout and all of them inside one budget, so the whole run fits one device call.
#
# Run from the repository root on the GPU machine (device tool: timeout_s 600, carry .whl):
#     bash tools/gpu_check.sh [WHEELS_DIR]
# WHEELS_DIR (the argument, or the WHEELS_DIR environment variable; default ./wheels, or
# ./.whl when only that exists) holds wheels of the packages of requirements.txt that the GPU
# machine's Python lacks (docs/gpu.md says how to get them); they are installed into
# /tmp/site without network before anything runs. Without wheels the machine's own packages
# are used (the train benchmark then needs grain there). Results land in $OUT or
# /tmp/gpu_check: one file per part (<part>.out / .err), summary.txt (rc, seconds), the
# device's gpu_target_config.pbtxt and XLA's GEMM autotuning results (autotune.tgz).
#
# Environment:
#   GPU_CHECK_BUDGET_S  seconds for all parts together (default 540): a part gets at most
#                       what is left; parts that no longer fit are listed as skipped
#   PARTS               the parts to run, in order (default: all, most important first:
#                       test_kernels bench_kernel bench_train_pallas bench_decode_b1
#                       bench_train_xla bench_decode_b32 bench_decode_n6
#                       bench_decode_host_loop test_decode test_model bench_train_unrolled:
#                       bench_train_xla with every stack unrolled, against its scanned LM,
#                       docs/design.md §2.2); a part's JSON is printed
#                       when it ends, so each decode batch size is a part of its own (a
#                       timeout loses one, not all); the tools write a line to the part's .err
#                       as each phase ends, and the script ends with one line of figures per
#                       benchmark part
#   DECODE_MODES        the decode benchmark's modes at n 3 (default ntp,threshold_tau0,verify);
#                       each mode compiles one paper-scale program first (the first lent run
#                       saw no mode finish within 95 s when each compiled two), and each
#                       row's JSON also goes to the part's .err as it ends
#   GPU_CHECK_CPU=1     rehearsal on a CPU: the same commands at tiny sizes (test files are
#                       collected, not run), so a session checks the script before it spends
#                       GPU minutes
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
WHEELS_DIR=${1:-${WHEELS_DIR:-}}
explicit=${WHEELS_DIR:+yes}
if [ -z "$WHEELS_DIR" ]; then
  WHEELS_DIR=wheels
  if ! ls wheels/*.whl >/dev/null 2>&1 && ls .whl/*.whl >/dev/null 2>&1; then
    WHEELS_DIR=.whl
  fi
fi
if ls "$WHEELS_DIR"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "$WHEELS_DIR"/*.whl || { echo "installing the wheels of $WHEELS_DIR failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
elif [ -n "$explicit" ]; then
  echo "no wheels (*.whl) in $WHEELS_DIR" >&2
  exit 1
else
  export PYTHONPATH=$PWD
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false
BUDGET=${GPU_CHECK_BUDGET_S:-540}
ALL="test_kernels bench_kernel bench_train_pallas bench_decode_b1 bench_decode_xla bench_train_xla"
ALL="$ALL bench_decode_b32 bench_decode_n6 bench_decode_host_loop test_decode test_model"
ALL="$ALL bench_train_unrolled estimate_programs estimate_kernels"
PARTS=${PARTS:-$ALL}
DECODE_MODES=${DECODE_MODES:-ntp,threshold_tau0,verify}
# bench_decode_host_loop: the batch-1 decode again with XLA's default command buffers
# (LCA_JAX_GPU_GRAPHS=0: each step's body one CUDA graph, the loop's predicate read back by the
# host after every step), against bench_decode_b1's whole decode loop as one CUDA graph
# (lca_jax/xla_options.py; a step is hundreds of small kernels, every launch counts at batch 1)
# bench_decode_xla: the batch-1 decode without the fused decode kernels (LCA_JAX_FUSED_DECODE=0,
# lca_jax/kernels/decode_fused.py), side by side with bench_decode_b1, which runs them
# estimate_programs / estimate_kernels: lca_jax.perf's estimated time of the same programs for
# this GPU (tools/gpu_aot.py, tools/bench_kernel.py --aot; no GPU needed, so they come last),
# to set beside what the parts above measured (docs/performance.md: calibration)
for p in $PARTS; do
  case " $ALL " in *" $p "*) ;; *) echo "unknown part $p (one of: $ALL)" >&2; exit 2 ;; esac
done

# Sizes. The GPU ones are the issue's: kernels at B 8, T 4096, 8 heads of 128, bf16 (the
# tool's defaults); the paper-scale config (configs/lca_mbp.py, bf16, T 4096) trained on the
# bundled corpus, micro-batch 16 rows and 8 when 16 does not fit; decoding a random-weight
# model of that config, batch 1 and 32.
TRAIN_DATA=(--config.data.format=text --config.data.train_files= --config.data.eval_files=)
if [ -n "${GPU_CHECK_CPU:-}" ]; then
  export JAX_PLATFORMS=cpu
  COLLECT=(--collect-only)
  KERNEL=(--small)
  TRAIN_CFG=configs/tiny_lca_mbp.py
  TRAIN_STEPS=(--steps 2 --warmup 1 --config.train.progress_bar=False)
  TRAIN_ROWS="4"
  TRAIN_SEQ=128
  DECODE=(--d-model 32 --d-inner 64 --n-heads 2 --layers 1,1,1,1 --prompt-bytes 16
    --new-bytes 8 --naive-bytes 0 --repeats 1 --stream-mb 1)
  DECODE_BATCH=2
else
  export JAX_PLATFORMS=cuda  # tests/conftest.py defaults to cpu
  # XLA's GEMM autotuning results, shared by the parts' processes (the first lent run, on
  # 2026-12-04, saw no paper-scale train or decode result within 150 s / 95 s a part)
  # (kept: $OUT/autotune.tgz at the end, for deviceless compiles to load)
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=/tmp/gpu_check_autotune"
  COLLECT=()
  KERNEL=()
  TRAIN_CFG=configs/lca_mbp.py
  TRAIN_STEPS=(--steps 5 --warmup 2 --config.train.progress_bar=False)
  TRAIN_ROWS="16 8"
  TRAIN_SEQ=4096
  DECODE=(--config configs/lca_mbp.py --new-bytes 256 --naive-bytes 0 --repeats 2)
  DECODE_BATCH=32
fi
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } \
  > "$OUT/gpu.txt" 2>&1
case "$(grep -o 'H100\|H200\|B200' "$OUT/gpu.txt" | head -n 1)" in  # the estimate's target
  H200) TARGET=h200 ;; B200) TARGET=b200 ;; *) TARGET=h100 ;;
esac
if [ -n "${GPU_CHECK_CPU:-}" ]; then
  ESTIMATE=(--config configs/tiny_lca_mbp.py --micro-per-gpu 2 --impls pallas --decode b1)
else
  ESTIMATE=(--impls xla,pallas --decode all)
fi
# the device's own target description (XLA writes it beside a dumped module), for deviceless
# compiles (`--xla_gpu_target_config_filename`) to describe this GPU exactly
python3 - "$OUT" >> "$OUT/gpu.txt" 2>&1 <<'PY'
import glob, os, shutil, sys, tempfile
import jax
with tempfile.TemporaryDirectory() as d:
  jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options={"xla_dump_to": d})
  for f in glob.glob(os.path.join(d, "*gpu_target_config.pbtxt"))[:1]:
    shutil.copy(f, os.path.join(sys.argv[1], "gpu_target_config.pbtxt"))
    print("target config:", os.path.join(sys.argv[1], "gpu_target_config.pbtxt"))
PY

t_start=$SECONDS
part() {  # name limit_s command...: run one part within what is left of the budget
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - t_start)))
  if [ "$left" -lt 20 ]; then
    echo "$name skipped (budget)" | tee -a "$OUT/summary.txt"
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$?
  echo "$name rc=$rc ${limit}s-limit $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  return $rc
}

train() {  # name impl [override...]: the paper-scale train step, the largest of TRAIN_ROWS
  # micro-batches that runs
  local name=$1 impl=$2 rows
  shift 2
  for rows in $TRAIN_ROWS; do
    part "$name" 200 python3 tools/bench_train.py --config "$TRAIN_CFG" "${TRAIN_STEPS[@]}" \
      "${TRAIN_DATA[@]}" --config.model.attention_impl="$impl" "$@" \
      --config.train.micro_batch_size="$rows" --config.train.global_batch_bytes=$((rows * TRAIN_SEQ)) \
      && return 0
    grep -qiE "RESOURCE_EXHAUSTED|out of memory" "$OUT/$name.err" || return 1
    mv "$OUT/$name.err" "$OUT/$name.rows$rows.err"  # kept: what did not fit
  done
  return 1  # no micro-batch size fitted
}

for p in $PARTS; do
  case $p in
    test_kernels) part "$p" 120 python3 -m pytest -q -p no:cacheprovider "${COLLECT[@]}" \
      tests/test_kernels.py tests/test_kernels_sharded.py ;;
    bench_kernel) part "$p" 120 python3 tools/bench_kernel.py "${KERNEL[@]}" ;;
    bench_train_xla) train "$p" xla ;;
    bench_train_pallas) train "$p" pallas ;;
    bench_train_unrolled) train "$p" xla --config.model.scan_min_layers=0 ;;
    bench_decode_b1) part "$p" 200 python3 tools/bench_decode.py "${DECODE[@]}" \
      --batch 1 --modes "$DECODE_MODES" --n 3 ;;
    bench_decode_xla) LCA_JAX_FUSED_DECODE=0 part "$p" 120 python3 tools/bench_decode.py \
      "${DECODE[@]}" --batch 1 --modes ntp,threshold_tau0 --n 3 ;;
    bench_decode_b32) part "$p" 120 python3 tools/bench_decode.py "${DECODE[@]}" \
      --batch "$DECODE_BATCH" --modes "$DECODE_MODES" --n 3 ;;
    bench_decode_n6) part "$p" 60 python3 tools/bench_decode.py "${DECODE[@]}" \
      --batch 1 --modes ntp,threshold_tau0 --n 6 ;;
    bench_decode_host_loop) LCA_JAX_GPU_GRAPHS=0 part "$p" 120 python3 tools/bench_decode.py "${DECODE[@]}" \
      --batch 1 --modes ntp,threshold_tau0 --n 3 ;;
    test_decode) part "$p" 120 python3 -m pytest -q -x -p no:cacheprovider "${COLLECT[@]}" \
      tests/test_decode.py ;;
    test_model) part "$p" 90 python3 -m pytest -q -x -p no:cacheprovider "${COLLECT[@]}" \
      tests/test_model_parity.py tests/test_model_causality.py ;;
    estimate_programs) part "$p" 240 python3 tools/gpu_aot.py --targets "$TARGET" --gpus 1 \
      "${ESTIMATE[@]}" ;;
    estimate_kernels) part "$p" 60 python3 tools/bench_kernel.py --aot "$TARGET" "${KERNEL[@]}" ;;
  esac
done
if [ -d /tmp/gpu_check_autotune ]; then  # XLA's GEMM autotuning results, one file per fusion
  tar -czf "$OUT/autotune.tgz" -C /tmp gpu_check_autotune 2>/dev/null
fi
cat "$OUT/gpu.txt" "$OUT/summary.txt"
for p in test_kernels test_decode test_model; do
  [ -f "$OUT/$p.out" ] && tail -n 3 "$OUT/$p.out"
done
# the figures of the benchmark parts that printed their JSON, one line each, with lca_jax.perf's
# estimate of the same program beside each (the end of the output is what a remote runner shows
# first)
python3 -m lca_jax.bench.gpu_check_summary "$OUT"
exit 0
