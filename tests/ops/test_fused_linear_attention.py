"""The fused Pallas causal linear attention kernel (interpret mode on CPU) against a dense
reference: values and gradients, decay, padding, causality, dtypes, bad input, and that forward
and backward lower for GPU (Triton) and TPU (Mosaic)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.ops.linear_attn import fused
from tests.helpers import rel_err


def dense(phi_q, phi_k, v, log_decay=None):
  """num [b, h, n, d] and den [b, h, n] from the masked weight matrix A_ij = (phi_q_i . phi_k_j)
  r^(i-j) for j <= i, else 0, computed in the inputs' dtype."""
  n = phi_q.shape[2]
  dist = jnp.arange(n)[:, None] - jnp.arange(n)[None, :]
  w = jnp.where(dist >= 0, 1.0, 0.0).astype(phi_q.dtype)[None]  # [1, n, n]
  if log_decay is not None:
    w = w * jnp.exp(log_decay[:, None, None] * jnp.maximum(dist, 0)[None])  # [h, n, n]
  a = jnp.einsum("bhim,bhjm->bhij", phi_q, phi_k) * w[None]
  return jnp.einsum("bhij,bhjd->bhid", a, v), jnp.sum(a, axis=-1)


def inputs(n, *, b=2, h=3, m=5, d=4, seed=0, dtype=np.float64):
  rng = np.random.default_rng(seed)
  q, k = (rng.uniform(0.1, 1.0, (b, h, n, m)) for _ in range(2))  # positive features
  v = rng.normal(size=(b, h, n, d))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


DECAY = np.array([-0.3, -0.02, 0.0])  # one per head; 0 is r = 1


def values_and_grads(f, q, k, v, seed=1):
  """f's (num, den) and the gradients w.r.t. q, k, v of a random projection of both."""
  (num, den), pullback = jax.vjp(f, q, k, v)
  rng = np.random.default_rng(seed)
  ct = (
      jnp.asarray(rng.normal(size=num.shape), num.dtype),
      jnp.asarray(rng.normal(size=den.shape), den.dtype),
  )
  return (num, den), pullback(ct)


def run_layout(layout, chunk, lr):
  """causal in the GPU layout ("loop": fused.causal on this CPU) or the TPU layout ("grid"),
  both in interpret mode."""
  if layout == "loop":
    return lambda *a: fused.causal(*a, chunk=chunk, log_decay=lr)
  return lambda *a: fused._apply(*a, lr, "causal", chunk, True, "tpu")


@pytest.mark.parametrize(
    "layout, n, chunk, m, d, decay",
    [
        ("loop", 37, 16, 5, 4, False),  # n not a multiple of chunk, m and d padded to 16
        ("loop", 37, 16, 5, 4, True),
        ("loop", 64, 32, 16, 32, True),  # no padding at all
        pytest.param("loop", 50, 64, 8, 20, True, marks=pytest.mark.slow),  # one partial chunk
        pytest.param("loop", 80, 16, 3, 7, False, marks=pytest.mark.slow),  # five chunks
        ("grid", 37, 16, 5, 4, True),
        pytest.param("grid", 80, 16, 3, 7, False, marks=pytest.mark.slow),
    ],
)
def test_values_and_gradients_match_dense_float64(layout, n, chunk, m, d, decay):
  q, k, v = inputs(n, m=m, d=d)
  lr = jnp.asarray(DECAY) if decay else None
  got = values_and_grads(run_layout(layout, chunk, lr), q, k, v)
  want = values_and_grads(lambda *a: dense(*a, lr), q, k, v)
  assert got[0][0].dtype == jnp.float64 and got[0][1].shape == (2, 3, n)
  for name, a, e in zip(("num", "den"), got[0], want[0]):
    assert rel_err(a, e) < 1e-9, name
  for name, a, e in zip(("d phi_q", "d phi_k", "dv"), got[1], want[1]):
    assert rel_err(a, e) < 1e-9, name


def test_float32_matches_float64_dense_at_256_tokens():
  q, k, v = inputs(256, b=1, h=3, m=32, d=32, seed=2)
  lr = jnp.asarray(DECAY)
  f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
  got = values_and_grads(lambda *a: fused.causal(*a, chunk=64, log_decay=lr), *f32)
  want = values_and_grads(lambda *a: dense(*a, lr), q, k, v)
  assert got[0][0].dtype == jnp.float32 and got[1][0].dtype == jnp.float32
  for a, e in zip(got[0] + got[1], want[0] + want[1]):
    assert rel_err(a, e) < 1e-4


def test_bf16_inputs_give_float32_sums():
  """bf16 inputs, float32 states and outputs: against the dense sums of the same bf16-rounded
  inputs in float64, values within 1e-5 (bf16 products are exact in float32) and the bf16
  gradients within 1e-2 (one bf16 rounding)."""
  q, k, v = (x.astype(jnp.bfloat16) for x in inputs(70, seed=3))
  got = values_and_grads(
      lambda *a: fused.causal(*a, chunk=32, log_decay=jnp.asarray(DECAY)), q, k, v
  )
  want = values_and_grads(
      lambda *a: dense(*a, jnp.asarray(DECAY)), *(x.astype(jnp.float64) for x in (q, k, v))
  )
  assert got[0][0].dtype == jnp.float32 and got[0][1].dtype == jnp.float32
  assert got[1][0].dtype == jnp.bfloat16
  for a, e in zip(got[0], want[0]):
    assert rel_err(a, e) < 1e-5
  for a, e in zip(got[1], want[1]):
    assert rel_err(a, e) < 1e-2


def test_no_output_depends_on_a_future_input():
  n, chunk = 40, 16
  q, k, v = inputs(n, b=1, h=1, seed=4)
  lr = jnp.asarray(DECAY[:1])
  f = jax.jit(
      lambda q, k, v, i: sum(
          jnp.sum(x[:, :, i]) for x in fused.causal(q, k, v, chunk=chunk, log_decay=lr)
      )
  )
  grad = jax.jit(jax.grad(f, argnums=(0, 1, 2)))
  for i in (0, 15, 16, 21, n - 1):  # chunk edges, inside a chunk, the padded last chunk
    for name, g in zip(("phi_q", "phi_k", "v"), grad(q, k, v, i)):
      g = np.asarray(g[0, 0])
      assert np.all(g[i + 1 :] == 0.0), f"output {i} depends on a future {name}"
      assert np.any(g[: i + 1] != 0.0), name


def test_chunk_sizes_and_layouts_agree():
  q, k, v = inputs(100, seed=5)
  lr = jnp.asarray(DECAY)
  outs = [run_layout("loop", c, lr)(q, k, v) for c in (16, 128)]
  outs.append(run_layout("grid", 32, lr)(q, k, v))
  for num, den in outs[1:]:
    assert rel_err(num, outs[0][0]) < 1e-12 and rel_err(den, outs[0][1]) < 1e-12


@pytest.mark.parametrize(
    "n, chunk, m, d", [(37, 16, 5, 4), pytest.param(64, 32, 16, 32, marks=pytest.mark.slow)]
)
def test_bidirectional_values_and_gradients_match_dense_float64(n, chunk, m, d):
  q, k, v = inputs(n, m=m, d=d, seed=8)

  def full(q, k, v):  # every query sees every key
    a = jnp.einsum("bhim,bhjm->bhij", q, k)
    return jnp.einsum("bhij,bhjd->bhid", a, v), jnp.sum(a, axis=-1)

  got = values_and_grads(lambda *a: fused.bidirectional(*a, chunk=chunk), q, k, v)
  want = values_and_grads(full, q, k, v)
  for a, e in zip(got[0] + got[1], want[0] + want[1]):
    assert rel_err(a, e) < 1e-9
  f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
  got = values_and_grads(lambda *a: fused.bidirectional(*a, chunk=chunk), *f32)
  assert got[0][0].dtype == jnp.float32
  for a, e in zip(got[0] + got[1], want[0] + want[1]):
    assert rel_err(a, e) < 1e-4


BAD_INPUT = [
    (dict(phi_q=jnp.zeros((2, 3, 8))), r"phi_q must be rank 4.*\(2, 3, 8\)"),
    (dict(phi_k=jnp.zeros((2, 3, 8, 6))), r"phi_q \(2, 3, 8, 5\) and phi_k \(2, 3, 8, 6\)"),
    (dict(v=jnp.zeros((2, 3, 9, 4))), r"v \(2, 3, 9, 4\) must share"),
    (dict(v=jnp.zeros((2, 3, 8, 129))), r"d=129 must lie in \[1, 128\]"),
    (dict(v=jnp.zeros((2, 3, 8, 4), jnp.int32)), r"v must be floating.*int32"),
    (dict(chunk=48), r"chunk must be a power of two >= 16; got 48"),
    (dict(chunk=8), r"got 8"),
    (dict(log_decay=jnp.zeros((2,))), r"log_decay must be \[heads\]=\(3,\).*\(2,\)"),
    (dict(log_decay=jnp.asarray([0.0, 0.1, -1.0])), r"maximum is 0.1"),
    (dict(interpret=False), r"interpret=False.*cpu"),
]


@pytest.mark.parametrize(
    "op, change, match",
    [(fused.causal, c, m) for c, m in BAD_INPUT]
    + [(fused.bidirectional, c, m) for c, m in BAD_INPUT if "log_decay" not in c],
)
def test_bad_input_raises_naming_the_value(op, change, match):
  args = dict(
      phi_q=jnp.zeros((2, 3, 8, 5)), phi_k=jnp.zeros((2, 3, 8, 5)), v=jnp.zeros((2, 3, 8, 4))
  )
  args.update(change)
  q, k, v = args.pop("phi_q"), args.pop("phi_k"), args.pop("v")
  with pytest.raises(ValueError, match=match):
    op(q, k, v, **args)


def test_supports_names_what_is_not_built():
  assert fused.supports(segments=False, key_scales=False, den_features=False, rpe=False) is None
  for cell in ("segments", "key_scales", "den_features", "rpe"):
    flags = dict(segments=False, key_scales=False, den_features=False, rpe=False)
    flags[cell] = True
    reason = fused.supports(**flags)
    assert isinstance(reason, str) and "not built" in reason


@pytest.mark.parametrize(
    "platform, call", [("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")]
)
@pytest.mark.parametrize(
    "kind, dtype",
    [("causal", jnp.float32), ("causal", jnp.bfloat16), ("bidirectional", jnp.float32)],
)
def test_forward_and_backward_lower_for_accelerators(platform, call, kind, dtype):
  """Lowering only (this CPU has neither): the Pallas kernels become Triton / Mosaic calls.
  Without float64, as on the accelerators (Mosaic rejects the int64 loop indices x64 makes)."""
  q = jax.ShapeDtypeStruct((2, 2, 100, 32), dtype)
  v = jax.ShapeDtypeStruct((2, 2, 100, 64), dtype)
  lr = jnp.asarray([-0.1, 0.0], jnp.float32) if kind == "causal" else None
  f = lambda q, k, v: fused._apply(q, k, v, lr, kind, 64, False, platform)
  loss = lambda q, k, v: sum(jnp.sum(x) for x in f(q, k, v))
  backward = 2 if kind == "causal" else 1  # causal: d phi_q, then d phi_k and dv
  for fn, kernels in ((f, 1), (jax.grad(loss, argnums=(0, 1, 2)), 1 + backward)):
    with jax.enable_x64(False):
      text = jax.jit(fn).trace(q, q, v).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(f"@{call}(") == kernels


@pytest.mark.slow
def test_long_sequence_float32_and_float64():
  q, k, v = inputs(1000, b=1, h=3, m=16, d=16, seed=6)
  lr = jnp.asarray(DECAY)
  want = values_and_grads(lambda *a: dense(*a, lr), q, k, v)
  got = values_and_grads(lambda *a: fused.causal(*a, chunk=64, log_decay=lr), q, k, v)
  for a, e in zip(got[0] + got[1], want[0] + want[1]):
    assert rel_err(a, e) < 1e-9
  f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
  got = values_and_grads(lambda *a: fused.causal(*a, chunk=64, log_decay=lr), *f32)
  for a, e in zip(got[0] + got[1], want[0] + want[1]):
    assert rel_err(a, e) < 1e-4
