"""A linear-attention language model trains on packed rows: the WikiText-103 Linear
Transformer row (ELU+1, sinusoidal absolute positions) with ``config.data.pack`` on the
repository's fixtures."""

from __future__ import annotations

import numpy as np
import pytest

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


# Slow (a training run); the default run keeps packing against each segment alone
# (tests/ops/test_segments.py).
@pytest.mark.slow
def test_wikitext_linear_lm_trains_packed(tmp_path):
  c = _config(tmp_path)
  run = run_lib.build_run(c, str(tmp_path / "probe"))
  batch = next(data_lib.train_iterator(run.task.source("train"), run.cfg))
  assert {"segment_ids", "positions"} <= set(batch)  # the stream is packed
  np.testing.assert_array_equal(batch["mask"], batch["segment_ids"] > 0)
  r = train_and_evaluate(c, tmp_path / "work")
  assert r["step"] == 3
  assert np.isfinite(r["train"]["loss"]) and np.isfinite(r["validation"]["loss"])
