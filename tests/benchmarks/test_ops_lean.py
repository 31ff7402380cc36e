"""benchmarks.ops_lean: a bad length list stops before any compute, naming the flag; the
benchmark's two attention-layer rows compute the same layer."""

import jax
import numpy as np
import pytest

from benchmarks import ops_lean

EMPTY = ["--linear_lengths=", "--memory_lengths=", "--time_lengths="]


@pytest.mark.parametrize("value", ["abc", "1", "4096,x"])
def test_bad_lengths_exit_2_naming_the_flag_and_value(value, capsys):
  assert ops_lean.main([*EMPTY, f"--causal_lengths={value}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [
      f"--causal_lengths must be comma-separated integers >= 2 (e.g. 4096,8192; empty: skip "
      f"the section); got {value!r}"
  ]


# Slow (a benchmark program); the default run keeps its flag checks (test_bad_lengths_...).
@pytest.mark.slow
def test_the_two_layer_rows_compute_the_same_layer():
  """The head-major layer row is the token-major layer with its projections written
  head-major: outputs and every gradient equal (float64)."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    shapes = [(2, 16, 12), (12, 3, 4), (12, 3, 4), (12, 3, 4), (3, 4, 12)]
    args = [jax.numpy.asarray(rng.normal(size=s) * 0.3) for s in shapes]
    ct = jax.numpy.asarray(rng.normal(size=(2, 16, 12)))
    layers = [ops_lean._layer(hm) for hm in (False, True)]
    outs = [f(*args) for f in layers]
    got = [jax.vjp(f, *args)[1](ct) for f in layers]
  np.testing.assert_allclose(outs[1], outs[0], rtol=1e-12, atol=0)
  for a, b in zip(got[0], got[1]):
    np.testing.assert_allclose(b, a, rtol=1e-11, atol=1e-13)


def test_the_causal_goal_holds_only_where_every_quiet_run_meets_it():
  results = []
  record = lambda text, value, ok: results.append((value, ok))
  ops_lean._causal_goal(record, 16384, 0.77)  # the other quiet runs there: 0.85x, 0.88x
  ops_lean._causal_goal(record, 4096, 0.69)
  ops_lean._causal_goal(record, 2048, 0.80)  # no other run recorded at this length
  assert [ok for _, ok in results] == [False, True, True]
  assert "other quiet runs: 0.85x, 0.88x" in results[0][0]
