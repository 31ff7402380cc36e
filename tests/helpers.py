"""Small shared test utilities."""

import numpy as np


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
