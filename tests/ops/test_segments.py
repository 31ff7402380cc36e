"""Linear attention over packed rows (segment ids): every segment's outputs and gradients are
those it has alone, causal and bidirectional, in the op and through the attention layer; no
state crosses a segment (also by gradient); the cells that pack and those that refuse."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.models import AttentionConfig, TaskInfo, model_config
from fastpos.models.attention import Attention
from fastpos.ops import attention as ops
from fastpos.ops import segments
from fastpos.positional import compatibility
from tests.helpers import rel_err

N, H, M, D = 24, 2, 5, 3
CHUNK = 4
# Segments of one row (0: padding). Row 0: boundaries at chunk edges (8, 12) and mid-chunk
# (19); row 1: a segment across three chunks, one of length 1, then padding.
LENGTHS = ((8, 4, 7, 5), (14, 1, 6))


def _ids():
  ids = np.zeros((2, N), np.int32)
  for r, lengths in enumerate(LENGTHS):
    ids[r, : sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
  return ids


def _spans(r):
  at = 0
  for n in LENGTHS[r]:
    yield at, n
    at += n


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  fq = rng.uniform(0.1, 1.0, (2, N, H, M))
  fk = rng.uniform(0.1, 1.0, (2, N, H, M))
  v = rng.normal(size=(2, N, H, D))
  return fq, fk, v


# By default causal with chunks of 5 (boundaries off the chunk edges; CHUNK's edges are the
# tests below) and bidirectional; the other two cells run with -m slow.
@pytest.mark.parametrize(
    "causal, chunk",
    [(True, 5), (False, CHUNK)]
    + [pytest.param(c, k, marks=pytest.mark.slow) for c, k in ((True, CHUNK), (False, 5))],
)
def test_packed_op_matches_dense_reference(causal, chunk):
  fq, fk, v = _inputs()
  ids = _ids()
  mask = ids > 0
  # Jitted: op by op, each primitive is compiled on its own.
  ref = jax.jit(functools.partial(ops.linear_attention_reference, causal=causal))(
      fq, fk, v, mask=mask, segment_ids=ids
  )
  out = jax.jit(functools.partial(ops.linear_attention, causal=causal, chunk_size=chunk))(
      fq, fk, v, mask=mask, segment_ids=ids
  )
  real = mask[..., None, None]
  assert rel_err(np.where(real, out, 0), np.where(real, ref, 0)) < 1e-12


VARIANTS = {
    "causal": {},
    "bidirectional": {},
    "one_hot": {"num_segments": 5},
    "decay": {"decay": (-0.2, -0.05)},
    "den_features": {},
    "running_max": {"key_eps": 1e-3},
}


@pytest.mark.parametrize(
    "variant",
    [
        "causal",
        "bidirectional",
        # Slow; the default run keeps the causal and bidirectional paths.
        pytest.param("running_max", marks=pytest.mark.slow),
        pytest.param("one_hot", marks=pytest.mark.slow),
        pytest.param("decay", marks=pytest.mark.slow),
        pytest.param("den_features", marks=pytest.mark.slow),
    ],
)
def test_packed_op_equals_each_segment_alone_with_gradients(variant):
  """Outputs and gradients (of every input) of each segment, packed against alone, float64."""
  rng = np.random.default_rng(2)
  fq, fk, v = _inputs(1)
  arrays = [fq, fk, v, rng.uniform(0.1, 1.0, fq.shape), rng.uniform(0.1, 1.0, fk.shape)]
  arrays.append(rng.normal(size=(2, N, H)) * 3.0)  # the keys' log scale (running_max)
  causal = variant not in ("bidirectional", "one_hot")
  extra = dict(VARIANTS[variant])
  if "decay" in extra:
    extra["decay"] = jnp.asarray(extra["decay"])

  def run(q, k, vv, dq, dk, s, mask, ids):
    kw = dict(extra, mask=mask, causal=causal, chunk_size=CHUNK)
    if variant == "den_features":
      kw["den_features"] = (dq, dk)
    if variant == "running_max":
      kw["key_log_scale"] = s
    if ids is None:
      kw.pop("num_segments", None)
      return ops.linear_attention(q, k, vv, **kw)
    return ops.segmented_linear_attention(q, k, vv, ids, **kw)

  def loss(*a):
    return jnp.sum(run(*a[:-1]) * a[-1])

  both = jax.jit(lambda *a: (run(*a[:-1]), jax.grad(loss, range(6))(*a)))
  ids = _ids()
  weights = rng.normal(size=(2, N, H, D))
  packed, grads = both(*arrays, ids > 0, ids, weights)
  worst_out = worst_grad = 0.0
  for r in range(2):
    for start, n in _spans(r):
      alone = []
      for a in arrays + [weights]:
        x = np.zeros_like(a[:1])
        x[0, :n] = a[r, start : start + n]
        alone.append(x)
      out, g_alone = both(*alone[:6], np.arange(N)[None] < n, None, alone[6])
      worst_out = max(worst_out, rel_err(packed[r, start : start + n], out[0, :n]))
      for g, ga in zip(grads, g_alone):
        # Against the whole gradient's scale: a 1-token segment's d out / d q is 0 up to rounding.
        diff = np.max(np.abs(np.asarray(g)[r, start : start + n] - np.asarray(ga)[0, :n]))
        worst_grad = max(worst_grad, diff / max(np.max(np.abs(np.asarray(g))), 1e-300))
  print(f"{variant}: packed vs alone {worst_out:.1e}, gradients {worst_grad:.1e}")
  assert worst_out < 1e-9, worst_out
  assert worst_grad < 1e-9, worst_grad


@pytest.mark.parametrize("causal", [True, False])
def test_no_output_depends_on_another_segment_by_gradient(causal):
  """d out_i / d (k_j, v_j) is exactly 0 for j in another segment (and for j > i, causal)."""
  fq, fk, v = _inputs(3)
  ids = _ids()

  def out_at(i, k, vv):
    return jnp.sum(
        ops.linear_attention(
            fq, k, vv, mask=ids > 0, causal=causal, segment_ids=ids, chunk_size=CHUNK
        )[0, i]
    )

  grad = jax.jit(jax.grad(out_at, (1, 2)))  # i traced: one compile
  for i in (0, 7, 8, 11, 12, 18, 19, 23):
    gk, gv = grad(i, fk, v)
    seen = ids[0] == ids[0, i]
    if causal:
      seen &= np.arange(N) <= i
    blind = ~seen
    assert np.all(np.asarray(gk)[0][blind] == 0) and np.all(np.asarray(gv)[0][blind] == 0), i
    assert np.all(np.asarray(gk)[1] == 0) and np.any(np.asarray(gv)[0][seen] != 0), i


def test_running_max_restarts_per_segment_in_float32():
  """A key ~200 above the rest in segment 1 would underflow segment 2's weights if the
  reference carried over: float32 stays within 1e-4 of float64."""
  fq, fk, v = _inputs(4)
  s = np.zeros((2, N, H))
  s[:, 3] = 200.0
  ids = _ids()
  op = jax.jit(  # op by op, each primitive is compiled on its own
      functools.partial(ops.linear_attention, causal=True, chunk_size=CHUNK, key_eps=1e-6)
  )
  kw = dict(mask=ids > 0, segment_ids=ids)
  out64 = op(fq, fk, v, key_log_scale=s, **kw)
  f32 = [a.astype(np.float32) for a in (fq, fk, v, s)]
  out32 = op(*f32[:3], key_log_scale=f32[3], **kw)
  real = (ids > 0)[..., None, None]
  assert np.all(np.isfinite(np.asarray(out32)))
  assert rel_err(np.where(real, out32, 0), np.where(real, out64, 0)) < 1e-4


def test_bad_segment_arguments_raise():
  fq, fk, v = _inputs()
  with pytest.raises(ValueError, match=r"segment_ids must be an integer array \[batch, N\]"):
    ops.linear_attention(fq, fk, v, segment_ids=np.zeros((2, N - 1), np.int32))
  with pytest.raises(ValueError, match="not built with rpe"):
    ops.linear_attention(fq, fk, v, segment_ids=_ids(), rpe=np.ones((H, 2 * N - 1)))
  with pytest.raises(ValueError, match="num_segments must be None or an int >= 1"):
    ops.segmented_linear_attention(fq, fk, v, _ids(), causal=True, num_segments=4)


# ---------------------------------------------------------------------------------------------
# Through the attention layer
# ---------------------------------------------------------------------------------------------
V = 13


def _layer(kernel, scheme, causal):
  c = model_config()
  c.num_layers, c.embed_dim, c.num_heads, c.mlp_dim, c.dropout_rate = 1, 16, 2, 16, 0.0
  c.kernel, c.positional, c.dtype = kernel, scheme, "float64"
  c.kernel_options.num_features = 8
  c.chunk_size = CHUNK
  info = TaskInfo("lm" if causal else "classify", V, 0 if causal else 3, N)
  return Attention(AttentionConfig.from_model_config(c, info).attention_only(), dtype=jnp.float64)


@functools.cache
def _layer_fns(kernel, scheme, causal):
  layer = _layer(kernel, scheme, causal)
  x = np.random.default_rng(5).normal(size=(1, N, 16))
  variables = jax.jit(layer.init)(jax.random.key(0), x)  # op by op, init compiles every primitive
  leaves, tree = jax.tree.flatten(variables)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  variables = jax.tree.unflatten(
      tree, [a + 0.3 * jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)]
  )

  def loss(params, xx, w, mask, ids, pos):
    with segments.packed(ids, pos):
      y = layer.apply(params, xx, mask=mask)
    return jnp.sum(y * w), y

  # One program per (packed, alone) gives the outputs and the gradients.
  return variables, jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))


LAYER_CELLS = [
    ("elu1", "none", True),
    # Slow; the default run keeps the layer with elu1 (above) and the ops' causal and
    # bidirectional paths (test_packed_op_equals_each_segment_alone_with_gradients).
    pytest.param("sikf", "none", True, marks=pytest.mark.slow),  # running-maximum path
    # per-segment key stabiliser (max over the segment)
    pytest.param("favor", "none", False, marks=pytest.mark.slow),
    pytest.param("elu1", "none", False, marks=pytest.mark.slow),
    pytest.param("relu", "none", True, marks=pytest.mark.slow),
    pytest.param("sikf", "none", False, marks=pytest.mark.slow),
    pytest.param("favor", "none", True, marks=pytest.mark.slow),
    # den_features, and stabilised keys outside the running maximum
    pytest.param("favor", "rope", True, marks=pytest.mark.slow),
    pytest.param("relu", "none", False, marks=pytest.mark.slow),
    pytest.param("sikf", "rope", False, marks=pytest.mark.slow),
    pytest.param("elu1", "rope", True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kernel, scheme, causal", LAYER_CELLS)
def test_packed_layer_equals_each_segment_alone(kernel, scheme, causal):
  """The layer inside ``packed()``: outputs and gradients (parameters and inputs) of every
  segment equal those of the segment alone (padded), float64."""
  variables, out_and_grad = _layer_fns(kernel, scheme, causal)
  rng = np.random.default_rng(6)
  ids = _ids()[:1]
  pos = np.zeros_like(ids)
  for start, n in _spans(0):
    pos[0, start : start + n] = np.arange(n)
  x = rng.normal(size=(1, N, 16))
  worst, worst_grad = 0.0, 0.0
  for start, n in _spans(0):
    xa = np.zeros_like(x)
    xa[0, :n] = x[0, start : start + n]
    mask = np.arange(N)[None] < n
    w = np.zeros((1, N, 16))
    w[0, start : start + n] = rng.normal(size=(n, 16))
    wa = np.zeros_like(w)
    wa[0, :n] = w[0, start : start + n]
    (_, packed), (gp, gx) = out_and_grad(variables, x, w, ids > 0, ids, pos)
    (_, alone), (ga, gxa) = out_and_grad(variables, xa, wa, mask, None, None)
    worst = max(worst, rel_err(packed[0, start : start + n], alone[0, :n]))
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(ga)):
      worst_grad = max(worst_grad, rel_err(a, b))
    worst_grad = max(worst_grad, rel_err(gx[0, start : start + n], gxa[0, :n]))
    outside = np.ones(N, bool)
    outside[start : start + n] = False
    assert np.all(np.asarray(gx)[0, outside] == 0)  # no segment reaches another
  print(f"{kernel}/{scheme}/causal={causal}: packed vs alone {worst:.1e}, grads {worst_grad:.1e}")
  assert worst < 1e-9, worst
  assert worst_grad < 1e-9, worst_grad


def test_linear_packing_cells():
  packed = lambda causal: compatibility.Setting(causal=causal, packed=True)
  assert compatibility.packable("elu1") == ["none", "absolute", "rope"]
  for kernel in ("elu1", "relu", "sikf", "favor", "dpfp", "orf"):
    for causal in (True, False):
      for scheme in compatibility.packable(kernel):
        assert compatibility.refusal(kernel, [scheme], packed(causal)) is None
  why = compatibility.refusal("sikf", ["absolute", "fastrpb"], packed(True))
  assert "'fastrpb': its W V is one Toeplitz product" in why
  why = compatibility.refusal("elu1", ["kernelized_rpe"], packed(False))
  assert "exp(b) weights are one Toeplitz product" in why
  assert "not checked" in compatibility.refusal("favor", ["permuteformer"], packed(True))
  assert compatibility.refusal("softmax", ["kernelized_rpe"], packed(True)) is None
