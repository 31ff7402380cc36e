"""FFT Toeplitz products against their dense O(N^2) references."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.ops import toeplitz
from tests.helpers import assert_causal_jacobian, rel_err

LENGTHS = (1, 2, 7, 64, 257, 1000)
# FFT paths are causal up to float64 round-off (see tests.helpers.assert_causal_jacobian).
FFT_ROUNDOFF = 1e-13
GRIDS = ((1, 1), (1, 5), (4, 4), (3, 5), (7, 2), (12, 10))


def _sampled(cases, default):
  """``cases`` as parameters; those not in ``default`` run with ``-m slow`` only."""
  return [
      pytest.param(*c, id="-".join(map(str, c)), marks=() if c in default else pytest.mark.slow)
      for c in cases
  ]


# One compiled function per (static options, shape), shared by the tests.
tm = jax.jit(toeplitz.toeplitz_matmul, static_argnames=("causal",))
tm2 = jax.jit(toeplitz.toeplitz_matmul_2d, static_argnames=("grid", "causal"))
fastrpb2 = jax.jit(toeplitz.fastrpb_2d_matmul, static_argnames=("grid",))


@functools.partial(jax.jit, static_argnames=("causal",))
def _dense_1d(w, x, causal):
  t = toeplitz.dense_toeplitz(w)
  if causal:
    t = jnp.where(toeplitz.causal_mask(x.shape[-2]), t, 0)
  return jnp.einsum("...ij,...jc->...ic", t, x)


@functools.partial(jax.jit, static_argnames=("grid", "causal"))
def _dense_2d(w, x, grid, causal):
  t = toeplitz.dense_toeplitz_2d(w, grid)
  if causal:
    t = jnp.where(toeplitz.causal_mask(x.shape[-2]), t, 0)
  return jnp.einsum("...ij,...jc->...ic", t, x)


def test_fft_size_is_smooth_and_minimal():
  for n in list(range(1, 300)) + [1999, 2047, 8191, 8193, 32767]:
    s = toeplitz.fft_size(n)
    assert s >= n
    r = s
    for p in (2, 3, 5):
      while r % p == 0:
        r //= p
    assert r == 1, (n, s)
    # No 5-smooth number in [n, s) was skipped.
    for m in range(n, s):
      r = m
      for p in (2, 3, 5):
        while r % p == 0:
          r //= p
      assert r != 1, (n, m, s)


def test_dense_toeplitz_convention():
  # W[i, j] = w_{j-i}: first row w_0..w_{N-1}, first column w_0, w_{-1}, ...
  w = jnp.arange(5.0)  # offsets -2..2 -> values 0..4
  t = toeplitz.dense_toeplitz(w)
  np.testing.assert_array_equal(t, [[2, 3, 4], [1, 2, 3], [0, 1, 2]])


# (n, heads, causal): the full product runs with -m slow. By default each length once, with every
# heads x causal pair; causal at 64 (the last dense one) and at 1000 (FFT, refined head that is
# itself FFT-refined), bidirectional FFT from N=1 up.
CASES_1D = list(itertools.product(LENGTHS, (1, 3), (False, True)))
DEFAULT_1D = {(1, 1, False), (2, 3, True), (7, 3, False), (64, 1, True), (257, 1, False)}
DEFAULT_1D |= {(1000, 3, True)}


@pytest.mark.parametrize("n, heads, causal", _sampled(CASES_1D, DEFAULT_1D))
def test_toeplitz_matmul_matches_dense_float64(n, heads, causal):
  rng = np.random.default_rng(n * 10 + heads)
  w = rng.normal(size=(heads, 2 * n - 1))
  x = rng.normal(size=(2, heads, n, 5))
  out = tm(w, x, causal=causal)
  assert out.shape == (2, heads, n, 5) and out.dtype == jnp.float64
  assert rel_err(out, _dense_1d(w, x, causal)) < 1e-9


def test_toeplitz_matmul_broadcasts_table_over_batch():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(9,))
  x = rng.normal(size=(3, 2, 5, 4))
  assert rel_err(tm(w, x), _dense_1d(w, x, False)) < 1e-12


@pytest.mark.parametrize("causal", _sampled([(False,), (True,)], {(True,)}))  # + head refinement
def test_toeplitz_matmul_float32_n4096(causal):
  n = 4096
  rng = np.random.default_rng(1)
  w = rng.normal(size=(2, 2 * n - 1))
  x = rng.normal(size=(1, 2, n, 8))
  ref = _dense_1d(w, x, causal)  # float64
  out = tm(w.astype(np.float32), x.astype(np.float32), causal=causal)
  assert out.dtype == jnp.float32
  assert rel_err(out, ref) < 1e-4


def test_toeplitz_matmul_bfloat16_computes_in_float32():
  rng = np.random.default_rng(2)
  w = jnp.asarray(rng.normal(size=(63,)), jnp.bfloat16)
  x = jnp.asarray(rng.normal(size=(32, 4)), jnp.bfloat16)
  out = tm(w, x)
  assert out.dtype == jnp.bfloat16
  ref = _dense_1d(w.astype(jnp.float64), x.astype(jnp.float64), False)
  assert rel_err(out.astype(jnp.float64), ref) < 2e-2  # bf16 output rounding only


@pytest.mark.parametrize("causal", (False, True))
def test_toeplitz_matmul_gradients_match_dense(causal):
  rng = np.random.default_rng(3)
  n = 37
  w = rng.normal(size=(2, 2 * n - 1))
  x = rng.normal(size=(3, 2, n, 4))
  probe = rng.normal(size=(3, 2, n, 4))
  grad = lambda f: jax.jit(jax.grad(lambda w, x: jnp.sum(f(w, x) * probe), argnums=(0, 1)))
  fast = grad(lambda w, x: toeplitz.toeplitz_matmul(w, x, causal=causal))(w, x)
  dense = grad(lambda w, x: _dense_1d(w, x, causal))(w, x)
  for a, b in zip(fast, dense):
    assert rel_err(a, b) < 1e-9


@pytest.mark.parametrize("n", (5, 100))  # dense below 64 positions, FFT + head refinement above
def test_toeplitz_matmul_causal_never_sees_the_future(n):
  rng = np.random.default_rng(4)
  w = rng.normal(size=(2 * n - 1,))
  x = rng.normal(size=(n, 3))
  jac = jax.jit(jax.jacrev(lambda x: toeplitz.toeplitz_matmul(w, x, causal=True)))(x)  # [n,3,n,3]
  assert_causal_jacobian(jac, n, in_axis=2, rtol=FFT_ROUNDOFF)
  # The check is sharp: the same product without causal=True fails it.
  leaky = jax.jit(jax.jacrev(lambda x: toeplitz.toeplitz_matmul(w, x)))(x)
  with pytest.raises(AssertionError, match="future"):
    assert_causal_jacobian(leaky, n, in_axis=2, rtol=FFT_ROUNDOFF)


# Each real length once by default, both directions among them; the rest -m slow.
@pytest.mark.parametrize(
    "n_real, causal",
    _sampled(
        list(itertools.product((1, 6, 13), (False, True))), {(1, True), (6, False), (13, True)}
    ),
)
def test_padding_never_changes_real_outputs(n_real, causal):
  # The FastRPB reference bug: an FFT sized for max_len is only right at N = max_len. Here a
  # length-n sequence padded with zeros to N and the centre-sliced table agree with the
  # unpadded product.
  n = 16
  rng = np.random.default_rng(n_real)
  w_max = rng.normal(size=(2 * n - 1,))
  x = rng.normal(size=(n_real, 3))
  x_pad = np.concatenate([x, np.zeros((n - n_real, 3))])
  w_small = w_max[n - n_real : n + n_real - 1]
  padded = tm(w_max, x_pad, causal=causal)[:n_real]
  assert rel_err(padded, tm(w_small, x, causal=causal)) < 1e-12


# (grid, heads, causal): by default each grid once, with every heads x causal pair; causal on
# the FFT path (H*W > 64) at (12, 10).
CASES_2D = list(itertools.product(GRIDS, (1, 3), (False, True)))
DEFAULT_2D = {((1, 1), 1, False), ((1, 5), 3, True), ((4, 4), 3, False), ((3, 5), 1, True)}
DEFAULT_2D |= {((7, 2), 1, False), ((12, 10), 3, True)}


@pytest.mark.parametrize("grid, heads, causal", _sampled(CASES_2D, DEFAULT_2D))
def test_toeplitz_matmul_2d_matches_dense_float64(grid, heads, causal):
  h, wd = grid
  rng = np.random.default_rng(h * 100 + wd)
  w = rng.normal(size=(heads, 2 * h - 1, 2 * wd - 1))
  x = rng.normal(size=(2, heads, h * wd, 4))
  out = tm2(w, x, grid, causal=causal)
  assert out.shape == x.shape
  assert rel_err(out, _dense_2d(w, x, grid, causal)) < 1e-9


def test_toeplitz_matmul_2d_float32_n4096():
  grid = (64, 64)
  rng = np.random.default_rng(5)
  w = rng.normal(size=(127, 127))
  x = rng.normal(size=(1, 4096, 4))
  ref = _dense_2d(w, x, grid, False)
  out = tm2(w.astype(np.float32), x.astype(np.float32), grid)
  assert rel_err(out, ref) < 1e-4


def test_toeplitz_matmul_2d_dense_follows_definition():
  # T[(r,c),(r',c')] = w[r'-r+H-1, c'-c+W-1], written out with loops.
  h, wd = 3, 4
  w = np.random.default_rng(6).normal(size=(2 * h - 1, 2 * wd - 1))
  t = np.asarray(jax.jit(toeplitz.dense_toeplitz_2d, static_argnums=1)(w, (h, wd)))
  for r in range(h):
    for c in range(wd):
      for r2 in range(h):
        for c2 in range(wd):
          assert t[r * wd + c, r2 * wd + c2] == w[r2 - r + h - 1, c2 - c + wd - 1]


@pytest.mark.parametrize("grid", ((3, 5), (9, 8), (3, 30)))  # dense; FFT refining rows / a row
def test_toeplitz_matmul_2d_raster_causal_by_gradient(grid):
  h, wd = grid
  n = h * wd
  rng = np.random.default_rng(7)
  w = rng.normal(size=(2 * h - 1, 2 * wd - 1))
  x = rng.normal(size=(n, 2))
  jac = jax.jit(jax.jacrev(lambda x: toeplitz.toeplitz_matmul_2d(w, x, grid, causal=True)))(x)
  assert_causal_jacobian(jac, n, in_axis=2, rtol=FFT_ROUNDOFF)


@functools.partial(jax.jit, static_argnames=("grid",))
def _fastrpb_2d_references(w_rows, w_cols, x, grid):
  """(the product with the full table w_rows + w_cols, the dense product with X + Y)."""
  full = w_rows[:, :, None] + w_cols[:, None, :]
  # W2d = X + Y of Appendix B.3: X depends on the row offset, Y on the column offset.
  xmat = toeplitz.dense_toeplitz_2d(jnp.broadcast_to(w_rows[:, :, None], full.shape), grid)
  ymat = toeplitz.dense_toeplitz_2d(jnp.broadcast_to(w_cols[:, None, :], full.shape), grid)
  dense = jnp.einsum("hij,bhjc->bhic", xmat + ymat, x)
  return toeplitz.toeplitz_matmul_2d(full, x, grid), dense


# One row, a tall grid and the largest by default; the others run with -m slow.
@pytest.mark.parametrize(
    "grid", _sampled([(g,) for g in GRIDS], {((1, 5),), ((7, 2),), ((12, 10),)})
)
def test_fastrpb_2d_equals_full_table_and_paper_definition(grid):
  h, wd = grid
  rng = np.random.default_rng(8)
  w_rows = rng.normal(size=(3, 2 * h - 1))
  w_cols = rng.normal(size=(3, 2 * wd - 1))
  x = rng.normal(size=(2, 3, h * wd, 5))
  out = fastrpb2(w_rows, w_cols, x, grid)
  with_full_table, ref = _fastrpb_2d_references(w_rows, w_cols, x, grid)
  assert rel_err(out, with_full_table) < 1e-9
  assert rel_err(out, ref) < 1e-9


def test_fastrpb_2d_shared_table():
  rng = np.random.default_rng(9)
  w = rng.normal(size=(9,))
  x = rng.normal(size=(25, 3))
  out = fastrpb2(w, w, x, (5, 5))
  ref = _dense_2d(w[:, None] + w[None, :], x, (5, 5), False)
  assert rel_err(out, ref) < 1e-12


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: toeplitz.toeplitz_matmul(jnp.ones(7), jnp.ones(4)), r"rank >= 2.*\(4,\)"),
        (lambda: toeplitz.toeplitz_matmul(jnp.ones(8), jnp.ones((4, 2))), r"8 entries.*2N-1=7"),
        (
            lambda: toeplitz.toeplitz_matmul(jnp.ones((3, 7)), jnp.ones((2, 4, 2))),
            r"\(3,\) do not broadcast.*\(2,\)",
        ),
        (
            lambda: toeplitz.toeplitz_matmul_2d(jnp.ones((5, 5)), jnp.ones((10, 2)), (3, 3)),
            r"grid \(3, 3\).*H\*W=9 but N=10",
        ),
        (
            lambda: toeplitz.toeplitz_matmul_2d(jnp.ones((5, 7)), jnp.ones((9, 2)), (3, 3)),
            r"\(5, 7\).*\(5, 5\)",
        ),
        (
            lambda: toeplitz.toeplitz_matmul_2d(jnp.ones((5, 5)), jnp.ones((9, 2)), 3),
            r"pair \(H, W\); got 3",
        ),
        (
            lambda: toeplitz.fastrpb_2d_matmul(jnp.ones(5), jnp.ones(4), jnp.ones((9, 2)), (3, 3)),
            r"w_cols has length 4.*2W-1=5",
        ),
        (lambda: toeplitz.dense_toeplitz(jnp.ones(4)), r"odd length.*got 4"),
    ],
)
def test_bad_input_raises_before_compute(call, match):
  with pytest.raises(ValueError, match=match):
    call()
