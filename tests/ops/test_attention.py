"""Softmax and kernelized attention against their dense references."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.ops import attention, features
from tests.helpers import assert_causal_jacobian, rel_err

LENGTHS = (1, 2, 7, 64, 257, 1000)
FFT_ROUNDOFF = 1e-13  # rpe paths go through the FFT (see tests.helpers)

# One compiled function per (static options, shape), shared by all tests.
linear_fast = jax.jit(attention.linear_attention, static_argnames=("causal", "grid", "chunk_size"))
linear_dense = jax.jit(attention.linear_attention_reference, static_argnames=("causal", "grid"))
softmax_fast = jax.jit(attention.softmax_attention, static_argnames=("causal",))
softmax_dense = jax.jit(attention.softmax_attention_reference, static_argnames=("causal",))


def _sampled(cases, default):
  """``cases`` as parameters; those not in ``default`` run with ``-m slow`` only."""
  return [
      pytest.param(*c, id="-".join(map(str, c)), marks=() if c in default else pytest.mark.slow)
      for c in cases
  ]


def _features(rng, shape):
  """Positive features of moderate spread (what a positive feature map produces)."""
  return np.exp(0.5 * rng.normal(size=shape))


def _mask(b, n, n_real):
  m = np.ones((b, n), bool)
  m[-1, n_real:] = False  # the last example is padded
  return m


def _inputs(n, heads, *, m=5, d=4, seed=0):
  rng = np.random.default_rng(seed + n * 7 + heads)
  return (
      _features(rng, (2, n, heads, m)),
      _features(rng, (2, n, heads, m)),
      rng.normal(size=(2, n, heads, d)),
      rng,
  )


# ---------------------------------------------------------------------------------------------
# Linear attention
# ---------------------------------------------------------------------------------------------
# (n, heads, causal, masked): the full product runs with -m slow. By default each length once,
# with every heads x causal and causal x masked pair present (a covering set, not the product).
DENSE_CASES = list(itertools.product(LENGTHS, (1, 3), (False, True), (False, True)))
DENSE_DEFAULT = {
    (1, 1, False, False),
    (2, 3, True, True),
    (7, 3, False, True),
    (64, 1, True, False),
    (257, 3, True, True),
    (1000, 1, False, True),
}


@pytest.mark.parametrize("n, heads, causal, masked", _sampled(DENSE_CASES, DENSE_DEFAULT))
def test_linear_attention_matches_dense_float64(n, heads, causal, masked):
  pq, pk, v, _ = _inputs(n, heads)
  mask = _mask(2, n, max(1, n // 2)) if masked else None
  out = linear_fast(pq, pk, v, mask=mask, causal=causal, chunk_size=16)
  assert out.shape == v.shape
  assert rel_err(out, linear_dense(pq, pk, v, mask=mask, causal=causal)) < 1e-9


# The same covering set as DENSE_DEFAULT, with heads flipped (the other half of each length).
RPE_DEFAULT = {(n, 4 - h, c, m) for n, h, c, m in DENSE_DEFAULT}


@pytest.mark.parametrize("n, heads, causal, masked", _sampled(DENSE_CASES, RPE_DEFAULT))
def test_linear_attention_rpe_matches_dense_float64(n, heads, causal, masked):
  pq, pk, v, rng = _inputs(n, heads, seed=1)
  rpe = np.exp(rng.normal(size=(heads, 2 * n - 1)))
  mask = _mask(2, n, max(1, n // 3)) if masked else None
  out = linear_fast(pq, pk, v, mask=mask, causal=causal, rpe=rpe)
  assert rel_err(out, linear_dense(pq, pk, v, mask=mask, causal=causal, rpe=rpe)) < 1e-9


# (grid, heads, causal): by default each grid once, with every heads x causal pair.
GRID_CASES = list(itertools.product(((1, 1), (4, 4), (3, 5), (12, 10)), (1, 3), (False, True)))
GRID_DEFAULT = {((1, 1), 1, True), ((4, 4), 3, False), ((3, 5), 3, True), ((12, 10), 1, False)}


@pytest.mark.parametrize("grid, heads, causal", _sampled(GRID_CASES, GRID_DEFAULT))
def test_linear_attention_rpe_2d_matches_dense_float64(grid, heads, causal):
  n = grid[0] * grid[1]
  pq, pk, v, rng = _inputs(n, heads, seed=2)
  rpe = np.exp(rng.normal(size=(heads, 2 * grid[0] - 1, 2 * grid[1] - 1)))
  mask = _mask(2, n, max(1, n - 3))
  out = linear_fast(pq, pk, v, mask=mask, causal=causal, rpe=rpe, grid=grid)
  ref = linear_dense(pq, pk, v, mask=mask, causal=causal, rpe=rpe, grid=grid)
  assert rel_err(out, ref) < 1e-9


# The extremes by default (one token per chunk; one chunk past N); a chunk that does not divide N
# is the dense tests' (16 at N=257). 3 and 64 run with -m slow.
@pytest.mark.parametrize("chunk_size", _sampled([(1,), (3,), (64,), (5000,)], {(1,), (5000,)}))
def test_causal_chunk_size_does_not_change_the_result(chunk_size):
  pq, pk, v, _ = _inputs(257, 2, seed=3)
  out = linear_fast(pq, pk, v, causal=True, chunk_size=chunk_size)
  assert rel_err(out, linear_dense(pq, pk, v, causal=True)) < 1e-12


# Each path once by default, the causal FFT ones (head refinement) included; the rest -m slow.
@pytest.mark.parametrize(
    "causal, rpe_kind",
    _sampled(
        list(itertools.product((False, True), (None, "1d", "2d"))),
        {(True, None), (True, "1d"), (False, "2d")},
    ),
)
def test_linear_attention_float32_n4096(causal, rpe_kind):
  # The causal FFT paths need the head refinement of fastpos.ops.toeplitz for this
  # (without it: 3e-3 at position 0).
  n, heads = 4096, 2
  pq, pk, v, rng = _inputs(n, heads, m=4, d=4, seed=4)
  pq, pk, v = pq[:1], pk[:1], v[:1]
  rpe, grid = None, None
  if rpe_kind == "1d":
    rpe = np.exp(rng.normal(size=(heads, 2 * n - 1)))
  elif rpe_kind == "2d":
    rpe, grid = np.exp(rng.normal(size=(heads, 127, 127))), (64, 64)
  ref = linear_dense(pq, pk, v, causal=causal, rpe=rpe, grid=grid)  # float64
  f32 = lambda a: None if a is None else a.astype(np.float32)
  out = linear_fast(f32(pq), f32(pk), f32(v), causal=causal, rpe=f32(rpe), grid=grid)
  assert out.dtype == jnp.float32
  assert rel_err(out, ref) < 1e-4


# Each value of each flag once by default (the written-out bidirectional backward is also held
# against the reference below, where the guard clamps); the other two cells -m slow.
@pytest.mark.parametrize(
    "causal, use_rpe",
    _sampled(list(itertools.product((False, True), (False, True))), {(True, False), (False, True)}),
)
def test_linear_attention_gradients_match_dense(causal, use_rpe):
  n, heads = 23, 2
  pq, pk, v, rng = _inputs(n, heads, seed=5)
  rpe = np.exp(rng.normal(size=(heads, 2 * n - 1))) if use_rpe else None
  mask = _mask(2, n, 15)
  probe = rng.normal(size=v.shape)

  def loss(fn, *args):
    return jnp.sum(fn(*args[:3], mask=mask, causal=causal, rpe=args[3]) * probe)

  args = (pq, pk, v, rpe)
  argnums = (0, 1, 2, 3) if use_rpe else (0, 1, 2)
  fast = jax.jit(
      jax.grad(
          functools.partial(loss, functools.partial(attention.linear_attention, chunk_size=4)),
          argnums=argnums,
      )
  )(*args)
  dense = jax.jit(
      jax.grad(functools.partial(loss, attention.linear_attention_reference), argnums=argnums)
  )(*args)
  for a, b in zip(fast, dense):
    assert rel_err(a, b) < 1e-9


@pytest.fixture
def rpe_fft_path(monkeypatch):
  """Kernelized RPE on its FFT path at any length (it runs densely up to
  ``_RPE_DENSE_UP_TO``), in groups of one feature. Functions traced under it must be jitted
  inside the test (a shared jit would keep the path it was first traced with)."""
  monkeypatch.setattr(attention, "_RPE_DENSE_UP_TO", 0)
  monkeypatch.setattr(attention, "_RPE_GROUP_BYTES", 1)


# By default 1D bidirectional and 2D causal: with the N=4096 float32 test's 1D causal and 2D
# bidirectional cells, every (dimension, direction) of the FFT path stays in the default run.
@pytest.mark.parametrize(
    "causal, grid, masked",
    _sampled(
        [(False, None, True), (True, None, True), (True, (3, 5), True), (False, (3, 5), False)],
        {(False, None, True), (True, (3, 5), True)},
    ),
)
def test_rpe_fft_path_matches_dense(rpe_fft_path, causal, grid, masked):
  """The FFT path (one loop step per head and feature, custom backward): outputs and the
  gradients of every input, the table included, equal the dense reference in float64."""
  n, heads = 15, 2
  pq, pk, v, rng = _inputs(n, heads, seed=9)
  shape = (heads, 2 * n - 1) if grid is None else (heads, 2 * grid[0] - 1, 2 * grid[1] - 1)
  rpe = np.exp(rng.normal(size=shape))
  mask, probe = _mask(2, n, 11) if masked else None, rng.normal(size=v.shape)

  def loss(fn, *args):
    return jnp.sum(fn(*args[:3], mask=mask, causal=causal, rpe=args[3], grid=grid) * probe)

  grads = [
      jax.jit(jax.value_and_grad(functools.partial(loss, fn), argnums=(0, 1, 2, 3)))(pq, pk, v, rpe)
      for fn in (attention.linear_attention, attention.linear_attention_reference)
  ]
  assert rel_err(grads[0][0], grads[1][0]) < 1e-9
  for a, b in zip(grads[0][1], grads[1][1]):
    assert rel_err(a, b) < 1e-9


@pytest.mark.parametrize("causal", _sampled([(False,), (True,)], {(True,)}))  # causal: the harder
def test_rpe_dense_path_float32_n2048(causal):
  """The dense path (lengths up to _RPE_DENSE_UP_TO) in float32 against float64."""
  n, heads = attention._RPE_DENSE_UP_TO, 2
  pq, pk, v, rng = _inputs(n, heads, m=4, d=4, seed=5)
  pq, pk, v = pq[:1], pk[:1], v[:1]
  rpe = np.exp(rng.normal(size=(heads, 2 * n - 1)))
  ref = linear_dense(pq, pk, v, causal=causal, rpe=rpe)
  f32 = lambda a: a.astype(np.float32)
  out = linear_fast(f32(pq), f32(pk), f32(v), causal=causal, rpe=f32(rpe))
  assert rel_err(out, ref) < 1e-4


def test_rpe_fft_path_never_sees_the_future(rpe_fft_path):
  n, heads = 12, 2
  pq, pk, v, rng = _inputs(n, heads, seed=6)
  pq, pk, v = pq[:1], pk[:1], v[:1]
  rpe = np.exp(rng.normal(size=(heads, 2 * n - 1)))
  fn = lambda a, b, c: attention.linear_attention(a, b, c, causal=True, rpe=rpe)[0]
  for jac in jax.jit(jax.jacrev(fn, argnums=(0, 1, 2)))(pq, pk, v):  # one compile
    assert_causal_jacobian(jac, n, in_axis=4, rtol=FFT_ROUNDOFF)


# By default: the chunked path, the 1D table past the toeplitz head refinement, a 2D grid.
@pytest.mark.parametrize(
    "use_rpe, grid, n",
    _sampled(
        [
            (False, None, 12),
            (True, None, 12),
            (True, None, 80),
            (True, (3, 4), 12),
            (True, (9, 9), 81),
        ],
        {(False, None, 12), (True, None, 80), (True, (9, 9), 81)},
    ),
)
def test_causal_linear_attention_never_sees_the_future(use_rpe, grid, n):
  heads = 2
  pq, pk, v, rng = _inputs(n, heads, seed=6)
  pq, pk, v = pq[:1], pk[:1], v[:1]
  rpe = None
  if use_rpe:
    shape = (heads, 2 * n - 1) if grid is None else (heads, 2 * grid[0] - 1, 2 * grid[1] - 1)
    rpe = np.exp(rng.normal(size=shape))
  fn = lambda a, b, c: attention.linear_attention(
      a, b, c, causal=True, rpe=rpe, grid=grid, chunk_size=5
  )[0]
  rtol = FFT_ROUNDOFF if use_rpe else 0.0  # the chunked path is exactly causal
  for jac in jax.jit(jax.jacrev(fn, argnums=(0, 1, 2)))(pq, pk, v):  # [n, h, d, 1, n, h, m] each
    assert_causal_jacobian(jac, n, in_axis=4, rtol=rtol)


# Causal with the table and bidirectional without by default; the other two cells -m slow.
@pytest.mark.parametrize(
    "causal, use_rpe",
    _sampled(list(itertools.product((False, True), (False, True))), {(True, True), (False, False)}),
)
def test_padding_never_changes_real_outputs(causal, use_rpe):
  n, n_real, heads = 20, 13, 2
  pq, pk, v, rng = _inputs(n, heads, seed=7)
  rpe = np.exp(rng.normal(size=(heads, 2 * n - 1))) if use_rpe else None
  mask = _mask(2, n, n_real)
  out = linear_fast(pq, pk, v, mask=mask, causal=causal, rpe=rpe, chunk_size=8)
  pk2, v2 = pk.copy(), v.copy()
  pk2[-1, n_real:] = 1e4 * rng.random(size=pk2[-1, n_real:].shape)
  v2[-1, n_real:] = 1e4 * rng.normal(size=v2[-1, n_real:].shape)
  out2 = linear_fast(pq, pk2, v2, mask=mask, causal=causal, rpe=rpe, chunk_size=8)
  assert rel_err(out2[-1, :n_real], out[-1, :n_real]) < 1e-12
  # and the padded sequence equals the unpadded one (rpe sliced to the real length)
  rpe_small = None if rpe is None else rpe[:, n - n_real : n + n_real - 1]
  short = linear_fast(
      pq[-1:, :n_real],
      pk[-1:, :n_real],
      v[-1:, :n_real],
      causal=causal,
      rpe=rpe_small,
      chunk_size=8,
  )
  assert rel_err(out[-1:, :n_real], short) < 1e-12


@pytest.mark.parametrize("causal", (False, True))
def test_rpe_of_ones_equals_no_rpe(causal):
  n, heads = 50, 3
  pq, pk, v, _ = _inputs(n, heads, seed=8)
  with_rpe = linear_fast(pq, pk, v, causal=causal, rpe=np.ones((heads, 2 * n - 1)))
  assert rel_err(with_rpe, linear_fast(pq, pk, v, causal=causal)) < 1e-12


def test_rpe_sits_inside_the_normalisation():
  # Luo et al. put exp(b) in numerator and denominator: scaling every c by a constant
  # changes nothing (a term added outside the normalisation, like FastRPB, would scale).
  n, heads = 30, 2
  pq, pk, v, rng = _inputs(n, heads, seed=9)
  rpe = np.exp(rng.normal(size=(heads, 2 * n - 1)))
  a = linear_fast(pq, pk, v, rpe=rpe)
  assert rel_err(linear_fast(pq, pk, v, rpe=7.0 * rpe), a) < 1e-12
  assert rel_err(a, linear_fast(pq, pk, v)) > 1e-3  # and the table does act


def test_linear_attention_bfloat16_keeps_float32_states():
  pq, pk, v, _ = _inputs(64, 2, seed=10)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  out = linear_fast(bf(pq), bf(pk), bf(v), causal=True)
  assert out.dtype == jnp.bfloat16
  ref = linear_dense(*(np.asarray(bf(a), np.float64) for a in (pq, pk, v)), causal=True)
  assert rel_err(out, ref) < 2e-2


# ---------------------------------------------------------------------------------------------
# Softmax attention
# ---------------------------------------------------------------------------------------------
# By default each length once, with every heads x causal and causal x masked pair.
SOFTMAX_CASES = list(itertools.product((1, 2, 7, 64, 257), (1, 3), (False, True), (False, True)))
SOFTMAX_DEFAULT = {c for c in DENSE_DEFAULT if c[0] != 1000}


@pytest.mark.parametrize("n, heads, causal, masked", _sampled(SOFTMAX_CASES, SOFTMAX_DEFAULT))
def test_softmax_attention_matches_reference(n, heads, causal, masked):
  rng = np.random.default_rng(n + heads)
  q, k, v = (rng.normal(size=(2, n, heads, 8)) for _ in range(3))
  bias = rng.normal(size=(heads, n, n))
  mask = _mask(2, n, max(1, n // 2)) if masked else None
  ref = softmax_dense(q, k, v, bias=bias, mask=mask, causal=causal)
  assert rel_err(softmax_fast(q, k, v, bias=bias, mask=mask, causal=causal), ref) < 1e-12
  # float32 goes through jax.nn.dot_product_attention
  f32 = [a.astype(np.float32) for a in (q, k, v, bias)]
  out = softmax_fast(*f32[:3], bias=f32[3], mask=mask, causal=causal)
  assert out.dtype == jnp.float32 and rel_err(out, ref) < 1e-5


def test_softmax_attention_float32_n4096():
  n = 4096
  rng = np.random.default_rng(11)
  q, k, v = (rng.normal(size=(1, n, 1, 16)) for _ in range(3))
  mask = _mask(1, n, 3000)
  ref = softmax_dense(q, k, v, mask=mask, causal=True)
  out = softmax_fast(*(a.astype(np.float32) for a in (q, k, v)), mask=mask, causal=True)
  assert rel_err(out, ref) < 1e-4


def test_softmax_attention_causal_and_padding_by_gradient():
  n = 9
  rng = np.random.default_rng(12)
  q, k, v = (rng.normal(size=(1, n, 2, 4)) for _ in range(3))
  causal = lambda *a: attention.softmax_attention(*a, causal=True)[0]
  for jac in jax.jit(jax.jacrev(causal, argnums=(1, 2)))(q, k, v):  # one compile
    assert_causal_jacobian(jac, n, in_axis=4)  # [n, h, d, 1, n, h, d]
  mask = _mask(1, n, 6)
  jac = np.asarray(
      jax.jit(jax.jacrev(lambda k: attention.softmax_attention(q, k, v, mask=mask)[0]))(k)
  )
  assert np.all(jac[:, :, :, :, 6:] == 0.0)  # padded keys have no influence


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
_X = jnp.ones((2, 5, 3, 4))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: attention.linear_attention(_X[0], _X, _X), r"phi_q must be .*rank 4.*\(5, 3, 4\)"),
        (lambda: attention.linear_attention(_X, _X[:, :4], _X), r"share \[batch, length, heads\]"),
        (
            lambda: attention.linear_attention(_X, _X, _X, mask=jnp.ones((2, 4), bool)),
            r"mask must be \[batch, length\]=\(2, 5\).*\(2, 4\)",
        ),
        (
            lambda: attention.linear_attention(_X, _X, _X, rpe=jnp.ones((3, 8))),
            r"rpe must be \[heads, 2N-1\]=\(3, 9\).*\(3, 8\)",
        ),
        (
            lambda: attention.linear_attention(_X, _X, _X, rpe=jnp.ones((3, 9)).at[0, 0].set(0.0)),
            r"positive.*minimum is 0.0",
        ),
        (
            lambda: attention.linear_attention(_X, _X, _X, rpe=-jnp.ones((3, 9))),
            r"positive.*minimum is -1.0",
        ),
        (
            lambda: attention.linear_attention(_X, _X, _X, rpe=jnp.ones((3, 3, 3)), grid=(2, 2)),
            r"grid \(2, 2\).*H\*W=4 but N=5",
        ),
        (lambda: attention.linear_attention(_X, _X, _X, grid=(1, 5)), r"grid is only used"),
        (
            lambda: attention.linear_attention(_X, _X, _X, causal=True, chunk_size=0),
            r"chunk_size.*got 0",
        ),
        (
            lambda: attention.softmax_attention(_X, _X, _X, bias=jnp.ones((3, 4, 4))),
            r"bias must be .*Lq=5, Lk=5.*\(1, 3, 4, 4\)",
        ),
        (lambda: attention.softmax_attention(_X, _X[..., :2], _X), r"same last dim"),
    ],
)
def test_bad_input_raises_before_compute(call, match):
  with pytest.raises(ValueError, match=match):
    call()


# ---------------------------------------------------------------------------------------------
# Keys with a separate log scale (the running maximum of the causal scan)
# ---------------------------------------------------------------------------------------------
def _scaled_inputs(n, heads, seed):
  pq, e, v, rng = _inputs(n, heads, seed=seed)
  return pq, e, v, 3.0 * rng.normal(size=e.shape[:3]), rng


# Each flag's two values once by default (running maximum with the eps); the rest -m slow.
@pytest.mark.parametrize(
    "causal, key_eps",
    _sampled(list(itertools.product((False, True), (0.0, 0.3))), {(True, 0.3), (False, 0.0)}),
)
def test_key_log_scale_matches_dense_float64(causal, key_eps):
  n, heads = 37, 2
  pq, e, v, s, rng = _scaled_inputs(n, heads, 11)
  mask, probe = _mask(2, n, 30), rng.normal(size=v.shape)
  fast = lambda q, k, vv, ls: attention.linear_attention(
      q, k, vv, mask=mask, causal=causal, key_log_scale=ls, key_eps=key_eps, chunk_size=8
  )
  dense = lambda q, k, vv, ls: attention.linear_attention_reference(
      q, k * jnp.exp(ls)[..., None] + key_eps, vv, mask=mask, causal=causal
  )
  got = [
      jax.jit(jax.value_and_grad(lambda *a, f=f: jnp.sum(f(*a) * probe), argnums=(0, 1, 2, 3)))(
          pq, e, v, s
      )
      for f in (fast, dense)
  ]
  assert rel_err(got[0][0], got[1][0]) < 1e-9
  for a, b in zip(got[0][1], got[1][1]):
    assert rel_err(a, b) < 1e-9


@pytest.mark.parametrize("causal", (False, True))
def test_key_log_scale_guards_the_denominator_in_the_keys_own_scale(causal):
  """A query nearly orthogonal to a late key whose scale is exp(100): relative to that key its
  denominator is ~1e-12, yet in the keys' own scale it is ~1e31, so the eps guard must not act
  (it did when it compared the rescaled denominator with eps)."""
  n, heads, m = 12, 1, 4
  rng = np.random.default_rng(15)
  pq = np.full((1, n, heads, m), 1e-3)
  pq[..., 0] = 1.0  # every query looks at feature 0, and barely at feature 1
  pq[..., 1] = 1e-12
  e = np.abs(rng.normal(size=(1, n, heads, m)))
  e[:, 8, :, :] = 1e-30
  e[:, 8, :, 1] = 1.0  # the late key lives on feature 1
  s = np.zeros((1, n, heads))
  s[:, 8] = 100.0
  v = rng.normal(size=(1, n, heads, 3))
  fast = jax.jit(  # op by op, every primitive would be compiled on its own
      functools.partial(attention.linear_attention, causal=causal, chunk_size=5)
  )(pq, e, v, key_log_scale=s)
  dense = linear_dense(pq, e * np.exp(s)[..., None], v, causal=causal)
  assert rel_err(fast, dense) < 1e-9


def test_key_log_scale_never_sees_the_future():
  n, heads = 12, 2
  pq, e, v, s, _ = _scaled_inputs(n, heads, 12)
  pq, e, v, s = pq[:1], e[:1], v[:1], s[:1]
  fn = lambda a, b, c, d: attention.linear_attention(
      a, b, c, causal=True, key_log_scale=d, key_eps=0.1, chunk_size=5
  )[0]
  for jac in jax.jit(jax.jacrev(fn, argnums=(0, 1, 2, 3)))(pq, e, v, s):  # one compile
    assert_causal_jacobian(jac, n, in_axis=4)


@pytest.mark.parametrize("name", ("favor", "sikf"))
def test_late_huge_key_does_not_overflow_the_running_max(name):
  """Causal keys at N = 4096 with one late key whose exponent is about 128 above the first
  key's: the first-key stabiliser overflows float32 (inf features); the split features with
  the running maximum match the float64 dense reference."""
  n, heads, dim = 4096, 2, 256
  rng = np.random.default_rng(13)
  proj = rng.normal(size=(16, dim)) if name == "favor" else None
  x = rng.normal(size=(1, n, heads, dim)) * 0.02
  # favor: x = w_0 gives w.x - |x|^2/2 = |w_0|^2 / 2 ~ dim / 2; sikf: a large entry.
  x[:, 3000] = proj[0] if name == "favor" else 128.0
  v = rng.normal(size=(1, n, heads, 4))
  f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)

  @jax.jit  # one program (op by op, every primitive would be compiled on its own)
  def run(x32, proj32, v32, x64, proj64):
    q = features.feature_map(name, x32, projection=proj32, is_query=True)
    old = features.feature_map(name, x32, projection=proj32, causal=True)
    e, s, key_eps = features.causal_key_parts(name, x32, projection=proj32)
    out = attention.linear_attention(q, e, v32, causal=True, key_log_scale=s, key_eps=key_eps)
    e64, s64, _ = features.causal_key_parts(name, x64, projection=proj64)
    return q, old, out, e64 * jnp.exp(s64)[..., None] + key_eps

  q, old, out, keys64 = run(f32(x), f32(proj), f32(v), x, proj)
  assert not np.all(np.isfinite(np.asarray(old)))  # the scheme this replaces overflows here
  ref = linear_dense(np.asarray(q, np.float64), keys64, v, causal=True)
  assert np.all(np.isfinite(np.asarray(out)))
  assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("name", ("sikf", "favor", "orf", "prf", "elu1"))
def test_causal_key_parts_equal_the_causal_features(name):
  rng = np.random.default_rng(14)
  x = rng.normal(size=(2, 9, 2, 4))
  mask = _mask(2, 9, 6)
  mask[0, :2] = False  # a left-padded row: the first real key sets the stabiliser
  proj = features.make_projection(name, jax.random.key(0), 8, 4, dtype=jnp.float64)
  e, s, key_eps = features.causal_key_parts(name, x, projection=proj, mask=mask)
  want = features.feature_map(name, x, projection=proj, mask=mask, causal=True)
  assert rel_err(e * jnp.exp(s)[..., None] + key_eps, want) < 1e-12


def test_key_log_scale_refuses_what_is_not_built():
  x = jnp.ones((1, 4, 2, 3))
  with pytest.raises(ValueError, match="key_log_scale must be"):
    attention.linear_attention(x, x, x, key_log_scale=jnp.zeros((1, 4)))
  with pytest.raises(ValueError, match="not built together with rpe"):
    attention.linear_attention(x, x, x, key_log_scale=jnp.zeros((1, 4, 2)), rpe=jnp.ones((2, 7)))


# ---------------------------------------------------------------------------------------------
# The bidirectional path's written-out backward, and the head-major layout
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_major", (False, True))
def test_bidirectional_gradients_where_the_guard_clamps(head_major):
  """Sign-changing features (as trf's) with one query whose denominator is 1e-5, inside the
  guard's eps = 1e-3 (clamped), while its numerator is not small: the written-out backward
  must pass no gradient through the clamped denominator, as autodiff of the reference's guard
  does. Another query's denominator is exactly 0."""
  n, heads, eps = 19, 2, 1e-3
  rng = np.random.default_rng(16)
  pq, pk = rng.normal(size=(2, 2, n, heads, 5))
  v, probe = rng.normal(size=(2, 2, n, heads, 3))
  mask = _mask(2, n, 11)
  ks = np.einsum("bjhm,bj->bhm", pk, mask)  # the real keys' feature sums
  r = pq[:, 4]  # [b, h, m]
  dot = np.sum(r * ks, axis=-1, keepdims=True)
  pq[:, 4] = r - (dot - 1e-5) * ks / np.sum(ks * ks, axis=-1, keepdims=True)
  pq[:, 7] = 0.0

  def grads(fn):
    loss = lambda *a: jnp.sum(fn(*a, mask=mask, eps=eps) * probe)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(pq, pk, v)

  swap = lambda a: jnp.swapaxes(a, 1, 2)
  fast_op = attention.linear_attention
  if head_major:  # the written-out backward (``_bidirectional``) on head-major arrays
    fast_op = lambda q, k, vv, **kw: swap(
        attention.linear_attention(swap(q), swap(k), swap(vv), head_major=True, **kw)
    )
  (out, fast), (ref, dense) = grads(fast_op), grads(attention.linear_attention_reference)
  assert abs(out - ref) <= 1e-9 * abs(ref)
  for a, b in zip(fast, dense):
    assert np.all(np.isfinite(np.asarray(a))) and rel_err(a, b) < 1e-9


# Causal and bidirectional once each by default (bidirectional on the head-major layout, which
# test_head_major_layout_equals_token_major ties to the token-major one); the rest -m slow.
@pytest.mark.parametrize(
    "causal,head_major",
    _sampled([(False, False), (True, False), (False, True)], {(True, False), (False, True)}),
)
def test_linear_attention_float32_gradients_n4096(causal, head_major):
  n, heads = 4096, 1
  pq, pk, v, rng = _inputs(n, heads, m=4, d=4, seed=17)
  pq, pk, v = pq[:1], pk[:1], v[:1]
  mask = _mask(1, n, 3000)
  probe = rng.normal(size=v.shape)

  def grads(fn, *args):
    loss = lambda *a: jnp.sum(fn(*a, mask=mask, causal=causal) * probe)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)

  dense = grads(attention.linear_attention_reference, pq, pk, v)  # float64
  swap = lambda a: jnp.swapaxes(a, 1, 2)
  op = attention.linear_attention
  if head_major:
    op = lambda q, k, vv, **kw: swap(
        attention.linear_attention(swap(q), swap(k), swap(vv), head_major=True, **kw)
    )
  fast = grads(op, *(a.astype(np.float32) for a in (pq, pk, v)))
  for a, b in zip(fast, dense):
    assert a.dtype == jnp.float32 and rel_err(a, b) < 1e-4


_HM_N, _HM_HEADS = 13, 3
_HM_FAST = ("plain", "causal", "key_log_scale")  # the rest: -m slow (compiles dominate)


def _head_major_kwargs(name, rng):
  """The token-major keyword arguments of one path of the op."""
  n, heads = _HM_N, _HM_HEADS
  den = tuple(_features(rng, (2, n, heads, 3)) for _ in range(2))
  rpe = np.exp(rng.normal(size=(heads, 2 * n - 1)))
  scale = rng.normal(size=(2, n, heads))
  return {
      "plain": {},
      "causal": dict(causal=True, chunk_size=4),
      "rpe": dict(rpe=rpe),
      "causal rpe": dict(causal=True, rpe=rpe),
      "decay": dict(causal=True, decay=-np.abs(rng.normal(size=(heads,))), chunk_size=4),
      "den_features": dict(den_features=den),
      "causal den_features": dict(causal=True, den_features=den, chunk_size=4),
      "key_log_scale": dict(key_log_scale=scale, key_eps=0.1),
      "causal key_log_scale": dict(causal=True, key_log_scale=scale, chunk_size=4),
  }[name]


@pytest.mark.parametrize(
    "name",
    [
        n if n in _HM_FAST else pytest.param(n, marks=pytest.mark.slow)
        for n in (
            "plain",
            "causal",
            "rpe",
            "causal rpe",
            "decay",
            "den_features",
            "causal den_features",
            "key_log_scale",
            "causal key_log_scale",
        )
    ],
)
def test_head_major_layout_equals_token_major(name):
  """``head_major=True`` takes and returns [b, h, N, .] (key_log_scale [b, h, N]) and gives
  the token-major results, outputs and gradients."""
  pq, pk, v, rng = _inputs(_HM_N, _HM_HEADS, seed=18)
  mask, probe = _mask(2, _HM_N, 9), rng.normal(size=v.shape)
  kw = _head_major_kwargs(name, rng)
  swap = lambda a: jnp.swapaxes(a, 1, 2)
  hm = dict(kw)
  if "den_features" in kw:
    hm["den_features"] = tuple(map(swap, kw["den_features"]))
  if "key_log_scale" in kw:
    hm["key_log_scale"] = swap(kw["key_log_scale"])
  token_major = lambda q, k, vv: attention.linear_attention(q, k, vv, mask=mask, **kw)
  head_major = lambda q, k, vv: swap(
      attention.linear_attention(swap(q), swap(k), swap(vv), mask=mask, head_major=True, **hm)
  )
  got = [
      jax.jit(lambda *x, f=f: (f(*x), jax.grad(lambda *y: jnp.sum(f(*y) * probe), (0, 1, 2))(*x)))(
          pq, pk, v
      )
      for f in (token_major, head_major)
  ]
  assert rel_err(got[1][0], got[0][0]) < 1e-12
  for x, y in zip(got[0][1], got[1][1]):
    assert rel_err(y, x) < 1e-12


def test_head_major_checks_its_rank():
  with pytest.raises(ValueError, match=r"\[batch, heads, length, dim\].*head_major"):
    attention.linear_attention(_X[0], _X, _X, head_major=True)


# ---------------------------------------------------------------------------------------------
# The softmax reference on rows that see no key
# ---------------------------------------------------------------------------------------------
def test_softmax_reference_rows_without_keys_are_zero():
  """Causal with left padding: query rows before the first real key see nothing. The
  reference gives 0 there (not NaN), so a loss masked by a product has finite gradients; the
  other rows are unchanged."""
  n = 8
  rng = np.random.default_rng(19)
  q, k, v = (rng.normal(size=(2, n, 2, 4)) for _ in range(3))
  k[1, :3] = 1e4  # huge padded keys: exp of their scores must never be taken
  mask = np.ones((2, n), bool)
  mask[1, :3] = False  # left padding: rows 0-2 of example 1 see no real key
  out = softmax_dense(q, k, v, mask=mask, causal=True)
  assert np.all(np.asarray(out[1, :3]) == 0.0)
  ref = softmax_dense(q[1:, 3:], k[1:, 3:], v[1:, 3:], causal=True)
  assert rel_err(out[1:, 3:], ref) < 1e-12
  real = mask[..., None, None].astype(np.float64)
  grads = jax.jit(
      jax.grad(
          lambda *a: jnp.sum(
              attention.softmax_attention_reference(*a, mask=mask, causal=True) * real
          ),
          argnums=(0, 1, 2),
      )
  )(q, k, v)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
