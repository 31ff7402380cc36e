"""fastpos.ops.rotations: every fast transform against its dense matrix (float64, random inputs).

The dense references build the matrices of Qin et al. (LRPE, Eq. 22-24, 73-75) in numpy
complex128 and apply them by a matmul; the fast paths gather, rotate and phase.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastpos.ops import rotations
from tests.helpers import rel_err

TOL = 1e-9
B, N, H = 2, 7, 3


def _x(f, seed=0, n=N, h=H):
  return np.random.default_rng(seed).standard_normal((B, n, h, f))


def _apply_dense(m, x):
  """``y[b, n, h] = m[n, h] @ x[b, n, h]``: m ``[N|1, H|1, f_out, f]`` complex."""
  return np.einsum("nhij,bnhj->bnhi", m, x.astype(complex))


def _realise(z):
  return np.concatenate([z.real, z.imag], axis=-1)


def _p_dense(p, f, *, householder_v=None, p_index=None, dft=None):
  """``[1, H|1, f, f]`` complex: the matrix P of each choice (Eq. 73, 74, the DFT)."""
  if p == "identity":
    return np.eye(f)[None, None].astype(complex)
  if p == "householder":
    v = householder_v / np.linalg.norm(householder_v, axis=-1, keepdims=True)
    return (np.eye(f)[None] - 2.0 * v[:, :, None] * v[:, None, :])[None].astype(complex)
  if p in ("permutation", "random_permutation"):
    m = np.zeros(p_index.shape + (f,))
    for h, idx in enumerate(p_index):
      m[h, np.arange(f), idx] = 1.0  # (P x)_j = x_{idx[j]}
    return m[None].astype(complex)
  jk = np.outer(np.arange(f), np.arange(f))
  return (np.exp(-2j * np.pi * jk / f) / np.sqrt(f))[None, None]


def _p_arrays(p, f, seed=1):
  rng = np.random.default_rng(seed)
  if p == "householder":
    return {"householder_v": rng.standard_normal((H, f))}
  if p == "permutation":
    return {"p_index": np.broadcast_to(rotations.interleave_index(f), (1, f)).copy()}
  if p == "random_permutation":
    return {"p_index": np.stack([rng.permutation(f) for _ in range(H)]).astype(np.int32)}
  if p == "fourier":
    return {"dft": rotations.dft_parts(f)}
  return {}


def _perm_matrix(perm):
  """``(M x)_j = x_{perm[j]}``."""
  m = np.zeros((len(perm), len(perm)))
  m[np.arange(len(perm)), perm] = 1.0
  return m


def _sampled(cases, default):
  """``cases`` as parameters; those not in ``default`` run with ``-m slow`` only."""
  return [
      pytest.param(*c, id="-".join(map(str, c)), marks=() if c in default else pytest.mark.slow)
      for c in cases
  ]


# Each P once by default, odd and even feature dims in turn; the full product -m slow.
P_F = [(p, f) for p in rotations.P_CHOICES for f in (5, 6)]
DEFAULT_P_F = {(p, (5, 6)[i % 2]) for i, p in enumerate(rotations.P_CHOICES)}


@pytest.mark.parametrize("p, f", _sampled(P_F, DEFAULT_P_F))
def test_apply_p_matches_its_dense_matrix(p, f):
  x = _x(f)
  arrays = _p_arrays(p, f)
  re, im = rotations.apply_p(x, p, **arrays)
  dense = _apply_dense(_p_dense(p, f, **arrays), x)
  got = np.asarray(re) + 1j * (0.0 if im is None else np.asarray(im))
  assert (im is None) == (p != "fourier")
  assert rel_err(_realise(got), _realise(dense)) < TOL


def test_interleave_index_is_eq74():
  # (P x)_{2k} = x_k, (P x)_{2k+1} = x_{ceil(f/2)+k}, 0-indexed.
  np.testing.assert_array_equal(rotations.interleave_index(5), [0, 3, 1, 4, 2])
  np.testing.assert_array_equal(rotations.interleave_index(6), [0, 3, 1, 4, 2, 5])


@pytest.mark.parametrize("f", [1, 4, 7])
def test_rotate_pairs_matches_block_rotations(f):
  x = _x(f, seed=2)
  angles = np.random.default_rng(3).uniform(-20, 20, (N, H, f // 2))
  m = np.zeros((N, H, f, f))
  for n in range(N):
    for h in range(H):
      m[n, h] = np.eye(f)
      for k in range(f // 2):
        c, s = np.cos(angles[n, h, k]), np.sin(angles[n, h, k])
        m[n, h, 2 * k : 2 * k + 2, 2 * k : 2 * k + 2] = [[c, -s], [s, c]]  # Eq. 23
  got = np.asarray(rotations.rotate_pairs(x, angles))
  assert rel_err(got, _apply_dense(m, x).real) < TOL


@pytest.mark.parametrize("complex_input", [False, True])
def test_phase_is_a_complex_diagonal(complex_input):
  f = 5
  re, im = _x(f, seed=4), (_x(f, seed=5) if complex_input else None)
  angles = np.random.default_rng(6).uniform(-9, 9, (N, 1, f))
  out_re, out_im = rotations.phase(re, im, angles)
  z = re + 1j * (0.0 if im is None else im)
  want = z * np.exp(1j * angles)[None]  # Eq. 22
  got = np.concatenate([np.asarray(out_re), np.asarray(out_im)], axis=-1)
  assert rel_err(got, _realise(want)) < TOL


def test_permutation_cycles_give_every_power():
  perm = np.random.default_rng(7).permutation(9)
  flat, start, offset, length = rotations.permutation_cycles(perm)
  power = np.arange(9)
  for s in range(25):
    np.testing.assert_array_equal(flat[start + (offset + s) % length], power)
    power = perm[power]  # pi^(s+1)(j) = pi(pi^s(j))


def test_permute_powers_matches_matrix_powers():
  f = 6
  perms = [np.random.default_rng(8 + h).permutation(f) for h in range(H)]
  tables = [rotations.permutation_cycles(p) for p in perms]
  cycles = tuple(np.stack([t[i] for t in tables]) for i in range(4))
  slot_pos = np.random.default_rng(9).integers(0, 40, (N, f))
  x = _x(f, seed=10)
  got = np.asarray(rotations.permute_powers(x, slot_pos, cycles))
  want = np.empty_like(x)
  for n in range(N):
    for h in range(H):
      for j in range(f):  # (Lambda^(s) x)_j = x_{pi^(s_j)(j)} (Eq. 24)
        row = np.linalg.matrix_power(_perm_matrix(perms[h]), int(slot_pos[n, j]))[j]
        want[:, n, h, j] = x[:, n, h] @ row
  assert rel_err(got, want) < TOL


def _lambda_dense(lrpe_type, f, theta, slot_pos, cycles_perm):
  """``[N, H|1, f, f]`` complex Lambda^(s) of each position (slot positions per slot)."""
  heads = theta.shape[0] if theta is not None else len(cycles_perm)
  m = np.zeros((len(slot_pos), heads, f, f), complex)
  for n in range(len(slot_pos)):
    for h in range(heads):
      if lrpe_type == 1:
        m[n, h] = np.diag(np.exp(1j * slot_pos[n] * theta[h]))
      elif lrpe_type == 2:
        m[n, h] = np.eye(f)
        for k in range(f // 2):
          a = slot_pos[n, k] * theta[h, k]
          m[n, h, 2 * k : 2 * k + 2, 2 * k : 2 * k + 2] = [
              [np.cos(a), -np.sin(a)],
              [np.sin(a), np.cos(a)],
          ]
      else:
        for j in range(f):
          m[n, h, j] = np.linalg.matrix_power(_perm_matrix(cycles_perm[h]), slot_pos[n, j])[j]
  return m


# Each type with an odd and an even feature dim, and every P among them; the full product
# runs with -m slow.
DEFAULT_TYPE_P_F = {
    (1, "identity", 5),
    (1, "fourier", 6),
    (2, "householder", 5),
    (2, "random_permutation", 6),
    (3, "permutation", 5),
    (3, "fourier", 6),
}


@pytest.mark.parametrize(
    "lrpe_type, p, f", _sampled([(t, p, f) for t in (1, 2, 3) for p, f in P_F], DEFAULT_TYPE_P_F)
)
def test_lrpe_apply_matches_lambda_times_p(lrpe_type, p, f):
  # realise(M_s x) with M_s = Lambda^(s) P (Eq. 75) against the dense complex product.
  rng = np.random.default_rng(11)
  n_slots = rotations.num_slots(lrpe_type, f)
  slot_pos = rng.integers(0, 50, (N, n_slots))
  arrays = _p_arrays(p, f)
  theta, perms = None, None
  if lrpe_type in (1, 2):
    theta = rng.uniform(0.0, 1.0, (H, n_slots))
    arrays["theta"] = theta
  else:
    perms = [rng.permutation(f) for _ in range(H)]
    tables = [rotations.permutation_cycles(q) for q in perms]
    arrays["cycles"] = tuple(np.stack([t[i] for t in tables]) for i in range(4))
  x = _x(f, seed=12)
  got = np.asarray(rotations.lrpe_apply(x, slot_pos, lrpe_type=lrpe_type, p=p, **arrays))
  m = _lambda_dense(lrpe_type, f, theta, slot_pos, perms) @ _p_dense(p, f, **_p_arrays(p, f))
  want = _apply_dense(m, x)
  if rotations.is_complex(lrpe_type, p):
    assert got.shape[-1] == 2 * f
    assert rel_err(got, _realise(want)) < TOL
  else:
    assert got.shape[-1] == f
    assert np.abs(want.imag).max() < 1e-12 and rel_err(got, want.real) < TOL


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("lrpe_type", [1, 2])
def test_transform_qk_scores_depend_on_the_offset_only(lrpe_type, two_d):
  # (M_s q)^H (M_t k) = q^H W_{t-s} k: shifting both positions leaves every score as it is.
  f = 8
  theta = rotations.inverse_frequencies(lrpe_type, f, two_d=two_d, base=10000.0)[None]
  rng = np.random.default_rng(13)
  q, k = rng.standard_normal((1, 1, 1, f)), rng.standard_normal((1, 1, 1, f))
  c = 2 if two_d else 1

  def score(s, t):
    a, b = rotations.transform_qk(
        q,
        k,
        np.array([s[:c]]),
        np.array([t[:c]]),
        lrpe_type=lrpe_type,
        p="identity",
        two_d=two_d,
        theta=theta,
    )
    return float(np.sum(np.asarray(a) * np.asarray(b)))

  base = score((3, 1), (5, 4))
  for shift in [(1, 0), (0, 2), (7, 3)]:
    moved = score((3 + shift[0], 1 + shift[1]), (5 + shift[0], 4 + shift[1]))
    assert abs(moved - base) <= TOL * max(1.0, abs(base))
  assert abs(score((3, 1), (6, 4)) - base) > 1e-6  # a different offset scores differently


@pytest.mark.parametrize(
    "lrpe_type, f, two_d, ok",
    [
        (1, 1, False, True),
        (1, 1, True, False),
        (2, 1, False, False),
        (2, 4, True, True),
        (3, 3, True, False),
    ],
)
def test_check_feature_dim(lrpe_type, f, two_d, ok):
  if ok:
    rotations.check_feature_dim(lrpe_type, f, two_d, "x")
  else:
    with pytest.raises(ValueError, match=f"x: type {lrpe_type} needs a feature dim"):
      rotations.check_feature_dim(lrpe_type, f, two_d, "x")


def test_ops_rotations_imports_no_flax():
  import ast
  import inspect

  tree = ast.parse(inspect.getsource(rotations))
  names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
  names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
  assert not [m for m in names if m.startswith(("flax", "fastpos"))], names
