"""The plain causal path of linear attention (written-out backward) against the dense reference."""

import jax
import numpy as np
import pytest

from fastpos.ops import attention
from fastpos.ops.linear_attn import recurrent
from tests.helpers import assert_causal_jacobian, rel_err


def _value_and_grads(fn):
  """The output and the grads of ``sum(out * probe)`` w.r.t. phi_q, phi_k and v."""

  def g(pq, pk, v, probe, **kw):
    out, vjp = jax.vjp(lambda a, b, c: fn(a, b, c, causal=True, **kw), pq, pk, v)
    return (out,) + vjp(probe.astype(out.dtype))

  return jax.jit(g, static_argnames=("chunk_size",))


fast = _value_and_grads(attention.linear_attention)
dense = _value_and_grads(attention.linear_attention_reference)


def _inputs(n, *, b=2, heads=3, m=5, d=4, seed=0, dtype=np.float64):
  rng = np.random.default_rng(seed + n)
  feats = lambda: np.exp(0.5 * rng.normal(size=(b, n, heads, m)))
  return tuple(
      a.astype(dtype)
      for a in (
          feats(),
          feats(),
          rng.normal(size=(b, n, heads, d)),
          rng.normal(size=(b, n, heads, d)),
      )
  )


@pytest.mark.parametrize(
    "n, chunk_size, masked",
    [(1, None, False), (7, None, True), (100, 16, True), (257, 32, False), (33, 64, True)],
)
def test_plain_causal_path_and_gradients_match_dense_float64(n, chunk_size, masked):
  pq, pk, v, probe = _inputs(n)
  mask = None
  if masked:  # the last example right-padded, the first left-padded (queries see no key)
    mask = np.ones((2, n), bool)
    mask[1, max(1, n // 2) :] = False
    mask[0, : n // 3] = False
  got = fast(pq, pk, v, probe, mask=mask, chunk_size=chunk_size)
  want = dense(pq, pk, v, probe, mask=mask)
  for name, a, e in zip(("out", "g_phi_q", "g_phi_k", "g_v"), got, want):
    assert a.shape == e.shape
    if np.max(np.abs(e)) < 1e-12:  # n = 1: the output cannot depend on phi_q (round-off only)
      assert np.max(np.abs(a)) < 1e-12, name
    else:
      assert rel_err(a, e) < 1e-9, name


def test_plain_causal_path_float32_n4096():
  pq, pk, v, probe = _inputs(4096, b=1, heads=2, m=16, d=16, seed=3)
  want = dense(pq, pk, v, probe)  # float64
  f32 = lambda a: a.astype(np.float32)
  got = fast(f32(pq), f32(pk), f32(v), f32(probe))
  worst = max(rel_err(a, e) for a, e in zip(got, want))
  assert worst < 1e-4, worst


@pytest.mark.parametrize("argnum", (0, 1, 2))
def test_plain_causal_path_never_sees_the_future(argnum):
  n = 12
  pq, pk, v, _ = (a[:1, :, :2] for a in _inputs(n, seed=6))
  fn = lambda a, b, c: attention.linear_attention(a, b, c, causal=True, chunk_size=5)[0]
  jac = jax.jit(jax.jacrev(fn, argnums=argnum))(pq, pk, v)  # [n, h, d, 1, n, h, m]
  assert_causal_jacobian(jac, n, in_axis=4)


def test_plain_causal_path_is_the_one_taken(monkeypatch):
  """Without rpe, decay, segments or den_features the recurrent mode runs ``_causal_scan``;
  with a decay it does not (the general chunked path), nor does the chunk mode."""
  calls = []
  real = recurrent._causal_scan

  def counted(*args):
    calls.append(args[0].shape)
    return real(*args)

  monkeypatch.setattr(recurrent, "_causal_scan", counted)
  pq, pk, v, _ = _inputs(70, b=1, heads=2)
  trace = lambda **kw: jax.make_jaxpr(
      lambda *a: attention.linear_attention(*a, mode="recurrent", **kw)
  )(pq, pk, v)
  trace(causal=True)
  chunk = attention.CAUSAL_PLAIN_CHUNK
  assert calls == [(-(-70 // chunk), 1, chunk, 2, 5)]
  trace(causal=True, decay=np.full((2,), -0.1))
  trace(causal=False)
  jax.make_jaxpr(lambda *a: attention.linear_attention(*a, causal=True, mode="chunk"))(pq, pk, v)
  assert len(calls) == 1


def test_plain_causal_path_rejects_a_bad_chunk_size():
  pq, pk, v, _ = _inputs(8, b=1)
  with pytest.raises(ValueError, match="chunk_size must be a positive int"):
    attention.linear_attention(pq, pk, v, causal=True, chunk_size=0)
