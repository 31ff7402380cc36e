"""softmax_attention's implementations ("einsum", "jax", "auto") against the dense reference
(values and gradients, with a bias, padding masks, causal, memory keys) and against each other,
and the choice "auto" makes per backend."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.ops import attention
from tests.helpers import rel_err

H, D = 3, 8


def _case(n, nk, seed):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(2, n, H, D))
  k, v = rng.normal(size=(2, nk, H, D)), rng.normal(size=(2, nk, H, D))
  bias = 0.5 * rng.normal(size=(H, n, nk))
  mask = np.ones((2, nk), bool)
  mask[-1, nk - nk // 3 :] = False  # the last example is right-padded
  return (q, k, v, bias), mask, rng.normal(size=q.shape)


def _value_and_grads(fn, args, probe, **kw):
  loss = lambda q, k, v, b: jnp.sum(fn(q, k, v, bias=b, **kw) * probe)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*args)


def _assert_close(got, want, tol):
  assert rel_err(got[0], want[0]) < tol
  for a, b in zip(got[1], want[1]):
    assert rel_err(a, b) < tol


CASES = [(13, 13, False, True), (13, 13, True, True), (9, 14, True, True), (16, 16, True, False)]


# The default run: each implementation on the causal, masked case with more keys than queries,
# and jax.nn.dot_product_attention bidirectional too; the other pairs with `-m slow`.
DEFAULT_CASES = {CASES[2]: ("einsum", "jax", "auto"), CASES[0]: ("jax",)}


@pytest.mark.parametrize(
    "n, nk, causal, masked, implementation",
    [
        pytest.param(
            *case,
            impl,
            marks=() if impl in DEFAULT_CASES.get(case, ()) else pytest.mark.slow,
            id=f"{impl}-" + "-".join(map(str, case)),
        )
        for impl in ("einsum", "jax", "auto")
        for case in CASES
    ],
)
def test_matches_reference(n, nk, causal, masked, implementation):
  """float64 < 1e-9 (float64 runs "einsum" whatever is asked) and float32 < 1e-4 against the
  float64 reference (where "jax" runs ``jax.nn.dot_product_attention``), values and the
  gradients of q, k, v and the bias."""
  args, mask, probe = _case(n, nk, seed=n + nk + causal)
  kw = {"mask": mask if masked else None, "causal": causal}
  ref = _value_and_grads(attention.softmax_attention_reference, args, probe, **kw)
  fast = functools.partial(attention.softmax_attention, implementation=implementation)
  _assert_close(_value_and_grads(fast, args, probe, **kw), ref, 1e-9)
  f32 = tuple(a.astype(np.float32) for a in args)
  _assert_close(_value_and_grads(fast, f32, probe.astype(np.float32), **kw), ref, 1e-4)


def test_einsum_and_jax_agree_in_float32_on_rows_without_keys():
  """Causal with left padding: the first query of the padded example sees no key. Both
  implementations return the same (finite) rows, the reference's masked rows aside."""
  args, _, probe = _case(10, 10, seed=4)
  mask = np.ones((2, 10), bool)
  mask[-1, :3] = False  # left padding: queries 0-2 of the last example see nothing
  f32 = tuple(a.astype(np.float32) for a in args)
  got = {
      impl: _value_and_grads(
          functools.partial(attention.softmax_attention, implementation=impl),
          f32,
          probe.astype(np.float32),
          mask=mask,
          causal=True,
      )
      for impl in ("einsum", "jax")
  }
  assert all(np.all(np.isfinite(g[0])) for g in got.values())
  _assert_close(got["einsum"], got["jax"], 1e-5)


def test_auto_picks_by_backend():
  pick = attention._softmax_implementation
  assert pick("auto", jnp.float32, "cpu") == "einsum"
  assert pick("auto", jnp.float32, "gpu") == "jax"
  assert pick("auto", jnp.bfloat16, "tpu") == "jax"
  assert pick("jax", jnp.float32, "cpu") == "jax"
  assert pick("jax", jnp.float64, "cpu") == "einsum"  # the softmax must not drop to float32
  assert pick("cudnn", jnp.bfloat16, "gpu") == "cudnn"


def test_auto_runs_the_picked_implementation(monkeypatch):
  calls = []
  real = attention._softmax_einsum
  monkeypatch.setattr(attention, "_softmax_einsum", lambda *a: calls.append("einsum") or real(*a))
  x = jnp.ones((1, 4, 2, 8), jnp.float32)
  attention.softmax_attention(x, x, x, implementation="jax")
  assert calls == []
  attention.softmax_attention(x, x, x)
  assert calls == (["einsum"] if jax.default_backend() == "cpu" else [])


@pytest.mark.parametrize(
    "implementation, backend, pattern",
    [
        ("flash", "cpu", r"one of \('auto', 'einsum', 'jax', 'cudnn'\); got 'flash'"),
        ("cudnn", "cpu", r"implementation='cudnn' needs a GPU; JAX runs on 'cpu'"),
    ],
)
def test_bad_implementation_is_refused(implementation, backend, pattern):
  with pytest.raises(ValueError, match=pattern):
    attention._softmax_implementation(implementation, jnp.float32, backend)
  if backend == jax.default_backend():
    x = jnp.ones((1, 4, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=pattern):
      attention.softmax_attention(x, x, x, implementation=implementation)
