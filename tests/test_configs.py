"""The paper configs' learning-rate schedule against the paper code's.

The paper's train.py builds transformers' get_cosine_schedule_with_warmup(num_warmup_steps,
max_train_steps) from its yaml (train.num_warmup_steps 2000, train.max_train_steps 48500,
optim.lr 3e-4); accelerate steps it once per process per optimizer step, over warmup and
horizon both multiplied by the process count, which is the same schedule in optimizer steps.
"""

import importlib
import math

import pytest

from lca_jax.train import optim

PAPER_CONFIGS = ("lca_mbp", "fxt", "spacebyte", "llamabyte", "mlp_mbp")
STEPS = (0, 1000, 2000, 10_000, 48_499, 48_500)


def paper_lr(step: int, lr=3e-4, warmup=2000, total=48_500) -> float:
  """transformers' cosine schedule with warmup (num_cycles 0.5), closed form."""
  if step < warmup:
    return lr * step / max(1, warmup)
  progress = (step - warmup) / max(1, total - warmup)
  return lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def schedule_of(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  horizon = optim.decay_horizon(config.optim, int(config.train.steps))
  return config, optim.make_schedule(config.optim, horizon)


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_config_schedule_is_the_paper_codes(name):
  config, schedule = schedule_of(name)
  assert int(config.train.steps) == 48_500
  assert int(config.optim.warmup_steps) == 2000
  assert int(config.train.global_batch_bytes) == 1_048_576
  lr = float(config.optim.lr)
  assert lr == 3e-4
  for step in STEPS:
    got = float(schedule(step))
    assert abs(got - paper_lr(step)) <= 1e-6 * lr, (step, got, paper_lr(step))
  assert float(schedule(48_500)) == pytest.approx(0.0, abs=1e-6 * lr)


def test_paper_schedule_matches_transformers():
  """The closed form above is transformers' own lambda (skipped where it does not import)."""
  opt = pytest.importorskip("transformers.optimization")
  lam = opt._get_cosine_schedule_with_warmup_lr_lambda
  _, schedule = schedule_of("lca_mbp")
  for step in STEPS:
    want = 3e-4 * lam(step, num_warmup_steps=2000, num_training_steps=48_500, num_cycles=0.5)
    assert abs(float(schedule(step)) - want) <= 1e-6 * 3e-4, step
    assert want == pytest.approx(paper_lr(step), abs=1e-12)
