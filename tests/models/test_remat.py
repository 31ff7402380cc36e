"""model.remat and model.scan_layers change memory, compile time and the parameter layout, never
the numbers: outputs and gradients equal the unrolled, non-rematerialised model's (float64)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from fastpos.models import TaskInfo, build_model, model_config
from fastpos.models.blocks import MLP
from fastpos.models.transformer import stack_layers, unstack_layers
from tests.helpers import nudged, rel_err

V = 13
N = 12


def _cfg(**kw):
  c = model_config()
  c.update(
      num_layers=2,
      embed_dim=16,
      num_heads=2,
      mlp_dim=32,
      dropout_rate=0.0,
      dtype="float64",
      chunk_size=4,
  )
  c.kernel_options.num_features = 8
  for k, v in kw.items():
    if isinstance(v, dict):
      for kk, vv in v.items():
        c[k][kk] = vv
    else:
      c[k] = v
  return c


def _batch(kind):
  rng = np.random.default_rng(0)
  ids = rng.integers(1, V, (2, N)).astype(np.int32)
  ids[1, N - 3 :] = 0  # padding in the second row
  out = {"inputs": jnp.asarray(ids), "mask": jnp.asarray(ids != 0)}
  if kind == "classify":
    out["targets"] = jnp.asarray([0, 2])
  return out


def _loss(model, kind):
  """A scalar of the whole output: the gradient reaches every parameter."""

  def fn(params, rest, batch):
    out = model.apply(
        {"params": params, **rest},
        batch,
        train=True,
        mutable=["batch_stats"],
        rngs={"dropout": jax.random.key(3)},
    )[0]
    w = jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)
    return jnp.sum(out * w), out

  return jax.jit(jax.value_and_grad(fn, has_aux=True))


# (kind, kernel, positional, extra fields): the LRA Text cell, a causal LM with the causal
# FFT output hook, softmax with a bias and BatchNorm, and a kv-mixing scheme.
TEXT = ("classify", "sikf", "absolute,fastrpb", {})
CELLS = [
    TEXT,
    ("lm", "elu1", "fastrpb", {}),
    ("classify", "softmax", "t5_bias", dict(norm="batch")),
    ("lm", "nprf", "kernelized_rpe", dict(norm="pre")),
]
# (model.remat, model.scan_layers), each against the unrolled, non-rematerialised model.
SETTINGS = [
    ("none", True),
    ("block", False),
    ("block", True),
    ("save_matmuls", False),
    ("save_matmuls", True),
    ("save_dots", True),
]
# The default run holds one remat policy under nn.scan, on the LRA Text cell (one compiled
# reference); `-m slow` runs every cell with every setting.
DEFAULT = [(TEXT, "save_dots", True)]
# nprf draws a random-feature projection per layer: scanned, each layer draws its unrolled
# twin's (tests/models/test_scan_keys.py holds every such kernel).
CASES = [
    pytest.param(c, r, s, marks=() if (c, r, s) in DEFAULT else pytest.mark.slow)
    for c in CELLS
    for r, s in SETTINGS
]


def _ids(value):
  return f"{value[0]}-{value[1]}-{value[2]}" if isinstance(value, tuple) else str(value)


@pytest.fixture(scope="module")
def references():
  """{cell: its reference}, each built at its first use and shared by the cell's settings."""
  return {}


def _reference(cell):
  kind, kernel, scheme, extra = cell
  task = TaskInfo(kind, V, 0 if kind == "lm" else 3, N)
  model = build_model(_cfg(kernel=kernel, positional=scheme, **extra), task)
  batch = _batch(kind)
  variables = jax.jit(model.init)(jax.random.key(0), batch)
  params = nudged(variables["params"], phase=1.0)
  rest = {k: v for k, v in variables.items() if k != "params"}
  (_, out), grads = _loss(model, kind)(params, rest, batch)
  return dict(
      kind=kind,
      task=task,
      fields=dict(kernel=kernel, positional=scheme, **extra),
      batch=batch,
      params=params,
      rest=rest,
      out=out,
      grads=grads,
  )


@pytest.mark.parametrize("cell, remat, scan", CASES, ids=_ids)
def test_remat_and_scan_change_no_output_or_gradient(references, cell, remat, scan):
  key = _ids(cell)
  if key not in references:
    references[key] = _reference(cell)
  r = references[key]
  model = build_model(_cfg(**r["fields"], remat=remat, scan_layers=scan), r["task"])
  convert = (lambda t: stack_layers(t, 2)) if scan else (lambda t: t)
  (_, out), grads = _loss(model, r["kind"])(convert(r["params"]), convert(r["rest"]), r["batch"])
  assert rel_err(out, r["out"]) < 1e-9
  if scan:
    grads = unstack_layers(grads, 2)
  assert jax.tree.structure(grads) == jax.tree.structure(r["grads"])
  # Relative to the largest gradient: some are zero up to round-off (a bias before a norm).
  scale = max(float(np.max(np.abs(e))) for e in jax.tree.leaves(r["grads"]))
  for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(r["grads"]), strict=True):
    assert float(np.max(np.abs(np.asarray(g) - np.asarray(e)))) < 1e-9 * max(scale, 1e-30)


def test_scanned_parameters_are_stacked_on_a_layer_axis():
  task = TaskInfo("classify", V, 3, N)
  unrolled = build_model(_cfg(kernel="elu1", positional="fastrpb"), task)
  scanned = build_model(_cfg(kernel="elu1", positional="fastrpb", scan_layers=True), task)
  batch = _batch("classify")
  zeros = lambda m: jax.tree.map(
      lambda s: np.zeros(s.shape, s.dtype),
      jax.eval_shape(m.init, jax.random.key(0), batch)["params"],
  )
  a, b = zeros(unrolled), zeros(scanned)
  assert set(b["encoder"]) == {"layers"}
  shapes = lambda t: jax.tree.map(np.shape, t)
  assert shapes(stack_layers(a, 2)) == shapes(b)
  assert shapes(unstack_layers(b, 2)) == shapes(a)


def test_bad_remat_names_the_valid_choices():
  task = TaskInfo("classify", V, 3, N)
  with pytest.raises(
      ValueError,
      match="unknown model.remat 'full'; valid choices: none, " "block, save_matmuls, save_dots",
  ):
    build_model(_cfg(remat="full"), task)
  with pytest.raises(ValueError, match="model.scan_layers must be a bool; got 'yes'"):
    build_model(ml_collections.ConfigDict({**_cfg().to_dict(), "scan_layers": "yes"}), task)


def test_scan_with_a_scheme_shared_across_layers_is_refused_naming_both():
  cfg = _cfg(
      kernel="elu1",
      positional="kernelized_rpe",
      scan_layers=True,
      positional_options={"kernelized_rpe": {"share_across_layers": True}},
  )
  with pytest.raises(
      ValueError,
      match=r"model.scan_layers=True cannot share a scheme across "
      r"layers \(share_across_layers of kernelized_rpe\)",
  ):
    build_model(cfg, TaskInfo("classify", V, 3, N))


class _TextbookMLP(nn.Module):
  """Dense -> GELU -> nn.Dropout -> Dense, as flax's examples write it."""

  @nn.compact
  def __call__(self, x, *, deterministic):
    y = nn.gelu(nn.Dense(32, dtype=jnp.float64, name="fc1")(x))
    y = nn.Dropout(0.3)(y, deterministic=deterministic)
    return nn.Dense(x.shape[-1], dtype=jnp.float64, name="fc2")(y)


@pytest.mark.parametrize("deterministic", [False, True])
def test_lean_mlp_equals_the_textbook_mlp_with_its_dropout_masks(deterministic):
  """Same parameters, same dropout masks (the rng stream is unchanged), same output and
  gradients: the lean MLP only keeps less for its backward pass."""
  x = jax.random.normal(jax.random.key(0), (2, 9, 16), jnp.float64)
  lean, ref = MLP(32, 0.3, dtype=jnp.float64), _TextbookMLP()
  params = ref.init(jax.random.key(1), x, deterministic=True)
  assert jax.tree.map(np.shape, lean.init(jax.random.key(1), x, deterministic=True)) == (
      jax.tree.map(np.shape, params)
  )
  outs = []
  for m in (lean, ref):
    f = lambda p, x, m=m: m.apply(
        p, x, deterministic=deterministic, rngs={"dropout": jax.random.key(2)}
    )
    y, vjp = jax.vjp(f, params, x)
    outs.append((y, vjp(jnp.cos(y))))
  (y0, g0), (y1, g1) = outs
  assert rel_err(y0, y1) < 1e-12
  if not deterministic:
    assert not np.allclose(y0, ref.apply(params, x, deterministic=True))  # dropout acted
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
    assert rel_err(a, b) < 1e-12
