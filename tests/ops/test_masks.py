"""Masks are boolean only, everywhere (``fastpos.ops.masks``).

Every op, layer and model that takes a mask rejects a float32, float64, 0/1 integer or additive
0/-1e9 mask with a ValueError naming the argument, the dtype received and the conversions, and a
mask of the wrong shape with a ValueError naming both shapes: eagerly and under ``jax.jit``
(the check runs at trace time). A boolean mask gives what the dense references and the
unpadded inputs give.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos import positional
from fastpos.models import TaskInfo, build_model, model_config
from fastpos.models.attention import Attention, AttentionConfig, KernelSpec
from fastpos.models.blocks import Block
from fastpos.models.transformer import Tower
from fastpos.ops import attention, features
from tests.helpers import rel_err

B, N, H, D = 2, 6, 2, 4
N_REAL = 4  # the second example is padded after N_REAL tokens
E = 8  # embedding width of the layers
V = 11  # vocabulary of the models

# The ways a mask goes wrong: the dtype each one reaches the check with, and the array.
BAD = {
    "float32": lambda m: m.astype(np.float32),
    "float64": lambda m: m.astype(np.float64),
    "int32": lambda m: m.astype(np.int32),
    "additive": lambda m: np.where(m, 0.0, -1e9).astype(np.float32),
}
BAD_DTYPE = {"float32": "float32", "float64": "float64", "int32": "int32", "additive": "float32"}


def _mask(n=N, b=B):
  m = np.ones((b, n), bool)
  m[-1, N_REAL:] = False
  return m


def _dtype_error(name, bad):
  return (
      rf"{re.escape(name)} must be a boolean array .*\(True = real token\); got "
      rf"{BAD_DTYPE[bad]}\. Convert a 0/1 mask with {re.escape(name)}\.astype\(bool\); "
      rf"an additive 0/-inf mask with {re.escape(name)} == 0\."
  )


def _shape_error(name, expected, got):
  return (
      rf"{re.escape(name)} must be \[.*\]={re.escape(str(expected))} .*; got shape "
      rf"{re.escape(str(got))}\."
  )


# ---------------------------------------------------------------------------------------------
# Ops: each takes the mask and returns the output.
# ---------------------------------------------------------------------------------------------
def _qkv(seed=0):
  rng = np.random.default_rng(seed)
  q, k = (np.exp(0.5 * rng.normal(size=(B, N, H, D))) for _ in range(2))
  return q, k, rng.normal(size=(B, N, H, D))


Q, K, VAL = _qkv()
RPE = np.exp(0.3 * np.random.default_rng(1).normal(size=(H, 2 * N - 1)))

OPS = {
    "softmax": lambda m: attention.softmax_attention(Q, K, VAL, mask=m),
    "softmax_causal": lambda m: attention.softmax_attention(Q, K, VAL, mask=m, causal=True),
    "softmax_f32_causal": lambda m: attention.softmax_attention(
        *(a.astype(np.float32) for a in (Q, K, VAL)), mask=m, causal=True
    ),
    "softmax_reference": lambda m: attention.softmax_attention_reference(Q, K, VAL, mask=m),
    "linear": lambda m: attention.linear_attention(Q, K, VAL, mask=m),
    "linear_causal": lambda m: attention.linear_attention(
        Q, K, VAL, mask=m, causal=True, chunk_size=4
    ),
    "linear_rpe": lambda m: attention.linear_attention(Q, K, VAL, mask=m, rpe=RPE),
    "linear_reference": lambda m: attention.linear_attention_reference(Q, K, VAL, mask=m),
}
# The dense reference each fast op must equal with a boolean mask.
REFERENCES = {
    "softmax": lambda m: attention.softmax_attention_reference(Q, K, VAL, mask=m),
    "softmax_causal": lambda m: attention.softmax_attention_reference(
        Q, K, VAL, mask=m, causal=True
    ),
    "linear": lambda m: attention.linear_attention_reference(Q, K, VAL, mask=m),
    "linear_causal": lambda m: attention.linear_attention_reference(Q, K, VAL, mask=m, causal=True),
    "linear_rpe": lambda m: attention.linear_attention_reference(Q, K, VAL, mask=m, rpe=RPE),
}
# Feature maps: fastpos/ops/features.py still casts any mask to bool (it is expected to call
# fastpos.ops.masks.check_mask like the ops above); strict, so the fix shows up as XPASS.
FEATURE_OPS = {
    "sikf_keys": lambda m: features.sikf(K, is_query=False, mask=m),
    "feature_map_favor_keys": lambda m: features.feature_map(
        "favor", K, projection=np.ones((3, D)), is_query=False, mask=m
    ),
}


def _jit(fn):
  return jax.jit(fn)


def _init(module, *args, **kwargs):
  """Random variables of ``module.init``'s shapes: traced, not compiled (compiling each init
  costs more than the checks, which hold for any parameters)."""
  shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), *args, **kwargs))
  rng = np.random.default_rng(0)
  draw = lambda a: (
      rng.normal(0.0, 0.3, a.shape).astype(a.dtype)
      if jnp.issubdtype(a.dtype, jnp.floating)
      else np.zeros(a.shape, a.dtype)
  )
  return jax.tree.map(draw, shapes)


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("jit", (False, True), ids=("eager", "jit"))
@pytest.mark.parametrize("op", OPS)
def test_op_rejects_non_boolean_mask(op, jit, bad):
  fn = _jit(OPS[op]) if jit else OPS[op]
  with pytest.raises(ValueError, match=_dtype_error("mask", bad)):
    fn(BAD[bad](_mask()))


@pytest.mark.parametrize("bad", ("float32", "additive"))
@pytest.mark.parametrize("op", list(FEATURE_OPS))
def test_feature_map_rejects_non_boolean_mask(op, bad):
  with pytest.raises(ValueError, match=_dtype_error("mask", bad)):
    FEATURE_OPS[op](BAD[bad](_mask()))


@pytest.mark.parametrize("jit", (False, True), ids=("eager", "jit"))
@pytest.mark.parametrize("op", OPS)
def test_op_rejects_wrong_mask_shape(op, jit):
  fn = _jit(OPS[op]) if jit else OPS[op]
  for wrong in (_mask(N - 1), _mask(N + 1), _mask()[:1], _mask()[..., None]):
    with pytest.raises(ValueError, match=_shape_error("mask", (B, N), wrong.shape)):
      fn(wrong)


def test_op_accepts_a_nested_list_of_bools():
  m = _mask()
  np.testing.assert_array_equal(OPS["softmax"](m.tolist()), OPS["softmax"](m))


@pytest.mark.parametrize("op", REFERENCES)
def test_boolean_mask_matches_reference_and_jit(op):
  m = jnp.asarray(_mask())
  out = np.asarray(OPS[op](m))  # eager
  assert rel_err(out, _jit(REFERENCES[op])(m)) < 1e-12
  np.testing.assert_allclose(np.asarray(_jit(OPS[op])(m)), out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", ("softmax", "linear"))
def test_boolean_mask_equals_the_unpadded_sequence(op):
  """The padded example's real rows equal the same tokens without padding, whatever the padded
  keys hold (huge values: an inverted or ignored mask would show at once)."""
  fn = {"softmax": attention.softmax_attention, "linear": attention.linear_attention}[op]
  fn = _jit(lambda q, k, v, mask=None, fn=fn: fn(q, k, v, mask=mask))
  k, v = K.copy(), VAL.copy()
  k[-1, N_REAL:], v[-1, N_REAL:] = 50.0, 1e6
  out = np.asarray(fn(Q, k, v, mask=_mask()))
  alone = np.asarray(fn(*(a[-1:, :N_REAL] for a in (Q, k, v))))
  assert rel_err(out[-1, :N_REAL], alone[0]) < 1e-12
  assert rel_err(out[0], np.asarray(fn(Q[:1], k[:1], v[:1]))[0]) < 1e-12


# ---------------------------------------------------------------------------------------------
# Layers: Attention, Block, Tower, positional.Context.
# ---------------------------------------------------------------------------------------------
def _attn_cfg(kernel):
  return AttentionConfig(
      num_heads=H,
      head_dim=E // H,
      embed_dim=E,
      kernel=KernelSpec(kernel, num_features=8),
      max_length=16,
      chunk_size=4,
  )


def _x(n=N, seed=0):
  return jax.random.normal(jax.random.key(seed), (B, n, E), jnp.float64)


@pytest.fixture(scope="module", params=("softmax", "sikf"))
def attention_layer(request):
  layer = Attention(_attn_cfg(request.param), dtype=jnp.float64)
  params = _init(layer, _x())
  return layer, params


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("jit", (False, True), ids=("eager", "jit"))
def test_attention_layer_rejects_non_boolean_mask(attention_layer, jit, bad):
  layer, params = attention_layer
  fn = lambda m: layer.apply(params, _x(), mask=m)
  with pytest.raises(ValueError, match=_dtype_error("mask", bad)):
    (_jit(fn) if jit else fn)(BAD[bad](_mask()))


@pytest.mark.parametrize("jit", (False, True), ids=("eager", "jit"))
def test_attention_layer_rejects_wrong_mask_shape(attention_layer, jit):
  layer, params = attention_layer
  fn = lambda m: layer.apply(params, _x(), mask=m)
  with pytest.raises(ValueError, match=_shape_error("mask", (B, N), (B, N - 1))):
    (_jit(fn) if jit else fn)(_mask(N - 1))


def test_attention_layer_boolean_mask_equals_the_unpadded_sequence(attention_layer):
  layer, params = attention_layer
  x = _x()
  out = np.asarray(jax.jit(lambda m: layer.apply(params, x, mask=m))(jnp.asarray(_mask())))
  alone = np.asarray(layer.apply(params, x[-1:, :N_REAL]))
  assert rel_err(out[-1, :N_REAL], alone[0]) < 1e-12
  assert rel_err(out, np.asarray(layer.apply(params, x, mask=_mask(), reference=True))) < 1e-12


def test_attention_layer_with_memory_checks_the_key_mask():
  """With memory the mask covers the M memory keys and the N current ones."""
  layer = Attention(_attn_cfg("softmax"), dtype=jnp.float64)
  mem = _x(3, seed=1)
  params = _init(layer, _x(), memory=mem)
  with pytest.raises(ValueError, match=_shape_error("mask", (B, 3 + N), (B, N))):
    layer.apply(params, _x(), memory=mem, mask=_mask())
  with pytest.raises(ValueError, match=_dtype_error("mask", "additive")):
    layer.apply(params, _x(), memory=mem, mask=BAD["additive"](_mask(3 + N)))
  assert layer.apply(params, _x(), memory=mem, mask=_mask(3 + N)).shape == (B, N, E)


@pytest.fixture(scope="module")
def block():
  layer = Block(_attn_cfg("softmax"), mlp_dim=16, dtype=jnp.float64)
  return layer, _init(layer, _x(), memory=_x(3, seed=1))


@pytest.mark.parametrize("bad", ("float32", "int32", "additive"))
@pytest.mark.parametrize("jit", (False, True), ids=("eager", "jit"))
def test_block_rejects_non_boolean_masks(block, jit, bad):
  layer, params = block
  mem = _x(3, seed=1)
  run = lambda m, mm: layer.apply(params, _x(), mask=m, memory=mem, memory_mask=mm)
  run = _jit(run) if jit else run
  with pytest.raises(ValueError, match=_dtype_error("mask", bad)):
    run(BAD[bad](_mask()), _mask(3))
  with pytest.raises(ValueError, match=_dtype_error("memory_mask", bad)):
    run(_mask(), BAD[bad](_mask(3)))
  with pytest.raises(ValueError, match=_shape_error("memory_mask", (B, 3), (B, N))):
    run(_mask(), _mask())
  with pytest.raises(ValueError, match=_shape_error("mask", (B, N), (B, 3))):
    run(_mask(3), _mask(3))


def test_block_boolean_masks_equal_all_true_defaults(block):
  """None means "all real": an all-True boolean mask gives the same output."""
  layer, params = block
  x, mem = _x(), _x(3, seed=1)
  ones = np.ones((B, N), bool)
  got = layer.apply(params, x, mask=ones, memory=mem, memory_mask=np.ones((B, 3), bool))
  np.testing.assert_array_equal(got, layer.apply(params, x, memory=mem))


def test_tower_rejects_non_boolean_masks():
  tower = Tower(_attn_cfg("softmax"), num_layers=1, mlp_dim=16)
  x = _x().astype(jnp.float32)
  params = _init(tower, x, _mask())
  with pytest.raises(ValueError, match=_dtype_error("mask", "int32")):
    tower.apply(params, x, BAD["int32"](_mask()))
  with pytest.raises(ValueError, match=_shape_error("mask", (B, N), (B, N + 1))):
    tower.apply(params, x, _mask(N + 1))
  states = [jnp.zeros((B, 3, E))]
  with pytest.raises(ValueError, match=_dtype_error("memory_mask", "float32")):
    tower.apply(params, x, _mask(), memory=(states, BAD["float32"](_mask(3))))
  with pytest.raises(ValueError, match=_shape_error("memory_mask", (B, 3), (B, 2))):
    tower.apply(params, x, _mask(), memory=(states, _mask(2)))


def test_context_rejects_non_boolean_mask():
  with pytest.raises(ValueError, match=_dtype_error("Context.mask", "float64")):
    positional.Context(mask=BAD["float64"](_mask()), length=N)
  with pytest.raises(
      ValueError, match=_shape_error("Context.mask", (None, N + 2), (B, N)).replace("None", r"\*")
  ):
    positional.Context(mask=_mask(), length=N, memory_length=2)
  assert positional.Context(mask=_mask(N + 2), length=N, memory_length=2).mask.dtype == bool


# ---------------------------------------------------------------------------------------------
# Models: the batch's masks and the decoder's memory mask.
# ---------------------------------------------------------------------------------------------
def _model(kind, kernel="softmax", **kw):
  c = model_config()
  c.num_layers, c.embed_dim, c.num_heads, c.mlp_dim, c.dropout_rate = 1, E, H, 16, 0.0
  c.kernel, c.positional, c.chunk_size = kernel, "none", 4
  for k, v in kw.items():
    c[k] = v
  return build_model(c, TaskInfo(kind, V, 3, N))


def _batch(pair=False):
  ids = np.random.default_rng(0).integers(1, V, (B, N)).astype(np.int32)
  ids[-1, N_REAL:] = 0
  out = {"inputs": ids, "mask": ids != 0}
  if pair:
    out.update(inputs2=ids[::-1].copy(), mask2=ids[::-1] != 0)
  return out


@pytest.fixture(scope="module", params=("classify-softmax", "classify-sikf", "retrieval"))
def encoder(request):
  kind, _, kernel = request.param.partition("-")
  model = _model(kind, kernel or "softmax")
  batch = _batch(pair=kind == "retrieval")
  return model, _init(model, batch), batch


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("jit", (False, True), ids=("eager", "jit"))
def test_encoder_models_reject_non_boolean_batch_masks(encoder, jit, bad):
  model, params, batch = encoder
  run = _jit(model.apply) if jit else model.apply
  for key in [k for k in ("mask", "mask2") if k in batch]:
    with pytest.raises(ValueError, match=_dtype_error(f"batch[{key!r}]", bad)):
      run(params, dict(batch, **{key: BAD[bad](batch[key])}))
    with pytest.raises(ValueError, match=_shape_error(f"batch[{key!r}]", (B, N), (B, N - 1))):
      run(params, dict(batch, **{key: batch[key][:, :-1]}))


def test_encoder_models_boolean_mask_equals_the_derived_one(encoder):
  """The batch's boolean mask is used as given: the same logits as the mask the model derives
  from ``inputs != 0`` when the batch has none."""
  model, params, batch = encoder
  derived = {k: v for k, v in batch.items() if not k.startswith("mask")}
  np.testing.assert_array_equal(
      jax.jit(model.apply)(params, batch), jax.jit(model.apply)(params, derived)
  )


def test_decoder_rejects_non_boolean_masks():
  model = _model("lm", memory_length=3, positional="transformer_xl")
  batch = {k: v for k, v in _batch().items()}
  params = _init(model, batch)
  with pytest.raises(ValueError, match=_dtype_error("batch['mask']", "additive")):
    model.apply(params, dict(batch, mask=BAD["additive"](batch["mask"])))
  states, mmask = model.init_memory(B)
  with pytest.raises(ValueError, match=_dtype_error("memory_mask", "int32")):
    jax.jit(model.apply)(params, batch, memory=(states, BAD["int32"](np.asarray(mmask))))
  logits, (new_states, new_mask) = jax.jit(model.apply)(params, batch, memory=(states, mmask))
  assert new_mask.dtype == bool and logits.shape == (B, N, V)
  np.testing.assert_array_equal(new_mask, batch["mask"][:, -3:])
