"""benchmarks.packing: a bad flag stops in one line before anything is built."""

from __future__ import annotations

from benchmarks import packing


def test_benchmark_refuses_a_bad_flag_in_one_line(capsys):
  assert packing.main(["--segments=0"]) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and "--segments must be >= 1" in err
