"""Kernelized RPE's dense-or-FFT choice by backend: the CPU threshold, the GPU one, and both
paths agreeing with the dense reference at a length where the two backends choose apart."""

import functools

import jax
import numpy as np
import pytest

from fastpos.ops import attention
from tests.helpers import rel_err


def test_cpu_threshold_is_unchanged_and_gpu_goes_further():
  faster = attention._rpe_dense_is_faster
  assert attention._RPE_DENSE_UP_TO == 2048
  assert faster(2048, 32, 64, "cpu") and not faster(2049, 32, 64, "cpu")
  assert faster(2049, 32, 64, "gpu") and faster(16384, 32, 64, "gpu")
  assert not faster(16385, 32, 64, "gpu")
  assert faster(4096, 32, 64, "gpu") and not faster(4096, 32, 64, "tpu")  # TPU: CPU's number
  if jax.default_backend() == "cpu":  # unset backend: the one JAX runs on
    assert faster(2048, 32, 64) and not faster(2049, 32, 64)


@pytest.mark.parametrize("causal", (False, True))
def test_both_choices_run_their_path_and_agree(monkeypatch, causal):
  n = 2100  # dense on GPU, FFT on CPU
  rng = np.random.default_rng(5)
  feats = lambda: np.exp(0.5 * rng.normal(size=(1, n, 1, 2)))
  pq, pk, v = feats(), feats(), rng.normal(size=(1, n, 1, 3))
  rpe = np.exp(0.3 * rng.normal(size=(1, 2 * n - 1)))
  calls = []
  for name in ("_rpe_dense", "_rpe_mix"):
    real = getattr(attention, name)
    wrapped = lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k)
    monkeypatch.setattr(attention, name, wrapped)
  # Jitted: one program each, not op by op (the spies record the path while it is traced).
  ref = jax.jit(functools.partial(attention.linear_attention_reference, causal=causal))(
      pq, pk, v, rpe=rpe
  )
  outs, real_choice = {}, attention._rpe_dense_is_faster
  for backend in ("cpu", "gpu"):
    choice = functools.partial(real_choice, backend=backend)
    monkeypatch.setattr(attention, "_rpe_dense_is_faster", choice)
    calls.clear()
    run = functools.partial(attention.linear_attention, causal=causal)
    outs[backend] = jax.jit(run)(pq, pk, v, rpe=rpe)
    assert calls == (["_rpe_mix"] if backend == "cpu" else ["_rpe_dense"])
    assert rel_err(outs[backend], ref) < 1e-9
  assert rel_err(outs["gpu"], outs["cpu"]) < 1e-9
