"""model.mlp_chunk runs each block's token-wise part (dropout, residual, norms, MLP) over chunks
of the sequence: the same function as the whole-sequence block, dropout masks included, with
outputs and gradients held to 1e-9 (float64); its masks are slices of the unchunked ones
(``bernoulli_at``), bit for bit."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from fastpos.models import TaskInfo, build_model, model_config
from fastpos.models.blocks import Block
from fastpos.models.tokenwise import bernoulli_at, mul_add_2x32
from tests.helpers import rel_err, run_on_devices

ROOT = Path(__file__).resolve().parents[2]
V = 13
N = 12


@pytest.mark.parametrize("x64", [True, False], ids=["float64", "float32"])
@pytest.mark.parametrize("typed", [True, False], ids=["typed_key", "raw_key"])
def test_bernoulli_at_gives_the_entries_of_the_whole_draw(x64, typed):
  shape = (3, 37, 50)
  rng = np.random.default_rng(1)
  index = (
      rng.integers(0, 3, (5, 1, 1)),
      rng.integers(0, 37, (1, 7, 1)),  # any positions, repeats included
      rng.permutation(50)[None, None, :],
  )
  with jax.enable_x64(x64):
    key = jax.random.key(7) if typed else jax.random.PRNGKey(7)
    # One compiled program for both draws (op by op, the draw's many small ops dominate).
    draw = jax.jit(
        lambda k: (jax.random.bernoulli(k, 0.9, shape), bernoulli_at(k, 0.9, shape, index))
    )
    full, got = (np.asarray(a) for a in draw(key))
  assert got.shape == (5, 7, 50) and got.dtype == bool
  np.testing.assert_array_equal(got, full[index])
  assert 0.8 < full.mean() < 0.95  # a real draw, not all kept


def test_flat_indices_are_64_bit():
  rng = np.random.default_rng(0)
  a = rng.integers(0, 2**32, 500, dtype=np.uint64)
  c = rng.integers(0, 2**32, 500, dtype=np.uint64)
  for m in (1, 1024, 2**16 + 3, 2**32 - 1):
    hi, lo = mul_add_2x32(jnp.asarray(a.astype(np.uint32)), m, jnp.asarray(c.astype(np.uint32)))
    got = [(int(h) << 32) + int(lo_) for h, lo_ in zip(np.asarray(hi), np.asarray(lo))]
    assert got == [int(x) * m + int(y) for x, y in zip(a, c)], m


def test_another_generator_is_refused_naming_the_one_needed():
  key = jax.random.key(0, impl="rbg")
  with pytest.raises(ValueError, match="need the threefry2x32 generator.*got 'rbg'"):
    bernoulli_at(key, 0.9, (2, 3), (np.arange(2)[:, None], np.arange(3)))


def _cfg(**kw):
  c = model_config()
  c.update(
      num_layers=2,
      embed_dim=16,
      num_heads=2,
      mlp_dim=32,
      dropout_rate=0.3,
      dtype="float64",
      chunk_size=4,
  )
  c.kernel_options.num_features = 8
  c.update(kw)
  return c


def _batch():
  ids = np.random.default_rng(0).integers(1, V, (2, N)).astype(np.int32)
  ids[1, N - 3 :] = 0  # padding in the second row
  return {"inputs": jnp.asarray(ids), "mask": jnp.asarray(ids != 0)}


def _step(model):
  """Output and gradients of a scalar of the whole output, dropout on (a fixed key)."""

  def fn(params, batch):
    out = model.apply({"params": params}, batch, train=True, rngs={"dropout": jax.random.key(3)})
    w = jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)
    return jnp.sum(out * w), out

  return jax.jit(jax.value_and_grad(fn, has_aux=True))


# (task kind, kernel, schemes, fields): the LRA Text cell (post-norm, CLS pooling: N + 1
# positions) and a causal pre-norm LM with the causal FFT output hook.
CELLS = [
    ("classify", "sikf", "absolute,fastrpb", dict(pooling="cls")),
    ("lm", "elu1", "fastrpb", dict(norm="pre")),
]
# (mlp_chunk, fields): chunks that do not divide the sequence, unrolled and scanned + remat.
SETTINGS = [(5, {}), (4, dict(scan_layers=True, remat="block"))]


# Every pair is slow: the default run keeps chunks that do not divide N inside the block's
# chunk loop (test_chunked_attention.py, fused-one_layer) and scan + remat (test_remat.py).
CASES = [
    pytest.param(CELLS[0], SETTINGS[0], id="classify-unrolled", marks=pytest.mark.slow),
    # Slow; the default run keeps chunks (tests/models/test_chunked_attention.py, causal
    # sikf-fastrpb-pieces) and scan + remat (tests/models/test_remat.py, save_dots).
    pytest.param(CELLS[1], SETTINGS[1], id="lm-scan_block", marks=pytest.mark.slow),
    pytest.param(CELLS[0], SETTINGS[1], id="classify-scan_block", marks=pytest.mark.slow),
    pytest.param(CELLS[1], SETTINGS[0], id="lm-unrolled", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("cell, setting", CASES)
def test_chunked_block_equals_the_whole_sequence_block(cell, setting):
  kind, kernel, schemes, fields = cell
  chunk, layout = setting
  task = TaskInfo(kind, V, 0 if kind == "lm" else 3, N)
  whole = build_model(_cfg(kernel=kernel, positional=schemes, **fields, **layout), task)
  chunked = build_model(
      _cfg(kernel=kernel, positional=schemes, **fields, **layout, mlp_chunk=chunk), task
  )
  batch = _batch()

  @jax.jit
  def run(key):
    """Both inits, both train steps (from the whole model's params) and both eval outputs: one
    compiled program instead of one per call (and no init or eval run op by op)."""
    params = whole.init(key, batch)["params"]
    init = chunked.init(key, batch)["params"]
    steps = [_step(m)(params, batch) for m in (whole, chunked)]
    evals = [m.apply({"params": params}, batch) for m in (whole, chunked)]
    return params, init, steps, evals

  params, init, steps, (eval_whole, eval_chunked) = run(jax.random.key(0))
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), init, params))
  trace = lambda m: str(jax.make_jaxpr(lambda p: _step(m)(p, batch))(params))
  traced = trace(chunked)
  assert "threefry2x32" in traced  # masks drawn by slice inside the chunk loop
  assert traced.count("scan[") > trace(whole).count("scan[")  # the chunk loop ran
  ((_, out0), g0), ((_, out1), g1) = steps
  assert rel_err(out1, out0) < 1e-9
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g0))
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
    assert float(jnp.max(jnp.abs(a - b))) < 1e-9 * scale
  assert rel_err(eval_chunked, eval_whole) < 1e-9
  assert rel_err(out0, eval_whole) > 1e-3  # dropout acted in the compared train outputs


@pytest.mark.parametrize(
    "value, needle",
    [
        (-1, "model.mlp_chunk must be an int >= 0 .*got -1"),
        (True, "model.mlp_chunk must be an int >= 0 .*got True"),
        (2.5, "model.mlp_chunk must be an int >= 0 .*got 2.5"),
    ],
)
def test_bad_chunk_is_refused_naming_it(value, needle):
  cfg = ml_collections.ConfigDict({**_cfg(kernel="elu1").to_dict(), "mlp_chunk": value})
  with pytest.raises(ValueError, match=needle):
    build_model(cfg, TaskInfo("classify", V, 3, N))


def test_batch_norm_is_refused_with_chunks():
  cfg = _cfg(kernel="elu1", norm="batch", mlp_chunk=4)
  with pytest.raises(ValueError, match="mlp_chunk=4 chunks the token-wise part.*norm='batch'"):
    build_model(cfg, TaskInfo("classify", V, 3, N))
  attention = build_model(_cfg(kernel="elu1"), TaskInfo("classify", V, 3, N)).attention
  with pytest.raises(ValueError, match="Block: mlp_chunk=2 chunks"):
    Block(attention, mlp_dim=8, norm="batch", mlp_chunk=2)


def run_split() -> dict:
  """In the subprocess (4 devices): the chunked model under a mesh with seq=4 against the
  whole-sequence model on one device, dropout on: {case: [out rel err, worst grad rel err]}."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from fastpos.train.sharding import tree_shardings

  mesh = Mesh(np.array(jax.devices()).reshape(1, 4), ("data", "seq"))
  batch = _batch()
  out = {}
  for pooling, layout in (("mean", {}), ("cls", dict(scan_layers=True, remat="block"))):
    fields = dict(kernel="sikf", positional="absolute,fastrpb", pooling=pooling, **layout)
    task = TaskInfo("classify", V, 3, N)
    whole = build_model(_cfg(**fields), task)
    chunked = build_model(_cfg(**fields, mlp_chunk=2), task)
    params = jax.tree.map(
        lambda a: a.astype(jnp.float64), whole.init(jax.random.key(0), batch)["params"]
    )
    (_, out0), g0 = _step(whole)(params, batch)
    with jax.set_mesh(mesh):
      split = jax.device_put(batch, NamedSharding(mesh, P("data", "seq")))
      placed = jax.device_put(params, tree_shardings(params, mesh, ()))
      (_, out1), g1 = _step(chunked)(placed, split)
    grads = [rel_err(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0))]
    out[pooling] = [rel_err(out1, out0), max(grads)]
  return out


_SCRIPT = """
import json
import jax
jax.config.update("jax_enable_x64", True)
from tests.models import test_tokenwise as t
assert jax.device_count() == 4, jax.devices()
print("RESULT" + json.dumps(t.run_split()))
"""


@pytest.mark.slow
def test_chunks_of_a_split_sequence_equal_the_whole_block():
  """Each device chunks its own block (CLS pooling: N + 1 positions, padded); the masks are
  the unsplit, unchunked ones."""
  result = run_on_devices(_SCRIPT, timeout=1200)
  for case, (out_err, grad_err) in result.items():
    assert out_err < 1e-9 and grad_err < 1e-9, (case, out_err, grad_err)
