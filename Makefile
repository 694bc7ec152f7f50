# Two commands do everything on a fresh machine: `make demo` and `make test`.
# The venvs' Python, 3.12 or newer: the first of python3.13 / python3.12 on PATH that runs, else the
# newest 3.12+ under pyenv's versions/; `make PY=/path/to/python3.12` names one.
PY_OK := import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 12))
ifeq ($(origin PY),undefined)
PY := $(shell for p in python3.13 python3.12 $$(ls -d "$$(pyenv root 2>/dev/null || echo "$${PYENV_ROOT:-$$HOME/.pyenv}")"/versions/3.*/bin/python3 2>/dev/null | sort -V -r); do "$$p" -c '$(PY_OK)' >/dev/null 2>&1 && { command -v "$$p"; break; }; done)
endif
# A venv recipe's first line: one line and exit status 2 when PY is missing or older than 3.12.
CHECK_PY = @if [ -z "$(PY)" ]; then echo "make: no Python 3.12+ found (python3.13 / python3.12 on PATH, pyenv's versions/3.12*): install Python 3.12 or 3.13, or run make PY=/path/to/python3.12" >&2; exit 2; \
  elif ! $(PY) -c '$(PY_OK)' 2>/dev/null; then echo "make: PY=$(PY) is not a Python 3.12+ with venv: install Python 3.12 or 3.13, or run make PY=/path/to/python3.12" >&2; exit 2; fi
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= workdirs/demo
DEMO_CONFIG ?= configs/demo.py
DEMO_STEPS ?= 800
DEMO_SAMPLE_ARGS ?=

.PHONY: venv demo test test-fast lint bench clean gpu-venv gpu-aot tpu-venv tpu-aot

venv: $(STAMP)

$(STAMP): requirements.txt setup.py
	$(CHECK_PY)
	$(PY) -m venv --clear $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements.txt
	$(VPY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# Trains configs/demo.py on the bundled corpus (~7.5 minutes on 2 CPU cores in all), then prints held-out
# bpb, the learned segmentation, ntp / verify / threshold decoding, and writes the loss curve
# (README "Demo"). A finished DEMO_DIR is not retrained: rerunning only samples again.
demo: $(STAMP)
	$(VENV)/bin/lca-train --config $(DEMO_CONFIG) --workdir $(DEMO_DIR) --config.train.steps=$(DEMO_STEPS)
	$(VPY) tools/demo_sample.py --checkpoint $(DEMO_DIR) $(DEMO_SAMPLE_ARGS)

# Tests in two tiers (markers in pytest.ini, the tiers' tables in tests/conftest.py):
#   make test       the whole suite (CI runs it);
#   make test-fast  the tests not marked slow: each area (model math, masks, attention, kernels
#                   in interpret mode, data, a train step, decode, checkpoint, eval) without the
#                   processes, CLIs, tool smoke tests and whole decode-loop compiles.
# pytest exits 5 when no test is collected; that is not a failure of the code.
# TEST_WORKERS pytest-xdist processes, a test file each at a time (--dist loadfile: a file's
# module fixtures are built once): min(4, cores, GiB of memory / 4), 0 = one process. Most
# tests are compile-bound on one thread, so workers help even on few cores.
TEST_WORKERS ?= $(shell $(or $(PY),python3) -c "import os; n = min(4, os.cpu_count() or 1, os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 2**32); print(n if n > 1 else 0)")
PYTEST := XLA_FLAGS=--xla_force_host_platform_device_count=8 $(VPY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile
test: $(STAMP)
	$(PYTEST) tests; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" tests; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

# ruff lint (pyflakes, pycodestyle, import order) and format check; config in ruff.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Compiles every production program for H100 / H200 / B200 GPUs on this host, without a GPU
# (lca_jax/aot, tools/gpu_aot.py): installs jax's CUDA plugin of the pinned jax into a separate
# .venv-cuda that reads every other package from .venv (the default venv never gets it), runs
# the tests that need the plugin, then prints the JSON report (also in GPU_AOT_OUT). cuDNN
# (requirements-gpu-aot.txt) lets cuDNN attention lower and be estimated without a GPU.
VENV_CUDA := .venv-cuda
CUDA_STAMP := $(VENV_CUDA)/.installed
JAX_VERSION := $(shell sed -n 's/^jax==//p' requirements.txt)
GPU_AOT_OUT ?= workdirs/gpu_aot.json
GPU_AOT_ARGS ?=

$(CUDA_STAMP): $(STAMP) requirements-gpu-aot.txt
	$(CHECK_PY)
	$(PY) -m venv --clear $(VENV_CUDA)
	$(VENV_CUDA)/bin/python -c "import site, sys; open(site.getsitepackages()[0] + '/lca_jax_main_venv.pth', 'w').write(sys.argv[1] + '\n')" "$$($(VPY) -c 'import site; print(site.getsitepackages()[0])')"
	$(VENV_CUDA)/bin/python -m pip install -q --no-deps jax-cuda12-plugin==$(JAX_VERSION) jax-cuda12-pjrt==$(JAX_VERSION) -r requirements-gpu-aot.txt
	$(VENV_CUDA)/bin/python -m pip install -q --no-deps -e .
	touch $(CUDA_STAMP)

# The plugin alone (a minute or two), for `.venv-cuda/bin/lca-train --aot ...` without the suite.
gpu-venv: $(CUDA_STAMP)

gpu-aot: $(CUDA_STAMP)
	JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 $(VENV_CUDA)/bin/python -m pytest -q tests/test_aot.py; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]
	mkdir -p $(dir $(GPU_AOT_OUT))
	$(VENV_CUDA)/bin/python tools/gpu_aot.py --out $(GPU_AOT_OUT) $(GPU_AOT_ARGS)

# Compiles every production program for TPU v5e / v5p / v6e slices on this host, without a TPU
# (lca_jax/aot, tools/tpu_aot.py, docs/tpu.md): installs libtpu of the pinned jax (jax[tpu]'s
# compiler) into a separate .venv-tpu that reads every other package from .venv, runs the tests
# that need it, then prints the JSON report (also in TPU_AOT_OUT).
VENV_TPU := .venv-tpu
TPU_STAMP := $(VENV_TPU)/.installed
TPU_AOT_OUT ?= workdirs/tpu_aot.json
TPU_AOT_ARGS ?= --fit

$(TPU_STAMP): $(STAMP)
	$(CHECK_PY)
	$(PY) -m venv --clear $(VENV_TPU)
	$(VENV_TPU)/bin/python -c "import site, sys; open(site.getsitepackages()[0] + '/lca_jax_main_venv.pth', 'w').write(sys.argv[1] + '\n')" "$$($(VPY) -c 'import site; print(site.getsitepackages()[0])')"
	$(VENV_TPU)/bin/python -m pip install -q --no-deps "libtpu==$$($(VPY) -c "import importlib.metadata as m; print(next(r.split('==')[1].split(';')[0].strip() for r in m.requires('jax') if r.startswith('libtpu')))")"
	$(VENV_TPU)/bin/python -m pip install -q --no-deps -e .
	touch $(TPU_STAMP)

# libtpu alone, for `.venv-tpu/bin/lca-train --aot v5p:8 ...` without the suite.
tpu-venv: $(TPU_STAMP)

tpu-aot: $(TPU_STAMP)
	JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $(VENV_TPU)/bin/python -m pytest -q tests/test_tpu_aot.py tests/test_tpu_kernel.py; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]
	mkdir -p $(dir $(TPU_AOT_OUT))
	$(VENV_TPU)/bin/python tools/tpu_aot.py --out $(TPU_AOT_OUT) $(TPU_AOT_ARGS)

clean:
	rm -rf $(VENV) $(VENV_CUDA) $(VENV_TPU) workdirs
