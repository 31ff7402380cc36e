"""Transformer-XL relative logits: left-shift fast path vs dense gather reference."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.ops import transformer_xl as txl
from tests.helpers import rel_err

SHAPES = [(1, 0), (1, 3), (5, 0), (7, 4), (16, 16), (33, 10)]  # (L, M)

# Jitted once per shape: op-by-op dispatch compiles every primitive and is several times slower.
_fast = jax.jit(txl.relative_logits)
_reference = jax.jit(txl.relative_logits_reference)
_shift = jax.jit(txl.rel_shift)
_shift_two_sided = jax.jit(functools.partial(txl.rel_shift, two_sided=True))
_fast_two_sided = jax.jit(functools.partial(txl.relative_logits, two_sided=True))
_reference_two_sided = jax.jit(functools.partial(txl.relative_logits_reference, two_sided=True))


def _sampled(cases, default):
  """``cases`` as parameters; those not in ``default`` run with ``-m slow`` only."""
  name = lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x)
  return [
      pytest.param(*c, id="-".join(map(name, c)), marks=() if c in default else pytest.mark.slow)
      for c in cases
  ]


F64, F32 = ("float64", 1e-12), ("float32", 1e-5)  # (dtype, tolerance)


def _inputs(seed, batch, length, memory, heads, dim, dtype):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, length, heads, dim)).astype(dtype)
  rel_k = rng.standard_normal((memory + length, heads, dim)).astype(dtype)
  pos_bias = rng.standard_normal((heads, dim)).astype(dtype)
  return q, rel_k, pos_bias


def _rel_shift_loop(x, two_sided=False):
  """The definition of rel_shift, one entry at a time."""
  length, cols = x.shape[-2:]
  memory = cols - length - (length - 1 if two_sided else 0)
  keys = memory + length
  out = np.zeros(x.shape[:-1] + (keys,), x.dtype)
  for i in range(length):
    for j in range(keys):
      if two_sided or j <= memory + i:
        out[..., i, j] = x[..., i, j + length - 1 - i]
  return out


def _relative_logits_loop(q, rel_k, pos_bias, two_sided=False):
  """Term (b) + (d) straight from the paper, in numpy float64: W R_d = rel_k[M+L-1-d] for the
  distance d = M+i-j (d < 0 only two-sided, in rows M+L..M+2L-2)."""
  batch, length, heads, _ = q.shape
  memory = rel_k.shape[0] - length - (length - 1 if two_sided else 0)
  keys = memory + length
  v = np.zeros(q.shape[2:]) if pos_bias is None else pos_bias
  out = np.zeros((batch, heads, length, keys))
  for i in range(length):
    for j in range(keys if two_sided else memory + i + 1):
      w_r = rel_k[keys - 1 - (memory + i - j)]  # [heads, dim]
      out[:, :, i, j] = np.einsum("bhd,hd->bh", q[:, i] + v[None], w_r)
  return out


# ---------------------------------------------------------------------------------------------
# rel_shift
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lead", [(), (2, 1, 3)])
@pytest.mark.parametrize("length, memory", SHAPES)
def test_rel_shift_matches_definition(lead, length, memory):
  # Distinct, non-zero entries so any misplaced entry and any non-zero future entry shows.
  x = np.arange(1, np.prod(lead + (length, memory + length)) + 1, dtype=np.float64)
  x = x.reshape(lead + (length, memory + length))
  got = np.asarray(_shift(x))
  want = _rel_shift_loop(x)
  np.testing.assert_array_equal(got, want)
  future = np.arange(memory + length)[None, :] > memory + np.arange(length)[:, None]
  assert np.all(got[..., future] == 0.0)
  assert np.all(got[..., ~future] != 0.0)


@pytest.mark.parametrize("lead", [(), (2, 1, 3)])
@pytest.mark.parametrize("length, memory", SHAPES)
def test_rel_shift_two_sided_matches_definition(lead, length, memory):
  cols = memory + 2 * length - 1
  x = np.arange(1, np.prod(lead + (length, cols)) + 1, dtype=np.float64)
  x = x.reshape(lead + (length, cols))
  got = np.asarray(_shift_two_sided(x))
  assert got.shape == lead + (length, memory + length)
  np.testing.assert_array_equal(got, _rel_shift_loop(x, two_sided=True))
  assert np.all(got != 0.0)  # every key is visible: nothing read from the zero column


def test_rel_shift_under_jit_and_integer_dtype():
  x = np.arange(4 * 9, dtype=np.int32).reshape(4, 9) + 1
  got = _shift(x)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), _rel_shift_loop(x))


@pytest.mark.parametrize("shape", [(5,), (4, 3), (2, 7, 6)])
def test_rel_shift_rejects_bad_shapes(shape):
  with pytest.raises(ValueError, match=re.escape(str(shape))):
    txl.rel_shift(np.zeros(shape))


# ---------------------------------------------------------------------------------------------
# relative_logits vs the dense reference
# ---------------------------------------------------------------------------------------------
# ((L, M), heads, use_bias, (dtype, tol)): the full product runs with -m slow. By default each
# shape once, with every pair of heads, bias and dtype values present (a covering set).
LOGITS_CASES = list(itertools.product(SHAPES, (1, 3), (False, True), (F64, F32)))
LOGITS_DEFAULT = {
    ((1, 0), 1, False, F64),
    ((1, 3), 3, True, F64),
    ((5, 0), 3, False, F32),
    ((7, 4), 1, True, F32),
    ((16, 16), 3, True, F64),
    ((33, 10), 1, False, F64),
}


@pytest.mark.parametrize(
    "shape, heads, use_bias, dtype_tol", _sampled(LOGITS_CASES, LOGITS_DEFAULT)
)
def test_relative_logits_matches_reference(shape, heads, use_bias, dtype_tol):
  (length, memory), (dtype, tol) = shape, dtype_tol
  dtype = np.dtype(dtype)
  q, rel_k, pos_bias = _inputs(0, 2, length, memory, heads, 8, dtype)
  pos_bias = pos_bias if use_bias else None
  got = _fast(q, rel_k, pos_bias=pos_bias)
  assert got.shape == (2, heads, length, memory + length)
  assert got.dtype == dtype
  # The float64 reference on the same (float32-representable) inputs is the exact answer, so
  # in float32 this bounds the rounding of the fast path.
  wide = lambda a: None if a is None else a.astype(np.float64)
  want = _reference(wide(q), wide(rel_k), pos_bias=wide(pos_bias))
  assert rel_err(got, want) < tol
  if dtype == np.float64:
    # The reference itself against the paper's formula, one pair at a time.
    assert rel_err(want, _relative_logits_loop(q, rel_k, pos_bias)) < 1e-12
    future = np.arange(memory + length)[None, :] > memory + np.arange(length)[:, None]
    assert np.all(np.asarray(got)[..., future] == 0.0)


# ((L, M), use_bias, (dtype, tol)): by default each shape once, with every bias x dtype pair.
TWO_SIDED_CASES = list(itertools.product(SHAPES, (False, True), (F64, F32)))
TWO_SIDED_DEFAULT = {
    ((1, 0), False, F64),
    ((1, 3), True, F32),
    ((5, 0), True, F64),
    ((7, 4), False, F32),
    ((16, 16), False, F64),
    ((33, 10), True, F64),
}


@pytest.mark.parametrize("shape, use_bias, dtype_tol", _sampled(TWO_SIDED_CASES, TWO_SIDED_DEFAULT))
def test_two_sided_relative_logits_matches_reference(shape, use_bias, dtype_tol):
  (length, memory), (dtype, tol) = shape, dtype_tol
  dtype = np.dtype(dtype)
  rng = np.random.default_rng(8)
  heads, dim = 3, 8
  q = rng.standard_normal((2, length, heads, dim)).astype(dtype)
  rel_k = rng.standard_normal((memory + 2 * length - 1, heads, dim)).astype(dtype)
  pos_bias = rng.standard_normal((heads, dim)).astype(dtype) if use_bias else None
  got = _fast_two_sided(q, rel_k, pos_bias=pos_bias)
  assert got.shape == (2, heads, length, memory + length)
  assert got.dtype == dtype
  wide = lambda a: None if a is None else a.astype(np.float64)
  want = _reference_two_sided(wide(q), wide(rel_k), pos_bias=wide(pos_bias))
  assert rel_err(got, want) < tol
  if dtype == np.float64:
    assert rel_err(want, _relative_logits_loop(q, rel_k, pos_bias, two_sided=True)) < 1e-12


def test_two_sided_agrees_with_one_sided_on_past_keys():
  # The first M+L rows of a two-sided table are the one-sided table: past keys match exactly,
  # and the future keys (zero one-sided) use the negative distances.
  rng = np.random.default_rng(9)
  length, memory, heads, dim = 6, 3, 2, 4
  q = rng.standard_normal((1, length, heads, dim))
  rel_k = rng.standard_normal((memory + 2 * length - 1, heads, dim))
  pos_bias = rng.standard_normal((heads, dim))
  two = np.asarray(_fast_two_sided(q, rel_k, pos_bias=pos_bias))
  one = np.asarray(_fast(q, rel_k[: memory + length], pos_bias=pos_bias))
  past = np.arange(memory + length)[None, :] <= memory + np.arange(length)[:, None]
  np.testing.assert_array_equal(two[..., past], one[..., past])
  assert np.all(one[..., ~past] == 0.0) and np.all(two[..., ~past] != 0.0)
  # Distance -1 (key j = M+i+1) reads row M+L of the table.
  for i in range(length - 1):
    want = np.einsum("hd,hd->h", q[0, i] + pos_bias, rel_k[memory + length])
    np.testing.assert_allclose(two[0, :, i, memory + i + 1], want, rtol=1e-13)


def test_pos_bias_is_term_d():
  # Term (d) alone: q = 0 leaves v . W R_{i-j}, which depends on the distance only.
  _, rel_k, pos_bias = _inputs(2, 1, 6, 3, 2, 4, np.float64)
  q = np.zeros((1, 6, 2, 4))
  got = np.asarray(_fast(q, rel_k, pos_bias=pos_bias))
  d_tilde = np.einsum("thd,hd->ht", rel_k, pos_bias)  # the paper's d-tilde
  for i in range(6):
    for j in range(3 + i + 1):
      np.testing.assert_allclose(got[0, :, i, j], d_tilde[:, j + 6 - 1 - i], rtol=1e-13)
  assert not np.allclose(got, _fast(q, rel_k))  # the bias is actually used


@pytest.mark.parametrize("length, memory", [(7, 4), (16, 16)])
def test_output_depends_only_on_distance(length, memory):
  rng = np.random.default_rng(3)
  heads, dim = 3, 5
  q_row = rng.standard_normal((1, 1, heads, dim))
  q = np.tile(q_row, (2, length, 1, 1))  # constant over i
  rel_k = rng.standard_normal((memory + length, heads, dim))
  out = np.asarray(_fast(q, rel_k, pos_bias=rng.standard_normal((heads, dim))))
  # (i, j) and (i+1, j+1) are at the same distance M + i - j.
  np.testing.assert_allclose(out[..., 1:, 1:], out[..., :-1, :-1], rtol=1e-13, atol=1e-13)
  # And every distance is really there: distance d sits at (L-1, M+L-1-d), all different.
  last_row = out[0, :, length - 1, :]
  assert len(np.unique(np.round(last_row[0], 10))) == memory + length


def test_relative_logits_has_no_gather():
  q, rel_k, pos_bias = _inputs(4, 2, 9, 5, 3, 4, np.float64)
  jaxpr = str(
      jax.make_jaxpr(lambda a, b, c: txl.relative_logits(a, b, pos_bias=c))(q, rel_k, pos_bias)
  )
  assert "gather" not in jaxpr
  assert "gather" in str(jax.make_jaxpr(lambda a, b: txl.relative_logits_reference(a, b))(q, rel_k))


def test_two_sided_has_no_gather():
  q, rel_k, pos_bias = _inputs(4, 2, 9, 5 + 8, 3, 4, np.float64)  # M = 5: 5 + 2*9 - 1 rows
  jaxpr = str(
      jax.make_jaxpr(lambda a, b, c: txl.relative_logits(a, b, pos_bias=c, two_sided=True))(
          q, rel_k, pos_bias
      )
  )
  assert "gather" not in jaxpr


def test_dtype_promotion():
  q, rel_k, pos_bias = _inputs(5, 1, 4, 2, 2, 3, np.float32)
  shape = jax.eval_shape  # dtype promotion is decided at trace time; nothing to compile
  f = txl.relative_logits
  assert shape(f, q, rel_k.astype(np.float64)).dtype == jnp.float64
  assert (
      shape(lambda a, b, c: f(a, b, pos_bias=c), q, rel_k, pos_bias.astype(np.float64)).dtype
      == jnp.float64
  )
  assert shape(f, q.astype(jnp.bfloat16), rel_k.astype(jnp.bfloat16)).dtype == jnp.bfloat16
  assert shape(f, q.astype(jnp.bfloat16), rel_k).dtype == jnp.float32


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length, memory", [(1, 3), (7, 4), (16, 16)])
def test_gradients_match_reference(length, memory):
  q, rel_k, pos_bias = _inputs(6, 2, length, memory, 3, 4, np.float64)
  weights = np.random.default_rng(7).standard_normal((2, 3, length, memory + length))

  def loss(fn):
    return lambda a, b, c: jnp.sum(weights * fn(a, b, pos_bias=c))

  grads = jax.jit(jax.grad(loss(txl.relative_logits), argnums=(0, 1, 2)))(q, rel_k, pos_bias)
  want = jax.jit(jax.grad(loss(txl.relative_logits_reference), argnums=(0, 1, 2)))(
      q, rel_k, pos_bias
  )
  for name, g, w in zip(("q", "rel_k", "pos_bias"), grads, want):
    assert np.max(np.abs(np.asarray(w))) > 0, name
    assert rel_err(g, w) < 1e-10, name


@pytest.mark.parametrize("length, memory", [(1, 3), (7, 4), (16, 0)])
def test_two_sided_gradients_match_reference(length, memory):
  q, rel_k, pos_bias = _inputs(10, 2, length, memory + length - 1, 3, 4, np.float64)
  weights = np.random.default_rng(11).standard_normal((2, 3, length, memory + length))

  def loss(fn):
    return lambda a, b, c: jnp.sum(weights * fn(a, b, pos_bias=c, two_sided=True))

  grads = jax.jit(jax.grad(loss(txl.relative_logits), argnums=(0, 1, 2)))(q, rel_k, pos_bias)
  want = jax.jit(jax.grad(loss(txl.relative_logits_reference), argnums=(0, 1, 2)))(
      q, rel_k, pos_bias
  )
  for name, g, w in zip(("q", "rel_k", "pos_bias"), grads, want):
    assert np.max(np.abs(np.asarray(w))) > 0, name
    assert rel_err(g, w) < 1e-10, name


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [txl.relative_logits, txl.relative_logits_reference])
@pytest.mark.parametrize("two_sided", [False, True])
def test_two_sided_needs_m_plus_2l_minus_1_rows(fn, two_sided):
  # 5 rows serve L = 4 one-sided (M = 1) but not two-sided (needs >= 2L - 1 = 7).
  q, rel_k = np.zeros((1, 4, 2, 3)), np.zeros((5, 2, 3))
  call = lambda a, b: fn(a, b, two_sided=two_sided)
  if two_sided:
    with pytest.raises(ValueError, match=re.escape("(5, 2, 3)")):
      jax.eval_shape(call, q, rel_k)
    with pytest.raises(ValueError, match=re.escape("(4, 5)")):
      txl.rel_shift(np.zeros((4, 5)), two_sided=True)
  else:
    assert jax.eval_shape(call, q, rel_k).shape == (1, 2, 4, 5)


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, bad",
    [
        ((4, 2, 3), (5, 2, 3), None, (4, 2, 3)),  # q rank 3
        ((1, 4, 2, 3), (6, 6), None, (6, 6)),  # rel_k rank 2
        ((1, 4, 2, 3), (6, 2, 3), (2, 3, 1), (2, 3, 1)),  # pos_bias rank 3
        ((1, 4, 2, 3), (3, 2, 3), None, (3, 2, 3)),  # rel_k shorter than L
        ((1, 4, 2, 3), (6, 5, 3), None, (6, 5, 3)),  # heads mismatch
        ((1, 4, 2, 3), (6, 2, 7), None, (6, 2, 7)),  # dim mismatch
        ((1, 4, 2, 3), (6, 2, 3), (5, 3), (5, 3)),  # pos_bias heads
        ((1, 4, 2, 3), (6, 2, 3), (2, 4), (2, 4)),  # pos_bias dim
    ],
)
@pytest.mark.parametrize("fn", [txl.relative_logits, txl.relative_logits_reference])
def test_bad_shapes_raise(fn, q_shape, k_shape, v_shape, bad):
  pos_bias = None if v_shape is None else np.zeros(v_shape)
  with pytest.raises(ValueError, match=re.escape(str(bad))):
    jax.eval_shape(
        lambda a, b, c: fn(a, b, pos_bias=c), np.zeros(q_shape), np.zeros(k_shape), pos_bias
    )
