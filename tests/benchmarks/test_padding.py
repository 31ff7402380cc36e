"""benchmarks.padding: its variable-length LM examples, one per line."""

from __future__ import annotations

import numpy as np

from benchmarks.padding import _line_source


def test_line_examples_of_the_packing_benchmark():
  """``benchmarks.padding``'s variable-length LM examples: each line (with its newline) is
  one next-token example; a line longer than the row is cut into pieces of row + 1 tokens."""
  nl = 11
  stream = np.array([5, 6, nl, 7, nl, 1, 2, 3, 4, 5, 6, nl, nl], np.int32)
  src = _line_source(stream, 4, nl)
  np.testing.assert_array_equal(
      src.arrays["inputs"], [[5, 6, 0, 0], [7, 0, 0, 0], [1, 2, 3, 4], [6, 0, 0, 0]]
  )
  np.testing.assert_array_equal(
      src.arrays["targets"], [[6, nl, 0, 0], [nl, 0, 0, 0], [2, 3, 4, 5], [nl, 0, 0, 0]]
  )
  np.testing.assert_array_equal(src.arrays["mask"], src.arrays["inputs"] != 0)
