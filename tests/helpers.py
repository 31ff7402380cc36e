"""Small shared test utilities."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# XLA's CPU backend compiles the tests' tiny programs about a quarter faster without its LLVM
# optimisations (same results up to round-off, which every comparison allows for).
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def run_on_devices(script: str, *args: str, devices: int = 4, timeout: int = 900):
  """Runs ``python -c script *args`` in a fresh process with ``devices`` CPU devices (fast XLA
  flags) and returns the JSON the script printed after ``RESULT`` on one line."""
  env = dict(
      os.environ,
      PYTHONPATH=str(ROOT),
      XLA_FLAGS=(
          f"--xla_force_host_platform_device_count={devices} "
          "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
      ),
  )
  env.pop("JAX_PLATFORMS", None)
  proc = subprocess.run(
      [sys.executable, "-c", script, *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
  return json.loads(line[len("RESULT") :])


def nudged(tree, *, scale: float = 0.1, phase: float = 0.0):
  """Every leaf plus ``scale * sin(arange(size) + phase)`` in its shape and dtype: parameters
  moved off their init deterministically (one set per head can then differ), by NumPy, so no
  program is compiled per leaf shape."""

  def nudge(p):
    wave = np.sin(np.arange(p.size).reshape(p.shape) + phase)
    return (np.asarray(p) + scale * wave).astype(p.dtype)

  return jax.tree.map(nudge, tree)


def rel_err(actual, expected) -> float:
  """max |actual - expected| / max |expected| (0 when both are all-zero)."""
  a = np.asarray(actual, np.float64)
  e = np.asarray(expected, np.float64)
  assert a.shape == e.shape, (a.shape, e.shape)
  scale = np.max(np.abs(e)) if e.size else 0.0
  err = np.max(np.abs(a - e)) if e.size else 0.0
  return float(err / scale) if scale > 0 else float(err)


def assert_causal_jacobian(jac, n: int, *, in_axis: int, rtol: float = 0.0) -> None:
  """Checks that output i never depends on input j > i.

  jac: ``[n, ..., n, ...]`` with the output position first and the input position at axis
  ``in_axis`` (its size must be n). With ``rtol=0`` the future entries must be exactly zero (dense
  and chunked paths). FFT paths mix every input into every output through the transform, so their
  future entries are float64 round-off: pass ``rtol`` (e.g. 1e-12) to bound them relative to the
  largest entry, which still tells apart a real leak (of order 1). Some past entry must be
  nonzero, so an all-zero Jacobian does not pass.
  """
  jac = np.asarray(jac)
  assert jac.shape[0] == n and jac.shape[in_axis] == n, (jac.shape, in_axis)
  jac = np.moveaxis(jac, in_axis, 1).reshape(n, n, -1)
  bound = rtol * np.max(np.abs(jac))
  for i in range(n):
    worst = np.max(np.abs(jac[i, i + 1 :]), initial=0.0)
    assert worst <= bound, f"output {i} depends on a future input ({worst:.3g} > {bound:.3g})"
  assert np.any(jac[np.tril_indices(n)] != 0.0)
