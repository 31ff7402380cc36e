"""A kernel's facts live on its record: a kernel added under a new name gets the causal layer's
scaled keys and exact decoding from its map's ``exp_form``, with no list of names to join."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.models import attention as model_attention
from fastpos.models.attention import Attention, AttentionConfig, KernelSpec
from fastpos.ops import attention as attn_ops
from fastpos.ops import decoding as dec_ops
from fastpos.ops import features as F
from tests.models import test_decoding

B, N, D, H = 2, 24, 16, 2


@pytest.fixture
def custom_kernels(monkeypatch):
  """``mine``: sikf's map under a new name; ``plain``: the same map without its exp_form."""
  sikf = F.get_kernel("sikf").map
  monkeypatch.setitem(F._MAPS, "mine", sikf)
  monkeypatch.setitem(F._MAPS, "plain", dataclasses.replace(sikf, exp_form=None))
  return "mine", "plain"


def test_the_facts_follow_the_map_not_the_name(custom_kernels):
  mine, plain = (F.get_kernel(n) for n in custom_kernels)
  assert mine.scaled_keys and mine.stabilised
  assert not plain.scaled_keys and not plain.stabilised
  assert F.get_kernel("prf").scaled_keys and not F.get_kernel("prf").stabilised


def _layer_output(kernel, x, mask, calls):
  cfg = AttentionConfig(
      num_heads=H,
      head_dim=D // H,
      embed_dim=D,
      kernel=KernelSpec(kernel),
      max_length=64,
      causal=True,
      chunk_size=8,
  )
  attn = Attention(cfg, dtype=jnp.float64)
  # The same random params for every kernel: shapes from an abstract init, values by NumPy.
  leaves, tree = jax.tree.flatten(jax.eval_shape(attn.init, jax.random.key(0), x)["params"])
  rng = np.random.default_rng(0)
  params = jax.tree.unflatten(
      tree, [jnp.asarray(0.3 * rng.standard_normal(a.shape)) for a in leaves]
  )
  calls.clear()
  # Compiled (the op's spy runs once, while tracing), not op by op.
  return np.asarray(jax.jit(lambda p: attn.apply({"params": p}, x, mask=mask))(params))


def test_a_custom_exponential_kernel_gets_scaled_keys(custom_kernels, monkeypatch):
  calls = []
  real = attn_ops.linear_attention

  def spy(*args, **kw):
    calls.append(kw.get("key_log_scale") is not None)
    return real(*args, **kw)

  monkeypatch.setattr(model_attention.attn_ops, "linear_attention", spy)
  x = jax.random.normal(jax.random.key(1), (B, N, D), jnp.float64)
  mask = jnp.ones((B, N), bool).at[1, :3].set(False)
  want = _layer_output("sikf", x, mask, calls)
  assert calls == [True]
  mine = _layer_output("mine", x, mask, calls)
  assert calls == [True]
  np.testing.assert_array_equal(mine, want)  # the same path, bit for bit
  plain = _layer_output("plain", x, mask, calls)
  assert calls == [False]  # no exp_form: the plain causal path (equal up to rounding)
  m = np.asarray(mask)
  assert np.max(np.abs(plain - want)[m]) / np.max(np.abs(want)[m]) < 1e-9


# Slow; the default run keeps decoding equal to the full forward (tests/models/test_decoding.py)
# and a custom kernel (test_a_custom_exponential_kernel_gets_scaled_keys).
@pytest.mark.slow
def test_a_custom_stabilised_kernel_decodes_exactly(custom_kernels):
  k = jax.random.normal(jax.random.key(3), (B, 5, H, D // H), jnp.float64)
  e, s, eps_add = dec_ops.key_parts("mine", k)
  np.testing.assert_allclose(e * np.exp(s)[..., None], np.exp(np.asarray(k)), rtol=1e-14)
  assert eps_add == 0.0 and np.all(np.max(e, axis=-1) == 1.0)
  # Without the fact the keys are not split, so a step could not share the first key's c.
  e, s, _ = dec_ops.key_parts("plain", k)
  assert not np.any(s) and np.allclose(e, F.feature_map("sikf", k))
  err, shift = test_decoding.decode_errors("mine", "none", {})
  assert err < test_decoding.TOL and shift < test_decoding.TOL, (err, shift)
