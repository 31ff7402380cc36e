"""Incremental decoding (``fastpos.models.decoding``) against the full causal forward.

For a kernel x scheme cell: a tiny float64 ``DecoderLM`` with perturbed parameters (so the
zero-initialised position tables matter), a batch whose second row is the first shifted right
by two LEFT-padding slots; a prompt prefill, a block of three tokens, then one token per call
(one jitted step function). Checked:

* the decoded logits equal the full causal forward of the same padded batch at every real
  position (relative error < 1e-9). ``favor`` / ``orf`` add eps after a key stabiliser shared
  by all keys, future ones included, so their full forward is causal only up to O(eps) (the
  earlier positions of a deeper layer's input change with later tokens): decoding computes
  the exactly causal form, which for one layer is the forward of the prefix each position has
  seen, and is checked so;
* the padded row equals the unpadded one (relative schemes; not ``absolute``, whose positions
  are slots, nor ``spe``, relative only in expectation);
* the decoding state of the recurrent cells does not depend on ``max_length``.

The default run checks one cell; ``-m slow`` runs every causal 1D cell of the
compatibility table and prints the worst error per cell.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos import positional
from fastpos.models import TaskInfo, build_model, decoding, model_config
from fastpos.ops import features as feature_ops
from fastpos.positional import compatibility

VOCAB, LENGTH, SHIFT = 13, 8, 2
# Tokens per decoding call: a prefill, a block of the same size on a non-empty state, single
# tokens (two sizes: two compiles of the step).
BLOCKS = (3, 3, 1, 1)
TOL = 1e-9
# Option variants run in the full matrix besides each scheme's defaults.
VARIANTS = {
    "permuteformer": [{"decay": 0.9}, {}],
    "spe": [{}, {"kind": "conv"}],
    "lrpe": [{}, {"type": 1, "p": "fourier"}],
    "t5_bias": [{}, {"bucketed": False}],
    "absolute": [{}, {"kind": "sinusoidal"}],
}
PREFIX_KERNELS = ("favor", "orf")  # full forward's key stabiliser sees future keys (O(eps))
# dpfp's features are sparse (products of ReLUs), so phi(q).phi(k) can sit far below
# |phi(q)| |phi(k)|; lrpe's Householder P and rotations of the numerator's features then lose
# that ratio's digits in any summation order: the full forward's own padded row differs from
# its unpadded row by ~1e-9 there (elu1 x lrpe: 5e-16).
TOLERANCES = {("dpfp", "lrpe"): 1e-8}


def causal_cells():
  """(kernel, scheme, options) for every causal 1D cell of the compatibility table."""
  cells = []
  for kernel in feature_ops.KERNELS:
    for scheme in positional.SCHEMES:
      if compatibility.problem(kernel, scheme, causal=True, two_d=False) is None:
        for opts in VARIANTS.get(scheme, [{}]):
          cells.append((kernel, scheme, opts))
  return cells


def _model(kernel, scheme, opts, max_length=LENGTH, mode="auto"):
  c = model_config()
  c.kernel, c.positional, c.attention_mode = kernel, scheme, mode
  c.num_layers = 1 if kernel in PREFIX_KERNELS else 2
  c.embed_dim, c.num_heads, c.mlp_dim = 16, 2, 32
  c.dropout_rate, c.dtype, c.max_length = 0.0, "float64", max_length
  c.kernel_options.num_features = 8
  if opts:
    c.positional_options = {scheme: dict(opts)}
  return build_model(c, TaskInfo(kind="lm", vocab_size=VOCAB, max_length=max_length))


def _batch():
  rng = np.random.default_rng(0)
  row = rng.integers(1, VOCAB, LENGTH)
  toks = np.stack([row, np.concatenate([np.zeros(SHIFT, int), row[:-SHIFT]])])
  mask = toks != 0
  return jnp.asarray(toks, jnp.int32), jnp.asarray(mask)


def _params(model, toks, mask):
  params = jax.jit(model.init)(jax.random.key(0), {"inputs": toks, "mask": mask})["params"]
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  return jax.tree.unflatten(
      tree, [a + 0.3 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)]
  )


def _forward(model, params, toks, mask):
  out = model.apply({"params": params}, {"inputs": toks, "mask": mask})
  return out[0] if isinstance(out, tuple) else out


def decode_errors(kernel, scheme, opts, mode="auto"):
  """(error against the full causal forward, error padded row vs unpadded row or None); the
  full forward's causal linear attention by ``mode``."""
  model = _model(kernel, scheme, opts, mode=mode)
  toks, mask = _batch()
  params = _params(model, toks, mask)
  step = decoding.step_fn(model)
  cache = model.init_cache(2, LENGTH)
  outs, start = [], 0
  for size in BLOCKS:  # a prefill, a block on a non-empty state, then single tokens
    logits, cache = step(
        params, cache, toks[:, start : start + size], mask[:, start : start + size]
    )
    outs.append(logits)
    start += size
  dec = np.asarray(jnp.concatenate(outs, axis=1))
  assert int(cache["index"]) == LENGTH
  if kernel in PREFIX_KERNELS:  # the prefix 0..i: later tokens masked (one compile)
    fwd = jax.jit(functools.partial(_forward, model))
    ref = np.stack(
        [
            np.asarray(fwd(params, toks, mask & (jnp.arange(LENGTH) <= i)[None]))[:, i]
            for i in range(LENGTH)
        ],
        axis=1,
    )
  else:
    ref = np.asarray(jax.jit(functools.partial(_forward, model))(params, toks, mask))
  m = np.asarray(mask)[..., None]
  err = float(np.max(np.abs(dec - ref) * m) / np.max(np.abs(ref) * m))
  shift = None
  if scheme not in ("absolute", "spe"):
    shift = float(np.max(np.abs(dec[1, SHIFT:] - dec[0, :-SHIFT])) / np.max(np.abs(dec[0])))
  return err, shift


# One cell per hook family a scheme decodes through (logits: softmax's key / value cache;
# features, kv, features + kv, output, embed: linear kernels' recurrent states), the prefix
# check (favor) and the FastRPB value cache; transformer_xl and spe (logits, features) run in
# the slow matrix. The default run keeps one cell (dpfp + FastRPB: the output hook's value
# cache); the others run under `-m slow` (here and in test_decoding_every_causal_cell).
_SLOW = pytest.mark.slow
DEFAULT_CELLS = [
    pytest.param("softmax", "t5_bias", {}, marks=_SLOW),
    pytest.param("elu1", "permuteformer", {"decay": 0.9}, marks=_SLOW),
    pytest.param("favor", "rope", {}, marks=_SLOW),
    pytest.param("sikf", "kernelized_rpe", {}, marks=_SLOW),
    pytest.param("dpfp", "fastrpb", {}),
    pytest.param("relu", "absolute", {}, marks=_SLOW),
]


@pytest.mark.parametrize(
    "kernel,scheme,opts", DEFAULT_CELLS, ids=[f"{c.values[0]}-{c.values[1]}" for c in DEFAULT_CELLS]
)
def test_decoding_matches_full_forward(kernel, scheme, opts):
  err, shift = decode_errors(kernel, scheme, opts)
  tol = TOLERANCES.get((kernel, scheme), TOL)
  assert err < tol, (kernel, scheme, err)
  if shift is not None:
    assert shift < tol, (kernel, scheme, shift)


# The full forward by each causal algorithm: plain (relu), decay (permuteformer), the running
# maximum of the keys' scale (sikf), numerator and denominator features apart (rope).
MODE_CELLS = [
    ("relu", "absolute", {}),
    ("elu1", "permuteformer", {"decay": 0.9}),
    ("sikf", "absolute", {}),
    ("elu1", "rope", {}),
]


# Slow; the default run keeps test_decoding_matches_full_forward[dpfp-fastrpb] (the ops' tests
# hold every mode of every algorithm to the dense reference).
@pytest.mark.parametrize("mode", ("chunk", "recurrent"))
@pytest.mark.parametrize(
    "kernel,scheme,opts",
    [pytest.param(*c, id=f"{c[0]}-{c[1]}", marks=pytest.mark.slow) for c in MODE_CELLS],
)
def test_decoding_matches_full_forward_in_every_mode(kernel, scheme, opts, mode):
  err, shift = decode_errors(kernel, scheme, opts, mode=mode)
  assert err < TOL, (kernel, scheme, mode, err)
  if shift is not None:
    assert shift < TOL, (kernel, scheme, mode, shift)


@pytest.mark.slow
def test_decoding_every_causal_cell():
  worst = {}
  for kernel, scheme, opts in causal_cells():
    err, shift = decode_errors(kernel, scheme, opts)
    worst[(kernel, scheme, tuple(sorted(opts.items())))] = (err, shift)
  for cell, (err, shift) in sorted(worst.items(), key=lambda kv: -kv[1][0]):
    print(f"{cell}: forward {err:.2e}" + ("" if shift is None else f", shift {shift:.2e}"))
  tol = {c: TOLERANCES.get(c[:2], TOL) for c in worst}
  bad = {c: e for c, e in worst.items() if e[0] >= tol[c] or (e[1] is not None and e[1] >= tol[c])}
  assert not bad, bad


def _cache_shapes(model, max_length):
  cache = jax.eval_shape(lambda: model.init_cache(2, max_length))
  return {jax.tree_util.keystr(p): a.shape for p, a in jax.tree_util.tree_leaves_with_path(cache)}


@pytest.mark.parametrize(
    "kernel,scheme,opts,constant",
    [
        ("elu1", "none", {}, True),
        ("favor", "rope", {}, True),
        ("sikf", "lrpe", {}, True),
        ("dpfp", "permuteformer", {"decay": 0.9}, True),
        ("prf", "spe", {}, True),
        ("relu", "absolute", {}, True),
        ("softmax", "none", {}, False),
        ("elu1", "fastrpb", {}, False),
        ("elu1", "kernelized_rpe", {}, False),
    ],
)
def test_state_size(kernel, scheme, opts, constant):
  """Recurrent cells keep the same state whatever the context; caches grow with it."""
  model = _model(kernel, scheme, opts, max_length=64)
  short, long = _cache_shapes(model, 16), _cache_shapes(model, 64)
  assert (short == long) is constant, (short, long)


def test_decoding_errors_are_clear():
  model = _model("elu1", "none", {})
  toks, mask = _batch()
  params = _params(model, toks, mask)
  with pytest.raises(ValueError, match="init_cache"):
    model.apply(
        {"params": params},
        {"inputs": toks[:, :1], "mask": mask[:, :1]},
        decode=True,
        mutable=["cache"],
    )
  with pytest.raises(ValueError, match="max_length"):
    model.init_cache(2, LENGTH + 1)
