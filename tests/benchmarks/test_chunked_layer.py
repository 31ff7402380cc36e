"""benchmarks.chunked_layer's flags: a bad size stops before any compute, naming the flag."""

import pytest

from benchmarks import chunked_layer


@pytest.mark.parametrize(
    "args, message",
    [
        (["--length=0"], "--length must be an int >= 1; got 0"),
        (["--chunk=64", "--length=64"], "--chunk must be below --length"),
    ],
)
def test_chunked_layer_bench_refuses_bad_sizes_before_compute(args, message, capsys):
  assert chunked_layer.main(args) == 2
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert line.startswith(message), line
