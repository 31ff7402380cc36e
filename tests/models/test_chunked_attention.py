"""``attn_chunk`` runs a bidirectional linear-attention layer by chunks of the sequence
(``fastpos.models.chunked_attention``): the same function as the whole-sequence layer, outputs
and gradients held to 1e-9 (float64), padding ignored; layers it cannot run are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from fastpos.models import TaskInfo, build_model, model_config
from fastpos.models.attention import Attention, AttentionConfig, KernelSpec, PositionalSpec
from tests.helpers import rel_err, run_on_devices

N = 29  # not a multiple of the chunk
V = 13


def _layer(kernel: str, schemes=("fastrpb",), chunk: int = 0, **kw) -> Attention:
  cfg = AttentionConfig(
      num_heads=2,
      head_dim=8,
      embed_dim=16,
      kernel=KernelSpec(kernel, num_features=8),
      positional=tuple(PositionalSpec.make(s) for s in schemes),
      max_length=32,
      attn_chunk=chunk,
      **kw,
  )
  return Attention(cfg, dtype=jnp.float64)


def _loss(layer, mask):
  def fn(params, x):
    y = layer.apply(params, x, mask=mask)
    return jnp.sum(jnp.sin(y) * mask[..., None]), y

  return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))


# sikf: its key stabiliser spans the chunks; ELU+1 (no stabiliser) runs with `-m slow`.
@pytest.mark.parametrize("kernel", ["sikf", pytest.param("elu1", marks=pytest.mark.slow)])
def test_chunked_layer_equals_the_whole_layer(kernel):
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(1), (2, N, 16), jnp.float64)
    mask = jnp.arange(N)[None] < jnp.array([[N], [19]])
    whole, chunked = _layer(kernel), _layer(kernel, chunk=4)
    params = whole.init(jax.random.key(0), x, mask=mask)
    # Random tables and biases (FastRPB starts at zero): every part of the layer counts.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    params = tree.unflatten(
        [a + 0.3 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)]
    )
    (_, y0), g0 = _loss(whole, mask)(params, x)
    (_, y1), g1 = _loss(chunked, mask)(params, x)
    assert "scan" in str(jax.make_jaxpr(lambda p: chunked.apply(p, x, mask=mask))(params))
    assert rel_err(y1, y0) < 1e-9
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
      assert rel_err(a, b) < 1e-9
    # Padding never changes a real token's output.
    noisy = jnp.where(mask[..., None], x, 50.0 * jnp.cos(x))
    y2 = chunked.apply(params, noisy, mask=mask)
    assert rel_err(jnp.where(mask[..., None], y2, 0), jnp.where(mask[..., None], y1, 0)) < 1e-12


def _cfg(**kw):
  c = model_config()
  c.update(
      num_layers=2,
      embed_dim=16,
      num_heads=2,
      mlp_dim=32,
      dropout_rate=0.3,
      dtype="float64",
      kernel="sikf",
      positional="absolute,fastrpb",
  )
  c.update(kw)
  return c


def _step(model):
  def fn(params, batch):
    out = model.apply({"params": params}, batch, train=True, rngs={"dropout": jax.random.key(3)})
    return jnp.sum(out * jnp.cos(jnp.arange(out.size)).reshape(out.shape)), out

  return jax.jit(jax.value_and_grad(fn, has_aux=True))


def _batch(n: int = N):
  ids = np.random.default_rng(0).integers(1, V, (2, n)).astype(np.int32)
  ids[1, n - 5 :] = 0
  return {"inputs": jnp.asarray(ids), "mask": jnp.asarray(ids != 0)}


def _compare(whole, chunked, params, batch, place=lambda p, b: (p, b)) -> tuple[float, float]:
  (_, out0), g0 = _step(whole)(params, batch)
  (_, out1), g1 = _step(chunked)(*place(params, batch))
  return rel_err(out1, out0), max(
      rel_err(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0))
  )


# attn_chunk == mlp_chunk: the token-wise part runs inside the attention's chunk loop; else
# after it, in its own chunks. The default run holds one layer, unrolled and fused.
SCAN = dict(scan_layers=True, remat="block")
CASES = [
    pytest.param(4, dict(num_layers=1), id="fused-one_layer"),
    pytest.param(4, SCAN, id="fused-scan_block", marks=pytest.mark.slow),
    pytest.param(8, SCAN, id="apart-scan_block", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("attn_chunk, layout", CASES)
def test_chunked_model_equals_the_whole_model(attn_chunk, layout):
  """The LRA Text cell's layout (CLS pooling: N + 1 positions) with the token-wise part
  chunked too (mlp_chunk=4): train-mode outputs and gradients, dropout on."""
  with jax.enable_x64(True):
    task = TaskInfo("classify", V, 3, N)
    layout = dict(pooling="cls", mlp_chunk=4, **layout)
    whole = build_model(_cfg(**layout), task)
    chunked = build_model(_cfg(**layout, attn_chunk=attn_chunk), task)
    params = whole.init(jax.random.key(0), _batch())["params"]
    out_err, grad_err = _compare(whole, chunked, params, _batch())
  assert out_err < 1e-9 and grad_err < 1e-9, (out_err, grad_err)


def run_split() -> dict:
  """In the subprocess (4 devices): the chunked model under a mesh with seq=4 against the
  whole-sequence model on one device: [out rel err, worst grad rel err]."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from fastpos.train.sharding import tree_shardings

  mesh = Mesh(np.array(jax.devices()).reshape(1, 4), ("data", "seq"))
  task = TaskInfo("classify", V, 3, 28)
  whole = build_model(_cfg(pooling="cls"), task)
  chunked = build_model(_cfg(pooling="cls", attn_chunk=3, mlp_chunk=3), task)
  batch = _batch(28)
  params = jax.tree.map(
      lambda a: a.astype(jnp.float64), whole.init(jax.random.key(0), batch)["params"]
  )

  def place(p, b):
    split = jax.device_put(b, NamedSharding(mesh, P("data", "seq")))
    return jax.device_put(p, tree_shardings(p, mesh, ())), split

  with jax.set_mesh(mesh):
    return {"split": list(_compare(whole, chunked, params, batch, place))}


_SCRIPT = """
import json
import jax
jax.config.update("jax_enable_x64", True)
from tests.models import test_chunked_attention as t
assert jax.device_count() == 4, jax.devices()
print("RESULT" + json.dumps(t.run_split()))
"""


@pytest.mark.slow
def test_chunks_of_a_split_sequence_equal_the_whole_model():
  """Each of 4 devices chunks its own block (CLS pooling: 29 positions, padded to 4 x 8, in
  chunks of 3, the token-wise part in the same loop); the key sums and sikf's stabiliser
  span the devices; dropout masks are the unsplit, unchunked ones."""
  out_err, grad_err = run_on_devices(_SCRIPT, timeout=1200)["split"]
  assert out_err < 1e-9 and grad_err < 1e-9, (out_err, grad_err)


@pytest.mark.parametrize(
    "kernel, schemes, kw, needle",
    [
        ("sikf", ("fastrpb",), dict(causal=True), "causal layers are not built by chunks"),
        ("softmax", (), {}, "kernel 'softmax' materialises"),
        ("favor", (), {}, "kernel 'favor' stabilises its key features over the whole sequence"),
        ("elu1", ("rope",), {}, "scheme 'rope' acts at the 'features' hook"),
        ("elu1", ("fastrpb",), dict(grid=(4, 4)), "2D grids are not built by chunks"),
    ],
)
def test_layers_it_cannot_chunk_are_refused(kernel, schemes, kw, needle):
  with pytest.raises(ValueError, match=f"attn_chunk=4 runs the layer by chunks.*{needle}"):
    _layer(kernel, schemes, chunk=4, **kw)


@pytest.mark.parametrize("value", [-1, True, 2.5])
def test_bad_chunk_is_refused_naming_it(value):
  cfg = ml_collections.ConfigDict({**_cfg().to_dict(), "attn_chunk": value})
  with pytest.raises(ValueError, match=f"attn_chunk must be an int >= 0 .*got {value!r}"):
    build_model(cfg, TaskInfo("classify", V, 3, N))
