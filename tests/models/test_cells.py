"""Every kernel x positional-scheme cell through the one Attention layer.

For each compatible cell (and the option variants in ``VARIANTS``), in 1D and 2D, causal and
not, with a batch holding one unpadded and one padded sequence:
* the fast layer equals the same layer computed with dense references (float64, < 1e-9);
* relative schemes are relative: shifting the real tokens inside a padded sequence shifts the
  outputs and nothing else;
* causal cells never look ahead (gradient of output i w.r.t. input j > i);
every incompatible cell raises the configuration error.

The default run takes a covering sample of the cells (the rule above ``_sample``), each test's
sample compiled as one program (``_Family``);
``-m slow`` runs the rest.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos import positional
from fastpos.models.attention import Attention, AttentionConfig, KernelSpec, PositionalSpec
from fastpos.positional import compatibility
from fastpos.positional.compatibility import KERNELS
from tests.helpers import assert_causal_jacobian, rel_err

B, N, D, H = 2, 11, 16, 2
GRID, MAX_GRID = (3, 4), (4, 5)
MAX_LENGTH = 16
CHUNK = 4

# Option variants exercised per scheme (the defaults first); a variant is used where it is
# compatible with the cell.
VARIANTS = {
    "absolute": [{"kind": "learned"}, {"kind": "sinusoidal"}],
    "fastrpb": [{}, {"per_head": True, "mode_2d": "full"}],
    "kernelized_rpe": [{}],
    "lrpe": [{"type": 1}, {"type": 2, "p": "householder"}, {"type": 3}],
    "permuteformer": [{}, {"decay": 0.9}],
    "spe": [{"kind": "sine"}, {"kind": "conv"}],
    "t5_bias": [{}, {"bucketed": False}],
}
# Schemes whose output depends on relative positions only (PermuteFormer with r = 1 only).
RELATIVE = (
    "fastrpb",
    "kernelized_rpe",
    "rope",
    "lrpe",
    "permuteformer",
    "t5_bias",
    "transformer_xl",
    "none",
)
# Combinations of several schemes in one layer.
COMBOS = [
    ("rope", "fastrpb"),
    ("permuteformer", "kernelized_rpe"),
    ("absolute", "fastrpb"),
    ("lrpe", "kernelized_rpe"),
]


def _variants(scheme):
  known = positional.option_names(scheme)
  return [v for v in VARIANTS.get(scheme, [{}]) if set(v) <= set(known)]


def _cells():
  for kernel in compatibility.KERNELS:
    for scheme in positional.SCHEMES:
      for causal, two_d in itertools.product((False, True), (False, True)):
        for i, opts in enumerate(_variants(scheme)):
          unused = positional.get_class(scheme).unused_options(opts, two_d=two_d)
          opts = {k: v for k, v in opts.items() if k not in unused}  # e.g. 2D-only options
          setting = dict(causal=causal, two_d=two_d)
          ok = compatibility.problem(kernel, scheme, options=opts, **setting) is None
          yield kernel, (scheme,), (opts,), causal, two_d, ok, i


# The default run keeps a covering sample of the fast-vs-dense matrices; `-m slow` runs the
# rest, and the causality and shift-invariance samples. A cell has
# facets (below); the sample holds every facet value some cell of the matrix has, so each
# scheme with each of its option variants runs causal and bidirectional, in 1D and 2D, on the
# softmax path and on a linear kernel's, and each kernel runs causal and bidirectional, in 1D
# and 2D (`test_the_sample_covers_every_facet` checks this). It is a greedy cover: take the cell
# with the most facet values not yet covered, the first in the order of `_cells()` on ties.
# Causality and shift invariance sample only the kernels whose own code could break them:
# softmax, SIKF (a masked max over the sequence) and FAVOR+ (a stabiliser over the keys);
# elementwise maps (ELU+1, TRF, ...) share the linear path of these.
PROPERTY_KERNELS = ("softmax", "sikf", "favor")
# The facets each test's sample covers. Causality is checked on causal cells only, shift
# invariance in 1D only (the properties' own axis is fixed there).
ALL_FACETS = ("scheme_causal", "scheme_2d", "scheme_path", "kernel_causal", "kernel_2d")
FACETS = {
    "fast_equals_dense": ALL_FACETS,
    "combinations": ("scheme_causal", "scheme_path", "kernel_causal"),
    "shift_invariant": ("scheme_causal", "scheme_path", "kernel_causal"),
    "causal": ("scheme_2d", "scheme_path", "kernel_2d"),
}


def _facets(c, names):
  """The facet values of cell ``c`` for the facets ``names``."""
  kernel, schemes, opts, causal, two_d = c[:5]
  scheme, path = (schemes, repr(opts)), kernel == "softmax"
  values = {
      "scheme_causal": (scheme, causal),
      "scheme_2d": (scheme, two_d),
      "scheme_path": (scheme, path),
      "kernel_causal": (kernel, causal),
      "kernel_2d": (kernel, two_d),
  }
  return {(n, values[n]) for n in names}


def _sample(cells, facets, kernels=None):
  """The cells of ``cells`` that the default run keeps, by the rule above."""
  cells = [c for c in cells if kernels is None or c[0] in kernels]
  need = set().union(*(_facets(c, facets) for c in cells))
  keep = []
  while need:
    best = max(cells, key=lambda c: len(_facets(c, facets) & need))
    keep.append(best)
    need -= _facets(best, facets)
  return keep


def _params(cells, facets, kernels=None):
  keep = {_id(c) for c in _sample(cells, facets, kernels)}
  return [
      pytest.param(c, id=_id(c), marks=() if _id(c) in keep else (pytest.mark.slow,)) for c in cells
  ]


ALL = list(_cells())
COMPATIBLE = [c for c in ALL if c[5]]
INCOMPATIBLE = [c for c in ALL if not c[5] and c[6] == 0]


def _id(c):
  kernel, schemes, opts, causal, two_d = c[:5]
  o = ",".join(f"{k}={v}" for d in opts for k, v in sorted(d.items()))
  return (
      f"{kernel}-{'+'.join(schemes)}{'[' + o + ']' if o else ''}-"
      f"{'causal' if causal else 'bidir'}-{'2d' if two_d else '1d'}"
  )


def _config(kernel, schemes, opts, causal, two_d):
  return AttentionConfig(
      num_heads=H,
      head_dim=D // H,
      embed_dim=D,
      kernel=KernelSpec(kernel, num_features=16),
      positional=tuple(PositionalSpec.make(s, o) for s, o in zip(schemes, opts)),
      max_length=MAX_LENGTH,
      grid=MAX_GRID if two_d else None,
      causal=causal,
      chunk_size=CHUNK,
  )


def _embed_schemes(cfg):
  return [p for p in cfg.positional if "embed" in p.cls.hooks]


def _layer(cfg):
  """A function (params, x, mask, reference) -> [b, n, D] running the embed hooks (if any)
  then the attention layer, and its initial params randomised (tables start at zero)."""
  attn = Attention(cfg.attention_only(), dtype=jnp.float64)
  grid = GRID if cfg.grid is not None else None

  def run(params, x, mask, reference):
    for p in _embed_schemes(cfg):
      dims = cfg.scheme_dims()[p.name]
      scheme = positional.build(p.name, dims, p.option_dict())
      ctx = positional.Context(mask=mask, grid=grid, causal=cfg.causal, length=x.shape[1])
      x = scheme.apply(
          {"params": params.get(f"embed_{p.name}", {})}, x, ctx, method=type(scheme).embed
      )
    return attn.apply({"params": params["attn"]}, x, mask=mask, grid=grid, reference=reference)

  return attn, run


def _init(cfg, attn, n, seed=0):
  grid = GRID if cfg.grid is not None else None
  x = jnp.zeros((B, n, D), jnp.float64)
  # Shapes only (every value is redrawn below): abstract init, no forward pass run op by op.
  init = functools.partial(attn.init, jax.random.key(seed), x, grid=grid)
  params = {"attn": jax.eval_shape(init)["params"]}
  ctx = positional.Context(grid=grid, causal=cfg.causal, length=n)
  for p in _embed_schemes(cfg):
    scheme = positional.build(p.name, cfg.scheme_dims()[p.name], p.option_dict())
    key = jax.random.key(seed + 1)
    init = functools.partial(scheme.init, key, x, ctx, method=type(scheme).embed)
    params[f"embed_{p.name}"] = jax.eval_shape(init).get("params", {})
  # Random values everywhere (positional tables are initialised to zero, which would make
  # the comparison trivial); small enough that exp-based maps stay tame. NumPy draws them: no
  # program to compile per leaf shape.
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.default_rng(seed + 2)
  leaves = [jnp.asarray(0.3 * rng.standard_normal(l.shape)) for l in leaves]
  return jax.tree.unflatten(tree, leaves)


def _inputs(n, seed=0):
  x = jax.random.normal(jax.random.key(seed + 10), (B, n, D), jnp.float64)
  mask = jnp.ones((B, n), bool).at[1, n - 3 :].set(False).at[1, :2].set(False)
  return x, mask


def _n(two_d):
  return GRID[0] * GRID[1] if two_d else N


def _case(cell):
  """A cell's layer function (params, x, mask, reference) -> [b, n, D], its random params, and
  inputs x [B, n, D] with mask [B, n] (one unpadded and one padded sequence)."""
  cfg = _config(*cell[:5])
  attn, run = _layer(cfg)
  n = _n(cell[4])
  return run, _init(cfg, attn, n), *_inputs(n)


def _fast_and_dense(cell):
  """(function, its argument) giving the fast and the dense layer outputs [B, n, D] and mask."""
  run, params, x, mask = _case(cell)
  return lambda a: (run(*a, False), run(*a, True), a[2]), (params, x, mask)


SHIFT, LENGTH = 3, 7


def _shifted(cell):
  """(function, its argument) giving the outputs [2, N, D] of a row whose real tokens sit at
  0..LENGTH-1 and of a row with the same tokens at SHIFT..SHIFT+LENGTH-1 (junk elsewhere)."""
  run, params, _, _ = _case(cell)
  real = jax.random.normal(jax.random.key(5), (1, LENGTH, D), jnp.float64)
  junk = jax.random.normal(jax.random.key(6), (1, N, D), jnp.float64)
  x = jnp.concatenate([junk.at[:, s : s + LENGTH].set(real) for s in (0, SHIFT)])
  mask = jnp.zeros((2, N), bool).at[0, :LENGTH].set(True).at[1, SHIFT : SHIFT + LENGTH].set(True)
  return lambda a: run(*a, False), (params, x, mask)


def _jacobian(cell):
  """(function, its argument) giving d out[i] / d x[j], [n, D, n, D], of one unpadded row."""
  run, params, x, _ = _case(cell)
  mask = jnp.ones((1, x.shape[1]), bool)

  def f(x1, params):
    return run(params, x1[None], mask, False)[0]

  return lambda a: jax.jacrev(f)(*a), (x[0], params)


class _Family:
  """The results of one test's cells. The default sample's cells run side by side in ONE
  compiled program (compiling dominates on 2 cores; one program for a family compiles in about
  half the time of one per cell); any other cell (`-m slow`) compiles alone."""

  def __init__(self, build, sample):
    self.build, self.sample, self.results = build, {_id(c): c for c in sample}, None

  def __call__(self, cell):
    if self.results is None and _id(cell) in self.sample:
      try:
        built = {i: self.build(c) for i, c in self.sample.items()}
        fns = {i: fn for i, (fn, _) in built.items()}
        args = {i: arg for i, (_, arg) in built.items()}
        self.results = jax.jit(lambda a: {i: fns[i](a[i]) for i in a})(args)
      except Exception:  # noqa: BLE001  the cell alone below raises it in its own test
        self.results = {}
    if self.results and _id(cell) in self.results:
      return self.results[_id(cell)]
    fn, arg = self.build(cell)
    return jax.jit(fn)(arg)


@pytest.fixture(scope="module")
def family():
  """Each test's `_Family`, shared by the module's tests."""
  return {
      "fast_equals_dense": _Family(
          _fast_and_dense,
          _sample(COMPATIBLE, FACETS["fast_equals_dense"])
          + _sample(COMBO_CELLS, FACETS["combinations"]),
      ),
      "shift_invariant": _Family(
          _shifted, _sample(SHIFT_CELLS, FACETS["shift_invariant"], PROPERTY_KERNELS)
      ),
      "causal": _Family(_jacobian, _sample(CAUSAL_CELLS, FACETS["causal"], PROPERTY_KERNELS)),
  }


def _check_fast_equals_dense(cell, family, record_property):
  fast, dense, mask = (np.asarray(a) for a in family["fast_equals_dense"](cell))
  assert fast.shape == (B, _n(cell[4]), D)
  assert np.all(np.isfinite(fast))
  # Padded queries' rows are meaningless; compare real rows.
  err = rel_err(fast[mask], dense[mask])
  # With `--junitxml`, scripts/cell_errors.py tabulates these per cell.
  record_property("rel_err", float(err))
  assert err < 1e-9, err


@pytest.mark.parametrize("cell", _params(COMPATIBLE, FACETS["fast_equals_dense"]))
def test_fast_equals_dense(cell, family, record_property):
  _check_fast_equals_dense(cell, family, record_property)


COMBO_CELLS = []
for _schemes in COMBOS:
  if all(s in positional.SCHEMES for s in _schemes):
    for _kernel in ("softmax", "elu1", "favor"):
      for _causal in (False, True):
        _opts = tuple({} for _ in _schemes)
        if all(compatibility.problem(_kernel, s, causal=_causal) is None for s in _schemes):
          COMBO_CELLS.append((_kernel, _schemes, _opts, _causal, False, True, 0))


@pytest.mark.parametrize("cell", _params(COMBO_CELLS, FACETS["combinations"]))
def test_combinations_fast_equals_dense(cell, family, record_property):
  _check_fast_equals_dense(cell, family, record_property)


def _shift_cells():
  for c in COMPATIBLE:
    kernel, schemes, opts, causal, two_d = c[:5]
    if two_d or not all(s in RELATIVE for s in schemes):
      continue
    if any(o.get("decay", 1.0) != 1.0 for o in opts):
      continue
    yield c


SHIFT_CELLS = list(_shift_cells())


# Slow (its sample); the default run keeps relative positions continuing across a memory
# boundary (tests/models/test_models.py::test_transformer_xl_memory_reproduces_...).
@pytest.mark.slow
@pytest.mark.parametrize("cell", _params(SHIFT_CELLS, FACETS["shift_invariant"], PROPERTY_KERNELS))
def test_relative_schemes_are_shift_invariant(cell, family):
  """Real tokens at positions s..s+L-1 of a padded sequence give the outputs of positions
  0..L-1 (and padding elsewhere changes nothing)."""
  out = np.asarray(family["shift_invariant"](cell))
  err = rel_err(out[1, SHIFT : SHIFT + LENGTH], out[0, :LENGTH])
  assert err < 1e-9, err


CAUSAL_CELLS = [c for c in COMPATIBLE if c[3]]


# Slow (its sample); the default run holds each causal op to causality by gradients (tests/ops)
# and the FFT-hook LM (tests/models/test_refusals.py::test_the_lm_never_sees_a_later_token).
@pytest.mark.slow
@pytest.mark.parametrize("cell", _params(CAUSAL_CELLS, FACETS["causal"], PROPERTY_KERNELS))
def test_causal_cells_never_look_ahead(cell, family):
  jac = family["causal"](cell)  # [n, D, n, D]
  # FFT paths (FastRPB / kernelized RPE tables) mix all positions through the transform:
  # their future entries are float64 round-off, bounded relative to the largest entry.
  fft = any(s in ("fastrpb", "kernelized_rpe") for s in cell[1])
  assert_causal_jacobian(jac, _n(cell[4]), in_axis=2, rtol=1e-12 if fft else 0.0)


@pytest.mark.parametrize("cell", INCOMPATIBLE, ids=_id)
def test_incompatible_cells_raise_at_configuration(cell):
  kernel, schemes, opts, causal, two_d = cell[:5]
  with pytest.raises(ValueError, match="incompatible") as e:
    _config(kernel, schemes, opts, causal, two_d)
  assert repr(kernel) in str(e.value) and repr(schemes[0]) in str(e.value)


def test_every_scheme_has_a_compatible_cell_and_the_table_prints(capsys):
  for scheme in positional.SCHEMES:
    assert any(c[1] == (scheme,) for c in COMPATIBLE), scheme
  compatibility.main()
  out = capsys.readouterr().out
  assert "| softmax |" in out and "fastrpb" in out


# Each facet as a projection of a cell, written out again so that the check below does not
# reuse the sampler's own code.
PROJECTIONS = {
    "scheme_causal": lambda c: (c[1], repr(c[2]), c[3]),
    "scheme_2d": lambda c: (c[1], repr(c[2]), c[4]),
    "scheme_path": lambda c: (c[1], repr(c[2]), c[0] == "softmax"),
    "kernel_causal": lambda c: (c[0], c[3]),
    "kernel_2d": lambda c: (c[0], c[4]),
}


@pytest.mark.parametrize(
    "cells, test, kernels",
    [
        (COMPATIBLE, "fast_equals_dense", KERNELS),
        (COMBO_CELLS, "combinations", KERNELS),
        (SHIFT_CELLS, "shift_invariant", PROPERTY_KERNELS),
        (CAUSAL_CELLS, "causal", PROPERTY_KERNELS),
    ],
    ids=("fast_equals_dense", "combinations", "shift_invariant", "causal"),
)
def test_the_sample_covers_every_facet(cells, test, kernels):
  """The default run's sample (the rule above `_sample`) is smaller than the matrix and has
  every facet value the matrix has: each scheme and option variant causal and bidirectional,
  1D and 2D, softmax and linear; each kernel causal and bidirectional, 1D and 2D."""
  sample = _sample(cells, FACETS[test], kernels)
  cells = [c for c in cells if c[0] in kernels]
  assert len(sample) < len(cells)
  assert {_id(c) for c in sample} <= {_id(c) for c in cells}
  for facet in FACETS[test]:
    project = PROJECTIONS[facet]
    assert {project(c) for c in sample} == {project(c) for c in cells}, (test, facet)
  assert {c[0] for c in sample} == {c[0] for c in cells}
  assert {c[1] for c in sample} == {c[1] for c in cells}


def test_kernelized_rpe_softmax_equals_linear_with_exact_exponential_features():
  """One table b, two paths (README "Design"): softmax with the logits bias b_{j-i} equals linear
  attention weighting keys by exp(b_{j-i}) when phi is an exact exponential feature map.

  For one-hot q, k over d symbols, exp(s q.k) = 1 + (e^s - 1) [q == k] = phi(q).phi(k) with
  phi(x) = (1, sqrt(e^s - 1) x): an exact finite feature map of the softmax kernel."""
  from fastpos.ops import attention as ops
  from fastpos.ops import toeplitz

  rng = np.random.default_rng(0)
  b, n, h = 2, 9, 2
  d, s = 3, 3**-0.5
  qa = rng.integers(0, d, (b, n, h))
  ka = rng.integers(0, d, (b, n, h))
  q = jnp.asarray(np.eye(d)[qa])
  k = jnp.asarray(np.eye(d)[ka])
  v = jnp.asarray(rng.normal(size=(b, n, h, 4)))
  mask = jnp.ones((b, n), bool).at[1, -2:].set(False)
  table = jnp.asarray(rng.normal(size=(h, 2 * n - 1)) * 0.5)
  c = np.sqrt(np.exp(s) - 1)

  def phi(x):
    return jnp.concatenate([jnp.ones(x.shape[:-1] + (1,)), c * x], axis=-1)

  @functools.partial(jax.jit, static_argnums=0)  # one program per setting, not op by op
  def both(causal):
    soft = ops.softmax_attention(
        q, k, v, bias=toeplitz.dense_toeplitz(table)[None], mask=mask, causal=causal, scale=s
    )
    lin = ops.linear_attention(phi(q), phi(k), v, mask=mask, causal=causal, rpe=jnp.exp(table))
    return soft, lin

  for causal in (False, True):
    soft, lin = both(causal)
    m = np.asarray(mask)
    assert rel_err(np.asarray(lin)[m], np.asarray(soft)[m]) < 1e-9
