"""Shared test setup and fixtures.

The environment defaults are set before jax is imported anywhere: tests run on CPU with 8
virtual host devices (so sharding tests can build meshes), unless the caller says otherwise.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The programs' own persistent XLA cache (lca_jax/xla_cache.py) stays off in tests and in the
# CLI processes they start: a test never reads or fills the user's ~/.cache (tests of the
# cache pass their own directory).
os.environ["LCA_JAX_XLA_CACHE"] = "0"
# The suite's time is mostly XLA compiling small programs (a decode loop ~2.4 s on CPU, of
# which LLVM's optimisation passes take half). jax's "most optimizations off" (XLA backend
# optimisation level 0, LLVM's expensive passes off) changes only how the machine code is
# optimised, not the HLO (the fusions, copies and op counts the HLO tests read); float results
# move at rounding level only (logits of a random and of the demo model within 9e-7 of their
# scale, greedy decodes identical: far inside REL_REORDER), and compile time halves. Set through
# the environment, so the CLI processes tests start inherit it; LCA_JAX_TEST_FULL_OPT=1 tests
# with XLA's default optimisation.
if os.environ.get("LCA_JAX_TEST_FULL_OPT", "0") in ("", "0"):
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import functools  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `configs` (config files import configs.base) and lca_jax from a checkout
  sys.path.insert(0, ROOT)

import flax.linen as nn  # noqa: E402  pylint: disable=g-import-not-at-top
import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # noqa: E402  pylint: disable=g-import-not-at-top

from lca_jax.decode import engine  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.model.config import ModelConfig  # noqa: E402  pylint: disable=g-import-not-at-top
from lca_jax.model.hierarchical import init_params  # noqa: E402  pylint: disable=g-import-not-at-top

# On a GPU, XLA runs float32 dots as TF32 by default (10-bit mantissa: ~3e-4 relative): the
# float32 references, the stored reference vectors and the causality checks are float32
# statements, so the suite asks for full float32 there. The Pallas kernels' own dots are
# compared at the precision they promise (test_kernels: TF32).
if jax.default_backend() == "gpu":
  jax.config.update("jax_default_matmul_precision", "highest")

# A persistent XLA cache across runs is opt-in: LCA_JAX_TEST_XLA_CACHE=DIR (faster reruns).
# Off by default: without eviction jax writes entries unlocked (an entry read while a child
# process of a multi-process test writes it can be torn), and a fresh machine gains nothing.
# (The suite's segfaults that first looked like cache reads were the memory-mapping limit, see
# _release_compiled_programs.) No size limit on purpose when on: jax's LRU eviction stops
# writing for good once any process without it has written an entry.
_cache = os.environ.get("LCA_JAX_TEST_XLA_CACHE", "0")
if _cache not in ("", "0"):
  jax.config.update("jax_compilation_cache_dir", _cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

# The tiny model and rows of the training tests (and of the demo's test run).
TINY_SHAPE = [
  "model.d_model=32",
  "model.d_inner=64",
  "model.n_heads=2",
  "model.n_kv_heads=2",
  "model.n_lm=1",
  "model.n_mbp=1",
  "data.seq_len=32",
  "train.micro_batch_size=8",
]

# Tiny training overrides shared by the training/checkpoint tests (one compiled train step).
# decay_steps is fixed so that runs of different lengths share one schedule (and one compile).
TRAIN_TINY = TINY_SHAPE + [
  "train.global_batch_bytes=512",
  "train.log_every=1",
  "train.eval_every=0",
  "train.checkpoint_every=1000",
  "train.progress_bar=False",
  "train.tensorboard=False",
  "optim.warmup_steps=2",
  "optim.lr=3e-3",
  "optim.decay_steps=40",
]


def host_params(state):
  """A train state's params as host numpy arrays."""
  return jax.tree_util.tree_map(np.asarray, jax.device_get(state.params))


def assert_trees_equal(a, b):
  """Same number of leaves, each bit-identical."""
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(x, y)


# Tolerances of float32 results computed two ways, relative to the scale of the values compared
# (see assert_close_rel). float32's epsilon is 1.2e-7; these leave room for sums of hundreds of
# terms through a few layers, in whatever order another CPU's kernels (vector width, blocking),
# a cache, a sharded reduction or another implementation add them, and stay far below what a
# wrong mask, index or missing term moves (1e-2 of the scale and more).
REL_REORDER = 2e-5  # the same math, another summation order (sharding, cache, kernel, remat)
REL_IMPL = 1e-4  # another implementation (PyTorch vs JAX, vectors computed on another machine)
# float32 dots at TF32 (a GPU's default precision for them, in XLA and in Triton's tl.dot): 8x
# TF32's unit roundoff 2^-11, as bfloat16 tests allow 2e-2 (~5x its 2^-8)
REL_TF32 = 4e-3
_TOL_LOG = os.environ.get("LCA_JAX_TEST_TOL_LOG", "")


def assert_close_rel(actual, ref, rel=REL_REORDER, scale=None, err_msg=""):
  """|actual - ref| <= rel * scale everywhere; ``scale`` defaults to max |ref|.

  Rounding errors of a float32 computation are a few ulps of the largest values it sums, not of
  each output, so the bound is absolute at the reference's scale: machine-independent (unlike a
  fixed atol, which is loose on small values and fails on large ones) and without rtol's
  blow-up on outputs near zero. A zero scale asks for equality. ``LCA_JAX_TEST_TOL_LOG=path``
  appends each call's observed error / (rel * scale) to ``path``, to check the margins on a
  new machine.
  """
  a, r = np.asarray(actual, np.float64), np.asarray(ref, np.float64)
  assert a.shape == r.shape, (a.shape, r.shape, err_msg)
  scale = float(np.max(np.abs(r), initial=0.0)) if scale is None else float(scale)
  tol = rel * scale
  if _TOL_LOG:
    err = float(np.max(np.abs(a - r), initial=0.0))
    with open(_TOL_LOG, "a") as f:
      caller = sys._getframe(1)  # pylint: disable=protected-access
      f.write(
        f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno} "
        f"{os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]} "
        f"{err / tol if tol else float(err > 0):.3g}\n"
      )
  np.testing.assert_allclose(
    a, r, rtol=0, atol=tol, err_msg=f"{err_msg} (tolerance {rel:g} x scale {scale:.4g})"
  )


REF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "reference")
REF_NAMES = ("lca_small", "lca_gqa", "fxt_small")

# Tiny dimensions shared by model tests: small enough that a jit compile takes ~1 s on CPU.
TINY_DIMS = dict(
  d_model=32, d_inner=64, n_heads=2, n_kv_heads=1, vocab_size=384, n_tokens=261, dropout=0.0
)

# Every member of the family at tiny size, built from ModelConfig directly.
VARIANTS = {
  "llamabyte": dict(kind="flat", n_enc=2, n_lm=0, n_dec=0, n_mbp=0),
  "spacebyte": dict(
    n_enc=1, n_lm=1, n_dec=1, n_mbp=0, boundaries="spacebyte", spacebyte_max_group=5
  ),
  "fxt": dict(n_enc=1, n_lm=1, n_dec=1, n_mbp=0),
  "mlp_mbp": dict(n_enc=1, n_lm=1, n_dec=1, n_mbp=0, n_mlp_mbp=2),
  "lca_mbp": dict(n_enc=1, n_lm=1, n_dec=1, n_mbp=2),
}


def tiny_config(variant: str, **overrides) -> ModelConfig:
  """A tiny ModelConfig of ``variant`` (a key of VARIANTS), with ``overrides``."""
  kw = dict(TINY_DIMS)
  kw.update(VARIANTS[variant])
  kw.update(overrides)
  return ModelConfig(**kw)


def train_forward(model, params, batch, key):
  """``model``'s training forward (Gumbel boundaries, dropout, both drawn from ``key``) on
  ``batch``: a dict of ids, segment_ids and positions [B, T]."""
  return model.apply(
    {"params": params},
    batch["ids"],
    batch["segment_ids"],
    batch["positions"],
    train=True,
    rngs={"gumbel": key, "dropout": key},
  )


@functools.lru_cache(maxsize=None)
def random_params(cfg: ModelConfig, seed: int = 0, bp_gain: float = 3.0):
  """Unboxed float32 params of ``ByteLM(cfg)`` with O(1) activations everywhere.

  The model's own init (std 0.02) makes every stage nearly constant in its input, so learned
  boundaries would be pure Gumbel noise and a changed byte would move logits by ~1e-4. Here
  kernels are N(0, 1/fan_in), embeddings and the null group N(0, 1), norm scales 1 + N(0, 0.1^2),
  biases N(0, 0.1^2), and the boundary predictor's output is multiplied by ``bp_gain`` so that
  its decisions depend on the bytes as much as on the noise. Built from the abstract shapes
  (no init compile), deterministic in ``seed``.
  """
  abstract = jax.eval_shape(lambda: nn.unbox(init_params(cfg, jax.random.PRNGKey(0))))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  rng = np.random.default_rng(seed)
  out = []
  for path, leaf in leaves:
    names = [getattr(k, "key", str(k)) for k in path]
    shape = leaf.shape
    if names[-1] == "kernel":
      x = rng.standard_normal(shape) / np.sqrt(shape[0])
      if names[0] == "boundary_predictor" and names[1] == "fc2":
        x = x * bp_gain
    elif names[-1] == "scale":
      x = 1.0 + 0.1 * rng.standard_normal(shape)
    elif names[-1] == "bias":
      x = 0.1 * rng.standard_normal(shape)
    else:  # embedding, null_group
      x = rng.standard_normal(shape)
    out.append(jnp.asarray(x, jnp.float32))
  return jax.tree_util.tree_unflatten(treedef, out)


def random_ids(rng: np.random.Generator, shape, text_like: bool = True) -> np.ndarray:
  """Byte ids (byte + 3). ``text_like``: mostly lowercase letters with spaces and punctuation,
  so that the SpaceByte rule closes groups; else uniform over all 256 bytes."""
  if not text_like:
    return rng.integers(3, 259, size=shape).astype(np.int32)
  alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz    ..,,ABC019\n", np.uint8)
  return alphabet[rng.integers(0, len(alphabet), size=shape)].astype(np.int32) + 3


def segmented_layout(lengths, total: int):
  """Doc ids and per-document positions for documents of ``lengths`` packed into one row of
  ``total`` bytes (the rest is padding: doc 0, position 0)."""
  doc = np.zeros(total, np.int32)
  pos = np.zeros(total, np.int32)
  at = 0
  for d, n in enumerate(lengths, start=1):
    doc[at : at + n] = d
    pos[at : at + n] = np.arange(n)
    at += n
  assert at <= total
  return doc, pos


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """After each test module, drop the executables it compiled (the decode engine's cache and
  jax's jit caches). One process runs the whole suite, and XLA:CPU's JIT code takes memory
  mappings (~900 per decode executable) out of vm.max_map_count (65530 by default): kept
  until the end, they aborted the suite inside XLA's compiler near its end."""
  yield
  engine.clear_compiled()
  jax.clear_caches()
  gc.collect()


@pytest.fixture
def np_rng():
  return np.random.default_rng(0)


@pytest.fixture(scope="session")
def ref_dir():
  """Path of tests/data/reference (reference vectors of the paper's PyTorch code)."""
  return REF_DIR


@pytest.fixture(scope="session")
def tiny_cfg():
  """The ``tiny_config`` factory as a fixture."""
  return tiny_config


@pytest.fixture(scope="session")
def jax_key():
  return jax.random.PRNGKey(0)


@pytest.fixture(scope="session")
def tiny_upstream_checkpoint(tmp_path_factory):
  """A checkpoint directory for the tool smoke tests: random params (``random_params``) of a tiny
  LCA-MBP model, one layer per stage, in the upstream layout (config.json + model.safetensors)."""
  from lca_jax.interop import upstream  # pylint: disable=g-import-not-at-top

  cfg = tiny_config("lca_mbp", n_mbp=1)
  path = str(tmp_path_factory.mktemp("tiny_upstream_checkpoint"))
  upstream.write_dir(path, random_params(cfg), cfg)
  return path


def run_cli_process(module: str, *argv, cwd=None, timeout: float = 300):
  """``python -m MODULE ARGV`` (e.g. ``lca_jax.cli.sample``): a command as the user runs it, in
  its own process, with this checkout's lca_jax first on the path. Returns the CompletedProcess
  (text stdout / stderr)."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  return subprocess.run(
    [sys.executable, "-m", module, *argv],
    capture_output=True,
    text=True,
    env=env,
    cwd=cwd,
    timeout=timeout,
  )


TOOLS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def load_tool(name: str):
  """The module of ``tools/<name>.py`` (tools are scripts, not a package)."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS_DIR, f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


# ---- test tiers -------------------------------------------------------------------------------
# `make test` runs every test; `make test-fast` runs those not marked `slow` (pytest -m "not
# slow"): a subset that still covers each area (model math, masks, attention, kernels in
# interpret mode, data, a train step, decode, checkpoint, eval). A test is slow when it starts
# processes or CLIs, smoke-tests a tool, or compiles whole decode loops or many train steps.
# New long tests take `@pytest.mark.slow`; the tables below mark the existing ones by name, so
# that the tiers live in one place. Names are test functions (all their parameters) or node
# names with parameters, as pytest prints them.
SLOW_FILES = frozenset(
  {
    "test_bad_input.py",
    "test_bench_serve.py",
    "test_convert.py",
    "test_costs.py",
    "test_cpu_devices.py",
    "test_demo.py",
    "test_disk_full.py",
    "test_fault_tolerance.py",
    "test_first_run.py",
    "test_hf_export.py",
    "test_kernels_sharded.py",
    "test_lm_eval.py",
    "test_multihost.py",
    "test_serve.py",
    "test_xla_cache.py",
  }
  | {
    f"test_tool_{t}.py"
    for t in ("bench_decode", "bench_hf", "bench_kernel", "bench_model", "bench_train")
    + ("bench_vs_upstream", "count_params", "demo_sample", "gpu_check")
  }
)
SLOW_TESTS = {
  "test_attention.py": (
    "test_model_blockwise_equals_dense",
    "test_no_t_by_t_buffer_in_train_step",
    "test_sharded_call_schedules_each_device_alone",
    "test_bfloat16_matches_float32_reference",
    "test_blockwise_equals_dense[mha_ragged_t-causal]",
    "test_blockwise_equals_dense[mqa_one_doc-causal]",
    "test_blockwise_equals_dense[gqa_docs-causal]",
  ),
  "test_checkpoint.py": ("test_restore_onto_smaller_mesh",),
  "test_data.py": ("test_multiprocess_workers_deterministic_and_resumable",),
  "test_decode_bounds.py": (
    "test_param_counts_cover_the_model",
    "test_cache_len_is_the_engine_length",
  ),
  "test_decode_hlo.py": (
    "test_stack_rows_equal_the_full_stack_at_those_rows",
    "test_stack_rows_without_cache",
    "test_decode_step_copies_no_cache",
    "test_step_stats_of_a_sampled_decode_read_the_decode_loop",
    "test_decode_step_fuses_projections_without_copying_weights",
    "test_cached_attention_reads_only_the_old_slots_it_is_given",
  ),
  "test_decode_batch.py": (
    "test_greedy_and_sampled_rows_share_a_batch[verify-3]",
    "test_long_prompt_prefills_in_pieces_between_chunks",
  ),
  # each compiles whole greedy decode loops twice (fused kernels in interpret mode, XLA); the
  # kernels' own tests in this file stay fast
  "test_decode_fused.py": ("test_greedy_decoding_with_the_fused_kernels_equals_the_xla_path",),
  "test_eval.py": (
    "test_tasks_end_to_end",
    "test_sweep_cli_on_real_checkpoints",
  ),
  "test_inference_imports.py": ("test_load_and_generate_import_no_training_module",),
  "test_model_grads.py": (
    "test_scanned_layers_same_loss_and_gradients",
    "test_forward_backward_xla",
  ),
  "test_model_parity.py": ("test_batch_equals_rows",),
  "test_tpu_aot.py": ("test_tool_and_cli_without_libtpu_or_with_a_bad_target_are_one_line_exit_2",),
  "test_train.py": (
    "test_loss_decreases",
    "test_sharded_step_matches_single_device",
    "test_data_parallel_step_gathers_nothing",
  ),
}
# files of which only these tests are fast (every decode test compiles a decode loop)
FAST_ONLY = {
  "test_decode.py": (
    "test_reference_decoding_vectors[fxt_small]",
    "test_cache_parity_per_step[flat]",
    "test_cache_parity_per_step[spacebyte]",
    "test_eos_stops_and_budget",
    "test_clear_errors",
  ),
}


def _named(item, names) -> bool:
  return item.name in names or getattr(item, "originalname", item.name) in names


def pytest_collection_modifyitems(config, items):
  """Marks the tests of the tables above ``slow``; a name that no test function of its file
  has is a usage error (a renamed test would otherwise change tiers unnoticed)."""
  del config
  modules = {}
  for item in items:
    base = os.path.basename(str(item.path))
    if getattr(item, "module", None) is not None:
      modules[base] = item.module
    if base in SLOW_FILES or _named(item, SLOW_TESTS.get(base, ())):
      item.add_marker(pytest.mark.slow)
    elif base in FAST_ONLY and not _named(item, FAST_ONLY[base]):
      item.add_marker(pytest.mark.slow)
  for table in (SLOW_TESTS, FAST_ONLY):
    for base, names in table.items():
      missing = [
        n for n in names if base in modules and not hasattr(modules[base], n.split("[")[0])
      ]
      if missing:
        raise pytest.UsageError(f"tests/conftest.py tiers: {base} has no test {missing}")
