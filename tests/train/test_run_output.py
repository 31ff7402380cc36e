"""What a user sees while a run goes: compile messages, tokens/s, the workdir's train.log."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest
from absl import logging

from fastpos.train import train_and_evaluate
from fastpos.train.steps import real_tokens
from fastpos.train.tensorboard import read_scalars
from tests.train.common import tiny_config


def test_real_tokens_counts_masked_tokens_of_real_examples():
  batch = {
      "weight": jnp.array([1.0, 1.0, 0.0]),  # the third example is padding
      "mask": jnp.array([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], bool),
      "mask2": jnp.array([[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], bool),
  }
  assert float(real_tokens(batch)) == 2 + 3 + 1 + 4
  del batch["mask2"]
  assert float(real_tokens(batch)) == 5


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
  """A 2-step run resumed to 4 steps in the same workdir, logging at INFO as train.py does."""
  workdir = tmp_path_factory.mktemp("run_output") / "run"
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.INFO)
  try:
    train_and_evaluate(tiny_config(num_train_steps=2), workdir)
    first_log = (workdir / "train.log").read_text()
    train_and_evaluate(tiny_config(), workdir)
  finally:
    logging.set_verbosity(verbosity)
  return workdir, first_log


def test_train_log_says_compiling_and_is_appended_on_resume(resumed_run):
  workdir, first_log = resumed_run
  log = (workdir / "train.log").read_text()
  assert log.startswith(first_log)  # appended, not rewritten
  second = log[len(first_log) :]
  for part in (first_log, second):
    for name in ("train", "eval"):
      assert f"compiling the {name} step..." in part
      assert part.index(f"compiling the {name} step...") < part.index(
          f"compiled the {name} step in "
      )
    assert "tokens/s" in part
  assert "resumed from " in second and "resumed from " not in first_log
  assert "step 4/4 " in second


def test_tokens_per_second_in_metrics_and_tensorboard(resumed_run):
  workdir, _ = resumed_run
  with open(workdir / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  train = [r for r in rows if r["split"] == "train"]
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  cfg = tiny_config()
  for r in train:
    # Synthetic inputs are 6-12 real tokens long, padded to 12: the count is the unpadded one.
    assert 6 * cfg.batch_size <= r["tokens_per_step"] <= 12 * cfg.batch_size
    assert r["tokens_per_step"] == int(r["tokens_per_step"])
    assert r["tokens_per_second"] == pytest.approx(r["steps_per_second"] * r["tokens_per_step"])
  # The first step of each run starts the timer (it waited for compilation): 0 steps/s there.
  assert all(r["tokens_per_second"] > 0 for r in train if r["step"] in (2, 4))
  assert len({r["tokens_per_step"] for r in train}) > 1  # counted per batch, not a constant
  tags = {(step, tag) for step, tag, _ in read_scalars(workdir / "tensorboard")}
  for step in (1, 2, 3, 4):
    assert {
        (step, "train/tokens_per_second"),
        (step, "train/steps_per_second"),
        (step, "train/tokens_per_step"),
    } <= tags


def test_a_run_that_fails_its_checks_writes_no_log(tmp_path):
  workdir = tmp_path / "run"
  with pytest.raises(ValueError):
    train_and_evaluate(tiny_config(**{"model.kernel": "nope"}), workdir)
  assert not workdir.exists() or not any(workdir.iterdir())
