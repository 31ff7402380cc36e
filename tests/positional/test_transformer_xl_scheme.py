"""transformer_xl scheme: the hook's bias against the paper's terms (b) + (c) + (d) built entry by
entry, with memory, causal and two-sided; distance-only dependence; compatibility; options; jit."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos import positional
from fastpos.ops.features import FEATURE_MAPS
from fastpos.positional import Context, Dims, KernelInfo, compatibility
from tests.helpers import rel_err

HEADS, HEAD_DIM = 2, 4
DIMS = Dims(
    num_heads=HEADS,
    head_dim=HEAD_DIM,
    feature_dim=HEAD_DIM,
    embed_dim=8,
    max_length=16,
    causal=True,
)


@functools.lru_cache(maxsize=None)
def _module(options: tuple = ()):
  return positional.build("transformer_xl", DIMS, dict(options))


def _init(module, shape):
  """Parameters of ``module`` (jitted: op-by-op init compiles every primitive)."""
  x = np.zeros(shape)
  ctx = Context(length=shape[1], causal=True)
  return jax.jit(lambda key: module.init(key, x, x, ctx, method="logits"))(jax.random.key(0))


@functools.lru_cache(maxsize=None)
def _params(options: tuple = ()):
  """Initialised, then redrawn N(0, 1) so that every term is of order one (the paper's init,
  N(0, 0.02^2), would leave the position terms tiny next to each other)."""
  params = _init(_module(options), (1, 3, HEADS, HEAD_DIM))
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.default_rng(1)
  return jax.tree.unflatten(tree, [rng.standard_normal(a.shape) for a in leaves])


@functools.lru_cache(maxsize=None)
def _bias_fn(options: tuple, ctx: Context):
  module = _module(options)
  return jax.jit(lambda params, q, k: module.apply(params, q, k, ctx, method="logits"))


def _bias(q, k, *, causal, reference=False, options=(), params=None):
  ctx = Context(
      causal=causal, reference=reference, length=q.shape[1], memory_length=k.shape[1] - q.shape[1]
  )
  params = _params(options) if params is None else params
  return np.asarray(_bias_fn(options, ctx)(params, q, k))


def _qk(seed, lq, memory, batch=2, dtype=np.float64):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, lq, HEADS, HEAD_DIM)).astype(dtype)
  k = rng.standard_normal((batch, memory + lq, HEADS, HEAD_DIM)).astype(dtype)
  return q, k


def _sinusoid(distance: int, width: int) -> np.ndarray:
  """R_distance of the paper's code, one position: [sin(d w_0..), cos(d w_0..)]."""
  freqs = [10000.0 ** (-2.0 * m / width) for m in range(width // 2)]
  return np.array([math.sin(distance * f) for f in freqs] + [math.cos(distance * f) for f in freqs])


def _reference(params, q, k, *, causal, width):
  """(q_i + v) . W_{k,R} R_{M+i-j} + u . k_j, over sqrt(d), entry by entry; NaN on future keys
  (causal) where the layer's mask decides."""
  p = jax.tree.map(np.asarray, params)["params"]
  w_kr, u, v = p["w_kr"], p["u"], p["v"]
  batch, lq = q.shape[:2]
  memory = k.shape[1] - lq
  out = np.full((batch, HEADS, lq, memory + lq), np.nan)
  for i in range(lq):
    for j in range(memory + lq):
      distance = memory + i - j
      if causal and distance < 0:
        continue
      w_r = np.einsum("r,rhd->hd", _sinusoid(distance, width), w_kr)  # W_{k,R} R_{i-j}
      terms_bd = np.einsum("bhd,hd->bh", q[:, i] + v[None], w_r)  # (b) + (d)
      term_c = np.einsum("bhd,hd->bh", k[:, j], u)  # (c)
      out[:, :, i, j] = (terms_bd + term_c) / math.sqrt(HEAD_DIM)
  return out


# ---------------------------------------------------------------------------------------------
# Against the dense reference
# ---------------------------------------------------------------------------------------------
CASES = [(1, 0), (5, 0), (5, 3), (4, 7), (1, 4)]  # (Lq, M)


# By default each shape once, with every (causal, path) pair; the full product -m slow.
DEFAULT_CASES = {
    ((1, 0), True, False),
    ((5, 0), False, True),
    ((5, 3), True, True),
    ((4, 7), False, False),
    ((1, 4), True, False),
}


@pytest.mark.parametrize(
    "lq, memory, causal, reference",
    [
        pytest.param(
            *shape,
            causal,
            reference,
            id=f"{shape}-{('two_sided', 'causal')[causal]}-{('shift', 'gather')[reference]}",
            marks=() if (shape, causal, reference) in DEFAULT_CASES else pytest.mark.slow,
        )
        for shape in CASES
        for causal in (True, False)
        for reference in (False, True)
    ],
)
def test_bias_matches_paper_terms(lq, memory, causal, reference):
  q, k = _qk(lq * 10 + memory, lq, memory)
  got = _bias(q, k, causal=causal, reference=reference)
  assert got.shape == (2, HEADS, lq, memory + lq) and got.dtype == np.float64
  want = _reference(_params(), q, k, causal=causal, width=DIMS.embed_dim)
  seen = ~np.isnan(want)
  assert seen.sum() == 2 * HEADS * (
      lq * (memory + lq) if not causal else sum(memory + i + 1 for i in range(lq))
  )
  assert rel_err(got[seen], want[seen]) < 1e-9


@pytest.mark.parametrize("causal", [True, False])
def test_rel_dim_option(causal):
  options = (("rel_dim", 6),)
  shapes = jax.tree.map(np.shape, _params(options))["params"]
  assert shapes == {"w_kr": (6, HEADS, HEAD_DIM), "u": (HEADS, HEAD_DIM), "v": (HEADS, HEAD_DIM)}
  q, k = _qk(3, 5, 2)
  got = _bias(q, k, causal=causal, options=options)
  want = _reference(_params(options), q, k, causal=causal, width=6)
  seen = ~np.isnan(want)
  assert rel_err(got[seen], want[seen]) < 1e-9


def test_default_width_is_embed_dim_and_init_is_the_papers():
  dims = Dims(num_heads=8, head_dim=16, feature_dim=16, embed_dim=128, max_length=8)
  params = _init(positional.build("transformer_xl", dims), (1, 3, 8, 16))["params"]
  assert params["w_kr"].shape == (128, 8, 16)
  for name in ("w_kr", "u", "v"):  # N(0, 0.02^2): >= 128 draws each
    assert 0.8 < float(jnp.std(params[name])) / 0.02 < 1.2, name


@pytest.mark.parametrize("causal", [True, False])
def test_shift_and_gather_paths_agree_everywhere(causal):
  q, k = _qk(5, 7, 5)
  fast = _bias(q, k, causal=causal)
  dense = _bias(q, k, causal=causal, reference=True)
  assert rel_err(fast, dense) < 1e-12


def test_causal_future_entries_hold_term_c_only():
  # (b) + (d) are exactly 0 on future keys; (c) is left there for the layer's mask.
  q, k = _qk(6, 4, 3)
  got = _bias(q, k, causal=True)
  u = np.asarray(_params()["params"]["u"])
  term_c = np.einsum("bjhd,hd->bhj", k, u) / math.sqrt(HEAD_DIM)
  for i in range(4):
    np.testing.assert_allclose(got[:, :, i, 3 + i + 1 :], term_c[:, :, 3 + i + 1 :], rtol=1e-13)


@pytest.mark.parametrize("causal", [True, False])
def test_memory_is_the_tail_of_a_longer_sequence(causal):
  # Queries M..M+Lq-1 of an (M+Lq)-long sequence, over the same keys, see the same bias.
  memory, lq = 5, 4
  q_full, k = _qk(7, memory + lq, 0)
  full = _bias(q_full, k, causal=causal)
  with_memory = _bias(q_full[:, memory:], k, causal=causal)
  assert rel_err(with_memory, full[:, :, memory:]) < 1e-12


@pytest.mark.parametrize("causal", [True, False])
def test_position_terms_depend_on_distance_only(causal):
  lq, memory = 6, 3
  rng = np.random.default_rng(8)
  q = np.tile(rng.standard_normal((1, 1, HEADS, HEAD_DIM)), (1, lq, 1, 1))  # same q_i
  k = np.tile(rng.standard_normal((1, 1, HEADS, HEAD_DIM)), (1, memory + lq, 1, 1))  # same k_j
  got = _bias(q, k, causal=causal)
  np.testing.assert_allclose(got[..., 1:, 1:], got[..., :-1, :-1], rtol=1e-12, atol=1e-12)
  last = got[0, 0, -1] if causal else got[0, 0, 0]
  assert len(np.unique(np.round(last, 9))) == memory + lq  # every distance is distinct
  if not causal:
    # R_{-d} != R_d: keys one after and one before the query get different biases.
    assert abs(got[0, 0, 2, memory + 3] - got[0, 0, 2, memory + 1]) > 1e-3


def test_jit_float32_and_gradients():
  q, k = _qk(9, 5, 2)
  params = _params()
  module = _module()
  ctx = Context(causal=True, length=5, memory_length=2)
  eager = np.asarray(module.apply(params, q, k, ctx, method="logits"))
  assert rel_err(_bias(q, k, causal=True), eager) < 1e-13
  # float32 inputs and parameters, against the float64 result on the same values.
  f32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  q32, k32 = q.astype(np.float32), k.astype(np.float32)
  apply = jax.jit(lambda p, a, b: module.apply(p, a, b, ctx, method="logits"))
  got32 = apply(f32, q32, k32)
  assert got32.dtype == jnp.float32
  want = apply(
      jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), f32),
      q32.astype(np.float64),
      k32.astype(np.float64),
  )
  assert rel_err(got32, want) < 1e-4
  # d sum(bias) / d u = Lq sum_{b,j} k_j / sqrt(d): term (c) reaches every (i, j).
  grad = jax.jit(jax.grad(lambda p: module.apply(p, q, k, ctx, method="logits").sum()))(params)[
      "params"
  ]
  np.testing.assert_allclose(grad["u"], 5 * k.sum(axis=(0, 1)) / math.sqrt(HEAD_DIM), rtol=1e-12)
  assert np.all(np.abs(np.asarray(grad["w_kr"])) > 0) and np.all(np.abs(grad["v"]) > 0)


# ---------------------------------------------------------------------------------------------
# Compatibility, options, errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
def test_compatibility_softmax_only(causal):
  cls = positional.get_class("transformer_xl")
  setting = compatibility.Setting(causal=causal)
  assert compatibility.plan("softmax", ["transformer_xl"], setting).path == "softmax"
  for name in FEATURE_MAPS:
    with pytest.raises(ValueError, match="only the softmax kernel materialises") as e:
      compatibility.plan(name, ["transformer_xl"], setting)
    assert f"kernel {name!r}" in str(e.value) and "Kernels that work with" in str(e.value)
  assert cls.hooks == ("logits",) and not cls.supports_2d and cls.supports_causal


@pytest.mark.parametrize("rel_dim", [7, 0, -2, "8", 8.0, True])
def test_bad_rel_dim_raises(rel_dim):
  cls = positional.get_class("transformer_xl")
  message = "rel_dim must be None (use dims.embed_dim) or a positive even integer"
  with pytest.raises(ValueError, match=re.escape(message)):
    cls.compatibility(KernelInfo("softmax"), causal=True, two_d=False, options={"rel_dim": rel_dim})
  with pytest.raises(ValueError, match=re.escape(message)):
    _init(positional.build("transformer_xl", DIMS, {"rel_dim": rel_dim}), (1, 3, HEADS, HEAD_DIM))


def test_odd_embed_dim_needs_rel_dim():
  dims = Dims(num_heads=HEADS, head_dim=HEAD_DIM, feature_dim=HEAD_DIM, embed_dim=9, max_length=8)
  shape = (1, 3, HEADS, HEAD_DIM)
  with pytest.raises(ValueError, match="dims.embed_dim = 9.*set rel_dim"):
    _init(positional.build("transformer_xl", dims), shape)
  params = _init(positional.build("transformer_xl", dims, {"rel_dim": 10}), shape)
  assert params["params"]["w_kr"].shape == (10, HEADS, HEAD_DIM)


def test_context_errors():
  module, params = _module(), _params()
  q, k = _qk(10, 4, 2)
  apply = lambda q_, k_, ctx: module.apply(params, q_, k_, ctx, method="logits")
  with pytest.raises(ValueError, match="memory_length = 0"):
    apply(q, k, Context(length=4, causal=True))
  with pytest.raises(ValueError, match="1D only"):
    apply(q, q, Context(length=4, grid=(2, 2)))
  with pytest.raises(ValueError, match=re.escape("heads=2, head_dim=4")):
    apply(q[..., :3], k[..., :3], Context(length=4, memory_length=2))
  with pytest.raises(ValueError, match="valid options: rel_dim"):
    positional.build("transformer_xl", DIMS, {"d_r": 8})
