"""A CPU host split into ``mesh.cpu_devices`` devices: the rule, jax honouring it before its
backends start, XLA_FLAGS taking precedence, and lca-train running data-parallel over them."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import ml_collections  # noqa: E402
import pytest  # noqa: E402
from conftest import ROOT, TRAIN_TINY  # noqa: E402

from lca_jax.train import run_config  # noqa: E402
from lca_jax.train import sharding as shd  # noqa: E402


def _mesh(**kw):
  m = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, cpu_devices=0))
  m.update(kw)
  return m


@pytest.mark.parametrize(
  "cpu_devices,cores,want",
  [
    (0, 2, 2),  # auto: two streams on a multi-core host, whatever the rows (cpu_mesh lays
    (0, 16, 2),  # out rows that do not divide)
    (0, 1, 1),  # one core
    (3, 1, 3),  # explicit values are kept (the mesh checks the rows later)
    (1, 2, 1),
  ],
)
def test_cpu_device_count_rule(cpu_devices, cores, want):
  assert shd.cpu_device_count(_mesh(cpu_devices=cpu_devices), cores) == want


def test_cpu_device_count_without_the_field_is_auto():
  m = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  assert shd.cpu_device_count(m, 2) == 2


@pytest.mark.parametrize(
  "axes,rows,n,want",
  [
    ({}, 4, 2, (-1, 1, 1)),  # rows divide: data-parallel, unchanged
    ({}, 1, 2, (-1, 1, 2)),  # one row: both devices on 'tensor'
    ({}, 3, 2, (-1, 1, 2)),
    ({}, 6, 4, (-1, 1, 2)),  # 2 ways data, 2 ways tensor
    ({"tensor": 2}, 1, 2, (-1, 1, 2)),  # the config's own layout is kept
    ({"fsdp": 2}, 1, 2, (-1, 2, 1)),
  ],
)
def test_cpu_mesh_puts_devices_rows_cannot_use_on_tensor(axes, rows, n, want):
  mesh = _mesh(**axes)
  got = shd.cpu_mesh(mesh, rows, n)
  assert tuple(got[a] for a in shd.AXES) == want
  data, fsdp, _ = shd.mesh_shape(got, n)
  assert data * fsdp <= n
  assert tuple(mesh[a] for a in shd.AXES) == tuple(
    {"data": -1, "fsdp": 1, "tensor": 1, **axes}[a] for a in shd.AXES
  )  # not modified


def test_make_mesh_lays_out_a_cpu_split_only():
  """Two CPU devices of an auto split and one row: tensor 2. Eight forced devices (XLA_FLAGS,
  not the split) keep the config's data-parallel layout, so a row count that does not divide
  still fails where it did."""
  devs = jax.devices()
  auto = shd.cpu_device_count(_mesh())
  mesh = shd.make_mesh(_mesh(), devs[:auto], micro_rows=1)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": auto}
  mesh8 = shd.make_mesh(_mesh(), devs, micro_rows=1)
  assert dict(mesh8.shape) == {"data": len(devs), "fsdp": 1, "tensor": 1}


def test_negative_cpu_devices_is_one_line_config_error():
  with pytest.raises(shd.MeshError, match="mesh.cpu_devices must be >= 0"):
    shd.cpu_device_count(_mesh(cpu_devices=-1), 2)
  cfg = ml_collections.ConfigDict(dict(mesh=dict(cpu_devices=-2)))
  with pytest.raises(run_config.RunConfigError, match="mesh.cpu_devices must be an integer >= 0"):
    run_config.validate_run_config(cfg)


def _env(xla_flags=None):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  if xla_flags is not None:
    env["XLA_FLAGS"] = xla_flags
  return env


PROBE = (
  "import jax; from lca_jax.train import sharding as s; "
  "n = s.use_cpu_devices({n}); print(n, len(jax.devices()))"
)


@pytest.mark.parametrize(
  "n,flags,want",
  [(2, None, "2 2"), (3, None, "3 3"), (2, "--xla_force_host_platform_device_count=5", "5 5")],
)
def test_use_cpu_devices_before_backends_start(n, flags, want):
  out = subprocess.run(
    [sys.executable, "-c", PROBE.format(n=n)],
    env=_env(flags),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == want.split()


def test_use_cpu_devices_after_backends_started_keeps_the_count():
  code = "import jax; jax.devices(); from lca_jax.train import sharding as s; print(s.use_cpu_devices(2))"
  out = subprocess.run(
    [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "1"


SPY = """
import sys
from lca_jax.cli import train as cli
from lca_jax.train import loop
orig = loop.prepare
def spy(config, devices=None):
  setup = orig(config, devices)
  print("mesh devices", setup.mesh.devices.size, dict(setup.mesh.shape), file=sys.stderr)
  return setup
loop.prepare = spy
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
  "rows,layout",
  [(8, "{'data': 2, 'fsdp': 1, 'tensor': 1}"), (1, "{'data': 1, 'fsdp': 1, 'tensor': 2}")],
)
def test_lca_train_runs_over_two_cpu_devices(tmp_path, rows, layout):
  """No XLA_FLAGS: lca-train splits the host into the devices asked for (auto on a >= 2-core
  host; given explicitly here so the test holds on a 1-core machine too): 8 rows run
  data-parallel over 2, a single row splits heads and MLP over them."""
  auto = (os.cpu_count() or 1) >= 2
  extra = [
    "train.steps=2",
    f"train.micro_batch_size={rows}",
    f"train.global_batch_bytes={32 * rows}",
  ]
  extra += [] if auto else ["mesh.cpu_devices=2"]
  argv = ["--config", os.path.join(ROOT, "configs", "tiny_lca_mbp.py"), "--workdir"]
  argv += [str(tmp_path / "w")] + [f"--config.{o}" for o in TRAIN_TINY + extra]
  out = subprocess.run(
    [sys.executable, "-c", SPY] + argv,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert f"mesh devices 2 {layout}" in out.stderr, out.stderr[-2000:]
  assert "lca-train: done at step 2" in out.stderr, out.stderr[-2000:]
