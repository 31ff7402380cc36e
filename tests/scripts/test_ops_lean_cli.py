"""fastpos.bench.ops_lean's flags: a bad length list stops before any compute, naming the flag."""

import pytest

from fastpos.bench import ops_lean

EMPTY = ["--linear_lengths=", "--memory_lengths=", "--time_lengths="]


@pytest.mark.parametrize("value", ["abc", "1", "4096,x"])
def test_bad_lengths_exit_2_naming_the_flag_and_value(value, capsys):
  assert ops_lean.main([*EMPTY, f"--causal_lengths={value}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [
      f"--causal_lengths must be comma-separated integers >= 2 (e.g. 4096,8192; empty: skip "
      f"the section); got {value!r}"
  ]
