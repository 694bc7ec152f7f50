"""RoPE: the host tables a call gathers from (``rope_len`` > 0, the model's default) equal the
cos / sin computed inline; a position past the table is NaN, never a wrong rotation."""

import jax.numpy as jnp
import numpy as np
from conftest import assert_close_rel

from lca_jax.model import layers


def test_rope_table_gather_equals_inline_values():
  e, base, max_len = 64, 10000.0, 4096
  pos = np.random.default_rng(0).integers(0, max_len, size=(2, 300))
  table = layers.rope_cos_sin(jnp.asarray(pos), e, base, max_len)
  inline = layers.rope_cos_sin(jnp.asarray(pos), e, base, 0)
  # both round the angle pos * inv_freq to float32 (numpy on the host, XLA here): an ulp of
  # inv_freq apart, angles near pos differ by ~ulp(pos); a row off by one would differ by O(1)
  tol = 4 * float(pos.max()) * np.finfo(np.float32).eps
  for got, want in zip(table, inline):
    assert got.shape == want.shape == (2, 300, 1, e)
    assert_close_rel(got, want, tol, scale=1.0)


def test_rope_position_past_the_table_is_nan():
  pos = jnp.arange(8)[None].at[0, -1].set(10_000)  # table rows: max(16, 8) + 2
  cos, sin = layers.rope_cos_sin(pos, 8, 10000.0, 16)
  assert np.all(np.isfinite(np.asarray(cos[0, :-1]))) and np.all(np.isnan(np.asarray(cos[0, -1])))
  assert np.all(np.isnan(np.asarray(sin[0, -1])))
