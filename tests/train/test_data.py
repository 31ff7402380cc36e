"""The grain pipelines: exact position restore, epochs, padded evaluation batches."""

from __future__ import annotations

import numpy as np

from fastpos import tasks
from fastpos.train import data
from tests.train.common import tiny_config


def _source(split):
  cfg = tiny_config()
  return cfg, tasks.make_task(cfg.task).source(split)


def test_train_iterator_restores_its_position_and_reshuffles_each_epoch():
  cfg, src = _source("train")  # 12 examples, batches of 4: 3 batches per epoch
  it = data.train_iterator(src, cfg)
  batches = [next(it) for _ in range(2)]
  state = it.get_state()
  rest = [next(it) for _ in range(4)]
  again = data.train_iterator(src, cfg)
  again.set_state(state)
  for a, b in zip(rest, [next(again) for _ in range(4)]):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  epochs = [batches + rest[:1], rest[1:4]]
  rows = {tuple(r) for r in src.arrays["inputs"]}
  orders = []
  for epoch in epochs:
    seen = [tuple(r) for b in epoch for r in b["inputs"]]
    assert sorted(seen) == sorted(rows)  # each example once per epoch
    orders.append(seen)
  assert orders[0] != orders[1]  # a fresh order each epoch
  assert all(np.all(b["weight"] == 1.0) and b["inputs"].shape == (4, 12) for b in batches)
  fresh = data.train_iterator(src, cfg)
  np.testing.assert_array_equal(next(fresh)["inputs"], batches[0]["inputs"])  # seeded


def test_eval_iterator_pads_the_last_batch_with_weight_zero():
  cfg, src = _source("test")  # 13 examples, batches of 4
  batches = list(data.eval_iterator(src, cfg))
  assert len(batches) == 4
  weights = np.concatenate([b["weight"] for b in batches])
  np.testing.assert_array_equal(weights, [1.0] * 13 + [0.0] * 3)
  inputs = np.concatenate([b["inputs"] for b in batches])
  np.testing.assert_array_equal(inputs[:13], src.arrays["inputs"])
  assert np.all(inputs[13:].sum(1) > 0)  # padding rows are real examples (never all-pad)
  assert len(list(data.eval_iterator(src, cfg, limit=2))) == 2
