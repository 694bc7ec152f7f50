"""Smoke test of tools/gpu_check.sh (the prepared check for a machine with a GPU).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/test_tool_gpu_check.py

The script has no CPU mode (every part needs CUDA), so it is rehearsed: it runs from a scratch
directory whose tests/ and tools/ link to the repository's, with stand-ins for python3 and
nvidia-smi on PATH that log their arguments and succeed. The test checks the script's syntax,
its wheel handling, that every part runs and is summarised, that each test file and tool it
names exists and that the options it passes to the tools parse.
"""

import os
import shlex
import shutil
import subprocess

import pytest
from conftest import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")
# Logs one line per call: name, PYTHONPATH=..., JAX_PLATFORMS=..., then the arguments.
STUB = """#!/usr/bin/env bash
{ printf '%q ' "$(basename "$0")" "PYTHONPATH=${PYTHONPATH:-}" "JAX_PLATFORMS=${JAX_PLATFORMS:-}" \
    "$@"; echo; } >> "$STUB_LOG"
"""

pytestmark = pytest.mark.skipif(
  shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout"
)


def _rehearse(tmp_path, *args, demo=False, wheels=None):
  """Runs the script with stubs; returns (completed process, logged calls, $OUT), each call as
  (program, PYTHONPATH, JAX_PLATFORMS, [arguments])."""
  work, bin_dir, out = tmp_path / "work", tmp_path / "bin", tmp_path / "out"
  for d in (work, bin_dir):
    d.mkdir()
  for name in ("tests", "tools"):
    os.symlink(os.path.join(ROOT, name), work / name)
  if demo:
    (work / "workdirs" / "demo").mkdir(parents=True)
  for name in ("python3", "nvidia-smi"):
    (bin_dir / name).write_text(STUB)
    (bin_dir / name).chmod(0o755)
  log = tmp_path / "calls.log"
  log.touch()
  env = {
    "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    "OUT": str(out),
    "STUB_LOG": str(log),
    "HOME": str(tmp_path),
  }
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
    prog, pythonpath, platforms, *argv = shlex.split(line)
    calls.append((prog, pythonpath.split("=", 1)[1], platforms.split("=", 1)[1], argv))
  return proc, calls, out


def test_syntax():
  proc = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("demo", [False, True])
def test_rehearsal(tmp_path, demo):
  """No wheels; the decode benchmark runs only when workdirs/demo exists."""
  proc, calls, out = _rehearse(tmp_path, demo=demo)
  assert proc.returncode == 0, proc.stderr
  parts = ["test_kernels", "bench_kernel"] + (["bench_decode"] if demo else []) + ["test_decode"]
  assert (out / "summary.txt").read_text().splitlines() == [f"{p} rc=0" for p in parts]
  for p in parts:
    assert (out / f"{p}.out").is_file() and (out / f"{p}.err").is_file(), p
  work = tmp_path / "work"
  assert [c[0] for c in calls] == ["nvidia-smi"] + ["python3"] * (1 + len(parts))
  assert calls[1][3][0] == "-c" and "jax.devices()" in calls[1][3][1]  # gpu.txt's device line
  ran = []
  for prog, pythonpath, platforms, argv in calls[1:]:
    assert pythonpath == str(work) and platforms == "cuda", (prog, pythonpath, platforms)
    if argv[0] == "-c":
      continue
    if argv[:2] == ["-m", "pytest"]:
      ran.append(argv[-1])
      assert argv[-1].startswith("tests/") and (work / argv[-1]).is_file(), argv
    else:
      ran.append(argv[0])
      assert argv[0].startswith("tools/") and (work / argv[0]).is_file(), argv
      # the options the script passes are the tool's own
      load_tool(os.path.splitext(os.path.basename(argv[0]))[0]).parse_args(argv[1:])
  assert ran == ["tests/test_kernels.py", "tools/bench_kernel.py"] + (
    ["tools/bench_decode.py"] if demo else []
  ) + ["tests/test_decode.py"]


def test_wheels_installed_first(tmp_path):
  wheels = tmp_path / "wh"
  wheels.mkdir()
  (wheels / "fake-0.0-py3-none-any.whl").write_text("")
  proc, calls, out = _rehearse(tmp_path, str(wheels))
  assert proc.returncode == 0, proc.stderr
  prog, _, _, argv = calls[0]
  assert prog == "python3" and argv[:3] == ["-m", "pip", "install"], calls[0]
  assert "--no-index" in argv and argv[-1] == str(wheels / "fake-0.0-py3-none-any.whl")
  assert argv[argv.index("--target") + 1] == "/tmp/site"
  for _, pythonpath, _, _ in calls[1:]:  # everything after sees the installed wheels first
    assert pythonpath == f"/tmp/site:{tmp_path / 'work'}"
  assert len((out / "summary.txt").read_text().splitlines()) == 3


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_missing_wheels_refused(tmp_path, how):
  empty = tmp_path / "nowheels"
  empty.mkdir()
  args, wheels = ([str(empty)], None) if how == "argument" else ([], empty)
  proc, calls, out = _rehearse(tmp_path, *args, wheels=wheels)
  assert proc.returncode == 1
  assert proc.stderr.strip() == f"no wheels (*.whl) in {empty}"
  assert calls == [] and not (out / "summary.txt").exists()  # nothing ran
