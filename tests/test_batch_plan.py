"""The batch plan of a run (lca_jax/train/inputs.py): ``data.seq_len``,
``train.global_batch_bytes`` and ``train.micro_batch_size`` read and checked in one place, the
mesh laid out for the plan, and a combination no run can use named in one error."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402

import jax  # noqa: E402
import ml_collections  # noqa: E402
import pytest  # noqa: E402

from lca_jax.train import inputs  # noqa: E402
from lca_jax.train import sharding as shd  # noqa: E402
from lca_jax.train.errors import TrainError  # noqa: E402


def _config(seq_len=32, gbb=512, micro=8, **mesh):
  return ml_collections.ConfigDict(
    dict(
      data=dict(seq_len=seq_len),
      train=dict(global_batch_bytes=gbb, micro_batch_size=micro),
      mesh=dict(dict(data=-1, fsdp=1, tensor=1, cpu_devices=0), **mesh),
    )
  )


def test_plan_fields():
  plan = inputs.plan_batches(_config())
  assert (plan.seq_len, plan.rows, plan.micro, plan.accum) == (32, 16, 8, 2)
  assert (plan.shards, plan.processes) == (1, jax.process_count())
  assert plan.host_rows == 16 and plan.host_micro == 8 and plan.bytes_per_step == 512
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.micro = 4


def test_plan_and_mesh_use_the_same_micro_batch():
  devs = jax.devices()
  plan, mesh = inputs.plan_and_mesh(_config(micro=8), devs[:4])
  assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 1}
  assert plan.shards == 4 and plan.shard_rows == 2
  assert plan == inputs.plan_batches(_config(micro=8), mesh)
  # a CPU host split by mesh.cpu_devices: the devices one row cannot use go to 'tensor'
  plan, mesh = inputs.plan_and_mesh(_config(gbb=32, micro=1, cpu_devices=2), devs[:2])
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 2}
  assert plan.shards == 1 and plan.shard_rows == 1


@pytest.mark.parametrize(
  "kw,words",
  [
    (dict(micro=0), ["data.seq_len, train.micro_batch_size and train.global_batch_bytes", "0"]),
    (dict(seq_len=-1), ["must be positive", "-1"]),
    (dict(gbb=500), ["train.global_batch_bytes=500 is not a multiple", "8 * 32 = 256"]),
    (dict(micro=6, gbb=6 * 32 * 2), ["train.micro_batch_size=6 rows cannot be divided over the 4"]),
  ],
)
def test_bad_combination_is_one_error_naming_the_fields(kw, words):
  with pytest.raises(TrainError) as e:
    inputs.plan_and_mesh(_config(**kw), jax.devices()[:4])
  msg = str(e.value)
  assert "\n" not in msg
  for w in words:
    assert w in msg, (w, msg)


def test_on_mesh_checks_the_shards():
  plan = inputs.plan_batches(_config(micro=2, gbb=64))
  mesh = shd.make_mesh({"data": 4, "fsdp": 1, "tensor": 1}, jax.devices()[:4])
  with pytest.raises(TrainError, match="use a multiple of 4"):
    plan.on_mesh(mesh)
