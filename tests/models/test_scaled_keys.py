"""Causal layers with stabilised random-feature kernels run the op with ``key_log_scale``.

The layer splits the keys (``features.causal_key_parts``) so the causal scan keeps a running
maximum of their scale: it equals the dense reference, never looks ahead, and a late key far
above the first one (which overflowed the first-key stabiliser) stays finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.models import attention as model_attention
from fastpos.models.attention import Attention, AttentionConfig, KernelSpec, PositionalSpec
from fastpos.ops import attention as attn_ops
from fastpos.ops import features as feature_ops
from tests.helpers import rel_err

B, N, D, H = 2, 24, 16, 2


def _cfg(kernel, schemes=(), causal=True):
  return AttentionConfig(
      num_heads=H,
      head_dim=D // H,
      embed_dim=D,
      kernel=KernelSpec(kernel, num_features=16),
      positional=tuple(PositionalSpec.make(s) for s in schemes),
      max_length=64,
      causal=causal,
      chunk_size=8,
  )


@pytest.fixture
def op_calls(monkeypatch):
  """Records the keyword arguments of every call of the op from the layer."""
  calls = []
  real = attn_ops.linear_attention

  def spy(*args, **kw):
    calls.append(kw)
    return real(*args, **kw)

  monkeypatch.setattr(model_attention.attn_ops, "linear_attention", spy)
  return calls


@pytest.mark.parametrize(
    "kernel,schemes,wired",
    [
        ("sikf", (), True),
        ("favor", (), True),
        ("orf", (), True),
        ("prf", (), True),
        ("sikf", ("permuteformer",), True),
        ("favor", ("permuteformer",), True),
        ("favor", ("spe",), True),
        ("sikf", ("rope",), False),
        ("favor", ("rope",), False),  # den_features: old path
        ("sikf", ("kernelized_rpe",), False),  # rpe: old path
        ("elu1", (), False),
    ],
)
def test_layer_equals_dense_float64(kernel, schemes, wired, op_calls):
  cfg = _cfg(kernel, schemes)
  attn = Attention(cfg, dtype=jnp.float64)
  x = jax.random.normal(jax.random.key(1), (B, N, D), jnp.float64)
  mask = jnp.ones((B, N), bool).at[1, :3].set(False).at[1, N - 2 :].set(False)
  # Shapes only (every value is redrawn, by NumPy: no program per leaf shape).
  params = jax.eval_shape(attn.init, jax.random.key(0), x)["params"]
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.default_rng(2)
  params = jax.tree.unflatten(
      tree, [jnp.asarray(0.3 * rng.standard_normal(a.shape)) for a in leaves]
  )
  op_calls.clear()  # init traced the layer once

  fast_calls = []

  @jax.jit  # one compiled program for both paths (op by op is slower)
  def fast_and_dense(params):
    fast = attn.apply({"params": params}, x, mask=mask)
    fast_calls.append(len(op_calls))  # while tracing: the fast path's calls of the op
    return fast, attn.apply({"params": params}, x, mask=mask, reference=True)

  fast, dense = fast_and_dense(params)
  assert fast_calls == [1]
  assert (op_calls[0].get("key_log_scale") is not None) == wired
  m = np.asarray(mask)
  assert rel_err(np.asarray(fast)[m], np.asarray(dense)[m]) < 1e-9


@pytest.mark.parametrize("kernel", ("sikf", "favor"))
def test_bidirectional_layer_keeps_the_old_path(kernel, op_calls):
  cfg = _cfg(kernel, causal=False)
  attn = Attention(cfg, dtype=jnp.float64)
  x = jnp.ones((1, 8, D), jnp.float64)
  attn.init_with_output(jax.random.key(0), x)
  assert op_calls and all(c.get("key_log_scale") is None for c in op_calls)


LATE = 50


@pytest.fixture(scope="module")
def huge_key_layer():
  """A causal SIKF layer, float32 and float64, and an input whose token LATE has a key whose
  exponent exceeds the first key's max by about 125 (exp overflows float32 past ~88). The
  query projection ignores input channel 0, which carries the push, so only the key is huge
  (a huge query too would make that token's own row a ratio of terms below float32's range)."""
  cfg = AttentionConfig(
      num_heads=H,
      head_dim=D // H,
      embed_dim=D,
      kernel=KernelSpec("sikf"),
      max_length=64,
      causal=True,
      chunk_size=16,
  )
  n = 64
  attn32, attn64 = Attention(cfg), Attention(cfg, dtype=jnp.float64)
  x = np.asarray(jax.random.normal(jax.random.key(3), (1, n, D), jnp.float64)) * 0.5
  params = jax.jit(attn64.init)(jax.random.key(4), jnp.asarray(x))["params"]
  params["query"]["kernel"] = params["query"]["kernel"].at[0].set(0.0)
  w = np.asarray(params["key"]["kernel"])[0]  # [h, d]: what channel 0 adds to the keys
  top = np.max(np.einsum("d,dhe->he", x[0, LATE], np.asarray(params["key"]["kernel"])))
  # Largest exponent z = k / d^(1/4) of token LATE about 125 (the first key's is about 1).
  x[0, LATE, 0] += (125.0 * (D // H) ** 0.25 - top) / np.max(w)
  params32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  return attn32, attn64, params32, params, x


def test_late_huge_key_is_finite_and_matches_float64(huge_key_layer, monkeypatch):
  attn32, attn64, params32, params64, x = huge_key_layer
  calls = []
  real = attn_ops.linear_attention

  def spy(*args, **kw):
    calls.append((args, kw))
    return real(*args, **kw)

  monkeypatch.setattr(model_attention.attn_ops, "linear_attention", spy)
  x32 = jnp.asarray(x, jnp.float32)

  @jax.jit  # compiled, not op by op: the layer, and the op on the features it formed before
  def layer_and_old_op(x32):
    out32 = attn32.apply({"params": params32}, x32)
    (fq, e, v), kw = calls[-1]
    s = kw["key_log_scale"]
    old = real(fq, e * jnp.exp(s)[..., None] + kw["key_eps"], v, causal=True, chunk_size=16)
    return out32, s, old

  out32, s, old = layer_and_old_op(x32)
  assert float(jnp.max(s)) > 110.0  # the late key's scale is far above the first key's
  # The op without the running maximum (the features the layer formed before) overflows.
  assert not np.all(np.isfinite(np.asarray(old)))
  # A kernel that declared no scaled keys: the plan then runs the layer without them.
  monkeypatch.setattr(feature_ops.Kernel, "scaled_keys", property(lambda self: False))
  old_layer = jax.jit(lambda x32: attn32.apply({"params": params32}, x32))(x32)
  assert not np.all(np.isfinite(np.asarray(old_layer)))
  monkeypatch.undo()
  ref = jax.jit(lambda x: attn64.apply({"params": params64}, x, reference=True))(jnp.asarray(x))
  assert np.all(np.isfinite(np.asarray(out32)))
  assert rel_err(out32, ref) < 1e-4


def test_late_huge_key_never_reaches_earlier_outputs(huge_key_layer):
  """Causality by gradient: outputs before LATE have exactly zero gradient w.r.t. tokens from
  LATE on (float32, the huge key included)."""
  attn32, _, params32, _, x = huge_key_layer

  def early(x1):
    return jnp.sum(attn32.apply({"params": params32}, x1)[:, :LATE] ** 2)

  grad = np.asarray(jax.jit(jax.grad(early))(jnp.asarray(x, jnp.float32)))  # one program
  assert np.all(np.isfinite(grad))
  assert np.all(grad[:, LATE:] == 0.0)
  assert np.any(grad[:, :LATE] != 0.0)


def test_causal_key_parts_match_the_layer_features():
  """The split the layer uses rebuilds the causal features it used before (float64)."""
  x = jax.random.normal(jax.random.key(5), (2, 9, 2, 4), jnp.float64)
  mask = jnp.ones((2, 9), bool).at[0, :2].set(False)
  e, s, eps = feature_ops.causal_key_parts("sikf", x, mask=mask)
  want = feature_ops.feature_map("sikf", x, mask=mask, causal=True)
  m = np.asarray(mask)
  assert rel_err(np.asarray(e * jnp.exp(s)[..., None] + eps)[m], np.asarray(want)[m]) < 1e-12
