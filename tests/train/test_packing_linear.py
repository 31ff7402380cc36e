"""A linear-attention language model trains on packed rows: the WikiText-103 Linear
Transformer row (ELU+1, sinusoidal absolute positions) with ``config.data.pack`` on the
repository's fixtures."""

from __future__ import annotations

import numpy as np

from configs import wikitext103_nprf_table2
from fastpos.train import data as data_lib
from fastpos.train import run as run_lib
from fastpos.train import train_and_evaluate


def _config(tmp_path):
  c = wikitext103_nprf_table2.get_config("model=linear,tiny=True")
  c.task.cache_dir = str(tmp_path / "cache")
  c.data.pack = True
  c.data.num_threads = 1
  c.update(num_train_steps=3, log_every_steps=1, eval_every_steps=3, checkpoint_every_steps=3)
  return c


def test_wikitext_linear_lm_trains_packed(tmp_path):
  c = _config(tmp_path)
  run = run_lib.build_run(c, str(tmp_path / "probe"))
  batch = next(data_lib.train_iterator(run.task.source("train"), run.cfg))
  assert {"segment_ids", "positions"} <= set(batch)  # the stream is packed
  np.testing.assert_array_equal(batch["mask"], batch["segment_ids"] > 0)
  r = train_and_evaluate(c, tmp_path / "work")
  assert r["step"] == 3
  assert np.isfinite(r["train"]["loss"]) and np.isfinite(r["validation"]["loss"])


def test_line_examples_of_the_packing_benchmark():
  """``fastpos.bench.padding``'s variable-length LM examples: each line (with its newline) is
  one next-token example; a line longer than the row is cut into pieces of row + 1 tokens."""
  from fastpos.bench.padding import _line_source

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
