"""``attn_chunk`` runs a linear-attention layer, bidirectional or causal, by chunks of the
sequence (``fastpos.models.chunked_attention``): the same function as the whole-sequence layer,
outputs and gradients held to 1e-9 (float64), padding ignored, no output reading a later
token; layers it cannot run are refused."""

from __future__ import annotations

import functools

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


# sikf: its key stabiliser spans the chunks; ELU+1 (no stabiliser), favor and orf (the
# stabiliser of a random map, plus eps) run with `-m slow`.
SLOW_BIDIRECTIONAL = [pytest.param(k, marks=pytest.mark.slow) for k in ("elu1", "favor", "orf")]


# Slow; the default run keeps the causal chunked layer (sikf-fastrpb-pieces, below).
@pytest.mark.parametrize(
    "kernel", [pytest.param("sikf", marks=pytest.mark.slow)] + SLOW_BIDIRECTIONAL
)
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


def _random_params(layer, x, mask):
  """The layer's parameters plus noise (FastRPB starts at zero): every part of it counts."""
  return _perturbed_init(layer, x, mask)


@functools.partial(jax.jit, static_argnums=0)
def _perturbed_init(layer, x, mask):
  # One compiled program (an eager init compiles every operation on its own).
  params = layer.init(jax.random.key(0), x, mask=mask)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(5), len(leaves))
  return tree.unflatten(
      [a + 0.3 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)]
  )


def _causal_inputs(dtype=jnp.float64):
  """x ``[3, N, 16]`` and a mask: a full row, a right-padded and a left-padded one (its first
  real key, the one sikf's causal stabiliser takes, at position 5)."""
  x = jax.random.normal(jax.random.key(1), (3, N, 16), dtype)
  pos = jnp.arange(N)[None]
  return x, (pos < jnp.array([[N], [19], [N]])) & (pos >= jnp.array([[0], [0], [5]]))


def _causal_errors(kernel, schemes, attn_chunk=4, **kw) -> tuple[float, float]:
  """Causal layer by chunks against the whole layer, float64: (output error on real tokens,
  worst gradient error over parameters and x); padding checked not to reach real tokens."""
  with jax.enable_x64(True):
    x, mask = _causal_inputs()
    whole = _layer(kernel, schemes, causal=True, **kw)
    chunked = _layer(kernel, schemes, chunk=attn_chunk, causal=True, **kw)
    params = _random_params(whole, x, mask)
    (_, y0), g0 = _loss(whole, mask)(params, x)
    (_, y1), g1 = _loss(chunked, mask)(params, x)
    real = mask[..., None]
    noisy = jnp.where(real, x, 50.0 * jnp.cos(x))
    (_, y2), _ = _loss(chunked, mask)(params, noisy)
    assert rel_err(jnp.where(real, y2, 0), jnp.where(real, y1, 0)) < 1e-12
    grads = zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True)
    return rel_err(jnp.where(real, y1, 0), jnp.where(real, y0, 0)), max(
        rel_err(a, b) for a, b in grads
    )


# (kernel, schemes, attn_chunk, more config): sikf's stabiliser is the first real key's; with
# chunk_size=3 each chunk of 8 runs in pieces of 3 (neither divides); without output hooks
# the first pass is skipped (one device). Every other kernel the chunked layer takes runs
# with `-m slow`.
CAUSAL_CASES = [
    # The default run's FastRPB case is sikf's in pieces (below); elu1's runs with `-m slow`.
    pytest.param("elu1", ("fastrpb",), 4, {}, id="elu1-fastrpb", marks=pytest.mark.slow),
    pytest.param("sikf", ("fastrpb",), 8, dict(chunk_size=3), id="sikf-fastrpb-pieces"),
    # Also run by test_a_late_huge_key_changes_no_earlier_output (float32).
    pytest.param("sikf", (), 4, {}, id="sikf-no_hooks", marks=pytest.mark.slow),
    # favor's eps weighs each key relative to the stabiliser: a max over all keys would move
    # the outputs by ~1e-4 here.
    # Slow; the default run keeps sikf-fastrpb-pieces.
    pytest.param("favor", (), 4, {}, id="favor-no_hooks", marks=pytest.mark.slow),
] + [
    pytest.param(k, ("fastrpb",), 4, {}, id=f"{k}-fastrpb", marks=pytest.mark.slow)
    for k in ("relu", "dpfp", "nprf", "prf", "orf")
]


@pytest.mark.parametrize("kernel, schemes, attn_chunk, kw", CAUSAL_CASES)
def test_causal_chunked_layer_equals_the_whole_layer(kernel, schemes, attn_chunk, kw):
  out_err, grad_err = _causal_errors(kernel, schemes, attn_chunk, **kw)
  assert out_err < 1e-9 and grad_err < 1e-9, (out_err, grad_err)


@pytest.mark.slow
def test_causal_chunked_trf_equals_the_whole_layer_to_its_conditioning():
  """trf's features change sign, so its denominators come near 0 and round-off grows (1e-7
  on these inputs): the chunked layer is held to the whole layer's own spread under another
  order of summation (its chunk_size), not to 1e-9."""
  out_err, grad_err = _causal_errors("trf", ("fastrpb",))
  with jax.enable_x64(True):
    x, mask = _causal_inputs()
    whole = _layer("trf", ("fastrpb",), causal=True)
    params = _random_params(whole, x, mask)
    _, g0 = _loss(whole, mask)(params, x)
    _, g1 = _loss(_layer("trf", ("fastrpb",), causal=True, chunk_size=3), mask)(params, x)
  spread = max(rel_err(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)))
  assert out_err < 1e-9 and grad_err < 10 * spread + 1e-9, (out_err, grad_err, spread)


def test_chunked_causal_layer_sees_no_future():
  """d y_i / d x_j == 0 exactly for j > i (sikf with causal FastRPB, chunks of 4 in pieces
  of 3), and not for j <= i."""
  with jax.enable_x64(True):
    x, mask = _causal_inputs()
    layer = _layer("sikf", ("fastrpb",), chunk=4, causal=True, chunk_size=3)
    params = _random_params(layer, x, mask)
    jac = jax.jit(jax.jacrev(lambda a: layer.apply(params, a[None], mask=mask[:1])[0]))(x[0])
  seen = jnp.max(jnp.abs(jac), axis=(1, 3))  # [N outputs, N inputs]
  later = jnp.triu(jnp.ones((N, N), bool), k=1)
  assert float(jnp.max(jnp.where(later, seen, 0))) == 0.0
  assert bool(jnp.all(jnp.where(later, 1, seen) > 0))


# Slow; the default run keeps late huge keys on the ops (tests/ops/test_attention.py::
# test_late_huge_key_does_not_overflow_the_running_max).
@pytest.mark.slow
def test_a_late_huge_key_changes_no_earlier_output():
  """sikf, float32, no output hooks (one pass): one key at position 20 made 80 above the
  first key's features (exp(80) still fits float32) changes no output before it; every
  output stays finite and equal to the whole layer's. A stabiliser over all keys would push
  the earlier features under the guard."""
  x, mask = _causal_inputs(jnp.float32)
  mask = jnp.ones_like(mask)
  chunked = _layer("sikf", (), chunk=4, causal=True).clone(dtype=jnp.float32)
  whole = _layer("sikf", (), causal=True).clone(dtype=jnp.float32)
  params = chunked.init(jax.random.key(0), x, mask=mask)
  w = params["params"]["key"]["kernel"]  # [16, heads, head_dim]: input 0 reads key (0, 0) only
  params["params"]["key"]["kernel"] = w.at[0].set(0.0).at[0, 0, 0].set(1.0)
  keys = jnp.einsum("bnd,dhe->bnhe", x, params["params"]["key"]["kernel"])
  keys = keys + params["params"]["key"]["bias"][None, None]
  lift = keys[:, 0, 0].max(-1) + 80.0 - keys[:, 20, 0, 0]  # key (0, 0) of token 20 to +80
  huge = x.at[:, 20, 0].add(lift)
  run = jax.jit(lambda m, a: m.apply(params, a, mask=mask), static_argnums=0)
  y, y_huge, y_whole = run(chunked, x), run(chunked, huge), run(whole, huge)
  assert bool(jnp.all(jnp.isfinite(y_huge)))
  assert rel_err(y_huge[:, :20], y[:, :20]) < 1e-6
  assert rel_err(y_huge[:, 20:], y[:, 20:]) > 1e-2  # the key does count where it is seen
  assert rel_err(y_huge, y_whole) < 1e-4


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
# after it, in its own chunks. The default run holds one layer, unrolled and fused (the block's
# own chunk loop with the token-wise part inside); `-m slow` the scanned and causal layouts.
SCAN = dict(scan_layers=True, remat="block")
CASES = [
    pytest.param(4, dict(num_layers=1), id="fused-one_layer"),
    pytest.param(4, SCAN, id="fused-scan_block", marks=pytest.mark.slow),
    pytest.param(8, SCAN, id="apart-scan_block", marks=pytest.mark.slow),
    # A causal LM (causal FastRPB), the token-wise part inside the causal pass.
    # `-m slow`: the default run holds the causal chunked layer (and its output hook) in
    # test_causal_chunked_layer_equals_the_whole_layer.
    pytest.param(4, dict(num_layers=1, task="lm"), id="lm-fused-one_layer", marks=pytest.mark.slow),
    pytest.param(8, dict(SCAN, task="lm"), id="lm-apart-scan_block", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("attn_chunk, layout", CASES)
def test_chunked_model_equals_the_whole_model(attn_chunk, layout):
  """The LRA Text cell's layout (CLS pooling: N + 1 positions), or a causal LM, with the
  token-wise part chunked too (mlp_chunk=4): train-mode outputs and gradients, dropout on."""
  with jax.enable_x64(True):
    layout = dict(layout)
    if layout.pop("task", "classify") == "lm":
      task, layout = TaskInfo("lm", V, 0, N), dict(mlp_chunk=4, **layout)
    else:
      task, layout = TaskInfo("classify", V, 3, N), dict(pooling="cls", mlp_chunk=4, **layout)
    whole = build_model(_cfg(**layout), task)
    chunked = build_model(_cfg(**layout, attn_chunk=attn_chunk), task)
    params = jax.jit(whole.init)(jax.random.key(0), _batch())["params"]
    out_err, grad_err = _compare(whole, chunked, params, _batch())
  assert out_err < 1e-9 and grad_err < 1e-9, (out_err, grad_err)


def run_split(kind: str) -> dict:
  """In the subprocess (4 devices): the chunked model (a ``kind`` task: "classify" or a
  causal "lm") under a mesh with seq=4 against the whole-sequence model on one device:
  [out rel err, worst grad rel err]."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from fastpos.train.sharding import tree_shardings

  mesh = Mesh(np.array(jax.devices()).reshape(1, 4), ("data", "seq"))
  layout = dict(pooling="cls") if kind == "classify" else {}
  task = TaskInfo(kind, V, 3 if kind == "classify" else 0, 28)
  whole = build_model(_cfg(**layout), task)
  chunked = build_model(_cfg(**layout, attn_chunk=3, mlp_chunk=3), task)
  batch = _batch(28)
  if kind == "lm":  # row 0 left-padded: its first real key (sikf's stabiliser) on device 1
    batch = {k: a.at[0, :9].set(0) for k, a in batch.items()}
  params = jax.tree.map(
      lambda a: a.astype(jnp.float64), whole.init(jax.random.key(0), batch)["params"]
  )

  def place(p, b):
    split = jax.device_put(b, NamedSharding(mesh, P("data", "seq")))
    return jax.device_put(p, tree_shardings(p, mesh, ())), split

  with jax.set_mesh(mesh):
    return {"split": list(_compare(whole, chunked, params, batch, place))}


_SCRIPT = """
import json, sys
import jax
jax.config.update("jax_enable_x64", True)
from tests.models import test_chunked_attention as t
assert jax.device_count() == 4, jax.devices()
print("RESULT" + json.dumps(t.run_split(sys.argv[1])))
"""


@pytest.mark.slow
def test_chunks_of_a_split_sequence_equal_the_whole_model():
  """Each of 4 devices chunks its own block (CLS pooling: 29 positions, padded to 4 x 8, in
  chunks of 3, the token-wise part in the same loop); the key sums and sikf's stabiliser
  span the devices; dropout masks are the unsplit, unchunked ones."""
  out_err, grad_err = run_on_devices(_SCRIPT, "classify", timeout=1200)["split"]
  assert out_err < 1e-9 and grad_err < 1e-9, (out_err, grad_err)


@pytest.mark.slow  # the default run splits causal sequences at the op (ops/test_context_parallel)
def test_chunks_of_a_split_causal_sequence_equal_the_whole_model():
  """A causal LM over 4 devices (28 positions, 7 per device, in chunks of 3, the token-wise
  part in the same loop): each block starts from the key sums of the blocks before it, sikf's
  stabiliser is the first real key's though it sits on device 1, causal FastRPB's ring
  product adds its terms; against the unsplit, unchunked model."""
  out_err, grad_err = run_on_devices(_SCRIPT, "lm", timeout=1200)["split"]
  assert out_err < 1e-9 and grad_err < 1e-9, (out_err, grad_err)


@pytest.mark.parametrize(
    "kernel, schemes, kw, needle",
    [
        ("softmax", (), {}, "kernel 'softmax' materialises"),
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


def test_the_layer_call_takes_nothing_of_the_block():
  """The chunk loop that also runs the block's token-wise part is the block's: the layer's
  call takes arrays and settings only; its chunked form is ``chunked_layer`` + ``attend``."""
  import inspect

  from fastpos.models import chunked_attention

  assert "tail" not in inspect.signature(Attention.__call__).parameters
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(1), (2, N, 16), jnp.float64)
    mask = jnp.arange(N)[None] < jnp.array([[N], [19]])
    layer = _layer("sikf", chunk=4)
    params = jax.jit(layer.init)(jax.random.key(0), x, mask=mask)

    def by_parts(module, a, m):
      return chunked_attention.attend(a, m, module.chunked_layer(a, mask=m))

    # Two compiled programs (op by op is slower); the same operations, so the same bits.
    y = jax.jit(layer.apply)(params, x, mask=mask)
    y_parts = jax.jit(functools.partial(layer.apply, method=by_parts))(params, x, mask)
  assert bool(jnp.all(y_parts == y))  # the call is exactly attend(x, mask, chunked_layer)


def test_chunked_layer_refuses_a_call_that_does_not_run_by_chunks():
  x = jnp.ones((1, 4, 16))  # one chunk of 4: the call runs on the whole sequence
  layer = _layer("sikf", chunk=4).clone(dtype=jnp.float32)
  # Shapes only: the refusals come while the call is traced, before any compute.
  params = jax.eval_shape(layer.init, jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"x of shape \(1, 4, 16\) does not run by chunks"):
    jax.eval_shape(
        functools.partial(layer.apply, method=lambda m, a: m.chunked_layer(a)), params, x
    )
  with pytest.raises(ValueError, match="called with grid=\\(2, 2\\)"):  # as the call checks
    jax.eval_shape(
        functools.partial(layer.apply, method=lambda m, a: m.chunked_layer(a, grid=(2, 2))),
        params,
        x,
    )
