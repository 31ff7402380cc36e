"""t5_bias: T5's buckets against a direct python transcription, the hook's bias against dense
references built entry by entry, offset-only dependence, compatibility, options, jit."""

from __future__ import annotations

import functools
import math
import re

import jax
import numpy as np
import pytest

from fastpos import positional
from fastpos.ops.features import FEATURE_MAPS
from fastpos.positional import Context, Dims, KernelInfo, compatibility, t5_bias
from tests.helpers import rel_err

HEADS = 3
DIMS_1D = Dims(num_heads=HEADS, head_dim=4, feature_dim=4, embed_dim=12, max_length=12)
DIMS_2D = Dims(num_heads=HEADS, head_dim=4, feature_dim=4, embed_dim=12, max_length=20, grid=(4, 5))
# Small buckets so that short test sequences reach the log buckets and the max_distance cap.
SMALL = (("num_buckets", 8), ("max_distance", 9))


def _py_bucket(rel: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
  """T5's _relative_position_bucket for one offset rel = j - i, in plain python."""
  n = -rel
  ret = 0
  if bidirectional:
    num_buckets //= 2
    if n < 0:
      ret += num_buckets
    n = abs(n)
  else:
    n = max(n, 0)
  max_exact = num_buckets // 2
  if n < max_exact:
    return ret + n
  val = max_exact + int(
      math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
  )
  return ret + min(val, num_buckets - 1)


# ---------------------------------------------------------------------------------------------
# Building and applying (jitted once per configuration)
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _module(options: tuple, dims: Dims):
  return positional.build("t5_bias", dims, dict(options))


@functools.lru_cache(maxsize=None)
def _params(options: tuple, dims: Dims):
  module = _module(options, dims)
  n = 4 if dims.grid is None else 4
  grid = None if dims.grid is None else (2, 2)
  x = np.zeros((1, n, dims.num_heads, dims.head_dim))
  ctx = Context(length=n, grid=grid)
  return jax.jit(lambda key: module.init(key, x, x, ctx, method="logits"))(jax.random.key(0))


@functools.lru_cache(maxsize=None)
def _bias_fn(options: tuple, dims: Dims, ctx: Context):
  module = _module(options, dims)
  return jax.jit(lambda params, q, k: module.apply(params, q, k, ctx, method="logits"))


def _bias(options: tuple, dims: Dims, *, lq: int, memory: int = 0, causal: bool = False, grid=None):
  """(bias [1, h, Lq, M+Lq] as numpy, the parameter table as numpy)."""
  params = _params(options, dims)
  ctx = Context(causal=causal, length=lq, memory_length=memory, grid=grid)
  q = np.zeros((2, lq, dims.num_heads, dims.head_dim))
  k = np.zeros((2, memory + lq, dims.num_heads, dims.head_dim))
  out = np.asarray(_bias_fn(options, dims, ctx)(params, q, k))
  return out, np.asarray(params["params"]["rel_bias"])


# ---------------------------------------------------------------------------------------------
# The bucketing
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_buckets, max_distance", [(32, 128), (8, 9), (8, 40), (4, 3), (16, 100)]
)
@pytest.mark.parametrize("bidirectional", [True, False])
def test_buckets_match_python_transcription(num_buckets, max_distance, bidirectional):
  offsets = np.arange(-300, 301)
  got = t5_bias.relative_position_bucket(
      offsets, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
  )
  want = [_py_bucket(int(o), bidirectional, num_buckets, max_distance) for o in offsets]
  np.testing.assert_array_equal(got, want)
  assert got.min() == 0 and got.max() == num_buckets - 1
  side = num_buckets // 2 if bidirectional else num_buckets
  past = got[offsets <= 0][::-1]  # distance 0, 1, 2, ...
  np.testing.assert_array_equal(past[: side // 2], np.arange(side // 2))  # exact buckets
  assert np.all(np.diff(past) >= 0)  # grows with the distance
  assert np.all(past[max_distance:] == side - 1)  # beyond max_distance: the last
  if bidirectional:
    future = got[offsets > 0]
    assert np.all(future >= side) and np.all(np.diff(future) >= 0)
  else:
    assert np.all(got[offsets > 0] == 0)  # future keys (masked): bucket 0


def test_t5_default_buckets_at_known_offsets():
  bucket = functools.partial(t5_bias.relative_position_bucket, num_buckets=32, max_distance=128)
  enc = bucket(np.array([0, -1, -7, -8, -16, -127, -128, -1000, 1, 7, 16, 128]), bidirectional=True)
  np.testing.assert_array_equal(enc, [0, 1, 7, 8, 10, 15, 15, 15, 17, 23, 26, 31])
  dec = bucket(np.array([0, -15, -16, -32, -64, -128, 5]), bidirectional=False)
  np.testing.assert_array_equal(dec, [0, 15, 16, 21, 26, 31, 0])


# ---------------------------------------------------------------------------------------------
# The hook against entry-by-entry references (1D, with memory)
# ---------------------------------------------------------------------------------------------
CASES_1D = [(1, 0), (5, 0), (7, 3), (4, 8)]  # (Lq, M)


def _sampled(cases, default):
  """``cases`` as parameters; those not in ``default`` run with ``-m slow`` only."""
  return [pytest.param(*c, marks=() if c in default else pytest.mark.slow) for c in cases]


# By default each shape once, with every (options, causal) pair; the full product -m slow.
BUCKETED_DEFAULT = {
    (SMALL, False, 1, 0),
    ((), True, 5, 0),
    (SMALL, True, 7, 3),
    ((), False, 4, 8),
    (SMALL, True, 9, 14),
}


@pytest.mark.parametrize(
    "options, causal, lq, memory",
    _sampled(
        [(o, c, *s) for o in (SMALL, ()) for c in (False, True) for s in CASES_1D + [(9, 14)]],
        BUCKETED_DEFAULT,
    ),
)
def test_bucketed_bias_matches_reference(options, causal, lq, memory):
  got, table = _bias(options, DIMS_1D, lq=lq, memory=memory, causal=causal)
  nb, md = dict(options).get("num_buckets", 32), dict(options).get("max_distance", 128)
  assert got.shape == (1, HEADS, lq, memory + lq)
  assert table.shape == (HEADS, nb)
  want = np.zeros((1, HEADS, lq, memory + lq))
  for i in range(lq):
    for j in range(memory + lq):
      want[0, :, i, j] = table[:, _py_bucket(j - (memory + i), not causal, nb, md)]
  assert rel_err(got, want) < 1e-9
  np.testing.assert_array_equal(got, want)  # a gather: exact


# Each shape once by default, causal and not in turn; the full product -m slow.
@pytest.mark.parametrize(
    "causal, lq, memory",
    _sampled(
        [(c, *s) for c in (False, True) for s in CASES_1D + [(12, 0)]],
        {(i % 2 == 1, *s) for i, s in enumerate(CASES_1D + [(12, 0)])},
    ),
)
def test_per_offset_bias_matches_reference(causal, lq, memory):
  got, table = _bias((("bucketed", False),), DIMS_1D, lq=lq, memory=memory, causal=causal)
  n_max = DIMS_1D.max_length
  assert table.shape == (HEADS, 2 * n_max - 1)
  want = np.zeros((1, HEADS, lq, memory + lq))
  for i in range(lq):
    for j in range(memory + lq):
      want[0, :, i, j] = table[:, (j - (memory + i)) + n_max - 1]
  assert rel_err(got, want) < 1e-9
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("options", [SMALL, (("bucketed", False),)], ids=["bucketed", "offset"])
@pytest.mark.parametrize("causal", [False, True])
def test_bias_depends_on_offset_only(options, causal):
  lq, memory = 7, 4
  got, _ = _bias(options, DIMS_1D, lq=lq, memory=memory, causal=causal)
  # (i, j) and (i+1, j+1) share the offset j - (M + i).
  np.testing.assert_array_equal(got[..., 1:, 1:], got[..., :-1, :-1])
  # ... and the offsets really are told apart: the last query row sees M+Lq offsets -> as many
  # distinct values as distinct buckets (per-offset: all distinct).
  offsets = np.arange(memory + lq) - (memory + lq - 1)
  if dict(options).get("bucketed", True):
    buckets = t5_bias.relative_position_bucket(
        offsets, bidirectional=not causal, num_buckets=8, max_distance=9
    )
    n_distinct = len(np.unique(buckets))
    assert n_distinct >= 4
  else:
    n_distinct = memory + lq
  assert len(np.unique(got[0, 0, -1])) == n_distinct


def test_memory_matches_rows_of_the_full_sequence():
  # With memory M the queries are positions M..M+Lq-1 of an (M+Lq)-long sequence.
  for options in (SMALL, (("bucketed", False),)):
    with_memory, _ = _bias(options, DIMS_1D, lq=4, memory=8)
    full, _ = _bias(options, DIMS_1D, lq=12)
    np.testing.assert_array_equal(with_memory, full[:, :, 8:, :])


# ---------------------------------------------------------------------------------------------
# 2D grids (raster order)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grid", [(3, 4), (4, 5), (1, 3)])
def test_2d_per_offset_matches_reference(causal, grid):
  got, table = _bias(
      (("bucketed", False),), DIMS_2D, lq=grid[0] * grid[1], causal=causal, grid=grid
  )
  (h, w), (mh, mw) = grid, DIMS_2D.grid
  assert table.shape == (HEADS, 2 * mh - 1, 2 * mw - 1)
  want = np.zeros((1, HEADS, h * w, h * w))
  for p in range(h * w):
    for p2 in range(h * w):
      dr, dc = p2 // w - p // w, p2 % w - p % w
      want[0, :, p, p2] = table[:, dr + mh - 1, dc + mw - 1]
  assert rel_err(got, want) < 1e-9
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grid", [(3, 4), (4, 5)])
def test_2d_bucketed_matches_reference(causal, grid):
  options = (("max_distance", 5), ("num_buckets", 8))
  got, table = _bias(options, DIMS_2D, lq=grid[0] * grid[1], causal=causal, grid=grid)
  h, w = grid
  assert table.shape == (HEADS, 8, 8)
  want = np.zeros((1, HEADS, h * w, h * w))
  for p in range(h * w):
    for p2 in range(h * w):
      dr, dc = p2 // w - p // w, p2 % w - p % w
      # Raster causal: rows bucketed causally, columns always two-sided.
      want[0, :, p, p2] = table[:, _py_bucket(dr, not causal, 8, 5), _py_bucket(dc, True, 8, 5)]
  assert rel_err(got, want) < 1e-9
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "options",
    [(("num_buckets", 8), ("max_distance", 5)), (("bucketed", False),)],
    ids=["bucketed", "offset"],
)
def test_2d_bias_depends_on_2d_offset_only(options):
  h, w = 4, 5
  got, _ = _bias(options, DIMS_2D, lq=h * w, grid=(h, w))
  b = got[0].reshape(HEADS, h, w, h, w)
  np.testing.assert_array_equal(b[:, 1:, :, 1:, :], b[:, :-1, :, :-1, :])  # shift both rows
  np.testing.assert_array_equal(b[:, :, 1:, :, 1:], b[:, :, :-1, :, :-1])  # shift both columns
  assert len(np.unique(b[0, 0, 0])) > 4


# ---------------------------------------------------------------------------------------------
# Parameters, jit, errors, compatibility
# ---------------------------------------------------------------------------------------------
def test_init_is_t5x_embed_init():
  dims = Dims(num_heads=16, head_dim=4, feature_dim=4, embed_dim=64, max_length=8)
  table = np.asarray(_params((), dims)["params"]["rel_bias"])
  assert table.shape == (16, 32)
  # Normal with variance 1 / num_buckets: 512 draws, the sample std is within ~3% of 32^-0.5.
  assert 0.85 < table.std() * math.sqrt(32) < 1.15
  assert abs(table.mean()) < 0.05


def test_jit_matches_eager():
  options = SMALL
  params = _params(options, DIMS_1D)
  module = _module(options, DIMS_1D)
  ctx = Context(causal=True, length=5, memory_length=2)
  q, k = np.zeros((1, 5, HEADS, 4)), np.zeros((1, 7, HEADS, 4))
  eager = module.apply(params, q, k, ctx, method="logits")
  jitted, _ = _bias(options, DIMS_1D, lq=5, memory=2, causal=True)
  np.testing.assert_array_equal(np.asarray(eager), jitted)
  # And differentiable: d sum(bias) / d table counts the pairs in each bucket.
  grad = jax.grad(lambda p: module.apply(p, q, k, ctx, method="logits").sum())(params)
  g = np.asarray(grad["params"]["rel_bias"])
  buckets = [_py_bucket(j - (2 + i), False, 8, 9) for i in range(5) for j in range(7)]
  np.testing.assert_array_equal(g[0], np.bincount(buckets, minlength=8))


def test_length_and_context_errors():
  with pytest.raises(ValueError, match="exceeds the maximum length 12"):
    _bias((("bucketed", False),), DIMS_1D, lq=9, memory=4)  # M + Lq = 13 > 12
  module = _module(SMALL, DIMS_1D)
  params = _params(SMALL, DIMS_1D)
  q, k = np.zeros((1, 5, HEADS, 4)), np.zeros((1, 7, HEADS, 4))
  with pytest.raises(ValueError, match="memory_length = 0"):
    module.apply(params, q, k, Context(length=5), method="logits")
  with pytest.raises(ValueError, match="built for 1D"):
    module.apply(params, q, q, Context(length=5, grid=(1, 5)), method="logits")
  module_2d, params_2d = _module(SMALL, DIMS_2D), _params(SMALL, DIMS_2D)
  with pytest.raises(ValueError, match="only defined for 1D"):
    module_2d.apply(
        params_2d, q, k, Context(length=5, memory_length=2, grid=(1, 5)), method="logits"
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("two_d", [False, True])
def test_compatibility_softmax_only(causal, two_d):
  cls = positional.get_class("t5_bias")
  setting = compatibility.Setting(causal=causal, two_d=two_d)
  for options in ({}, {"bucketed": False}):
    opts = {"t5_bias": options}
    assert compatibility.plan("softmax", ["t5_bias"], setting, options=opts).path == "softmax"
    for name in FEATURE_MAPS:
      with pytest.raises(ValueError, match="incompatible") as e:
        compatibility.plan(name, ["t5_bias"], setting, options=opts)
      assert "use kernelized_rpe" in str(e.value) and f"kernel {name!r}" in str(e.value)
  assert cls.hooks == ("logits",) and cls.supports_2d and cls.supports_causal


BAD_OPTIONS = [
    ({"num_buckets": 7}, "num_buckets must be an even integer >= 4"),
    ({"num_buckets": 2}, "num_buckets must be an even integer >= 4"),
    ({"num_buckets": "32"}, "num_buckets must be an even integer >= 4"),
    (
        {"num_buckets": 32, "max_distance": 16},
        "max_distance must be an integer > " "num_buckets // 2 = 16",
    ),
    ({"max_distance": 100.0}, "max_distance must be an integer"),
    ({"bucketed": "yes"}, "bucketed must be True or False"),
    ({"share_across_layers": 1}, "share_across_layers must be True or False"),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS)
def test_bad_options_raise(options, message):
  cls = positional.get_class("t5_bias")
  with pytest.raises(ValueError, match=re.escape(message)):
    cls.compatibility(KernelInfo("softmax"), causal=False, two_d=False, options=options)
  module = positional.build("t5_bias", DIMS_1D, options)
  x = np.zeros((1, 3, HEADS, 4))
  with pytest.raises(ValueError, match=re.escape(message)):
    module.init(jax.random.key(0), x, x, Context(length=3), method="logits")


def test_unknown_option_lists_valid_ones():
  with pytest.raises(ValueError, match="bucketed, num_buckets, max_distance"):
    positional.build("t5_bias", DIMS_1D, {"buckets": 8})
