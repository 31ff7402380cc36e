"""Length bucketing: batches cut to bucket lengths, exact restore, every example once, and no
example's output changed by the cut."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from fastpos import tasks
from fastpos.models import build_model
from fastpos.train import bucketing, data
from fastpos.train.steps import model_inputs
from fastpos.train.trainer import train_and_evaluate
from tests.helpers import rel_err
from tests.train.common import assert_trees_equal, tiny_config

BUCKETS = (7, 9)  # + max_length 12; the synthetic examples have 6..12 tokens


def _source(split, **overrides):
  cfg = tiny_config(**{"data.bucket_lengths": BUCKETS, "data.bucket_window": 3, **overrides})
  return cfg, tasks.make_task(cfg.task).source(split)


def _rows(batch):
  """Each row's real tokens, as a hashable tuple."""
  return [tuple(int(t) for t, m in zip(x, k) if m) for x, k in zip(batch["inputs"], batch["mask"])]


def _check_cut(batch, lengths):
  width = batch["inputs"].shape[1]
  longest = int(bucketing.example_lengths(tasks.base.ArraySource(batch)).max())
  assert width == bucketing.fit(longest, lengths)  # the shortest bucket that holds the batch
  assert batch["mask"].shape == batch["inputs"].shape


def test_train_batches_are_bucketed_restorable_and_cover_each_epoch():
  cfg, src = _source("train")  # 12 examples, batches of 4, windows of 3 batches = one epoch
  lengths = bucketing.bucket_lengths(cfg, 12)
  assert lengths == (7, 9, 12)
  it = data.train_iterator(src, cfg)
  first = [next(it) for _ in range(4)]
  state = it.get_state()
  rest = [next(it) for _ in range(5)]
  again = data.train_iterator(src, cfg)
  again.set_state(state)
  for a, b in zip(rest, [next(again) for _ in range(5)]):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  batches = first + rest
  widths = {b["inputs"].shape[1] for b in batches}
  assert len(widths) > 1 and widths <= set(lengths)
  for b in batches:
    _check_cut(b, lengths)
    assert np.all(b["weight"] == 1.0)
  everything = sorted(_rows({"inputs": src.arrays["inputs"], "mask": src.arrays["mask"]}))
  for epoch in (batches[0:3], batches[3:6], batches[6:9]):
    assert sorted(r for b in epoch for r in _rows(b)) == everything  # each example once
  fresh = data.train_iterator(src, cfg)
  np.testing.assert_array_equal(next(fresh)["inputs"], first[0]["inputs"])  # seeded
  other = data.train_iterator(
      src, tiny_config(**{"data.bucket_lengths": BUCKETS, "data.bucket_window": 3, "seed": 1})
  )
  assert _rows(next(other)) + _rows(next(other)) != _rows(first[0]) + _rows(first[1])


def test_slots_shrink():
  cfg, src = _source("train")
  plain = next(data.train_iterator(src, tiny_config()))["inputs"].size
  it = data.train_iterator(src, cfg)
  assert sum(next(it)["inputs"].size for _ in range(3)) < 3 * plain


@pytest.mark.parametrize("limit", [0, 2])
def test_eval_batches_score_each_example_once(limit):
  cfg, src = _source("test")  # 13 examples, batches of 4
  plain = list(data.eval_iterator(src, tiny_config(), limit))
  bucketed = list(data.eval_iterator(src, cfg, limit))
  assert len(bucketed) == len(plain) == (2 if limit else 4)
  lengths = bucketing.bucket_lengths(cfg, 12)
  for b in bucketed:
    _check_cut(b, lengths)

  def scored(batches):
    return sorted(r for b in batches for r, w in zip(_rows(b), b["weight"]) if w == 1.0)

  assert scored(bucketed) == scored(plain)
  assert sum(float(b["weight"].sum()) for b in bucketed) == (8 if limit else 13)
  assert all(np.all(b["mask"].sum(1) > 0) for b in bucketed)  # fillers are real examples


# Slow; the default run keeps padding invariance (tests/ops/test_masks.py).
@pytest.mark.slow
def test_bucketing_changes_no_example_output():
  """The main job's cell (SIKF, absolute + FastRPB, mean pooling), computed in float64: each
  example's logits from its bucketed batch equal its logits padded to max_length (the
  classifier head returns float32 logits: equal to float32 rounding)."""
  cfg, src = _source("test")
  mc = cfg.model
  mc.update(
      kernel="sikf",
      positional="absolute+fastrpb",
      dtype="float64",
      dropout_rate=0.0,
      norm="post",
      pooling="mean",
  )
  model = build_model(mc, tasks.make_task(cfg.task).info)
  full = {k: src.arrays[k] for k in ("inputs", "mask")}

  @jax.jit  # one compiled program, not the float64 model's initialisation op by op
  def random_variables(full):
    variables = model.init(jax.random.key(0), full)
    # Random, not initial, parameters: FastRPB's weights start at zero.
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(
        tree, [x + 0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    )

  variables = random_variables(full)
  apply = jax.jit(lambda b: model.apply(variables, b))
  reference = dict(zip(_rows(full), np.asarray(apply(full))))
  worst, widths = 0.0, set()
  for b in data.eval_iterator(src, cfg):
    widths.add(b["inputs"].shape[1])
    out = np.asarray(apply(model_inputs(b)))
    for row, logits in zip(_rows(b), out):
      worst = max(worst, rel_err(logits, reference[row]))
  print(f"worst relative error, bucketed vs padded: {worst:.2e}")
  assert worst < 1e-9, worst
  assert min(widths) < 12  # some batches were cut


@pytest.mark.parametrize(
    "override, match",
    [
        ({"data.bucket_lengths": (9, 7)}, "strictly increasing"),
        ({"data.bucket_lengths": (0, 7)}, r"must lie in \[1, task.max_length=12\]"),
        ({"data.bucket_lengths": (7, 13)}, r"must lie in \[1, task.max_length=12\]"),
        ({"data.bucket_lengths": (7.5,)}, "must be integers"),
        ({"data.bucket_lengths": (7,), "data.bucket_window": 0}, "bucket_window=0 must be"),
    ],
)
def test_bad_bucket_config_stops_with_one_message(override, match):
  with pytest.raises(ValueError, match=match):
    bucketing.bucket_lengths(tiny_config(**override), 12)


def test_bucketing_refused_where_it_does_not_apply():
  cfg = tiny_config(**{"data.bucket_lengths": (7,)})
  with pytest.raises(ValueError, match="'lm' task; bucketing serves variable-length"):
    bucketing.check_config(cfg, "lm", 12, None)
  with pytest.raises(ValueError, match="an image task"):
    bucketing.check_config(cfg, "classify", 12, (3, 4))
  with pytest.raises(ValueError, match=r"mesh.seq=2 must divide every bucket length; \[7\]"):
    bucketing.check_config(cfg, "classify", 12, None, seq_devices=2)
  bucketing.check_config(tiny_config(), "lm", 12, None)  # off: nothing to refuse


@pytest.mark.slow  # three trainer runs, each compiling a step per bucket length (~1 min)
def test_bucketed_resume_is_bitwise_exact(tmp_path):
  """4 steps in one go = 2 steps, then resumed to 4 (the iterator's position restored)."""
  over = {"data.bucket_lengths": BUCKETS, "data.bucket_window": 3, "eval_every_steps": 4}
  full = train_and_evaluate(tiny_config(**over), tmp_path / "full")
  train_and_evaluate(tiny_config(num_train_steps=2, **over), tmp_path / "split")
  second = train_and_evaluate(tiny_config(**over), tmp_path / "split")
  assert_trees_equal(full["state"], second["state"])
  assert full["validation"] == second["validation"]
