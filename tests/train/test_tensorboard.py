"""TensorBoard logs (tensorboardX) read back with TensorBoard's own EventAccumulator: the
scalars are metrics.jsonl's, each step once across resumes, and the config is written once."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from fastpos.train import evaluate, train_and_evaluate
from fastpos.train.tensorboard import EventWriter, read_scalars, read_text
from tests.train.common import tiny_config


def _jsonl_scalars(workdir):
  out = {}
  with open(workdir / "metrics.jsonl") as f:
    for line in f:
      row = json.loads(line)
      for key, value in row.items():
        if key not in ("step", "split", "time"):
          out[(row["step"], f"{row['split']}/{key}")] = value
  return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """4 steps; then the checkpoint of step 4 is lost and the run resumes from step 2 (steps 3
  and 4 are written twice); then the test split is evaluated."""
  workdir = tmp_path_factory.mktemp("tensorboard") / "run"
  train_and_evaluate(tiny_config(), workdir)
  first = read_scalars(workdir / "tensorboard")
  shutil.rmtree(workdir / "checkpoints" / "4")
  train_and_evaluate(tiny_config(), workdir)
  test = evaluate(tiny_config(), workdir, "test", checkpoint="latest")
  return workdir, first, test


def test_scalars_equal_metrics_jsonl_across_a_resume(run):
  workdir, first, _ = run
  assert len(list((workdir / "tensorboard").glob("events.out.tfevents.*"))) == 3
  scalars = read_scalars(workdir / "tensorboard")
  steps = [(tag, step) for step, tag, _ in scalars]
  assert len(steps) == len(set(steps))  # steps 3 and 4 once each, the resumed run's
  jsonl = _jsonl_scalars(workdir)
  board = {(step, tag): value for step, tag, value in scalars if not tag.startswith("test/")}
  assert board.keys() == jsonl.keys()
  for key, value in jsonl.items():
    assert board[key] == np.float32(value), key
  train_steps = sorted(step for step, tag in board if tag == "train/loss")
  assert train_steps == [1, 2, 3, 4]
  for tag in ("train/steps_per_second", "train/tokens_per_second", "validation/accuracy"):
    assert any(t == tag for _, t in board)
  # The first run's own step-4 values were replaced (steps/s differs between the runs).
  first_rate = {s: v for s, t, v in first if t == "train/steps_per_second"}
  assert board[(4, "train/steps_per_second")] == np.float32(jsonl[(4, "train/steps_per_second")])
  assert set(first_rate) == {1, 2, 3, 4}


def test_test_metrics_at_the_checkpoint_step(run):
  workdir, _, test = run
  scalars = {(step, tag): value for step, tag, value in read_scalars(workdir / "tensorboard")}
  assert scalars[(test["step"], "test/accuracy")] == np.float32(test["accuracy"])
  assert scalars[(test["step"], "test/loss")] == np.float32(test["loss"])


def test_config_and_hparams_written_once(run):
  workdir, _, _ = run
  ((step, text),) = read_text(workdir / "tensorboard")  # the resumed run did not add one
  assert step == 0
  assert json.loads(text) == json.loads((workdir / "config.json").read_text())
  from tensorboard.backend.event_processing import event_accumulator

  acc = event_accumulator.EventAccumulator(str(workdir / "tensorboard")).Reload()
  content = acc.PluginTagToContent("hparams")
  assert set(content) == {
      "_hparams_/experiment",
      "_hparams_/session_start_info",
      "_hparams_/session_end_info",
  }
  from tensorboard.plugins.hparams import plugin_data_pb2

  start = plugin_data_pb2.HParamsPluginData.FromString(
      content["_hparams_/session_start_info"]
  ).session_start_info.hparams
  assert "model.num_layers" in start and "optimizer.learning_rate" in start
  assert {k.split(".")[0] for k in start} == {"model", "optimizer", "task"}  # no cadence etc.
  assert start["model.num_layers"].number_value == json.loads(text)["model"]["num_layers"]


def test_an_evaluation_run_again_keeps_one_point_per_step(tmp_path):
  logdir = tmp_path / "tb"
  for value in (0.5, 0.25, 0.125):  # eval.py three times on the same checkpoint
    writer = EventWriter(logdir, replaces="test-4")
    writer.scalars(4, {"test/loss": value})
    writer.close()
  other = EventWriter(logdir, replaces="test-8")
  other.scalars(8, {"test/loss": 1.0})
  other.close()
  assert read_scalars(logdir) == [(4, "test/loss", 0.125), (8, "test/loss", 1.0)]
  with pytest.raises(ValueError, match="replaces='a/b' must be"):
    EventWriter(logdir, replaces="a/b")


def test_a_run_from_scratch_over_old_files_purges_them(tmp_path):
  logdir = tmp_path / "tb"
  old = EventWriter(logdir, resume_step=0)
  old.config({"a": 1}, "old", ["validation/loss"])
  old.scalars(1, {"train/loss": 5.0})
  old.close()
  new = EventWriter(logdir, resume_step=0)
  new.config({"a": 2}, "new", ["validation/loss"])
  new.scalars(1, {"train/loss": 3.0})
  new.close()
  assert read_scalars(logdir) == [(1, "train/loss", 3.0)]
  assert read_text(logdir) == [(0, "new")]
  with pytest.raises(FileNotFoundError, match="no TensorBoard event files"):
    read_scalars(tmp_path / "missing")
