"""Smoke test of tools/gpu_check.sh (the prepared check for a machine with a GPU).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_tool_gpu_check.py

Its GPU command lines are rehearsed with stand-ins: the script runs from a scratch directory
whose tests/, tools/ and configs/ link to the repository's, with python3 and nvidia-smi on PATH
replaced by stubs that log their arguments and succeed (or report an out-of-memory error when
told to). The tests check the script's syntax, its wheel handling, that every part runs in
order and is summarised, the budget and the part selection, the micro-batch fallback, that each
test file and tool it names exists and that the options it passes to the tools parse. Then its
CPU mode (``GPU_CHECK_CPU=1``: the same commands at tiny sizes) runs some parts for real.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
from conftest import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")
# Logs one line per call: name, PYTHONPATH=..., JAX_PLATFORMS=..., XLA_FLAGS=...,
# LCA_JAX_GPU_GRAPHS=..., LCA_JAX_FUSED_DECODE=..., then the arguments.
STUB = """#!/usr/bin/env bash
{ printf '%q ' "$(basename "$0")" "PYTHONPATH=${PYTHONPATH:-}" "JAX_PLATFORMS=${JAX_PLATFORMS:-}" \
    "XLA_FLAGS=${XLA_FLAGS:-}" "LCA_JAX_GPU_GRAPHS=${LCA_JAX_GPU_GRAPHS:-}" \
    "LCA_JAX_FUSED_DECODE=${LCA_JAX_FUSED_DECODE:-}" "$@"; echo; } \
    >> "$STUB_LOG"
if [ -n "${STUB_OOM:-}" ] && [[ " $* " == *"$STUB_OOM "* ]]; then
  echo "RESOURCE_EXHAUSTED: Out of memory while trying to allocate" >&2
  exit 1
fi
"""

pytestmark = pytest.mark.skipif(
  shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout"
)


def _rehearse(tmp_path, *args, wheels=None, env=None):
  """Runs the script with stubs; returns (completed process, logged calls, $OUT), each call as
  (program, PYTHONPATH, JAX_PLATFORMS, [arguments], XLA_FLAGS, LCA_JAX_GPU_GRAPHS,
  LCA_JAX_FUSED_DECODE)."""
  work, bin_dir, out = tmp_path / "work", tmp_path / "bin", tmp_path / "out"
  for d in (work, bin_dir):
    d.mkdir(parents=True)
  for name in ("tests", "tools", "configs"):
    os.symlink(os.path.join(ROOT, name), work / name)
  for name in ("python3", "nvidia-smi"):
    (bin_dir / name).write_text(STUB)
    (bin_dir / name).chmod(0o755)
  log = tmp_path / "calls.log"
  log.touch()
  extra = env or {}
  env = {
    "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    "OUT": str(out),
    "STUB_LOG": str(log),
    "HOME": str(tmp_path),
  }
  env.update(extra)
  if wheels is not None:
    env["WHEELS_DIR"] = str(wheels)
  proc = subprocess.run(
    ["bash", SCRIPT, *args],
    cwd=work,
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
    check=False,
  )
  calls = []
  for line in log.read_text().splitlines():
    prog, pythonpath, platforms, xla_flags, graphs, fused, *argv = shlex.split(line)
    value = lambda s: s.split("=", 1)[1]
    calls.append(
      (
        prog,
        value(pythonpath),
        value(platforms),
        argv,
        value(xla_flags),
        value(graphs),
        value(fused),
      )
    )
  return proc, calls, out


def test_syntax():
  proc = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr


PARTS = [
  "test_kernels",
  "bench_kernel",
  "bench_train_pallas",
  "bench_decode_b1",
  "bench_decode_xla",
  "bench_train_xla",
  "bench_decode_b32",
  "bench_decode_n6",
  "bench_decode_host_loop",
  "test_decode",
  "test_model",
  "bench_train_unrolled",
  "estimate_programs",
  "estimate_kernels",
]


def _parse_tool_args(tool: str, argv):
  """The tool's own parser accepts the options the script passes (bench_train also applies its
  ``--config.*`` overrides to the config file named)."""
  mod = load_tool(tool)
  if tool == "gpu_aot":
    parsed, rest = mod._parser("gpu", "").parse_known_args(argv)  # pylint: disable=protected-access
    assert rest == [] and parsed.targets == "h100", (rest, parsed)  # nvidia-smi names no GPU
    return parsed
  parsed = mod.parse_args(argv)
  if tool == "bench_train":
    args, config = parsed
    assert config.model.attention_impl in ("xla", "pallas")
    assert config.data.format == "text" and config.data.train_files == ""  # bundled corpus
    return args
  return parsed


def _summary(out):
  """Part name -> its status word(s) in summary.txt (``rc=0`` or ``skipped``)."""
  return {ln.split()[0]: ln.split()[1] for ln in (out / "summary.txt").read_text().splitlines()}


def test_rehearsal(tmp_path, monkeypatch):
  """No wheels: every part runs once, in order, on CUDA, with test files and tools that exist
  and options the tools accept."""
  proc, calls, out = _rehearse(tmp_path)
  monkeypatch.chdir(tmp_path / "work")  # the tools' relative paths, as the script runs them
  assert proc.returncode == 0, proc.stderr
  assert list(_summary(out).items()) == [(p, "rc=0") for p in PARTS]
  for p in PARTS:
    assert (out / f"{p}.out").is_file() and (out / f"{p}.err").is_file(), p
  work = tmp_path / "work"
  # the device line, the target config, each part, the closing summary of the figures
  assert [c[0] for c in calls] == ["nvidia-smi"] + ["python3"] * (3 + len(PARTS))
  assert calls[-1][3] == ["-m", "lca_jax.bench.gpu_check_summary", str(out)]
  assert calls[2][3] == ["-", str(out)]
  calls = calls[:-1]
  assert calls[1][3][0] == "-c" and "jax.devices()" in calls[1][3][1]  # gpu.txt's device line
  ran = []
  for prog, pythonpath, platforms, argv, *_ in calls[3:]:
    assert pythonpath == str(work) and platforms == "cuda", (prog, pythonpath, platforms)
    if argv[:2] == ["-m", "pytest"]:
      files = [a for a in argv if a.startswith("tests/")]
      assert files and all((work / f).is_file() for f in files), argv
      assert "--collect-only" not in argv  # the tests really run on the GPU
      ran.append(tuple(files))
    else:
      tool = os.path.splitext(os.path.basename(argv[0]))[0]
      assert argv[0].startswith("tools/") and (work / argv[0]).is_file(), argv
      args = _parse_tool_args(tool, argv[1:])
      ran.append((tool, getattr(args, "config", None)))
  assert ran == [
    ("tests/test_kernels.py", "tests/test_kernels_sharded.py"),
    ("bench_kernel", None),
    ("bench_train", "configs/lca_mbp.py"),
    ("bench_decode", "configs/lca_mbp.py"),
    ("bench_decode", "configs/lca_mbp.py"),
    ("bench_train", "configs/lca_mbp.py"),
    ("bench_decode", "configs/lca_mbp.py"),
    ("bench_decode", "configs/lca_mbp.py"),
    ("bench_decode", "configs/lca_mbp.py"),
    ("tests/test_decode.py",),
    ("tests/test_model_parity.py", "tests/test_model_causality.py"),
    ("bench_train", "configs/lca_mbp.py"),
    ("gpu_aot", os.path.join(ROOT, "configs", "lca_mbp.py")),
    ("bench_kernel", None),
  ]
  # the paper-scale shapes of the issue: bench_kernel's defaults, micro-batch 16 first
  assert load_tool("bench_kernel").parse_args([]).seq == 4096
  train = calls[5][3]
  assert "--config.train.micro_batch_size=16" in train
  assert "--config.train.global_batch_bytes=65536" in train
  trains = [c[3] for c in calls[3:] if c[3][0] == "tools/bench_train.py"]
  assert ["--config.model.scan_min_layers=0" in a for a in trains] == [False, False, True]
  decode = [c[3] for c in calls[3:] if c[3][0] == "tools/bench_decode.py"]
  assert [(a[a.index("--batch") + 1], a[a.index("--n") + 1]) for a in decode] == [
    ("1", "3"),
    ("1", "3"),
    ("32", "3"),
    ("1", "6"),
    ("1", "3"),
  ]
  # the GPU's parts share XLA's autotuning results; the host-loop part alone decodes without
  # the decode loop as one CUDA graph (LCA_JAX_GPU_GRAPHS=0, lca_jax/xla_options.py)
  flags = [c[4] for c in calls[3:]]
  assert all("--xla_gpu_per_fusion_autotune_cache_dir=" in f for f in flags)
  graphs = [c[5] for c in calls[3:]]
  assert graphs == ["0" if p == "bench_decode_host_loop" else "" for p in PARTS]
  # fused decode kernels against XLA's: only bench_decode_xla turns them off
  assert [c[6] for c in calls[3:]] == ["0" if p == "bench_decode_xla" else "" for p in PARTS]
  # the estimates are of the same programs, for the GPU nvidia-smi names (h100 by default)
  assert calls[-1][3][:3] == ["tools/bench_kernel.py", "--aot", "h100"]


def test_parts_and_budget(tmp_path):
  """PARTS picks parts in the order given; a part that no longer fits the budget is skipped
  and listed; an unknown part is refused with exit status 2 before anything runs."""
  proc, calls, out = _rehearse(tmp_path, env={"PARTS": "bench_decode_b32 test_kernels"})
  assert proc.returncode == 0, proc.stderr
  assert list(_summary(out)) == ["bench_decode_b32", "test_kernels"]
  proc, calls, out = _rehearse(tmp_path / "b", env={"GPU_CHECK_BUDGET_S": "5"})
  assert proc.returncode == 0, proc.stderr
  assert set(_summary(out).values()) == {"skipped"} and list(_summary(out)) == PARTS
  assert [c[0] for c in calls] == ["nvidia-smi"] + ["python3"] * 3  # device, target, summary
  proc, calls, out = _rehearse(tmp_path / "c", env={"PARTS": "bench_kernel nope"})
  assert proc.returncode == 2 and "unknown part nope" in proc.stderr
  assert calls == []


def test_out_of_memory_falls_back_to_fewer_rows(tmp_path):
  """A train part whose 16-row micro-batch runs out of memory is run again with 8 rows; any
  other failure is not retried."""
  proc, calls, out = _rehearse(
    tmp_path, env={"PARTS": "bench_train_xla", "STUB_OOM": "micro_batch_size=16"}
  )
  assert proc.returncode == 0, proc.stderr
  rows = [a for c in calls[2:] for a in c[3] if a.startswith("--config.train.micro_batch_size")]
  assert rows == ["--config.train.micro_batch_size=16", "--config.train.micro_batch_size=8"]
  assert (out / "bench_train_xla.rows16.err").is_file()
  lines = (out / "summary.txt").read_text().splitlines()
  assert [ln.split()[:2] for ln in lines] == [
    ["bench_train_xla", "rc=1"],
    ["bench_train_xla", "rc=0"],
  ]
  # another failure is the part's result, not retried
  proc, calls, out = _rehearse(
    tmp_path / "b", env={"PARTS": "bench_train_xla", "STUB_OOM": "attention_impl=nope"}
  )
  assert [ln.split()[1] for ln in (out / "summary.txt").read_text().splitlines()] == ["rc=0"]


def test_wheels_installed_first(tmp_path):
  wheels = tmp_path / "wh"
  wheels.mkdir()
  (wheels / "fake-0.0-py3-none-any.whl").write_text("")
  proc, calls, out = _rehearse(tmp_path, str(wheels))
  assert proc.returncode == 0, proc.stderr
  prog, _, _, argv, *_ = calls[0]
  assert prog == "python3" and argv[:3] == ["-m", "pip", "install"], calls[0]
  assert "--no-index" in argv and argv[-1] == str(wheels / "fake-0.0-py3-none-any.whl")
  assert argv[argv.index("--target") + 1] == "/tmp/site"
  for _, pythonpath, *_ in calls[1:]:  # everything after sees the installed wheels first
    assert pythonpath == f"/tmp/site:{tmp_path / 'work'}"
  assert len((out / "summary.txt").read_text().splitlines()) == len(PARTS)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_missing_wheels_refused(tmp_path, how):
  empty = tmp_path / "nowheels"
  empty.mkdir()
  args, wheels = ([str(empty)], None) if how == "argument" else ([], empty)
  proc, calls, out = _rehearse(tmp_path, *args, wheels=wheels)
  assert proc.returncode == 1
  assert proc.stderr.strip() == f"no wheels (*.whl) in {empty}"
  assert calls == [] and not (out / "summary.txt").exists()  # nothing ran


def test_cpu_mode_runs_for_real(tmp_path):
  """``GPU_CHECK_CPU=1`` with this interpreter: a train step, a decode benchmark and test
  collection really run (tiny sizes, the CPU), each part's JSON is complete."""
  out = tmp_path / "out"
  bin_dir = os.path.dirname(sys.executable)  # a virtual environment's python3 (not a link to it)
  if not os.path.isfile(os.path.join(bin_dir, "python3")):
    pytest.skip(f"no python3 beside {sys.executable}")
  env = dict(
    os.environ,
    PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    OUT=str(out),
    GPU_CHECK_CPU="1",
    PARTS="test_kernels bench_train_xla bench_decode_n6 test_model",
  )
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
    ["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
  )
  assert proc.returncode == 0, proc.stderr
  summary = (out / "summary.txt").read_text().splitlines()
  assert [ln.split()[:2] for ln in summary] == [
    ["test_kernels", "rc=0"],
    ["bench_train_xla", "rc=0"],
    ["bench_decode_n6", "rc=0"],
    ["test_model", "rc=0"],
  ], (summary, proc.stdout)
  train = json.loads((out / "bench_train_xla.out").read_text())
  assert train["backend"] == "cpu" and train["attention_impl"] == "xla" and train["accum"] == 1
  assert train["step_time_s"] > 0 and train["bytes_per_s"] > 0
  decode = json.loads((out / "bench_decode_n6.out").read_text())
  assert decode["n"] == 6 and set(decode["results"]) == {"ntp_b1", "threshold_tau0_b1"}
  # the output ends with each benchmark's figures, one line each
  assert f"bench_train_xla: xla micro-batch {train['micro_batch']}: step " in proc.stdout
  for key in ("ntp_b1", "threshold_tau0_b1"):
    assert f"bench_decode_n6: {key}: {decode['results'][key]['bytes_per_s']} bytes/s" in proc.stdout
  assert "tests collected" in (out / "test_kernels.out").read_text()
