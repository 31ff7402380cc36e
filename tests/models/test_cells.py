"""Every kernel x positional-scheme cell through the one Attention layer.

For each compatible cell (and the option variants in ``VARIANTS``), in 1D and 2D, causal and
not, with a batch holding one unpadded and one padded sequence:
* the fast layer equals the same layer computed with dense references (float64, < 1e-9);
* relative schemes are relative: shifting the real tokens inside a padded sequence shifts the
  outputs and nothing else;
* causal cells never look ahead (gradient of output i w.r.t. input j > i);
every incompatible cell raises the configuration error.

The default run takes a deterministic sample of the cells (the rule above ``_sample``);
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


# The default run samples the matrix; `-m slow` runs the rest. The rule, per test:
# * group the cells by setting (schemes, options, causal, 1D / 2D);
# * in every group keep the softmax cell (its own path) and one cell of a linear kernel: the
#   candidate kernel used least so far in the same (causal, 1D / 2D) setting, ties broken by
#   the order of `compatibility.KERNELS`, groups taken in the order of `_cells()`.
# So every setting runs both paths, and every linear kernel runs in each (causal, 1D / 2D)
# setting where it fits (`test_the_sample_covers_every_kernel_and_setting` checks this).
# Causality and shift invariance sample only the kernels whose own code could break them:
# softmax, SIKF (a masked max over the sequence) and FAVOR+ (a stabiliser over the keys);
# elementwise maps (ELU+1, TRF, ...) share the linear path of these.
PROPERTY_KERNELS = ("softmax", "sikf", "favor")


def _group(c):
  """A cell's setting: schemes, options, causal, 2D."""
  return c[1], repr(c[2]), c[3], c[4]


def _sample(cells, kernels=None):
  """The cells of ``cells`` that the default run keeps, by the rule above."""
  groups, used, keep = {}, {}, []
  for c in cells:
    if kernels is None or c[0] in kernels:
      groups.setdefault(_group(c), []).append(c)
  for (_, _, causal, two_d), group in groups.items():
    keep += [c for c in group if c[0] == "softmax"]
    linear = [c for c in group if c[0] != "softmax"]
    if linear:
      count = used.setdefault((causal, two_d), {})
      pick = min(linear, key=lambda c: (count.get(c[0], 0), KERNELS.index(c[0])))
      count[pick[0]] = count.get(pick[0], 0) + 1
      keep.append(pick)
  return keep


def _params(cells, kernels=None):
  keep = {_id(c) for c in _sample(cells, kernels)}
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
  # the comparison trivial); small enough that exp-based maps stay tame.
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 2), len(leaves))
  leaves = [0.3 * jax.random.normal(k, l.shape, jnp.float64) for k, l in zip(keys, leaves)]
  return jax.tree.unflatten(tree, leaves)


def _inputs(n, seed=0):
  x = jax.random.normal(jax.random.key(seed + 10), (B, n, D), jnp.float64)
  mask = jnp.ones((B, n), bool).at[1, n - 3 :].set(False).at[1, :2].set(False)
  return x, mask


def _n(two_d):
  return GRID[0] * GRID[1] if two_d else N


@pytest.mark.parametrize("cell", _params(COMPATIBLE))
def test_fast_equals_dense(cell, record_property):
  kernel, schemes, opts, causal, two_d = cell[:5]
  cfg = _config(kernel, schemes, opts, causal, two_d)
  attn, run = _layer(cfg)
  n = _n(two_d)
  params = _init(cfg, attn, n)
  x, mask = _inputs(n)
  fast = run(params, x, mask, False)
  dense = run(params, x, mask, True)
  assert fast.shape == (B, n, D)
  assert np.all(np.isfinite(np.asarray(fast)))
  # Padded queries' rows are meaningless; compare real rows.
  m = np.asarray(mask)
  err = rel_err(np.asarray(fast)[m], np.asarray(dense)[m])
  # With `--junitxml`, scripts/cell_errors.py tabulates these per cell.
  record_property("rel_err", float(err))
  assert err < 1e-9, err


COMBO_CELLS = []
for _schemes in COMBOS:
  if all(s in positional.SCHEMES for s in _schemes):
    for _kernel in ("softmax", "elu1", "favor"):
      for _causal in (False, True):
        _opts = tuple({} for _ in _schemes)
        if all(compatibility.problem(_kernel, s, causal=_causal) is None for s in _schemes):
          COMBO_CELLS.append((_kernel, _schemes, _opts, _causal, False, True, 0))


@pytest.mark.parametrize("cell", _params(COMBO_CELLS))
def test_combinations_fast_equals_dense(cell, record_property):
  test_fast_equals_dense(cell, record_property)


def _shift_cells():
  for c in COMPATIBLE:
    kernel, schemes, opts, causal, two_d = c[:5]
    if two_d or not all(s in RELATIVE for s in schemes):
      continue
    if any(o.get("decay", 1.0) != 1.0 for o in opts):
      continue
    yield c


@pytest.mark.parametrize("cell", _params(list(_shift_cells()), PROPERTY_KERNELS))
def test_relative_schemes_are_shift_invariant(cell):
  """Real tokens at positions s..s+L-1 of a padded sequence give the outputs of positions
  0..L-1 (and padding elsewhere changes nothing)."""
  kernel, schemes, opts, causal, two_d = cell[:5]
  cfg = _config(kernel, schemes, opts, causal, two_d)
  attn, run = _layer(cfg)
  n, length, shift = N, 7, 3
  params = _init(cfg, attn, n)
  real = jax.random.normal(jax.random.key(5), (1, length, D), jnp.float64)
  junk = jax.random.normal(jax.random.key(6), (1, n, D), jnp.float64)
  outs = []
  for s in (0, shift):
    x = junk.at[:, s : s + length].set(real)
    mask = jnp.zeros((1, n), bool).at[:, s : s + length].set(True)
    outs.append(
        np.asarray(run(params, jnp.concatenate([x, x]), jnp.concatenate([mask, mask]), False))[
            0, s : s + length
        ]
    )
  err = rel_err(outs[1], outs[0])
  assert err < 1e-9, err


def _causal_cells():
  for c in COMPATIBLE:
    if c[3]:
      yield c


@pytest.mark.parametrize("cell", _params(list(_causal_cells()), PROPERTY_KERNELS))
def test_causal_cells_never_look_ahead(cell):
  kernel, schemes, opts, causal, two_d = cell[:5]
  cfg = _config(kernel, schemes, opts, causal, two_d)
  attn, run = _layer(cfg)
  n = _n(two_d)
  params = _init(cfg, attn, n)
  x, _ = _inputs(n)
  mask = jnp.ones((1, n), bool)

  def f(x1, params):
    return run(params, x1[None], mask, False)[0]

  jac = jax.jit(jax.jacrev(f))(x[0], params)  # [n, D, n, D]; one compiled program
  # FFT paths (FastRPB / kernelized RPE tables) mix all positions through the transform:
  # their future entries are float64 round-off, bounded relative to the largest entry.
  fft = any(s in ("fastrpb", "kernelized_rpe") for s in schemes)
  assert_causal_jacobian(jac, n, in_axis=2, rtol=1e-12 if fft else 0.0)


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


@pytest.mark.parametrize(
    "cells, kernels",
    [
        (COMPATIBLE, KERNELS),
        (COMBO_CELLS, KERNELS),
        (list(_shift_cells()), PROPERTY_KERNELS),
        (list(_causal_cells()), PROPERTY_KERNELS),
    ],
    ids=("fast_equals_dense", "combinations", "shift_invariant", "causal"),
)
def test_the_sample_covers_every_kernel_and_setting(cells, kernels):
  """The default run's sample (the rule above `_sample`): every setting runs softmax and a
  linear kernel where they fit, and every kernel runs in every (causal, 1D / 2D) setting
  where it fits."""
  sample = _sample(cells, kernels)
  assert len(sample) < len(cells)
  cells = [c for c in cells if c[0] in kernels]
  for g in {_group(c) for c in cells}:
    fits = {c[0] == "softmax" for c in cells if _group(c) == g}
    assert fits == {c[0] == "softmax" for c in sample if _group(c) == g}, g
  # Each kernel in each (causal, 2D) setting where it fits.
  assert {(c[0], c[3], c[4]) for c in cells} == {(c[0], c[3], c[4]) for c in sample}
  assert {c[0] for c in sample} == {c[0] for c in cells}


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

  for causal in (False, True):
    soft = ops.softmax_attention(
        q, k, v, bias=toeplitz.dense_toeplitz(table)[None], mask=mask, causal=causal, scale=s
    )
    lin = ops.linear_attention(phi(q), phi(k), v, mask=mask, causal=causal, rpe=jnp.exp(table))
    m = np.asarray(mask)
    assert rel_err(np.asarray(lin)[m], np.asarray(soft)[m]) < 1e-9
