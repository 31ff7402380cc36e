"""Tests for fastpos.ops.features: formulas, shapes, unbiasedness, stabilisers, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.ops import features as F

B, L, H, D, M = 2, 5, 3, 4, 6
RANDOM = ("favor", "prf", "trf", "nprf", "orf")


def _x(seed, shape=(B, L, H, D), scale=1.0, shift=0.0):
  return np.random.default_rng(seed).normal(size=shape) * scale + shift


def _attn(phi_q, phi_k):
  """Normalised kernel attention weights A[b, h, i, j] by a plain einsum."""
  s = jnp.einsum("bihm,bjhm->bhij", phi_q, phi_k, precision="highest")
  return s / jnp.sum(s, axis=-1, keepdims=True)


def _key(seed=0):
  return jax.random.PRNGKey(seed)


# ---------------------------------------------------------------------------------------------
# Shapes, dtypes, registry
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", F.FEATURE_MAPS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float64])
def test_shape_and_dtype(name, dtype):
  x = jnp.asarray(_x(0), dtype)
  proj = F.make_projection(name, _key(), M, D)  # float32
  assert (proj is None) == (name not in RANDOM)
  out = F.feature_map(name, x, projection=proj, nu=2)
  assert out.shape == (B, L, H, F.feature_dim(name, D, num_features=M, nu=2))
  assert out.dtype == (jnp.float64 if dtype == jnp.float64 else jnp.float32)
  assert np.all(np.isfinite(np.asarray(out)))


def test_feature_dim_and_nonnegative_registry():
  expected = {
      "softmax": 4,
      "elu1": 4,
      "relu": 4,
      "sikf": 4,
      "dpfp": 24,
      "favor": 7,
      "prf": 7,
      "trf": 14,
      "nprf": 7,
      "orf": 7,
  }
  assert {n: F.feature_dim(n, 4, num_features=7, nu=3) for n in expected} == expected
  assert [n for n in expected if not F.is_nonnegative(n)] == ["trf"]
  assert [n for n in expected if F.needs_projection(n)] == list(RANDOM)
  assert [n for n in expected if F.get_kernel(n).estimates_softmax] == [
      "favor",
      "prf",
      "trf",
      "orf",
  ]


@pytest.mark.parametrize("name", RANDOM)
def test_per_head_projection_matches_shared(name):
  x = jnp.asarray(_x(1))
  proj = F.make_projection(name, _key(3), M, D, dtype=jnp.float64)
  per_head = jnp.stack([proj, 2.0 * proj, -proj])  # [H, M, D]
  out = F.feature_map(name, x, projection=per_head, is_query=True)
  for h, w in enumerate(per_head):
    ref = F.feature_map(name, x[:, :, h : h + 1], projection=w, is_query=True)
    np.testing.assert_allclose(out[:, :, h : h + 1], ref, rtol=1e-13, atol=0)


def test_jit():
  x = jnp.asarray(_x(2))
  w = F.make_projection("orf", _key(), M, D, dtype=jnp.float64)
  fn = jax.jit(lambda x, w: F.feature_map("orf", x, projection=w, is_query=False))
  np.testing.assert_allclose(fn(x, w), F.favor(x, w, is_query=False), rtol=1e-13)


# ---------------------------------------------------------------------------------------------
# Formulas against direct numpy evaluation (float64)
# ---------------------------------------------------------------------------------------------
def _np_prf_exponent(x, w):
  return np.einsum("blhd,md->blhm", x, w) - 0.5 * np.sum(x * x, -1, keepdims=True)


def _np_dpfp(x, nu):
  xp = np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], -1)
  n = xp.shape[-1]
  out = np.zeros(x.shape[:-1] + (n * nu,))
  for j in range(1, nu + 1):
    for i in range(n):
      out[..., (j - 1) * n + i] = xp[..., i] * xp[..., (i - j) % n]
  return out


def _reference(name, x, w, mask):
  m = None if w is None else w.shape[0]
  if name == "elu1":
    return np.where(x > 0, x + 1.0, np.exp(x))
  if name == "relu":
    return np.maximum(x, 0.0) + 1e-6
  if name == "sikf_q":
    return np.exp(x - x.max(-1, keepdims=True))
  if name == "sikf_k":
    real = np.where(mask[:, :, None, None], x, -np.inf)
    return np.exp(x - real.max(axis=(1, 3), keepdims=True))
  if name.startswith("dpfp"):
    return _np_dpfp(x, int(name[-1]))
  if name == "prf":
    return np.exp(_np_prf_exponent(x, w)) / np.sqrt(m)
  if name == "favor_q":
    z = _np_prf_exponent(x, w)
    return np.exp(z - z.max(-1, keepdims=True)) / np.sqrt(m) + 1e-6
  if name == "favor_k":
    z = _np_prf_exponent(x, w)
    zmax = np.where(mask[:, :, None, None], z, -np.inf).max(axis=(1, 3), keepdims=True)
    return np.exp(z - zmax) / np.sqrt(m) + 1e-6
  if name == "trf":
    wx = np.einsum("blhd,md->blhm", x, w)
    scale = np.exp(0.5 * np.sum(x * x, -1, keepdims=True)) / np.sqrt(m)
    return np.concatenate([np.sin(wx), np.cos(wx)], -1) * scale
  if name == "nprf":
    xn = x / np.linalg.norm(x, axis=-1, keepdims=True)
    return np.exp(_np_prf_exponent(xn, w)) / np.sqrt(m)
  raise AssertionError(name)


_CALLS = {
    "elu1": lambda x, w, mask: F.elu1(x),
    "relu": lambda x, w, mask: F.relu(x),
    "sikf_q": lambda x, w, mask: F.sikf(x, is_query=True),
    "sikf_k": lambda x, w, mask: F.sikf(x, is_query=False, mask=mask),
    "dpfp1": lambda x, w, mask: F.dpfp(x, nu=1),
    "dpfp3": lambda x, w, mask: F.dpfp(x, nu=3),
    "dpfp7": lambda x, w, mask: F.dpfp(x, nu=7),
    "prf": lambda x, w, mask: F.prf(x, w),
    "favor_q": lambda x, w, mask: F.favor(x, w, is_query=True),
    "favor_k": lambda x, w, mask: F.favor(x, w, is_query=False, mask=mask),
    "trf": lambda x, w, mask: F.trf(x, w),
    "nprf": lambda x, w, mask: F.nprf(x, w),
}


@pytest.mark.parametrize("name", list(_CALLS))
def test_formula_matches_numpy(name):
  x = _x(4)
  w = np.random.default_rng(5).normal(size=(M, D))
  mask = np.ones((B, L), bool)
  mask[1, 3:] = False
  out = np.asarray(_CALLS[name](jnp.asarray(x), jnp.asarray(w), jnp.asarray(mask)))
  ref = _reference(name, x, w, mask)
  assert out.dtype == np.float64 and out.shape == ref.shape
  if name == "trf":  # sin can be ~0, so the error is measured against the largest feature
    assert np.max(np.abs(out - ref)) <= 1e-12 * np.max(np.abs(ref))
  else:
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=0)


# The dense (numpy) check of every feature map in the registry, by kernel name:
# ``(x, w, mask, is_query, nu) -> phi(x)``. A new kernel needs its entry here
# (tests/ops/test_kernel_registry.py fails without one); orf is favor fed an orthogonal draw.
_NUMPY = {
    "elu1": lambda x, w, mask, q, nu: _reference("elu1", x, w, mask),
    "relu": lambda x, w, mask, q, nu: _reference("relu", x, w, mask),
    "sikf": lambda x, w, mask, q, nu: _reference("sikf_q" if q else "sikf_k", x, w, mask),
    "dpfp": lambda x, w, mask, q, nu: _np_dpfp(x, nu),
    "favor": lambda x, w, mask, q, nu: _reference("favor_q" if q else "favor_k", x, w, mask),
    "prf": lambda x, w, mask, q, nu: _reference("prf", x, w, mask),
    "trf": lambda x, w, mask, q, nu: _reference("trf", x, w, mask),
    "nprf": lambda x, w, mask, q, nu: _reference("nprf", x, w, mask),
    "orf": lambda x, w, mask, q, nu: _reference("favor_q" if q else "favor_k", x, w, mask),
}


@pytest.mark.parametrize("name", F.FEATURE_MAPS)
@pytest.mark.parametrize("is_query", [True, False])
def test_registered_map_matches_numpy(name, is_query):
  # Through the registry (feature_map, with the projection the entry draws), float64.
  x = _x(4)
  mask = np.ones((B, L), bool)
  mask[1, 3:] = False
  w = F.make_projection(name, _key(5), M, D, dtype=jnp.float64)
  out = np.asarray(
      F.feature_map(
          name, jnp.asarray(x), projection=w, is_query=is_query, mask=jnp.asarray(mask), nu=3
      )
  )
  ref = _NUMPY[name](x, None if w is None else np.asarray(w), mask, is_query, 3)
  assert out.dtype == np.float64 and out.shape == ref.shape
  if name == "trf":  # sin can be ~0, so the error is measured against the largest feature
    assert np.max(np.abs(out - ref)) <= 1e-12 * np.max(np.abs(ref))
  else:
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------
# Signs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", F.FEATURE_MAPS)
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_nonnegative(name, scale):
  x = jnp.asarray(_x(6, scale=scale), jnp.float32)
  w = F.make_projection(name, _key(6), M, D)
  out = np.asarray(F.feature_map(name, x, projection=w, is_query=False, nu=2))
  if F.is_nonnegative(name):
    assert not np.any(np.isnan(out)) and np.all(out >= 0)
  elif scale == 1.0:  # trf: sin / cos features take both signs
    assert np.any(out < 0) and np.any(out > 0)


# ---------------------------------------------------------------------------------------------
# Unbiasedness: phi(q).phi(k) -> exp(q.k)
# ---------------------------------------------------------------------------------------------
NUM_FEATURES = 2**16
# Tolerance: each pair's relative error must be below 4 theoretical standard deviations of one
# estimate with m = 2^16 features, and below 5% in absolute terms. For PRF (and ORF, whose
# variance is no larger) sigma = sqrt((exp(|q+k|^2) - 1) / m) (Luo Eq. 14): <= 1.4% for
# |q|, |k| <= 0.8, <= 2.9% for the unit vectors of NPRF. For TRF
# sigma = exp(|q-k|^2 / 2) (1 - exp(-|q-k|^2)) / sqrt(2m) <= 1.4%. The seeds are fixed.
UNBIASED_SIGMAS = 4.0
UNBIASED_RTOL = 0.05


def _sigma(name, q, k):
  m = NUM_FEATURES
  if name == "trf":
    u2 = np.sum((q - k) ** 2, -1).ravel()
    return np.exp(u2 / 2) * (1 - np.exp(-u2)) / np.sqrt(2 * m)
  return np.sqrt((np.exp(np.sum((q + k) ** 2, -1).ravel()) - 1) / m)


def _check_unbiased(est, exact, sigma):
  err = np.abs(est / exact - 1)
  assert np.all(err < UNBIASED_SIGMAS * sigma), (err / sigma).max()
  assert np.max(err) < UNBIASED_RTOL, err.max()


def _pairs(norm_lo, norm_hi, n=8, d=8, seed=7):
  rng = np.random.default_rng(seed)

  def draw():
    v = rng.normal(size=(n, d))
    v /= np.linalg.norm(v, axis=-1, keepdims=True)
    return v * rng.uniform(norm_lo, norm_hi, size=(n, 1))

  q, k = draw(), draw()
  return q.reshape(1, n, 1, d), k.reshape(1, n, 1, d)


def _estimate(phi, q, k):
  return np.asarray(jnp.sum(phi(jnp.asarray(q)) * phi(jnp.asarray(k)), axis=-1)).ravel()


@pytest.mark.parametrize("name", ["prf", "trf", "prf_orthogonal"])
def test_unbiased(name):
  q, k = _pairs(0.3, 0.8)
  make = F.orthogonal_projection if name == "prf_orthogonal" else F.gaussian_projection
  w = make(_key(11), NUM_FEATURES, q.shape[-1], dtype=jnp.float64)
  phi = F.trf if name == "trf" else F.prf
  est = _estimate(lambda x: phi(x, w), q, k)
  exact = np.exp(np.sum(q * k, -1)).ravel()
  _check_unbiased(est, exact, _sigma(name, q, k))


def test_nprf_unbiased_for_normalised_inputs():
  q, k = _pairs(0.5, 5.0)  # any norm: nprf normalises them first
  w = F.gaussian_projection(_key(12), NUM_FEATURES, q.shape[-1], dtype=jnp.float64)
  est = _estimate(lambda x: F.nprf(x, w), q, k)
  qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
  kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
  exact = np.exp(np.sum(qn * kn, -1)).ravel()
  _check_unbiased(est, exact, _sigma("nprf", qn, kn))


def test_orf_attention_approximates_softmax():
  # Through the registry, stabiliser included: weights of one query over 8 keys vs softmax.
  q, k = _pairs(0.3, 0.8)
  q = np.broadcast_to(q[:, :1], k.shape)
  w = F.make_projection("orf", _key(13), NUM_FEATURES, q.shape[-1], dtype=jnp.float64)
  phi_q = F.feature_map("orf", jnp.asarray(q), projection=w, is_query=True)
  phi_k = F.feature_map("orf", jnp.asarray(k), projection=w, is_query=False)
  a = np.asarray(_attn(phi_q, phi_k))[0, 0, 0]
  logits = np.sum(q[0, 0, 0] * k[0, :, 0], -1)
  softmax = np.exp(logits) / np.sum(np.exp(logits))
  assert np.max(np.abs(a / softmax - 1)) < UNBIASED_RTOL  # 5%, a ratio of two estimates


# ---------------------------------------------------------------------------------------------
# Orthogonal projection
# ---------------------------------------------------------------------------------------------
# The projection sizes below repeat those used above, so the jitted projections compile once.
def _unit_blocks(w, d):
  u = w / np.linalg.norm(w, axis=-1, keepdims=True)
  return [u[start : start + d] for start in range(0, len(u), d)]


def test_orthogonal_projection_blocks_are_orthogonal():
  # M = 6 rows of dim D = 4: one full block and one truncated to 2 rows.
  w = np.asarray(F.orthogonal_projection(_key(20), M, D, dtype=jnp.float64))
  assert w.shape == (M, D)
  blocks = _unit_blocks(w, D)
  assert [len(b) for b in blocks] == [D, M - D]
  for blk in blocks:
    np.testing.assert_allclose(blk @ blk.T, np.eye(len(blk)), rtol=0, atol=1e-12)
  assert np.max(np.abs(blocks[0] @ blocks[1].T)) > 0.1  # different blocks are independent
  np.testing.assert_array_equal(w, F.orthogonal_projection(_key(20), M, D, dtype=jnp.float64))
  assert not np.allclose(w, F.orthogonal_projection(_key(21), M, D, dtype=jnp.float64))


def test_orthogonal_projection_large():
  d = 8
  w = np.asarray(F.orthogonal_projection(_key(22), NUM_FEATURES, d, dtype=jnp.float64))
  u = w.reshape(-1, d, d) / np.linalg.norm(w, axis=-1).reshape(-1, d, 1)
  gram = np.einsum("bid,bjd->bij", u, u)
  assert np.max(np.abs(gram - np.eye(d))) < 1e-12
  sq = np.sum(w * w, axis=-1)
  # Squared norms are chi^2(d): mean d (std of the sample mean 0.2%), variance 2d (std of the
  # sample variance ~1%; it would be 0 if the norms were fixed at sqrt(d)).
  assert abs(sq.mean() / d - 1) < 0.02
  assert abs(sq.var() / (2 * d) - 1) < 0.06
  # Marginally N(0, 1) entries.
  assert abs(w.mean()) < 0.01 and abs(w.var() - 1) < 0.02


# ---------------------------------------------------------------------------------------------
# Stabilisers: shift invariance, cancellation, masks, causal gradients
# ---------------------------------------------------------------------------------------------
def test_sikf_shift_invariance():
  q, k = jnp.asarray(_x(30)), jnp.asarray(_x(31))
  a = _attn(F.sikf(q, is_query=True), F.sikf(k, is_query=False))
  a_q = _attn(F.sikf(q + 3.7, is_query=True), F.sikf(k, is_query=False))
  a_k = _attn(F.sikf(q, is_query=True), F.sikf(k - 5.2, is_query=False))
  a_exp = _attn(jnp.exp(q), jnp.exp(k))  # the unstabilised kernel: the stabiliser cancels
  for other in (a_q, a_k, a_exp):
    np.testing.assert_allclose(other, a, rtol=1e-12, atol=0)


def test_sikf_huge_inputs():
  x = _x(32, scale=1.0)
  for dtype in (jnp.float32, jnp.float64):
    for is_query in (True, False):
      big = np.asarray(F.sikf(jnp.asarray(x + 1000.0, dtype), is_query=is_query))
      assert np.all(np.isfinite(big)) and np.all(big >= 0) and np.max(big) == 1.0
  # float64: the features themselves are shift invariant up to the rounding of x + 1000.
  for is_query in (True, False):
    big = F.sikf(jnp.asarray(x + 1000.0), is_query=is_query)
    np.testing.assert_allclose(big, F.sikf(jnp.asarray(x), is_query=is_query), rtol=1e-11)


def test_favor_attention_equals_prf_attention():
  q, k = jnp.asarray(_x(33)), jnp.asarray(_x(34))
  w = F.gaussian_projection(_key(35), M, D, dtype=jnp.float64)
  a_prf = _attn(F.prf(q, w), F.prf(k, w))
  a_favor = _attn(F.favor(q, w, is_query=True, eps=0.0), F.favor(k, w, is_query=False, eps=0.0))
  np.testing.assert_allclose(a_favor, a_prf, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["sikf", "favor"])
def test_padded_keys_do_not_change_real_features(name):
  k = jnp.asarray(_x(40))
  w = F.gaussian_projection(_key(41), M, D, dtype=jnp.float64)
  mask = np.ones((B, L), bool)
  mask[0, 3:] = False
  mask[1, :] = False  # a batch row with no real key at all must stay finite

  def phi(x, mask):
    if name == "sikf":
      return F.sikf(x, is_query=False, mask=mask)
    return F.favor(x, w, is_query=False, mask=mask)

  ref = phi(k, jnp.asarray(mask))
  assert np.all(np.isfinite(np.asarray(ref)))
  # 1e4 maximises the sikf exponent; w_i maximises the favor exponent w_i.x - |x|^2/2.
  row = w[jnp.argmax(jnp.sum(w * w, axis=-1))]
  for bad in (jnp.full((D,), 1e4), row):
    k_bad = k.at[0, 3:].set(jnp.broadcast_to(bad, (L - 3, H, D)))
    np.testing.assert_array_equal(phi(k_bad, jnp.asarray(mask))[0, :3], ref[0, :3])
  # Control: without the mask the padded key moves the shared key scale.
  assert not np.allclose(phi(k_bad, None)[0, :3], ref[0, :3])


@pytest.mark.parametrize("name", ["sikf", "favor"])
@pytest.mark.parametrize("is_query", [True, False])
def test_stabiliser_gradients_stay_per_token(name, is_query):
  x = jnp.asarray(_x(50, shape=(1, 4, 1, D)))
  w = F.gaussian_projection(_key(51), M, D, dtype=jnp.float64)

  def phi(x):
    if name == "sikf":
      return F.sikf(x, is_query=is_query)
    return F.favor(x, w, is_query=is_query)

  jac = np.asarray(jax.jacrev(phi)(x))[0, :, 0, :, 0, :, 0, :]  # [i, feature, j, d]
  for i in range(4):
    for j in range(4):
      if i == j:
        assert np.any(jac[i, :, j] != 0)
      else:
        assert np.all(jac[i, :, j] == 0), (i, j)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
def _raises(fn, *fragments):
  with pytest.raises(ValueError) as info:
    fn()
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))


def test_bad_input():
  x = jnp.asarray(_x(60))
  w = F.gaussian_projection(_key(), M, D)
  _raises(lambda: F.feature_map("softmax", x), "'softmax'", "elu1", "orf")
  _raises(lambda: F.make_projection("rff", _key(), M, D), "'rff'", "favor")
  _raises(lambda: F.feature_dim("rff", D), "'rff'")
  _raises(lambda: F.is_nonnegative("rff"), "'rff'")
  for name in RANDOM:
    _raises(lambda name=name: F.feature_map(name, x), name, "None")
  _raises(
      lambda: F.feature_map("prf", x, projection=jnp.zeros((M, D + 3))), str(D + 3), f"[m, {D}]"
  )
  _raises(lambda: F.favor(x, jnp.zeros((H + 1, M, D)), is_query=True), str(H + 1), f"heads={H}")
  _raises(lambda: F.trf(x, jnp.zeros((2, H, M, D))), str((2, H, M, D)))
  _raises(lambda: F.feature_map("elu1", x, projection=w), "'elu1'", "no projection")
  _raises(lambda: F.feature_map("elu1", x[0]), str((L, H, D)), "[batch, length, heads, dim]")
  _raises(lambda: F.sikf(x[..., None], is_query=True), str((B, L, H, D, 1)))
  _raises(lambda: F.sikf(x, is_query=False, mask=jnp.ones((B, L + 1), bool)), str((B, L + 1)))
  for nu in (0, 2 * D, 1.5, True):
    _raises(lambda nu=nu: F.dpfp(x, nu=nu), repr(nu), f"[1, {2 * D - 1}]")
  _raises(lambda: F.feature_dim("dpfp", D, nu=2 * D), str(2 * D))
  _raises(lambda: F.feature_dim("favor", D), "num_features")
  _raises(lambda: F.gaussian_projection(_key(), 0, D), "num_features", "0")
  _raises(lambda: F.orthogonal_projection(_key(), M, -2), "dim", "-2")


# ---------------------------------------------------------------------------------------------
# Causality through the attention layer (every kernel of the registry)
# ---------------------------------------------------------------------------------------------
def _causal_layer(kernel: str):
  """(out(dk, dv) -> [n, D], n): a causal Attention layer (rope, float64) whose key and value
  projections get ``dk`` / ``dv`` ``[1, n, h, d]`` added, so outputs are functions of k, v."""
  import flax.linen as nn

  from fastpos.models.attention import Attention, AttentionConfig, KernelSpec, PositionalSpec

  n, width, heads = 9, 16, 2
  cfg = AttentionConfig(
      num_heads=heads,
      head_dim=width // heads,
      embed_dim=width,
      kernel=KernelSpec(kernel, num_features=16),
      positional=(PositionalSpec.make("rope", {}),),
      max_length=n,
      causal=True,
      chunk_size=4,
  )
  layer = Attention(cfg, dtype=jnp.float64)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(1, n, width)))
  # Random parameters of the init's shapes (traced only: compiling an init per kernel costs
  # more than the check).
  shapes = jax.eval_shape(layer.init, jax.random.key(0), x)
  params = jax.tree.map(lambda a: rng.normal(0.0, 0.25, a.shape).astype(a.dtype), shapes)

  def out(dk, dv):
    def add(next_fun, args, kwargs, context):
      y = next_fun(*args, **kwargs)
      if context.method_name == "__call__" and context.module.name in ("key", "value"):
        y = y + (dk if context.module.name == "key" else dv)
      return y

    with nn.intercept_methods(add):
      return layer.apply(params, x)[0]

  return out, n, (1, n, heads, width // heads)


# The default run: the kernels with a stabiliser shared by the keys (sikf, favor), softmax and
# one map of a token alone (elu1); the other maps of a token alone run with `-m slow`.
CAUSAL_DEFAULT = ("softmax", "elu1", "sikf", "favor")


@pytest.mark.parametrize(
    "kernel",
    [k if k in CAUSAL_DEFAULT else pytest.param(k, marks=pytest.mark.slow) for k in F.KERNELS],
)
def test_causal_outputs_never_depend_on_later_keys_or_values(kernel):
  """For every kernel, causal: d out_i / d k_j = d out_i / d v_j = 0 for j > i, by autodiff
  and as the true derivative: any change of the keys and values after i leaves out_i
  bit for bit (a stabiliser taken over all keys would shift it)."""
  out, n, shape = _causal_layer(kernel)
  zero = jnp.zeros(shape, jnp.float64)
  rng = np.random.default_rng(0)
  cases, dks, dvs = [], [zero], [zero]  # entry 0: the unperturbed output
  for t in range(n - 1):
    for scale in (0.5, 3.0):
      later = (np.arange(n) > t)[None, :, None, None]
      dks.append(np.where(later, scale * rng.standard_normal(shape), 0.0))
      dvs.append(np.where(later, scale * rng.standard_normal(shape), 0.0))
      cases.append((t, scale))

  # One compiled program: the Jacobian and every output, one after the other (lax.map runs the
  # same code for each, so an unchanged output is bit for bit the base one).
  def check(dk, dv):
    jac = jax.jacrev(out, argnums=(0, 1))(zero, zero)  # [n, D, 1, n, h, d] each
    return jac, jax.lax.map(lambda a: out(*a), (dk, dv))

  (jk, jv), outs = jax.jit(check)(jnp.asarray(np.stack(dks)), jnp.asarray(np.stack(dvs)))
  for jac in (jk, jv):
    jac = np.abs(np.asarray(jac)).reshape(n, -1, n, shape[2] * shape[3]).max(axis=(1, 3))
    assert np.all(jac[np.triu_indices(n, 1)] == 0.0), jac  # [i, j]: j > i is exactly 0
    assert jac.max() > 0
  outs = np.asarray(outs)
  base = outs[0]
  later_changed = False
  for (t, scale), moved in zip(cases, outs[1:]):
    assert np.array_equal(moved[: t + 1], base[: t + 1]), (
        kernel,
        t,
        scale,
        np.abs(moved[: t + 1] - base[: t + 1]).max(),
    )
    later_changed |= not np.array_equal(moved[t + 1 :], base[t + 1 :])
  assert later_changed  # the perturbations reach the outputs that may see them
