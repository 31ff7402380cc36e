"""Sequence packing in the input pipeline: every example once per window, segments and
in-segment positions right, exact restore, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from fastpos.models import TaskInfo, build_model, model_config
from fastpos.tasks.base import ArraySource
from fastpos.train import bucketing, data, packing
from tests.train.common import tiny_config
from tests.train.test_packing_classify import check_stream

N = 16


def _lm_source(n=24, seed=0):
  rng = np.random.default_rng(seed)
  inputs = np.zeros((n, N), np.int32)
  for i, length in enumerate(rng.integers(2, N + 1, n)):
    inputs[i, :length] = rng.integers(1, 9, length)
  targets = np.roll(inputs, -1, axis=1)
  return ArraySource({"inputs": inputs, "mask": inputs != 0, "targets": targets})


def _cfg(**overrides):
  return tiny_config(**{"data.pack": True, "data.bucket_window": 2, **overrides})


def test_pack_rows_first_fit_decreasing():
  lengths = np.array([9, 3, 7, 5, 16, 1, 4])
  rows = packing.pack_rows(lengths, 16)
  assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
  assert all(lengths[r].sum() <= 16 for r in rows)
  assert rows == [[4], [0, 2], [3, 6, 1, 5]]


def test_packed_batches_hold_each_example_once_and_restore():
  src = _lm_source()
  cfg = _cfg()  # windows of 2 * 4 = 8 examples
  sizes = bucketing.example_lengths(src)
  it = data.train_iterator(src, cfg)
  first = [next(it) for _ in range(3)]
  state = it.get_state()
  rest = [next(it) for _ in range(4)]
  again = data.train_iterator(src, cfg)
  again.set_state(state)
  for a, b in zip(rest, [next(again) for _ in range(4)]):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])

  def segments_of(batch):
    out = []
    for r in np.flatnonzero(batch["weight"]):
      ids, pos = batch["segment_ids"][r], batch["positions"][r]
      assert np.all(batch["mask"][r] == (ids > 0))
      for s in range(1, ids.max() + 1):
        where = np.flatnonzero(ids == s)
        assert np.all(np.diff(where) == 1)  # contiguous
        np.testing.assert_array_equal(pos[where], np.arange(len(where)))
        tokens = batch["inputs"][r, where]
        i = next(
            i
            for i in range(len(src))
            if sizes[i] == len(where)
            and np.array_equal(src.arrays["inputs"][i, : len(where)], tokens)
        )
        np.testing.assert_array_equal(
            batch["targets"][r, where], src.arrays["targets"][i, : len(where)]
        )
        out.append(i)
    return out

  seen, fresh = [], data.train_iterator(src, cfg)
  for _ in range(30):
    batch = next(fresh)
    assert batch["inputs"].shape == (4, N) and batch["weight"].all()  # no filler rows
    seen += segments_of(batch)
  check_stream(seen, cfg, len(src), carry=3 * 8)  # at most 3 rows of <= 8 examples
  real = sum(int((b["mask"] * b["weight"][:, None]).sum()) for b in first + rest)
  slots = sum(int(b["weight"].sum()) * N for b in first + rest)
  plain = sizes.sum() / (len(src) * N)
  assert real / slots > plain  # fewer padding slots than one example per row


def test_packing_refusals():
  cfg = _cfg()
  lm = TaskInfo("lm", 16, 0, N)

  def model(kernel, scheme, **kw):
    c = model_config()
    c.update(
        kernel=kernel, positional=scheme, num_layers=1, embed_dim=16, num_heads=2, mlp_dim=16, **kw
    )
    return build_model(c, lm)

  packing.check_config(cfg, "lm", N, model("softmax", "absolute"))
  packing.check_config(cfg, "lm", N, model("elu1", "absolute"))  # linear kernels pack too
  with pytest.raises(ValueError, match="kernel 'elu1', schemes kernelized_rpe.*with a linear"):
    packing.check_config(cfg, "lm", N, model("elu1", "kernelized_rpe"))
  with pytest.raises(ValueError, match="'retrieval' task: a retrieval example is two documents"):
    packing.check_config(cfg, "retrieval", N, model("softmax", "absolute"))
  with pytest.raises(ValueError, match="'vision' task: packing serves lm / classify tasks"):
    packing.check_config(cfg, "vision", N, model("softmax", "absolute"))
  with pytest.raises(ValueError, match="choose one"):
    packing.check_config(
        _cfg(**{"data.bucket_lengths": (8,)}), "lm", N, model("softmax", "absolute")
    )
