"""spe: the Monte Carlo mean of qhat . khat against sum_d q_md k_nd P_d(m - n) built here from
the raw parameters (sine: sum of cosines; conv: cross-correlation of the two filters; gated:
(1 - b) P + b) with a stated statistical tolerance; offset-only dependence in expectation (and
not per realisation); the closed-form kernel; fast vs reference paths; shapes,
feature_out_dim, memory keys, position-wise maps (causal); a fixed noise draw (seed, path,
prefixes); option and input errors; jit and gradients."""

from __future__ import annotations

import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos import positional
from fastpos.ops.features import FEATURE_MAPS
from fastpos.positional import Context, Dims, KernelInfo, compatibility, spe
from tests.helpers import rel_err

B, H, D = 2, 2, 3
MAX_LENGTH = 9
DIMS = Dims(num_heads=H, head_dim=D, feature_dim=D, embed_dim=H * D, max_length=MAX_LENGTH)
K_SINES, KSIZE = 3, 4
R_MC = 16384  # realisations for the Monte Carlo checks
R_SMALL = 8
# Max |mean - target| / standard error over all (b, h, m, n) entries (a few hundred, correlated
# through shared noise): for a correct estimator this is a maximum of |N(0, 1)| draws, ~3-4.
Z_TOL = 5.5
WORST: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _print_worst():
  """Prints the worst errors measured (``pytest -s``)."""
  yield
  for name, err in sorted(WORST.items()):
    print(f"\n  worst {name:48s} {err:.3g}", end="")


def _note(name: str, err: float) -> float:
  WORST[name] = max(WORST.get(name, 0.0), float(err))
  return err


def _opts(kind, gated=True, r=R_SMALL, **extra) -> tuple:
  return tuple(
      sorted(
          {
              "kind": kind,
              "gated": gated,
              "num_realizations": r,
              "num_sines": K_SINES,
              "kernel_size": KSIZE,
              **extra,
          }.items()
      )
  )


# ---------------------------------------------------------------------------------------------
# Building, parameters, applying (one jit per configuration, context and shapes: each compile
# holds a threefry draw, so the tests share a few configurations)
# ---------------------------------------------------------------------------------------------
LQ, MEM = 6, 2  # the standard shapes: 6 queries after 2 memory
LK = LQ + MEM


def _std(kind, gated=True) -> tuple:
  """The options most tests share (R = R_MC, so Monte Carlo and exact checks reuse a compile)."""
  return _opts(kind, gated, r=R_MC)


@functools.lru_cache(maxsize=None)
def _module(options: tuple, dims: Dims = DIMS):
  return positional.build("spe", dims, dict(options))


@functools.lru_cache(maxsize=None)
def _init(kind: str, gated: bool):
  """The initial parameters (through ``offset_kernel``, which creates them without noise)."""
  module = _module(_opts(kind, gated))
  return jax.jit(lambda key: module.init(key, 3, method="offset_kernel"))(jax.random.key(0))


@functools.lru_cache(maxsize=None)
def _params(options: tuple):
  """Random parameters (not the init): frequencies f = sigmoid(raw) / 2 in ~(0.04, 0.46) so
  that the kernel varies over a few positions; random phases, gains, signed filters, gates."""
  opts = dict(options)
  init = _init(opts["kind"], opts["gated"])["params"]
  rng = np.random.default_rng(1)
  out = {}
  for name in sorted(init):
    shape = init[name].shape
    if name == "frequencies":
      out[name] = rng.uniform(-2.5, 2.5, shape)
    elif name == "gate":
      out[name] = rng.uniform(-1.5, 1.5, shape)
    else:
      out[name] = rng.normal(0.0, 0.7, shape)
  return {"params": {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}}


@functools.lru_cache(maxsize=None)
def _apply_fn(options: tuple, ctx: Context):
  module = _module(options)
  return jax.jit(lambda params, q, k: module.apply(params, q, k, ctx, method="features"))


def _run(options, q, k, *, memory=0, reference=False, params=None):
  ctx = Context(length=q.shape[1], memory_length=memory, reference=reference)
  params = _params(options) if params is None else params
  qh, kh = _apply_fn(options, ctx)(params, q, k)
  return np.asarray(qh), np.asarray(kh)


def _qk(lq, lk, seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(B, lq, H, D)), rng.normal(size=(B, lk, H, D))


# ---------------------------------------------------------------------------------------------
# Dense references built from the raw parameters
# ---------------------------------------------------------------------------------------------
def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _kernel_ref(options: tuple, qpos, kpos) -> np.ndarray:
  """``[h, d, len(qpos), len(kpos)]``: P~_d(m - n) from the raw parameters, entry by entry."""
  opts = dict(options)
  p = {k: np.asarray(v, np.float64) for k, v in _params(options)["params"].items()}
  out = np.zeros((H, D, len(qpos), len(kpos)))
  for i, m in enumerate(qpos):
    for j, n in enumerate(kpos):
      delta = m - n
      if opts["kind"] == "sine":
        f = _sigmoid(p["frequencies"]) / 2
        lam2 = np.log1p(np.exp(p["gains"])) ** 2
        val = np.sum(lam2 * np.cos(2 * np.pi * f * delta + p["phases"]), axis=-1)
      else:
        fq, fk = p["filter_q"], p["filter_k"]
        val = np.zeros((H, D))
        for t in range(KSIZE):
          if 0 <= t + delta < KSIZE:
            val += fq[..., t] * fk[..., t + delta]
      if opts["gated"]:
        b = _sigmoid(p["gate"])
        val = (1 - b) * val + b
      out[:, :, i, j] = val
  return out


def _target(options, q, k, memory=0) -> np.ndarray:
  """``[b, h, Lq, Lk]``: sum_d q_md k_nd P~_d(m - n), queries at M + i, keys at j."""
  lq, lk = q.shape[1], k.shape[1]
  pk = _kernel_ref(options, np.arange(memory, memory + lq), np.arange(lk))
  return np.einsum("bmhd,bnhd,hdmn->bhmn", q, k, pk)


def _mc(qh, kh):
  """(mean, standard error) ``[b, h, Lq, Lk]`` of the R per-realisation terms
  R qhat_mr khat_nr, whose mean is qhat . khat."""
  r = qh.shape[-1]
  terms = r * np.einsum("bmhr,bnhr->bhmnr", qh, kh)
  mean = terms.mean(-1)
  np.testing.assert_allclose(mean, np.einsum("bmhr,bnhr->bhmn", qh, kh), rtol=1e-10, atol=1e-12)
  return mean, terms.std(-1, ddof=1) / np.sqrt(r)


# ---------------------------------------------------------------------------------------------
# (1) The expectation: E[qhat . khat] = sum_d q k P~_d(m - n)
# ---------------------------------------------------------------------------------------------
# (kind, gated): each kind once by default, gated and not; the other two cells -m slow.
KIND_GATED = [(k, g) for k in spe.KINDS for g in (True, False)]
DEFAULT_KIND_GATED = {("sine", True), ("conv", False)}
KIND_GATED_PARAMS = [
    pytest.param(k, g, marks=() if (k, g) in DEFAULT_KIND_GATED else pytest.mark.slow)
    for k, g in KIND_GATED
]


@pytest.mark.parametrize("kind, gated", KIND_GATED_PARAMS)
def test_monte_carlo_mean_matches_relative_kernel(kind, gated):
  options = _std(kind, gated)
  q, k = _qk(LQ, LK, seed=1)
  qh, kh = _run(options, q, k, memory=MEM)  # queries at positions 2..7, keys at 0..7
  mean, se = _mc(qh, kh)
  target = _target(options, q, k, MEM)
  z = np.max(np.abs(mean - target) / se)
  _note(f"MC max z-score ({kind}, gated={gated})", z)
  _note(f"MC rel err R={R_MC} ({kind}, gated={gated})", rel_err(mean, target))
  assert z < Z_TOL, z
  # The tolerance is meaningful: the standard error is small next to the target, and the
  # position-free score q . k (what SPE must differ from) is many standard errors away.
  assert np.max(se) < 0.05 * np.max(np.abs(target))
  plain = np.einsum("bmhd,bnhd->bhmn", q, k)
  assert np.max(np.abs(plain - target) / se) > 10 * Z_TOL


@pytest.mark.parametrize("kind, gated", KIND_GATED_PARAMS)
def test_offset_kernel_closed_form(kind, gated):
  options = _opts(kind, gated)
  n = 6
  got = np.asarray(_module(options).apply(_params(options), n, jnp.float64, method="offset_kernel"))
  dense = _kernel_ref(options, np.arange(n), np.arange(n))  # [h, d, i, j]
  want = np.zeros((H, D, 2 * n - 1))
  for i in range(n):
    for j in range(n):
      want[:, :, j - i + n - 1] = dense[:, :, i, j]
  assert _note(f"offset_kernel vs reference ({kind})", rel_err(got, want)) < 1e-12
  if kind == "conv" and not gated:  # a filter cross-correlation: zero beyond |delta| >= L
    assert np.all(got[..., : n - KSIZE] == 0) and np.all(got[..., n + KSIZE - 1 :] == 0)


# ---------------------------------------------------------------------------------------------
# (2) Relative in expectation only
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", spe.KINDS)
def test_score_depends_on_offset_only_in_expectation(kind):
  options = _std(kind)
  rng = np.random.default_rng(5)
  q0, k0 = rng.normal(size=(B, 1, H, D)), rng.normal(size=(B, 1, H, D))
  q, k = np.repeat(q0, LQ, axis=1), np.repeat(k0, LK, axis=1)  # the same content everywhere
  qh, kh = _run(options, q, k, memory=MEM)
  mean, se = _mc(qh, kh)
  # Shifting both positions keeps the mean (within the joint standard error)...
  diff = mean[..., 1:, 1:] - mean[..., :-1, :-1]
  joint = np.sqrt(se[..., 1:, 1:] ** 2 + se[..., :-1, :-1] ** 2)
  z = np.max(np.abs(diff) / joint)
  _note(f"MC Toeplitz max z-score ({kind})", z)
  assert z < Z_TOL, z
  # ... the target does vary with the offset (a constant would pass trivially) ...
  target = _target(options, q, k, MEM)
  assert np.all(np.ptp(target[..., 0, :], axis=-1) > 0.1 * np.max(np.abs(target)))
  # ... while one realisation's score (one of the R terms) is not a function of m - n.
  single = np.einsum("bmh,bnh->bhmn", qh[..., 0], kh[..., 0])
  dev = np.max(np.abs(single[..., 1:, 1:] - single[..., :-1, :-1])) / np.max(np.abs(single))
  _note(f"one realisation: Toeplitz deviation ({kind}) [expected large]", dev)
  assert dev > 0.1, dev


# ---------------------------------------------------------------------------------------------
# (3) Shapes, feature_out_dim, reference path, memory, position-wise maps
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", spe.KINDS)
def test_shapes_and_feature_out_dim(kind):
  q, k = _qk(LQ, LK)
  qh, kh = _run(_std(kind), q, k, memory=MEM)
  assert qh.shape == (B, LQ, H, R_MC) and kh.shape == (B, LK, H, R_MC)
  assert spe.SPE.feature_out_dim(D, dict(_std(kind))) == R_MC
  assert spe.SPE.feature_out_dim(16, {"num_realizations": 5}) == 5
  assert spe.SPE.feature_out_dim(16, {}) == 64  # the default R
  assert spe.SPE.feature_out_dim(16, {"kind": "conv"}) == 64
  params = _init(kind, True)["params"]
  if kind == "sine":
    assert {n: v.shape for n, v in params.items()} == {
        "frequencies": (H, D, K_SINES),
        "phases": (H, D, K_SINES),
        "gains": (H, D, K_SINES),
        "gate": (H, D),
    }
    f = 1 / (1 + np.exp(-np.asarray(params["frequencies"], np.float64))) / 2
    assert np.all((f > 0) & (f < 0.5)) and np.median(f) < 0.05  # slow sinusoids at init
    np.testing.assert_array_equal(params["phases"], 0.0)
    lam = np.log1p(np.exp(np.asarray(params["gains"], np.float64)))
    np.testing.assert_allclose(np.sum(lam**2, axis=-1), 1.0, rtol=1e-5)  # P_d(0) = 1 at init
  else:
    assert {n: v.shape for n, v in params.items()} == {
        "filter_q": (H, D, KSIZE),
        "filter_k": (H, D, KSIZE),
        "gate": (H, D),
    }
    for name in ("filter_q", "filter_k"):
      w = np.asarray(params[name])
      assert np.all((w >= 0) & (w <= 2 / np.sqrt(KSIZE)))
  np.testing.assert_array_equal(params["gate"], 0.0)  # b = 1/2 at init
  assert "gate" not in _init(kind, False)["params"]
  cls = positional.get_class("spe")
  assert cls.hooks == ("features",) and cls.feature_stage == "pre_phi"
  assert cls.supports_causal and cls.supports_1d and not cls.supports_2d
  assert "share_across_layers" in {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("kind", spe.KINDS)
def test_fast_path_matches_reference(kind):
  options = _std(kind)
  q, k = _qk(LQ, LK, seed=3)
  fast = _run(options, q, k, memory=MEM)
  ref = _run(options, q, k, memory=MEM, reference=True)
  for a, b in zip(fast, ref):
    assert _note(f"fast vs reference ({kind})", rel_err(a, b)) < 1e-12


@pytest.mark.parametrize("kind", spe.KINDS)
def test_memory_rows_and_length_prefixes(kind):
  # Positions index one draw: a 4-long sequence's codes are the first rows of the 8-long one
  # with 2 memory keys (its queries sit at positions 2..7, keys at 0..7).
  options = _std(kind)
  q, k = _qk(LK, LK, seed=4)
  qm, km = _run(options, q[:, MEM:], k, memory=MEM)
  qs, ks = _run(options, q[:, :4], k[:, :4])
  assert rel_err(ks, km[:, :4]) < 1e-12
  assert rel_err(qs[:, MEM:], qm[:, : 4 - MEM]) < 1e-12


@pytest.mark.parametrize("kind", spe.KINDS)
def test_maps_are_position_wise_so_causal_attention_stays_causal(kind):
  options = _opts(kind, r=4)
  n = 6
  q, k = _qk(n, n, seed=6)
  module, params = _module(options), _params(options)
  ctx = Context(length=n, causal=True)

  def jacobians(q, k):
    fq = lambda x: module.apply(params, x, k, ctx, method="features")[0][0]
    fk = lambda x: module.apply(params, q, x, ctx, method="features")[1][0]
    return jax.jacfwd(fq)(q), jax.jacfwd(fk)(k)

  for jac in jax.jit(jacobians)(q, k):  # [n, h, R, b, n, h, d]
    jac = np.moveaxis(np.asarray(jac)[:, :, :, 0], 3, 1).reshape(n, n, -1)
    eye = np.eye(n, dtype=bool)
    assert np.all(jac[~eye] == 0.0)  # no other position's data
    assert np.all(np.abs(jac[eye]).max(-1) > 0)


# ---------------------------------------------------------------------------------------------
# (4) A fixed noise draw
# ---------------------------------------------------------------------------------------------
class _ThreeLayers(nn.Module):
  """SPE modules under different names (layers): a and b share the seed, c has another."""

  options: tuple

  @nn.compact
  def __call__(self, q, k):
    ctx = Context(length=q.shape[1])
    outs = []
    for name, seed in (("layer_a", 0), ("layer_b", 0), ("layer_c", 1)):
      opts = dict(self.options, seed=seed)
      outs.append(positional.build("spe", DIMS, opts, name=name).features(q, k, ctx)[0])
    return outs


@pytest.mark.parametrize("kind", spe.KINDS)
def test_noise_is_a_fixed_draw_per_seed_and_path(kind):
  options = _opts(kind, r=6)
  q, k = _qk(5, 5, seed=7)
  layers = _ThreeLayers(options)
  p = _params(options)["params"]
  params = {"params": {"layer_a": p, "layer_b": p, "layer_c": p}}
  fn = jax.jit(layers.apply)
  qa, qb, qc = (np.asarray(x) for x in fn(params, q, k))
  again = fn(params, q, k)
  np.testing.assert_array_equal(qa, np.asarray(again[0]))  # same seed: same numbers
  assert rel_err(qa, qb) > 0.1  # another path: another draw
  assert rel_err(qa, qc) > 0.1  # another seed: another draw


# ---------------------------------------------------------------------------------------------
# (5) Errors
# ---------------------------------------------------------------------------------------------
BAD_OPTIONS = [
    ({"kind": "cosine"}, "spe: unknown kind 'cosine'; valid choices: sine, conv"),
    ({"kind": None}, "spe: unknown kind None; valid choices: sine, conv"),
    ({"num_realizations": 0}, "num_realizations must be an integer >= 1"),
    ({"num_realizations": 8.0}, "num_realizations must be an integer >= 1"),
    ({"num_realizations": True}, "num_realizations must be an integer >= 1"),
    ({"num_sines": 0}, "num_sines must be an integer >= 1"),
    ({"kind": "conv", "kernel_size": -3}, "kernel_size must be an integer >= 1"),
    ({"gated": 1}, "gated must be True or False"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"share_across_layers": "no"}, "share_across_layers must be True or False"),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS)
def test_bad_options_raise(options, message):
  cls = positional.get_class("spe")
  with pytest.raises(ValueError, match=re.escape(message)):
    cls.compatibility(KernelInfo("softmax"), causal=False, two_d=False, options=options)
  with pytest.raises(ValueError, match=re.escape(message)):
    cls.feature_out_dim(D, options)
  module = positional.build("spe", DIMS, options)
  x = np.zeros((1, 3, H, D))
  with pytest.raises(ValueError, match=re.escape(message)):
    module.init(jax.random.key(0), x, x, Context(length=3), method="features")


def test_unknown_option_lists_valid_ones():
  with pytest.raises(
      ValueError,
      match="kind, num_realizations, num_sines, kernel_size, gated, " "seed, share_across_layers",
  ):
    positional.build("spe", DIMS, {"realizations": 8})


def test_bad_inputs_raise():
  options = _opts("conv")
  module, params = _module(options), _params(options)
  q = np.zeros((1, 4, H, D))
  with pytest.raises(ValueError, match=re.escape("q must be [batch, length, 2, 3]")):
    module.apply(params, np.zeros((1, 4, H, D + 1)), q, Context(length=4), method="features")
  with pytest.raises(ValueError, match=re.escape("k must be [batch, length, 2, 3]")):
    module.apply(params, q, np.zeros((1, 4, H + 1, D)), Context(length=4), method="features")
  with pytest.raises(ValueError, match="only 1D"):
    module.apply(params, q, q, Context(length=4, grid=(2, 2)), method="features")
  with pytest.raises(ValueError, match="ctx.memory_length = 0"):
    module.apply(params, q, np.zeros((1, 6, H, D)), Context(length=4), method="features")
  long = np.zeros((1, MAX_LENGTH + 1, H, D))
  with pytest.raises(ValueError, match="exceeds the maximum length 9"):
    module.apply(params, long, long, Context(length=MAX_LENGTH + 1), method="features")
  # sineSPE has no length limit.
  qh, _ = _run(_opts("sine"), long, long)
  assert qh.shape == (1, MAX_LENGTH + 1, H, R_SMALL) and np.all(np.isfinite(qh))


@pytest.mark.parametrize("causal", [False, True])
def test_compatible_with_every_kernel_1d_only(causal):
  cls = positional.get_class("spe")
  for options in ({}, {"kind": "conv"}):
    for name in ("softmax",) + FEATURE_MAPS:
      assert (
          cls.compatibility(KernelInfo(name), causal=causal, two_d=False, options=options) is None
      )
      assert compatibility.problem(name, "spe", causal=causal, options=options) is None
      assert "no 2D form" in compatibility.problem(
          name, "spe", causal=causal, two_d=True, options=options
      )


# ---------------------------------------------------------------------------------------------
# (6) jit, dtypes, gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", spe.KINDS)
def test_jit_matches_eager_and_gradients_flow(kind):
  options = _opts(kind, r=6)
  q, k = _qk(5, 7, seed=8)
  module, params = _module(options), _params(options)
  ctx = Context(length=5, memory_length=2)
  jitted = _run(options, q, k, memory=2)
  if kind == "sine":  # eager runs op by op (slow to dispatch); the noise code is shared
    eager = module.apply(params, q, k, ctx, method="features")
    for a, b in zip(eager, jitted):
      assert _note(f"jit vs eager ({kind})", rel_err(np.asarray(a), b)) < 1e-12

  def loss(p):
    qh, kh = module.apply(p, q, k, ctx, method="features")
    return jnp.sum(jnp.einsum("bmhr,bnhr->bhmn", qh, kh) ** 2)

  grads = jax.jit(jax.grad(loss))(params)["params"]
  assert set(grads) == set(params["params"])
  for name, g in grads.items():
    g = np.asarray(g)
    assert np.all(np.isfinite(g)) and np.any(g != 0), name


@pytest.mark.parametrize("kind, dtypes", [("sine", ("bfloat16",)), ("conv", ("float32",))])
def test_lower_precision_inputs_use_the_same_draw(kind, dtypes):
  # The noise is drawn in float32 whatever the dtype, so float32 / bfloat16 runs give the
  # float64 codes up to rounding (bfloat16: inputs and outputs rounded to 8 bits).
  options = _opts(kind, r=6)
  q, k = _qk(5, 5, seed=9)
  ref = _run(options, q, k)
  for name in dtypes:
    dtype, tol = jnp.dtype(name), {"float32": 1e-4, "bfloat16": 3e-2}[name]
    qh, kh = _run(options, jnp.asarray(q, dtype), jnp.asarray(k, dtype))
    assert qh.dtype == dtype and kh.dtype == dtype
    for a, b in zip((qh, kh), ref):
      assert _note(f"{name} vs float64 ({kind})", rel_err(np.asarray(a, np.float64), b)) < tol


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_layer_with_more_realizations_than_head_dims(causal):
  """A softmax layer with SPE gives q, k ``num_realizations`` dims and v ``head_dim``: the
  layer computes (jax.nn.dot_product_attention needs one dim for all three, so the softmax
  takes the plain formula) and equals its dense reference, with padded keys."""
  import fastpos  # pylint: disable=import-outside-toplevel

  layer = fastpos.attention(
      16,
      2,
      kernel="softmax",
      positional=("spe",),
      causal=causal,
      max_length=12,
      spe={"num_realizations": 24},
  )  # head_dim 8 != 24
  x = jax.random.normal(jax.random.key(0), (2, 12, 16), jnp.float32)
  mask = jnp.arange(12)[None, :] < jnp.array([[12], [9]])
  variables = jax.jit(layer.init)(jax.random.key(1), x, mask=mask)  # compiled, not op by op
  fast = jax.jit(layer.apply)(variables, x, mask=mask)
  ref = jax.jit(functools.partial(layer.apply, reference=True))(variables, x, mask=mask)
  assert fast.shape == (2, 12, 16)
  err = _note(f"softmax layer causal={causal}", rel_err(fast, ref))
  assert err < 1e-4, err
