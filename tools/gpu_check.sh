#!/usr/bin/env bash
# One prepared check for a session that is lent a GPU: the Pallas kernels compiled by Triton
# against the XLA reference, their speed (issue 5 targets), and the decode engine on the GPU.
# Every part has its own timeout so the whole run fits one device call (~10 min at most).
#
# Run from the repository root on the GPU machine:
#     bash tools/gpu_check.sh [WHEELS_DIR]
# WHEELS_DIR (the argument, or the WHEELS_DIR environment variable; default ./wheels, or
# ./.whl when only that exists) holds wheels of the packages of requirements.txt that the GPU
# machine's Python lacks (README "GPU check" says how to download them); they are installed
# into /tmp/site without network before anything runs. Without wheels the machine's own
# packages are used. The decode benchmark also runs when workdirs/demo holds a trained
# checkpoint. Results land in $OUT or /tmp/gpu_check.
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
export JAX_PLATFORMS=cuda  # tests/conftest.py defaults to cpu
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } \
  > "$OUT/gpu.txt" 2>&1

part() {  # name timeout_s command...: run one part, keep its output and exit status
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  echo "$name rc=$?" | tee -a "$OUT/summary.txt"
}
part test_kernels 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py
part bench_kernel 180 python3 tools/bench_kernel.py
if [ -d workdirs/demo ]; then
  part bench_decode 200 python3 tools/bench_decode.py --checkpoint workdirs/demo --batch 1,8 --naive-bytes 32
fi
part test_decode 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py
cat "$OUT/gpu.txt" "$OUT/summary.txt"
tail -n 3 "$OUT/test_kernels.out" "$OUT/test_decode.out"
cat "$OUT/bench_kernel.out"
