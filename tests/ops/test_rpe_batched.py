"""Kernelized RPE's FFT path in steps by backend: one batched step over every head and feature
(the GPU / TPU policy, forced here on the CPU) against the dense reference and against the
CPU's serial groups, and the step size the policy picks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.ops import attention, toeplitz
from tests.helpers import assert_causal_jacobian, rel_err, run_on_devices

HEADS, M, D = 3, 4, 5
_GROUP, _FFT_BYTES = attention._rpe_group, attention._rpe_fft_bytes  # before any patching


def _spy_group(monkeypatch, backend: str, seen: list):
  """Kernelized RPE on its FFT path at any length, stepped as on ``backend``; the steps
  picked are recorded in ``seen``."""

  def group(*args):
    got = _GROUP(*args, backend=backend)
    seen.append(got)
    return got

  monkeypatch.setattr(attention, "_rpe_dense_is_faster", lambda *a, **k: False)
  monkeypatch.setattr(attention, "_rpe_group", group)
  monkeypatch.setattr(attention, "_rpe_fft_bytes", functools.partial(_FFT_BYTES, backend=backend))


def _case(n, grid, seed, *, masked):
  rng = np.random.default_rng(seed)
  feats = lambda: np.exp(0.5 * rng.normal(size=(2, n, HEADS, M)))
  pq, pk, v = feats(), feats(), rng.normal(size=(2, n, HEADS, D))
  shape = (HEADS, 2 * n - 1) if grid is None else (HEADS, 2 * grid[0] - 1, 2 * grid[1] - 1)
  rpe = np.exp(rng.normal(size=shape))
  mask = None
  if masked:
    mask = np.ones((2, n), bool)
    mask[-1, n - n // 3 :] = False
  return (pq, pk, v, rpe), mask, rng.normal(size=v.shape)


def _value_and_grads(fn, args, mask, probe, **kw):
  loss = lambda q, k, v, c: jnp.sum(fn(q, k, v, rpe=c, mask=mask, **kw) * probe)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*args)


def _assert_close(got, want, tol):
  assert rel_err(got[0], want[0]) < tol
  for a, b in zip(got[1], want[1]):
    assert rel_err(a, b) < tol


# 1D and 2D, causal or not, masked or not; decay (causal only) folded into the table.
CASES = [
    (17, None, False, True, False),
    (17, None, True, True, False),
    (17, None, True, False, True),
    (15, (3, 5), False, True, False),
    (15, (3, 5), True, True, True),
    (80, None, True, True, False),  # past the causal head refinement of the Toeplitz product
]


@pytest.mark.parametrize("n, grid, causal, masked, use_decay", CASES)
def test_one_batch_matches_dense_and_grouped(monkeypatch, n, grid, causal, masked, use_decay):
  """The one-step path equals the dense reference (values and the gradients of every input,
  the table included; float64 < 1e-9) and the CPU's serial path in groups of one feature."""
  args, mask, probe = _case(n, grid, seed=n + 3 * causal, masked=masked)
  kw = {"causal": causal, "grid": grid}
  if use_decay:
    kw["decay"] = np.log(np.array([0.9, 0.7, 1.0]))
  ref = _value_and_grads(attention.linear_attention_reference, args, mask, probe, **kw)
  seen = []
  _spy_group(monkeypatch, "gpu", seen)
  one = _value_and_grads(attention.linear_attention, args, mask, probe, **kw)
  assert set(seen) == {(HEADS, M)}  # every head and feature in one step
  _assert_close(one, ref, 1e-9)
  seen.clear()
  _spy_group(monkeypatch, "cpu", seen)
  monkeypatch.setattr(attention, "_RPE_GROUP_BYTES", 1)
  grouped = _value_and_grads(attention.linear_attention, args, mask, probe, **kw)
  assert set(seen) == {(1, 1)}  # HEADS * M serial steps
  _assert_close(grouped, one, 1e-9)


def test_blocks_of_heads_match_dense(monkeypatch):
  """Past the accelerator budget: steps of whole heads (here one head, all its features)."""
  n = 16
  args, mask, probe = _case(n, None, seed=2, masked=True)
  ref = _value_and_grads(attention.linear_attention_reference, args, mask, probe, causal=True)
  seen = []
  _spy_group(monkeypatch, "gpu", seen)
  one_head = 2 * n * M * (D + 1) * 8  # float64 channels of one head, batch 2
  monkeypatch.setattr(attention, "_RPE_GROUP_BYTES_ACCELERATOR", one_head)
  got = _value_and_grads(attention.linear_attention, args, mask, probe, causal=True)
  assert set(seen) == {(1, M)}
  _assert_close(got, ref, 1e-9)


def test_one_batch_never_sees_the_future(monkeypatch):
  n = 12
  (pq, pk, v, rpe), _, _ = _case(n, None, seed=6, masked=False)
  _spy_group(monkeypatch, "gpu", [])
  fn = lambda a, b, c: attention.linear_attention(a, b, c, causal=True, rpe=rpe)[0]
  for jac in jax.jit(jax.jacrev(fn, argnums=(0, 1, 2)))(pq[:1], pk[:1], v[:1]):
    assert_causal_jacobian(jac, n, in_axis=4, rtol=1e-13)


@pytest.mark.parametrize("backend", ("gpu", "tpu"))
@pytest.mark.parametrize("n", (2048, 4096, 8192, 16384))
def test_accelerators_take_every_channel_at_the_benchmark_shapes(backend, n):
  """Batch 1, 8 heads, m = 32, d = 64, float32 (the GPU check's kernelized RPE rows)."""
  assert attention._rpe_group(1, n, 8, 32, 64, 4, backend) == (8, 32)


@pytest.mark.parametrize("backend", ("gpu", "tpu"))
@pytest.mark.parametrize(
    "b, n, h, m, d, expected",
    [
        (1, 2**16, 16, 32, 64, (2, 32)),  # whole heads, two per step
        (4, 2**18, 8, 32, 64, (1, 4)),  # one head's features in groups
        (8, 2**20, 16, 64, 128, (1, 1)),  # one channel per step is the floor
    ],
)
def test_accelerator_steps_are_bounded_for_huge_inputs(backend, b, n, h, m, d, expected):
  heads, group = attention._rpe_group(b, n, h, m, d, 4, backend)
  assert (heads, group) == expected
  step = b * heads * n * group * (d + 1) * 4
  assert step <= attention._RPE_GROUP_BYTES_ACCELERATOR or expected == (1, 1)


def test_cpu_keeps_one_head_and_its_byte_budget():
  for n in (2048, 4096, 16384):
    heads, group = attention._rpe_group(1, n, 8, 32, 64, 4, "cpu")
    assert heads == 1 and 32 % group == 0
    assert n * group * 65 * 4 <= attention._RPE_GROUP_BYTES or group == 1
    bigger = [g for g in range(group + 1, 33) if 32 % g == 0]
    assert not bigger or n * bigger[0] * 65 * 4 > attention._RPE_GROUP_BYTES


@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("grid", (None, (4, 5)))
def test_toeplitz_group_bytes_changes_only_the_schedule(causal, grid):
  """``group_bytes`` of one batch entry (a serial loop) and of the whole batch agree."""
  rng = np.random.default_rng(1)
  n = 20
  x = rng.normal(size=(3, 2, n, 6))
  if grid is None:
    w = rng.normal(size=(2, 2 * n - 1))
    fn = lambda w, x, g: toeplitz.toeplitz_matmul(w, x, causal=causal, group_bytes=g)
  else:
    w = rng.normal(size=(2, 2 * grid[0] - 1, 2 * grid[1] - 1))
    fn = lambda w, x, g: toeplitz.toeplitz_matmul_2d(w, x, grid, causal=causal, group_bytes=g)
  loss = lambda w, x, g: jnp.sum(fn(w, x, g) * x)
  run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)  # not op by op
  small, large = (run(w, x, g) for g in (1, 2**30))
  assert rel_err(small[0], large[0]) < 1e-12
  for a, b in zip(small[1], large[1]):
    assert rel_err(a, b) < 1e-12


_CONTEXT_PARALLEL = """
import functools, json
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_enable_x64", True)
from jax.sharding import Mesh, PartitionSpec as P
from fastpos.ops import attention
from fastpos.ops import context_parallel as cp
group = functools.partial(attention._rpe_group, backend="gpu")
seen = []
attention._rpe_group = lambda *a: seen.append(group(*a)) or group(*a)
attention._rpe_fft_bytes = functools.partial(attention._rpe_fft_bytes, backend="gpu")
attention._rpe_dense_is_faster = lambda *a, **k: False
rng = np.random.default_rng(0)
b, n, h, m, d = 2, 16, 2, 3, 4
q, k = rng.uniform(0.1, 1, (b, n, h, m)), rng.uniform(0.1, 1, (b, n, h, m))
v, ct = rng.normal(size=(b, n, h, d)), rng.normal(size=(b, n, h, d))
rpe = np.exp(0.3 * rng.normal(size=(h, 2 * n - 1)))
mesh, s = Mesh(np.array(jax.devices()[:4]), ("seq",)), P(None, "seq")
errs = {}
for causal in (False, True):
  full = lambda q, k, v, c: attention.linear_attention(q, k, v, rpe=c, causal=causal)
  local = lambda q, k, v, c: cp.linear_attention(q, k, v, rpe=c, causal=causal, axis_name="seq")
  split = jax.shard_map(local, mesh=mesh, in_specs=(s, s, s, P()), out_specs=s)
  run = lambda fn: jax.jit(
      jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2, 3))
  )(q, k, v, rpe)
  (a, ga), (r, gr) = run(split), run(full)
  errs[str(causal)] = max(
      float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))) for x, y in zip([a, *ga], [r, *gr])
  )
print("RESULT" + json.dumps({"errs": errs, "seen": sorted(set(seen))}))
"""


@pytest.mark.slow
def test_context_parallel_one_batch_matches_unsplit():
  """The context-parallel op (4 devices, a ring of block products) with the one-step policy:
  output and gradients equal the unsplit op's, causal or not (float64)."""
  got = run_on_devices(_CONTEXT_PARALLEL)
  assert got["seen"] == [[2, 3]]  # both heads and all features in one step
  assert max(got["errs"].values()) < 1e-9
