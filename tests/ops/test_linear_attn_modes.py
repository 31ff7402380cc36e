"""Causal linear attention by algorithm (``mode=``): every mode against the dense float64
reference (values and gradients) on every causal cell; chunk mode never sees the future; its
compiled forward and backward hold no long serial loop (optimized HLO); bad modes refused."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.ops import attention
from fastpos.ops.linear_attn import auto, chunk, dispatch, naive, recurrent
from tests.helpers import assert_causal_jacobian, rel_err

B, N, H, M, D = 2, 37, 2, 3, 4  # N = 37: no chunk size below divides it
CHUNK = 8
FUSED_CHUNK = 16  # the fused kernel's smallest chunk (Triton's smallest matmul side)


MODES = ("chunk", "recurrent", "fused")  # "fused" runs where its module is merged


def _inputs(seed=0, n=N):
  rng = np.random.default_rng(seed)
  feats = lambda m=M: rng.uniform(0.1, 1.0, (B, n, H, m))
  pq, pk, v = feats(), feats(), rng.normal(size=(B, n, H, D))
  dq, dk = feats(2), feats(2)
  ids = np.zeros((B, n), np.int32)  # row 0: segments across and inside chunks; row 1: one
  ids[0] = 1 + np.searchsorted(np.array([9, 12, 28]) * n // N, np.arange(n), side="right")
  ids[1, : n * 30 // N] = 1
  ids[1, n * 29 // N : n * 30 // N] = 2
  mask = np.ones((B, n), bool)
  mask[0, 33:] = False  # right padding
  mask[1, :5] = False  # left padding: the first queries see no key
  s = 3.0 * rng.normal(size=(B, n, H))
  return dict(
      pq=pq, pk=pk, v=v, dq=dq, dk=dk, ids=ids, mask=mask, s=s, probe=rng.normal(size=v.shape)
  )


DECAY = np.array([-0.3, 0.0])
# Each causal cell: the op's keywords built from the inputs (den_features, segments, ...).
CELLS = {
    "plain": lambda x: {},
    "masked": lambda x: dict(mask=x["mask"]),
    "decay": lambda x: dict(decay=DECAY),
    "den_features": lambda x: dict(den_features=(x["dq"], x["dk"])),
    "decay_den_masked": lambda x: dict(
        decay=DECAY, den_features=(x["dq"], x["dk"]), mask=x["mask"]
    ),
    "segments": lambda x: dict(segment_ids=x["ids"], mask=x["ids"] > 0),
    "segments_decay": lambda x: dict(segment_ids=x["ids"], decay=DECAY),
    "segments_den": lambda x: dict(segment_ids=x["ids"], den_features=(x["dq"], x["dk"])),
}


def _value_and_grads(fn, x, kw, *, scaled=False, key_eps=0.0):
  """``fn``'s output and the grads of ``sum(out * probe)`` w.r.t. phi_q, phi_k, v (and the
  key scale when ``scaled``), one jitted program."""

  def loss(pq, pk, v, s):
    return jnp.sum(fn(pq, pk, v, s) * x["probe"])

  argnums = (0, 1, 2, 3) if scaled else (0, 1, 2)
  run = jax.jit(lambda *a: (fn(*a),) + jax.grad(loss, argnums=argnums)(*a))
  return run(x["pq"], x["pk"], x["v"], x["s"])


def _check(got, want):
  for i, (a, e) in enumerate(zip(got, want)):
    assert rel_err(a, e) < 1e-9, (i, rel_err(a, e))


# The default run: each mode on the cells that hold every keyword together (decay, den_features
# and mask; segments with decay, with den_features), and the fused kernel on the cells it runs
# (masked, decay) and refuses; the single-keyword cells under `-m slow`.
DEFAULT_CELLS = ("decay_den_masked", "segments_decay", "segments_den")


@pytest.mark.parametrize(
    "mode, cell",
    [
        pytest.param(
            mode,
            cell,
            marks=()
            if cell in DEFAULT_CELLS or (mode == "fused" and cell in ("masked", "decay"))
            else pytest.mark.slow,
        )
        for mode in MODES
        for cell in sorted(CELLS)
    ],
)
def test_mode_matches_dense_float64(mode, cell):
  if mode == "fused":
    fused = pytest.importorskip("fastpos.ops.linear_attn.fused")
    kw0 = CELLS[cell](_inputs())
    why = fused.supports(
        segments="segment_ids" in kw0,
        key_scales=False,
        den_features="den_features" in kw0,
        rpe=False,
    )
    if why is not None:
      with pytest.raises(ValueError, match="does not run this cell"):
        attention.linear_attention(
            *(_inputs()[k] for k in ("pq", "pk", "v")), causal=True, mode="fused", **kw0
        )
      return
  x = _inputs(1)
  kw = CELLS[cell](x)
  fast = lambda pq, pk, v, s: attention.linear_attention(
      pq, pk, v, causal=True, chunk_size=FUSED_CHUNK if mode == "fused" else CHUNK, mode=mode, **kw
  )
  dense = lambda pq, pk, v, s: naive.linear_attention_reference(pq, pk, v, causal=True, **kw)
  _check(_value_and_grads(fast, x, kw), _value_and_grads(dense, x, kw))


# The default run: both modes with segments (and padding); without segments under `-m slow`.
@pytest.mark.parametrize("segmented", (pytest.param(False, marks=pytest.mark.slow), True))
@pytest.mark.parametrize("mode", ("chunk", "recurrent"))
def test_key_log_scale_modes_match_dense_float64(mode, segmented):
  """Keys ``phi_k exp(s) + key_eps`` with the running-maximum reference, padded, with and
  without segments."""
  x = _inputs(2)
  kw = dict(mask=x["mask"])
  if segmented:
    kw = dict(segment_ids=x["ids"], mask=x["mask"] & (x["ids"] > 0))
  fast = lambda pq, pk, v, s: attention.linear_attention(
      pq, pk, v, causal=True, chunk_size=CHUNK, mode=mode, key_log_scale=s, key_eps=0.2, **kw
  )
  dense = lambda pq, pk, v, s: naive.linear_attention_reference(
      pq, pk * jnp.exp(s)[..., None] + 0.2, v, causal=True, **kw
  )
  got = _value_and_grads(fast, x, kw, scaled=True)
  _check(got, _value_and_grads(dense, x, kw, scaled=True))


# The default run: chunk mode (the recurrent one under `-m slow`).
@pytest.mark.parametrize("mode", ("chunk", pytest.param("recurrent", marks=pytest.mark.slow)))
def test_late_huge_key_scale_does_not_overflow(mode):
  """A late key with scale 750 (exp(750) overflows float64): no inf or NaN, values and
  gradients finite; queries before it match the reference without it, queries after it
  the reference with every key's scale shifted by -400 (the op's output is scale-free)."""
  x = _inputs(3)
  late = 29
  s = x["s"].copy()
  s[:, late] = 750.0
  x["s"] = s
  fast = lambda pq, pk, v, s: attention.linear_attention(
      pq, pk, v, causal=True, chunk_size=CHUNK, mode=mode, key_log_scale=s, key_eps=0.2
  )
  got = _value_and_grads(fast, x, {}, scaled=True)
  for a in got:
    assert np.all(np.isfinite(np.asarray(a)))
  before = np.where(np.arange(N)[None, :, None] == late, 0.0, s)
  want_before = naive.linear_attention_reference(
      x["pq"], x["pk"] * np.exp(before)[..., None] + 0.2, x["v"], causal=True
  )
  want_after = naive.linear_attention_reference(
      x["pq"],
      x["pk"] * np.exp(s - 400.0)[..., None] + 0.2 * np.exp(-400.0),
      x["v"],
      causal=True,
      eps=1e-6 * np.exp(-400.0),
  )
  out = np.asarray(got[0])
  assert rel_err(out[:, :late], want_before[:, :late]) < 1e-9
  assert rel_err(out[:, late:], want_after[:, late:]) < 1e-9


# The default run: chunk 8, which does not divide N (4 and N under `-m slow`).
@pytest.mark.parametrize(
    "c", [pytest.param(4, marks=pytest.mark.slow), 8, pytest.param(N, marks=pytest.mark.slow)]
)
def test_chunk_mode_equals_recurrent_internals_float64(c):
  """The chunkwise-parallel (num, den) and (num, den, ref) equal the serial scan's to
  rounding, decay and segments together, chunk sizes that do (N) and do not divide N. Each
  function runs jitted (one compile, not one per operation)."""
  x = _inputs(4)
  q, k, v = (jnp.swapaxes(jnp.asarray(x[n]), 1, 2) for n in ("pq", "pk", "v"))
  ids = jnp.asarray(x["ids"])
  for kw in ({}, dict(log_decay=jnp.asarray(DECAY), segment_ids=ids)):
    for a, e in zip(
        jax.jit(chunk.causal_chunked, static_argnums=3)(q, k, v, c, **kw),
        jax.jit(recurrent._causal_chunked, static_argnums=3)(q, k, v, c, **kw),
    ):
      assert rel_err(a, e) < 1e-12
  s = jnp.swapaxes(jnp.asarray(x["s"]), 1, 2)
  e = jnp.full(s.shape, 0.1)
  for seg in (None, ids):
    for a, b in zip(
        jax.jit(chunk.causal_running_max, static_argnums=5)(q, k, v, s, e, c, seg),
        jax.jit(recurrent._causal_running_max, static_argnums=5)(q, k, v, s, e, c, seg),
    ):
      assert rel_err(a, b) < 1e-12


# Slow; the default run keeps float32 at n = 4096 in tests/ops/test_attention.py
# (test_linear_attention_float32_gradients_n4096) and tests/ops/test_causal_fast.py.
@pytest.mark.slow
def test_chunk_mode_float32_n4096():
  rng = np.random.default_rng(5)
  n = 4096
  pq, pk = (np.exp(0.5 * rng.normal(size=(1, n, 2, 16))) for _ in range(2))
  v, probe = rng.normal(size=(2, 1, n, 2, 16))
  x = dict(pq=pq, pk=pk, v=v, s=np.zeros((1, n, 2)), probe=probe)
  kw = dict(decay=np.array([-1e-3, 0.0]))
  dense = lambda a, b, c, s: naive.linear_attention_reference(a, b, c, causal=True, **kw)
  want = _value_and_grads(dense, x, kw)
  x32 = {k_: np.asarray(a, np.float32) for k_, a in x.items()}
  fast = lambda a, b, c, s: attention.linear_attention(
      a, b, c, causal=True, mode="chunk", decay=kw["decay"].astype(np.float32)
  )
  got = _value_and_grads(fast, x32, kw)
  worst = max(rel_err(a, e) for a, e in zip(got, want))
  assert worst < 1e-4, worst


@pytest.mark.parametrize("scaled", (False, True))
def test_chunk_mode_never_sees_the_future(scaled):
  n = 12
  x = _inputs(6, n=n)
  one = lambda a: a[:1]
  pq, pk, v, s = (one(x[k]) for k in ("pq", "pk", "v", "s"))
  kw = (
      dict(key_log_scale=s, key_eps=0.1)
      if scaled
      else dict(decay=DECAY, den_features=(one(x["dq"]), one(x["dk"])))
  )
  fn = lambda a, b, c: attention.linear_attention(
      a, b, c, causal=True, chunk_size=5, mode="chunk", **kw
  )[0]
  for jac in jax.jit(jax.jacrev(fn, argnums=(0, 1, 2)))(pq, pk, v):
    assert_causal_jacobian(jac, n, in_axis=4)


# ---------------------------------------------------------------------------------------------
# No long serial loop in the compiled chunk mode
# ---------------------------------------------------------------------------------------------
_WHILE = re.compile(r"=\s.*?\swhile\(")
_TRIPS = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


def while_trip_counts(hlo_text: str) -> list[int | None]:
  """The trip count of every ``while`` op in optimized HLO text (XLA writes a loop's known
  count into its ``backend_config`` as ``"known_trip_count":{"n":"512"}``); None for a loop
  whose count XLA does not know."""
  counts = []
  for line in hlo_text.splitlines():
    if _WHILE.search(line):
      found = _TRIPS.search(line)
      counts.append(int(found.group(1)) if found else None)
  return counts


def _compiled_trip_counts(mode, cell, n=16384):
  b, h, m, d = 1, 1, 2, 2
  rng = np.random.default_rng(7)
  pq, pk = (jnp.asarray(rng.uniform(0.1, 1, (b, n, h, m)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(b, n, h, d)), jnp.float32)
  kw = {
      "plain": {},
      "decay_den_masked": dict(
          decay=jnp.full((h,), -0.01), den_features=(pq, pk), mask=jnp.ones((b, n), bool)
      ),
      "segments": dict(segment_ids=jnp.repeat(jnp.arange(4), n // 4)[None]),
      "key_scale": dict(key_log_scale=jnp.zeros((b, n, h)), key_eps=0.1),
  }[cell]
  loss = lambda a, c, e: jnp.sum(attention.linear_attention(a, c, e, causal=True, mode=mode, **kw))
  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  return while_trip_counts(fn.lower(pq, pk, v).compile().as_text())


def test_trip_count_parser_reads_xla_loops():
  text = (
      "%while.3 = (s32[], f32[2]{0}) while(%tuple.1), condition=%c, body=%b, "
      'backend_config={"known_trip_count":{"n":"512"}}\n'
      "%while.4 = (s32[]) while(%t), condition=%c2, body=%b2\n"
      "%add.1 = f32[] add(%x, %y)\n"
  )
  assert while_trip_counts(text) == [512, None]


def test_recurrent_mode_has_the_long_loop_the_check_looks_for():
  """The check can fail: the serial scan's loop runs N / chunk = 512 times."""
  counts = _compiled_trip_counts("recurrent", "plain")
  assert counts and max(c or 0 for c in counts) >= 512


@pytest.mark.parametrize(
    "cell",
    ["plain"]
    + [
        pytest.param(c, marks=pytest.mark.slow)
        for c in ("decay_den_masked", "segments", "key_scale")
    ],
)
def test_chunk_mode_compiles_without_a_long_loop(cell):
  counts = _compiled_trip_counts("chunk", cell)
  assert all(c is not None and c <= 16 for c in counts), counts


# ---------------------------------------------------------------------------------------------
# The keyword
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ("Chunk", "parallel", "", 3, None))
def test_bad_mode_is_refused_naming_the_choices(bad):
  x = jnp.ones((1, 4, 1, 2))
  with pytest.raises(
      ValueError, match=r"mode must be one of 'auto', 'chunk', 'recurrent', 'fused'"
  ):
    attention.linear_attention(x, x, x, causal=True, mode=bad)
  with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(")):
    attention.segmented_linear_attention(x, x, x, jnp.zeros((1, 4), int), mode=bad)


def test_bidirectional_ignores_chunk_and_recurrent_and_refuses_fused():
  x = _inputs(8)
  args = (x["pq"], x["pk"], x["v"])
  outs = [
      attention.linear_attention(*args, mask=x["mask"], mode=m)
      for m in ("auto", "chunk", "recurrent")
  ]
  assert all(np.array_equal(outs[0], o) for o in outs[1:])
  with pytest.raises(ValueError, match="causal attention only"):
    attention.linear_attention(*args, mode="fused")


def test_auto_table_names_its_source_and_picks_per_backend():
  for backend in ("cpu", "gpu", "tpu"):
    entry = auto.TABLE[backend]
    assert entry["mode"] in ("chunk", "recurrent") and entry["source"]
    assert auto.pick(backend) == entry["mode"]
  assert auto.pick("something-else") == "chunk"
  assert dispatch.resolve("auto", causal=True) == auto.pick()


# The default run: a chunk that is not a power of two (a sequence shorter than the smallest
# block, the same padding path, runs with `-m slow`).
@pytest.mark.parametrize("n, chunk_size", [pytest.param(6, None, marks=pytest.mark.slow), (40, 24)])
def test_fused_takes_any_chunk_and_short_sequences(n, chunk_size):
  """mode='fused' on a sequence shorter than its smallest block, and with a chunk that is not
  a power of two: the kernel's block rounds up (padding the sequence); values and gradients
  equal the dense float64 reference."""
  rng = np.random.default_rng(n)
  pq, pk = (jnp.asarray(rng.uniform(0.1, 1.0, (1, n, 2, 4))) for _ in range(2))
  v = jnp.asarray(rng.standard_normal((1, n, 2, 3)))

  def loss(fn, *a):
    return jnp.sum(jnp.sin(fn(*a)))

  fused = functools.partial(
      attention.linear_attention, causal=True, mode="fused", chunk_size=chunk_size
  )
  dense = functools.partial(attention.linear_attention_reference, causal=True)
  assert rel_err(fused(pq, pk, v), dense(pq, pk, v)) < 1e-9
  for g, w in zip(
      jax.grad(functools.partial(loss, fused), argnums=(0, 1, 2))(pq, pk, v),
      jax.grad(functools.partial(loss, dense), argnums=(0, 1, 2))(pq, pk, v),
  ):
    assert rel_err(g, w) < 1e-9
