"""Sliding-window evaluation of WikiText-103 (``config.task.eval_stride``): every target is
scored once, with at least L - S tokens before it, and the trainer's perplexity reads
``score``."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from fastpos import tasks
from fastpos.tasks import wikitext as wt
from fastpos.tasks.paths import SAMPLES
from fastpos.train.steps import loss_and_metrics

ROOT = os.path.join(SAMPLES, "wikitext")


@pytest.mark.parametrize(
    "n,length,stride", [(2, 4, 2), (10, 4, 2), (11, 4, 1), (30, 8, 3), (9, 8, 8), (50, 16, 5)]
)
def test_windows_score_every_target_once_with_context(n, length, stride):
  stream = np.arange(100, 100 + n)
  w = wt.windows(stream, length, stride)
  starts = np.arange(len(w["inputs"]))[:, None] * stride
  pos = starts + np.arange(length)[None, :]
  scored = pos[w["score"]]
  np.testing.assert_array_equal(np.sort(scored), np.arange(n - 1))  # each target once
  np.testing.assert_array_equal(w["inputs"][w["mask"]], stream[pos[w["mask"]]])
  np.testing.assert_array_equal(w["targets"][w["mask"]], stream[pos[w["mask"]] + 1])
  context = np.broadcast_to(np.arange(length), pos.shape)[w["score"]]
  assert np.all((context >= length - stride) | (pos[w["score"]] < length))
  assert not np.any(w["score"] & ~w["mask"])
  if stride == length:  # the non-overlapping segments
    seg = wt.segments(stream, length)
    for key in ("inputs", "targets", "mask"):
      np.testing.assert_array_equal(w[key], seg[key])


def test_eval_splits_use_windows(tmp_path):
  c = tasks.task_config("wikitext103")
  c.update(data_dir=ROOT, cache_dir=str(tmp_path), segment_length=16, vocab_size=143, eval_stride=4)
  task = tasks.make_task(c)
  valid, train = task.load_split("validation"), task.load_split("train")
  assert "score" in valid and "score" not in train
  assert valid["score"].sum() == task.token_stream("validation").size - 1
  c.eval_stride = 17
  with pytest.raises(ValueError, match="eval_stride"):
    tasks.make_task(c).info  # noqa: B018


def test_loss_counts_scored_tokens_only():
  logits = jnp.zeros((1, 4, 5))
  batch = {
      "targets": jnp.zeros((1, 4), jnp.int32),
      "weight": jnp.ones(1),
      "mask": jnp.ones((1, 4), bool),
      "score": jnp.asarray([[False, False, True, True]]),
  }
  loss, metrics = loss_and_metrics(logits, batch, "lm")
  assert float(metrics["loss"][1]) == 2.0 and np.isclose(float(loss), 2 * np.log(5))
