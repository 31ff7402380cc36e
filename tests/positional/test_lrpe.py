"""lrpe and rope: the hook's per-position maps against dense P^H Lambda^(s) P built here from the
paper's definitions, the group law W_s^H W_t = W_{t-s} (1D and 2D), offset-only scores, RoPE as
LRPE type 2 with P = I, feature_out_dim, options, shapes under jit, dtypes, gradients."""

from __future__ import annotations

import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos import positional
from fastpos.ops.features import FEATURE_MAPS
from fastpos.positional import Context, Dims, KernelInfo, lrpe
from tests.helpers import rel_err as _real_rel_err

HEADS = 2
F = 6
GRID = (3, 4)
N1 = 11  # positions extracted in 1D
TYPES = (1, 2, 3)
PS = lrpe.P_CHOICES
CONFIGS = [(t, p) for t in TYPES for p in PS]
# The (type, p) cells of the default run: each type twice and each P at least once (the shared
# cells also share compiles across the tests); the full product runs with -m slow.
DEFAULT_CONFIGS = {
    (1, "fourier"),
    (1, "identity"),
    (2, "householder"),
    (2, "permutation"),
    (3, "random_permutation"),
    (3, "householder"),
}
WORST: dict[str, float] = {}  # worst relative errors, printed with -s


def _sampled(cases, default, ids=None):
  """``cases`` as parameters; those not in ``default`` run with ``-m slow`` only."""
  return [
      pytest.param(
          *(c if isinstance(c, tuple) and ids is None else (c,)),
          id=None if ids is None else ids[i],
          marks=() if c in default else pytest.mark.slow,
      )
      for i, c in enumerate(cases)
  ]


@pytest.fixture(scope="module", autouse=True)
def _print_worst_errors():
  """Prints the worst errors measured (``pytest -s``) when the module's tests are done."""
  yield
  for name, err in sorted(WORST.items()):
    print(f"\n  worst {name:50s} {err:.2e}", end="")


def _note(name: str, err: float) -> float:
  WORST[name] = max(WORST.get(name, 0.0), err)
  return err


def _dims(f=F, *, two_d=False, head_dim=None) -> Dims:
  return Dims(
      num_heads=HEADS,
      head_dim=head_dim or f,
      feature_dim=f,
      embed_dim=8,
      max_length=16,
      grid=GRID if two_d else None,
  )


def _opts(lrpe_type, p, **extra) -> tuple:
  return tuple(sorted({"type": lrpe_type, "p": p, **extra}.items()))


# ---------------------------------------------------------------------------------------------
# Building and applying (one jit per configuration and context)
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _module(name: str, options: tuple, dims: Dims):
  return positional.build(name, dims, dict(options))


def _init_args(dims: Dims):
  n = N1 if dims.grid is None else GRID[0] * GRID[1]
  x = np.zeros((1, n, HEADS, dims.feature_dim))
  return x, Context(length=n, grid=None if dims.grid is None else GRID)


@functools.lru_cache(maxsize=None)
def _init_params(name: str, options: tuple, dims: Dims):
  """The initial parameters (lrpe: built by ``setup`` alone, nothing else to compile)."""
  module = _module(name, options, dims)
  if name == "lrpe":
    return jax.jit(lambda key: module.init(key, method=lambda m: m._arrays()))(jax.random.key(0))
  x, ctx = _init_args(dims)
  return jax.jit(lambda key: module.init(key, x, x, ctx, method="features"))(jax.random.key(0))


@functools.lru_cache(maxsize=None)
def _params(name: str, options: tuple, dims: Dims):
  """Random parameters of the right shapes (traced, not compiled): angles U(0.3, 1.3) so that
  nearby offsets give clearly different maps; householder vectors N(0, 1)."""
  module = _module(name, options, dims)
  x, ctx = _init_args(dims)
  shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), x, x, ctx, method="features"))
  rng = np.random.default_rng(zlib.crc32(repr((name, options, dims)).encode()))

  def draw(path, leaf):
    if "theta" in jax.tree_util.keystr(path):
      return rng.uniform(0.3, 1.3, leaf.shape)
    return rng.standard_normal(leaf.shape)

  return jax.tree_util.tree_map_with_path(draw, shapes)


@functools.lru_cache(maxsize=None)
def _features_fn(name: str, options: tuple, dims: Dims, ctx: Context):
  module = _module(name, options, dims)
  return jax.jit(lambda params, q, k: module.apply(params, q, k, ctx, method="features"))


def _features(name, options, dims, q, k, *, params=None):
  """(q_hat, k_hat) as numpy; memory M = Lk - Lq; the grid is GRID when dims has one."""
  grid = None if dims.grid is None else GRID
  ctx = Context(length=q.shape[1], memory_length=k.shape[1] - q.shape[1], grid=grid)
  params = _params(name, options, dims) if params is None else params
  return tuple(np.asarray(a) for a in _features_fn(name, options, dims, ctx)(params, q, k))


def rel_err(actual, expected) -> float:
  """tests.helpers.rel_err for complex arrays too (it would drop imaginary parts)."""
  a, e = np.asarray(actual), np.asarray(expected)
  return _real_rel_err(np.stack([a.real, a.imag]), np.stack([e.real, e.imag]))


def _complex(out, f):
  """[Re, Im] realised features -> complex; real ones as they are."""
  if out.shape[-1] == 2 * f:
    return out[..., :f] + 1j * out[..., f:]
  assert out.shape[-1] == f
  return out.astype(complex)


def _maps(name, options, dims):
  """The hook's map M_s at every position: ``[n, heads, f_out, f_in]`` complex, read off
  basis inputs (q = e_j at every position); the q and k maps must agree."""
  f = dims.feature_dim
  n = N1 if dims.grid is None else GRID[0] * GRID[1]
  basis = np.zeros((f, n, HEADS, f))
  basis[np.arange(f), :, :, np.arange(f)] = 1.0
  qh, kh = _features(name, options, dims, basis, basis)
  np.testing.assert_array_equal(qh, kh)
  assert qh.shape[-1] == positional.get_class(name).feature_out_dim(f, dict(options))
  return np.moveaxis(_complex(qh, f), 0, -1)


def _w(maps):
  """W_s = M_0^H M_s (M_0 = P since Lambda^(0) = I): ``[n, heads, f, f]``."""
  return np.einsum("hji,shjk->shik", maps[0].conj(), maps)


def _dag(a):
  return np.swapaxes(a.conj(), -1, -2)


# ---------------------------------------------------------------------------------------------
# Dense references from the paper's definitions
# ---------------------------------------------------------------------------------------------
def _slot_axes(n, two_d):
  """Which coordinate each angle slot follows: 1D all 0; 2D first ceil(n/2) rows."""
  return np.array([0] * n if not two_d else [0] * (n - n // 2) + [1] * (n // 2))


def _ref_p(p, f, params, head):
  """P (complex [f, f]) from its definition, or None for the fixed random ones."""
  if p == "identity":
    return np.eye(f, dtype=complex)
  if p == "householder":
    if "householder_v" not in params.get("params", {}):
      return None
    v = np.asarray(params["params"]["householder_v"])[head]
    return (np.eye(f) - 2.0 * np.outer(v, v) / (v @ v)).astype(complex)  # Eq. 73
  if p == "permutation":  # Eq. 74
    out = np.zeros((f, f), complex)
    half = (f + 1) // 2
    for k in range(half):
      out[2 * k, k] = 1.0
    for k in range(f // 2):
      out[2 * k + 1, half + k] = 1.0
    return out
  if p == "fourier":
    return np.fft.fft(np.eye(f), norm="ortho", axis=0)
  return None


def _ref_lambda(lrpe_type, f, theta, slot_pos):
  """Lambda for per-slot positions ``slot_pos`` (types 1, 2; Eq. 22, 23), complex [f, f]."""
  if lrpe_type == 1:
    return np.diag(np.exp(1j * slot_pos * theta))
  out = np.eye(f, dtype=complex)
  for k in range(f // 2):
    a = slot_pos[k] * theta[k]
    out[2 * k : 2 * k + 2, 2 * k : 2 * k + 2] = [[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]]
  return out


def _positions(dims):
  if dims.grid is None:
    return np.arange(N1)[:, None]
  idx = np.arange(GRID[0] * GRID[1])
  return np.stack([idx // GRID[1], idx % GRID[1]], axis=-1)


def _assert_permutation_matrix(m):
  assert np.allclose(m.imag, 0.0, atol=1e-12)
  r = np.round(m.real)
  assert np.allclose(m.real, r, atol=1e-12) and set(np.unique(r)) <= {0.0, 1.0}
  np.testing.assert_array_equal(r.sum(0), 1.0)
  np.testing.assert_array_equal(r.sum(1), 1.0)


def _check_maps_against_reference(lrpe_type, p, options, dims, maps):
  """M_s == Lambda^(s) P for every position s and head, with P and Lambda from the paper's
  definitions (fixed random P / type 3's pi: read off the hook, then checked to be what they
  must be: a permutation / a Householder reflection, and Lambda^(s) = pi's powers)."""
  f = dims.feature_dim
  params = _params("lrpe", options, dims)
  pos = _positions(dims)
  two_d = dims.grid is not None
  worst = 0.0
  for h in range(HEADS):
    hp = h if dict(options).get("per_head", False) else 0
    pm = _ref_p(p, f, params, hp)
    if pm is None:
      pm = maps[0, h]  # Lambda^(0) = I: M_0 = P
      if p == "random_permutation":
        _assert_permutation_matrix(pm)
      else:  # fixed Householder: a reflection
        assert rel_err(pm, _dag(pm)) < 1e-12
        assert rel_err(pm @ pm, np.eye(f)) < 1e-12
        assert np.linalg.matrix_rank(np.eye(f) - pm, tol=1e-9) == 1
    if lrpe_type in (1, 2):
      theta = params.get("params", {}).get("theta")
      if theta is None:  # fixed angles: the paper's ladder
        theta = lrpe.inverse_frequencies(
            lrpe_type, f, two_d=two_d, base=dict(options).get("base", 10000.0)
        )
      else:
        theta = np.asarray(theta)[hp]
      n_slots = f if lrpe_type == 1 else f // 2
      axes = _slot_axes(n_slots, two_d)
      lams = [_ref_lambda(lrpe_type, f, theta, pos[s][axes]) for s in range(len(pos))]
    else:
      # pi (one per axis in 2D) read off the unit steps, Lambda = M P^H; then its powers.
      units = [1] if not two_d else [GRID[1], 1]  # raster index of (1, 0) and (0, 1)
      gens = [maps[u, h] @ _dag(pm) for u in units]
      for g in gens:
        _assert_permutation_matrix(g)
        assert not np.allclose(g, np.eye(f))
      gens = [np.round(g.real) for g in gens]  # exact 0/1 matrices
      if two_d:
        assert rel_err(gens[0] @ gens[1], gens[1] @ gens[0]) == 0.0  # the axes commute
      lams = [
          functools.reduce(
              np.matmul, [np.linalg.matrix_power(g, int(c)) for g, c in zip(gens, pos[s])]
          )
          for s in range(len(pos))
      ]
    for s in range(len(pos)):
      worst = max(worst, rel_err(maps[s, h], lams[s] @ pm))
  return worst


# ---------------------------------------------------------------------------------------------
# (1) the group law W_s^H W_t = W_{t-s} and the maps against P^H Lambda^(s) P
# ---------------------------------------------------------------------------------------------
EXTRA_1D = [  # per-head parameters, fixed angles / householder vector, odd feature dims
    (_opts(1, "fourier", per_head=True), 6),
    (_opts(2, "householder", per_head=True), 6),
    (_opts(3, "random_permutation", per_head=True), 6),
    (_opts(2, "householder", learnable_p=False), 6),
    (_opts(1, "identity", learnable_theta=False), 6),
    (_opts(1, "householder"), 5),
    (_opts(2, "identity"), 5),
    (_opts(2, "fourier"), 5),
    (_opts(3, "permutation"), 5),
    (_opts(2, "permutation"), 7),
]
CASES_1D = [(_opts(t, p), F) for t, p in CONFIGS] + EXTRA_1D
# Default: the default cells, per-head parameters, fixed P / fixed angles and an odd dimension.
DEFAULT_1D = {(_opts(t, p), F) for t, p in DEFAULT_CONFIGS} | {
    EXTRA_1D[2],
    EXTRA_1D[3],
    EXTRA_1D[4],
    EXTRA_1D[9],
}


def _case_id(case):
  options, f = case
  return ",".join(f"{k}={v}" for k, v in options) + f",f={f}"


@pytest.mark.parametrize(
    "case", _sampled(CASES_1D, DEFAULT_1D, ids=[_case_id(c) for c in CASES_1D])
)
def test_group_law_and_maps_match_paper_definitions(case):
  options, f = case
  o = dict(options)
  dims = _dims(f)
  maps = _maps("lrpe", options, dims)
  w = _w(maps)
  eye = np.broadcast_to(np.eye(f), w.shape)
  assert _note("W_0 = I", rel_err(w[0], eye[0])) < 1e-9
  assert _note("W_s unitary", rel_err(_dag(w) @ w, eye)) < 1e-9
  worst = 0.0
  for s in range(N1):
    for t in range(N1):
      want = w[t - s] if t >= s else _dag(w[s - t])
      worst = max(worst, rel_err(_dag(w[s]) @ w[t], want))
  assert _note("W_s^H W_t = W_{t-s} (1D)", worst) < 1e-9
  err = _check_maps_against_reference(o["type"], o["p"], options, dims, maps)
  assert _note("M_s = Lambda^(s) P vs paper definitions", err) < 1e-9
  # Positions really are told apart: W_1 is not the identity.
  assert np.max(np.abs(w[1] - eye[0])) > 1e-2
  if o.get("per_head"):  # heads hold different parameters / permutations
    assert np.max(np.abs(maps[1, 0] - maps[1, 1])) > 1e-3


# ---------------------------------------------------------------------------------------------
# (2) scores depend on the offset j - i only (with memory: queries at M + i)
# ---------------------------------------------------------------------------------------------
def _ref_scores(w, q, k, memory):
  """q_i^T Re(W_{j - (M + i)}) k_j from the maps W (offsets beyond the table: W_{-r} = W_r^H)."""
  lq, lk = q.shape[1], k.shape[1]
  out = np.zeros((q.shape[0], HEADS, lq, lk))
  for i in range(lq):
    for j in range(lk):
      r = j - (memory + i)
      wr = w[r] if r >= 0 else _dag(w[-r])
      out[:, :, i, j] = np.einsum("bhf,hfg,bhg->bh", q[:, i], wr.real, k[:, j])
  return out


def _qk_shapes(f, memory):
  """Shapes shared by the 1D tests (one compile per configuration and memory): batch f (as
  the basis inputs), keys N1, queries N1 - M."""
  return (f, N1 - memory, HEADS, f), (f, N1, HEADS, f)


# The default cells, with and without memory in turn; the full product runs with -m slow.
@pytest.mark.parametrize(
    "lrpe_type, p, memory",
    _sampled(
        [(t, p, m) for m in (0, 4) for t, p in CONFIGS],
        {(t, p, 4 * (i % 2)) for i, (t, p) in enumerate(sorted(DEFAULT_CONFIGS))},
    ),
)
def test_scores_depend_on_offset_only(lrpe_type, p, memory):
  options, dims = _opts(lrpe_type, p), _dims()
  q_shape, k_shape = _qk_shapes(F, memory)
  rng = np.random.default_rng(3)
  # Same content at every position: the score matrix must be Toeplitz.
  q0, k0 = rng.standard_normal((HEADS, F)), rng.standard_normal((HEADS, F))
  q, k = np.broadcast_to(q0, q_shape).copy(), np.broadcast_to(k0, k_shape).copy()
  qh, kh = _features("lrpe", options, dims, q, k)
  scores = np.einsum("bihf,bjhf->bhij", qh, kh)
  assert _note("score shift (1D)", rel_err(scores[..., 1:, 1:], scores[..., :-1, :-1])) < 1e-9
  assert np.ptp(scores[0, 0, 0]) > 1e-2 * np.max(np.abs(scores))  # offsets told apart
  w = _w(_maps("lrpe", options, dims))
  assert _note("scores vs q^T Re(W_{j-i}) k", rel_err(scores, _ref_scores(w, q, k, memory))) < 1e-9
  # Different content at every position, against the dense reference entry by entry.
  q, k = rng.standard_normal(q_shape), rng.standard_normal(k_shape)
  qh, kh = _features("lrpe", options, dims, q, k)
  scores = np.einsum("bihf,bjhf->bhij", qh, kh)
  assert _note("scores vs q^T Re(W_{j-i}) k", rel_err(scores, _ref_scores(w, q, k, memory))) < 1e-9
  # Query i after M memory keys sits at position M + i: the same map as key M + i.
  qh2, kh2 = _features("lrpe", options, dims, k[:, memory:], k)
  np.testing.assert_array_equal(qh2, kh2[:, memory:])
  # feature_out_dim is what comes out (softmax dims: f = head_dim).
  out_dim = positional.get_class("lrpe").feature_out_dim(F, dict(options))
  assert qh.shape == q_shape[:3] + (out_dim,) and kh.shape == k_shape[:3] + (out_dim,)


@pytest.mark.parametrize("p", PS)
def test_type1_real_p_scores_are_even_in_the_offset(p):
  """Re(W_r) = P^T diag(cos r alpha) P for real P: the score of offset r equals that of -r
  (documented); the complex Fourier P breaks the symmetry."""
  w = _w(_maps("lrpe", _opts(1, p), _dims()))
  sym = rel_err(w[3].real, _dag(w[3]).real)  # Re(W_{-3}) = Re(W_3^H)
  if p == "fourier":
    assert sym > 1e-3
  else:
    assert sym < 1e-12


def test_long_offsets_and_cycles():
  """Far positions (queries at 1000..1006): angles and permutation powers still give
  q_i^T Re(W_{j-i}) k_j, with W read off positions 0..N1-1."""
  for lrpe_type, p in [(1, "fourier"), (2, "householder"), (3, "random_permutation")]:
    options, dims = _opts(lrpe_type, p), _dims()
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((2, 7, HEADS, F)), rng.standard_normal((2, 1007, HEADS, F))
    qh, kh = _features("lrpe", options, dims, q, k)
    scores = np.einsum("bihf,bjhf->bhij", qh, kh)[..., 1000 - 4 :]  # keys 996..1006
    want = _ref_scores(_w(_maps("lrpe", options, dims)), q, k[:, 1000 - 4 :], 4)
    assert _note("scores at positions ~1000", rel_err(scores, want)) < 1e-9


# ---------------------------------------------------------------------------------------------
# (3) RoPE = LRPE type 2, P = I, fixed angles base^(-2k/f)
# ---------------------------------------------------------------------------------------------
def _rope_classic(x, positions, base=10000.0):
  """RoFormer in complex form: z_k = x_{2k} + i x_{2k+1} -> z_k exp(i s base^(-2k/f))."""
  f = x.shape[-1]
  out = x.copy()
  for kk in range(f // 2):
    z = x[..., 2 * kk] + 1j * x[..., 2 * kk + 1]
    z = z * np.exp(1j * positions[None, :, None] * base ** (-2.0 * kk / f))
    out[..., 2 * kk], out[..., 2 * kk + 1] = z.real, z.imag
  return out


@pytest.mark.parametrize(
    "f, two_d, base",
    [
        (6, False, 10000.0),
        (5, False, 10000.0),
        (8, False, 500.0),
        (8, True, 10000.0),
        (9, True, 100.0),
    ],
)
def test_rope_is_lrpe_type2_identity(f, two_d, base):
  dims = _dims(f, two_d=two_d)
  rng = np.random.default_rng(5)
  n = GRID[0] * GRID[1] if two_d else 7
  memory = 0 if two_d else 3
  q = rng.standard_normal((2, n, HEADS, f))
  k = rng.standard_normal((2, n + memory, HEADS, f))
  rope = _features("rope", (("base", base),), dims, q, k, params={})
  fixed = _opts(2, "identity", learnable_theta=False, base=base)
  lrpe_fixed = _features("lrpe", fixed, dims, q, k, params={})
  for a, b in zip(rope, lrpe_fixed):
    np.testing.assert_array_equal(a, b)
  if f in (6, 8) and base == 10000.0:  # the learned angles start at RoPE's
    learned = _opts(2, "identity", base=base)
    init = _init_params("lrpe", learned, dims)
    for a, b in zip(rope, _features("lrpe", learned, dims, q, k, params=init)):
      assert _note("rope vs lrpe(2, identity, learned init)", rel_err(a, b)) < 1e-12
  if not two_d:
    want_q = _rope_classic(q, memory + np.arange(n), base)
    want_k = _rope_classic(k, np.arange(n + memory), base)
    assert _note("rope vs RoFormer formula", rel_err(rope[0], want_q)) < 1e-12
    assert _note("rope vs RoFormer formula", rel_err(rope[1], want_k)) < 1e-12
    if f % 2:
      np.testing.assert_array_equal(rope[0][..., -1], q[..., -1])  # odd f: last unrotated
  else:
    # Axial: the first ceil(n/2) pairs rotate with the row, the rest with the column, each
    # with its own ladder base^(-2k/(2g)).
    npairs = f // 2
    groups = (npairs - npairs // 2, npairs // 2)
    ladders = [base ** (-np.arange(g) / g) for g in groups]
    rows, cols = np.arange(n) // GRID[1], np.arange(n) % GRID[1]
    want = q.copy()
    for kk in range(npairs):
      axis, idx = (0, kk) if kk < groups[0] else (1, kk - groups[0])
      a = (rows if axis == 0 else cols)[None, :, None] * ladders[axis][idx]
      x0, x1 = q[..., 2 * kk], q[..., 2 * kk + 1]
      want[..., 2 * kk] = x0 * np.cos(a) - x1 * np.sin(a)
      want[..., 2 * kk + 1] = x0 * np.sin(a) + x1 * np.cos(a)
    assert _note("rope 2D vs axial formula", rel_err(rope[0], want)) < 1e-12


def test_rope_has_no_parameters_and_declares_its_hook():
  cls = positional.get_class("rope")
  assert cls.hooks == ("features",) and cls.feature_stage == "post_phi"
  assert not cls.keeps_nonnegative and cls.supports_causal and cls.supports_2d
  assert positional.option_names("rope") == ("base",)
  params = _init_params("rope", (), _dims())
  assert not jax.tree.leaves(params)


# ---------------------------------------------------------------------------------------------
# (4) feature_out_dim, (6) shapes under jit for softmax and linear dims, dtypes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lrpe_type, p", _sampled(CONFIGS, DEFAULT_CONFIGS))
def test_feature_out_dim_and_shapes_under_jit(lrpe_type, p):
  """Linear-kernel dims: the hook sees f = m (10) != head_dim (4); params follow m. (Softmax
  dims, f = head_dim, 1D and 2D: the shapes checks of the tests above.)"""
  cls = positional.get_class("lrpe")
  options = _opts(lrpe_type, p)
  for f in (4, 5, 10, 64):
    assert cls.feature_out_dim(f, dict(options)) == (
        2 * f if lrpe_type == 1 or p == "fourier" else f
    )
  dims = _dims(10, head_dim=4)
  out_dim = cls.feature_out_dim(10, dict(options))
  rng = np.random.default_rng(6)
  q, k = rng.standard_normal((3, 5, HEADS, 10)), rng.standard_normal((3, 7, HEADS, 10))
  qh, kh = _features("lrpe", options, dims, q, k)  # jitted
  assert qh.shape == (3, 5, HEADS, out_dim) and kh.shape == (3, 7, HEADS, out_dim)
  # Unitary maps preserve each token's norm.
  assert rel_err(np.linalg.norm(qh, axis=-1), np.linalg.norm(q, axis=-1)) < 1e-12
  params = jax.tree.leaves(_params("lrpe", options, dims))
  assert all(a.shape[-1] in (10, 5) for a in params)  # v [1, m], theta [1, m or m/2]
  assert positional.get_class("rope").feature_out_dim(10, {}) == 10


@pytest.mark.parametrize("lrpe_type, p", [(1, "householder"), (2, "fourier"), (3, "permutation")])
def test_float32_and_bfloat16_keep_their_dtype(lrpe_type, p):
  options, dims = _opts(lrpe_type, p), _dims()
  rng = np.random.default_rng(7)
  q = rng.standard_normal(_qk_shapes(F, 0)[0])
  want = _features("lrpe", options, dims, q, q)[0]
  params32 = jax.tree.map(lambda a: np.asarray(a, np.float32), _params("lrpe", options, dims))
  got = _features(
      "lrpe", options, dims, q.astype(np.float32), q.astype(np.float32), params=params32
  )[0]
  assert got.dtype == np.float32
  assert _note("float32 vs float64", rel_err(got, want)) < 1e-5
  got16 = _features(
      "lrpe",
      options,
      dims,
      jnp.asarray(q, jnp.bfloat16),
      jnp.asarray(q, jnp.bfloat16),
      params=params32,
  )[0]
  assert got16.dtype == jnp.bfloat16
  assert rel_err(got16.astype(np.float64), want) < 3e-2


# ---------------------------------------------------------------------------------------------
# (7) 2D (axial): W_a^H W_b = W_{b-a} for 2D offsets; scores shift in rows and columns
# ---------------------------------------------------------------------------------------------
CASES_2D = CONFIGS + [(2, "identity", 9), (3, "householder", 7), (1, "fourier", 5)]


# Default: the default cells and one odd feature dimension; the rest -m slow.
DEFAULT_2D = set(DEFAULT_CONFIGS) | {(2, "identity", 9)}


@pytest.mark.parametrize("case", _sampled(CASES_2D, DEFAULT_2D, ids=[str(c) for c in CASES_2D]))
def test_2d_group_law_and_shift(case):
  lrpe_type, p = case[:2]
  f = case[2] if len(case) > 2 else 8
  options, dims = _opts(lrpe_type, p), _dims(f, two_d=True)
  maps = _maps("lrpe", options, dims)
  w = _w(maps)
  h, wd = GRID
  rc = [(a // wd, a % wd) for a in range(h * wd)]
  worst = 0.0
  for a in range(h * wd):
    for b in range(h * wd):
      dr, dc = rc[b][0] - rc[a][0], rc[b][1] - rc[a][1]
      lhs = _dag(w[a]) @ w[b]
      # W_(dr,dc) = W_(dr,0) W_(0,dc); negative offsets are inverses (W^H).
      wr = w[dr * wd] if dr >= 0 else _dag(w[-dr * wd])
      wc = w[dc] if dc >= 0 else _dag(w[-dc])
      worst = max(worst, rel_err(lhs, wr @ wc))
  assert _note("W_a^H W_b = W_{b-a} (2D)", worst) < 1e-9
  err = _check_maps_against_reference(lrpe_type, p, options, dims, maps)
  assert _note("M_(r,c) = Lambda^(r,c) P vs definitions (2D)", err) < 1e-9
  eye = np.eye(f)
  w_row, w_col = w[wd], w[1]  # offsets (1, 0) and (0, 1)
  assert np.max(np.abs(w_row - eye)) > 1e-2 and np.max(np.abs(w_col - eye)) > 1e-2
  assert np.max(np.abs(w_row - w_col)) > 1e-2
  rng = np.random.default_rng(8)
  q0, k0 = rng.standard_normal((HEADS, f)), rng.standard_normal((HEADS, f))
  qh, kh = _features(
      "lrpe",
      options,
      dims,
      np.broadcast_to(q0, (f, h * wd, HEADS, f)),
      np.broadcast_to(k0, (f, h * wd, HEADS, f)),
  )
  s = np.einsum("ihf,jhf->hij", qh[0], kh[0]).reshape(HEADS, h, wd, h, wd)
  scale = np.max(np.abs(s))
  assert (
      _note("score shift (2D)", np.max(np.abs(s[:, 1:, :, 1:, :] - s[:, :-1, :, :-1, :])) / scale)
      < 1e-9
  )
  assert (
      _note("score shift (2D)", np.max(np.abs(s[:, :, 1:, :, 1:] - s[:, :, :-1, :, :-1])) / scale)
      < 1e-9
  )


# ---------------------------------------------------------------------------------------------
# Parameters: the paper's init, learnable or fixed, gradients, locality
# ---------------------------------------------------------------------------------------------
def test_init_is_the_papers():
  dims = _dims(8)
  p1 = _init_params("lrpe", _opts(1, "identity"), dims)["params"]
  np.testing.assert_allclose(
      np.asarray(p1["theta"]), [10000.0 ** (-2.0 * np.arange(8) / 8)], rtol=1e-15
  )
  p2 = _init_params("lrpe", _opts(2, "householder"), dims)["params"]
  np.testing.assert_allclose(
      np.asarray(p2["theta"]), [10000.0 ** (-2.0 * np.arange(4) / 8)], rtol=1e-15
  )
  v = np.asarray(p2["householder_v"])
  assert v.shape == (1, 8) and np.all(v != 0.0) and len(np.unique(v)) == 8
  ph = _init_params("lrpe", _opts(2, "householder", per_head=True), dims)["params"]
  assert ph["theta"].shape == (HEADS, 4) and ph["householder_v"].shape == (HEADS, 8)
  p2d = _init_params("lrpe", _opts(2, "identity"), _dims(8, two_d=True))["params"]
  # 2D: two pairs per axis, each axis with the ladder base^(-2k/4).
  np.testing.assert_allclose(np.asarray(p2d["theta"]), [[1.0, 0.01, 1.0, 0.01]], rtol=1e-15)
  assert not jax.tree.leaves(_init_params("lrpe", _opts(3, "identity"), dims))
  assert not jax.tree.leaves(
      _init_params("lrpe", _opts(2, "householder", learnable_theta=False, learnable_p=False), dims)
  )
  assert positional.option_names("lrpe") == (
      "type",
      "p",
      "learnable_theta",
      "learnable_p",
      "per_head",
      "base",
      "seed",
  )


def test_gradients_reach_theta_and_householder_vector():
  options, dims = _opts(1, "householder"), _dims()
  module = _module("lrpe", options, dims)
  rng = np.random.default_rng(9)
  q, k = rng.standard_normal((1, 5, HEADS, F)), rng.standard_normal((1, 5, HEADS, F))
  ctx = Context(length=5)

  def loss(params):
    qh, kh = module.apply(params, q, k, ctx, method="features")
    return jnp.sum(jnp.einsum("bihf,bjhf->bhij", qh, kh) ** 2)

  grads = jax.jit(jax.grad(loss))(_params("lrpe", options, dims))["params"]
  for name in ("theta", "householder_v"):
    g = np.asarray(grads[name])
    assert np.all(np.isfinite(g)) and np.max(np.abs(g)) > 1e-6, name


def test_each_position_sees_only_its_own_input():
  """A per-position map: changing token 3 changes output 3 only (so no causal leak)."""
  for lrpe_type, p in [(1, "fourier"), (2, "householder"), (3, "random_permutation")]:
    options, dims = _opts(lrpe_type, p), _dims()
    rng = np.random.default_rng(10)
    q = rng.standard_normal(_qk_shapes(F, 0)[0])
    q2 = q.copy()
    q2[:, 3] += 1.0
    a, b = _features("lrpe", options, dims, q, q)[0], _features("lrpe", options, dims, q2, q2)[0]
    changed = np.any(a != b, axis=(0, 2, 3))
    np.testing.assert_array_equal(changed, np.arange(N1) == 3)


def test_seed_picks_the_fixed_permutations():
  dims = _dims(8)
  m = {s: _maps("lrpe", _opts(3, "random_permutation", seed=s), dims) for s in (0, 1)}
  assert not np.array_equal(m[0][0], m[1][0])  # P differs
  again = _maps("lrpe", _opts(3, "random_permutation", seed=0), dims)
  np.testing.assert_array_equal(again, m[0])


# ---------------------------------------------------------------------------------------------
# (5) options and errors; compatibility
# ---------------------------------------------------------------------------------------------
TYPE_MSG = "valid choices: 1 (unitary, complex), 2 (orthogonal rotations), 3 (permutation)"
P_MSG = "valid choices: identity, householder, permutation, random_permutation, fourier"
BAD_OPTIONS = [
    ({"type": 4}, "unknown type 4; " + TYPE_MSG),
    ({"type": 0}, "unknown type 0; " + TYPE_MSG),
    ({"type": "2"}, "unknown type '2'; " + TYPE_MSG),
    ({"type": True}, "unknown type True; " + TYPE_MSG),
    ({"p": "fft"}, "unknown p 'fft'; " + P_MSG),
    ({"p": "Householder"}, "unknown p 'Householder'; " + P_MSG),
    ({"type": 3, "learnable_theta": True}, "learnable_theta=True needs type 1 or 2"),
    ({"learnable_theta": "yes"}, "learnable_theta must be None, True or False"),
    ({"p": "identity", "learnable_p": True}, "learnable_p=True needs p='householder'"),
    ({"learnable_p": 1}, "learnable_p must be None, True or False"),
    ({"per_head": 1}, "per_head must be True or False"),
    ({"base": -1.0}, "base must be a finite number > 0"),
    ({"base": float("inf")}, "base must be a finite number > 0"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"seed": 1.5}, "seed must be an integer >= 0"),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS)
def test_bad_options_raise(options, message):
  cls = positional.get_class("lrpe")
  with pytest.raises(ValueError, match=re.escape(message)):
    cls.compatibility(KernelInfo("softmax"), causal=False, two_d=False, options=options)
  with pytest.raises(ValueError, match=re.escape(message)):
    cls.feature_out_dim(F, options)
  module = positional.build("lrpe", _dims(), options)
  x = np.zeros((1, 3, HEADS, F))
  with pytest.raises(ValueError, match=re.escape(message)):
    module.init(jax.random.key(0), x, x, Context(length=3), method="features")


@pytest.mark.parametrize(
    "name, options, f, two_d, message",
    [
        ("lrpe", {"type": 2}, 1, False, "type 2 needs a feature dim >= 2 in 1D; got feature dim 1"),
        ("lrpe", {"type": 3}, 1, False, "type 3 needs a feature dim >= 2 in 1D"),
        ("lrpe", {"type": 2}, 3, True, "type 2 needs a feature dim >= 4 in 2D"),
        ("lrpe", {"type": 3}, 3, True, "type 3 needs a feature dim >= 4 in 2D"),
        ("lrpe", {"type": 1}, 1, True, "type 1 needs a feature dim >= 2 in 2D"),
        ("rope", {}, 3, True, "rope: type 2 needs a feature dim >= 4 in 2D"),
        ("rope", {"base": 0}, 6, False, "rope: base must be a finite number > 0"),
    ],
)
def test_too_few_features_and_bad_base_raise_at_build(name, options, f, two_d, message):
  module = positional.build(name, _dims(f, two_d=two_d), options)
  n = 12 if two_d else 3
  x = np.zeros((1, n, HEADS, f))
  ctx = Context(length=n, grid=GRID if two_d else None)
  with pytest.raises(ValueError, match=re.escape(message)):
    module.init(jax.random.key(0), x, x, ctx, method="features")


def test_type1_with_one_feature_works_in_1d():
  dims = _dims(1)
  w = _w(_maps("lrpe", _opts(1, "identity"), dims))
  assert (
      abs(
          w[2, 0, 0, 0]
          - np.exp(2j * _params("lrpe", _opts(1, "identity"), dims)["params"]["theta"][0, 0])
      )
      < 1e-12
  )


@pytest.mark.parametrize("name", ["lrpe", "rope"])
def test_call_errors(name):
  options = () if name == "rope" else _opts(2, "identity")
  module, dims = _module(name, options, _dims()), _dims()
  params = _init_params(name, options, dims)
  x = np.zeros((1, 4, HEADS, F))
  with pytest.raises(ValueError, match=re.escape(f"{name}: q must be [batch, length")):
    module.apply(params, np.zeros((1, 4, HEADS, F + 1)), x, Context(length=4), method="features")
  with pytest.raises(ValueError, match="ctx.memory_length = 0"):
    module.apply(params, x, np.zeros((1, 6, HEADS, F)), Context(length=4), method="features")
  with pytest.raises(ValueError, match="built for 1D"):
    module.apply(params, x, x, Context(length=4, grid=(2, 2)), method="features")
  dims2 = _dims(8, two_d=True)
  module2, params2 = _module(name, options, dims2), _init_params(name, options, dims2)
  y = np.zeros((1, 12, HEADS, 8))
  with pytest.raises(ValueError, match="built for a 2D grid but called without one"):
    module2.apply(params2, y, y, Context(length=12), method="features")
  with pytest.raises(ValueError, match="does not cover length 12"):
    module2.apply(params2, y, y, Context(length=12, grid=(2, 5)), method="features")
  with pytest.raises(ValueError, match="unknown option 'kind'"):
    positional.build(name, dims, {"kind": 1})


@pytest.mark.parametrize("name", ["lrpe", "rope"])
def test_compatible_with_every_kernel_causal_and_2d(name):
  cls = positional.get_class(name)
  assert cls.hooks == ("features",) and cls.feature_stage == "post_phi"
  assert not cls.keeps_nonnegative and cls.supports_causal and cls.supports_1d
  assert cls.supports_2d
  for kernel in ("softmax",) + FEATURE_MAPS:
    for causal in (False, True):
      for two_d in (False, True):
        assert cls.compatibility(KernelInfo(kernel), causal=causal, two_d=two_d, options={}) is None
