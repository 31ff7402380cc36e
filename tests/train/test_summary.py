"""The trainer's last line: validation (and test) metric beside the majority-class baseline,
tokens/s and where the run's outputs are."""

from __future__ import annotations

import json
import types

import numpy as np

from fastpos.tasks.base import ArraySource
from fastpos.tasks.info import TaskInfo
from fastpos.train.metrics import MetricWriter
from fastpos.train.trainer import summary_line

NONE = {"positional": "none", "changes": []}  # the run's model.positional, its change record


def _src(targets):
  targets = np.asarray(targets)
  return ArraySource({"inputs": np.ones((len(targets), 4)), "targets": targets})


def test_summary_line(tmp_path):
  task = types.SimpleNamespace(task_name="listops", metric="accuracy", has_split=lambda s: True)
  info = TaskInfo(kind="classify", vocab_size=20, num_classes=10, max_length=4)
  result = {
      "step": 100,
      "validation": {"accuracy": 0.375, "loss": 1.0},
      "best": {"step": 50, "accuracy": 0.4},
      "tokens_per_second": 2000.0,  # the metric writer's running mean
  }
  # training's majority is 3 (3 of 5); it is 1 of 4 validation examples
  line = summary_line(
      tmp_path, task, info, result, _src([3, 3, 3, 1, 2]), _src([3, 1, 1, 2]), **NONE
  )
  assert line.startswith(
      "listops: step 100; validation accuracy 37.50% (best 40.00% at step "
      "50); majority-class baseline 25.00% (always 3); 2,000 tokens/s; "
      f"workdir {tmp_path}: metrics.jsonl"
  )
  assert "test accuracy" not in line and "plot_positional.py" not in line  # no results_test
  assert f"; test: python eval.py --workdir={tmp_path} --split=test" in line
  for positional, plots in (
      ("absolute+fastrpb", True),
      ("rope", False),
      ("lrpe", True),
      ("none", False),
  ):
    line = summary_line(
        tmp_path, task, info, result, _src([3]), _src([3]), positional=positional, changes=[]
    )
    assert (f"plots: python scripts/plot_positional.py {tmp_path}" in line) == plots, positional
  (tmp_path / "results_test.json").write_text(json.dumps({"accuracy": 0.41, "step": 50}))
  assert "; test accuracy 41.00% (step 50);" in summary_line(
      tmp_path, task, info, result, _src([3]), _src([3]), **NONE
  )


def test_no_test_command_without_a_test_split(tmp_path):
  """A text task holding out no test split (test_fraction=0) is not offered eval --split=test."""
  from fastpos import tasks

  cfg = tasks.task_config("text_lm")
  cfg.update(paths=str(tmp_path), test_fraction=0.0)
  task = tasks.make_task(cfg)
  assert task.has_split("validation") and not task.has_split("test")
  info = TaskInfo(kind="lm", vocab_size=257, num_classes=0, max_length=4)
  result = {"step": 10, "validation": {"loss": 2.0}}
  line = summary_line(tmp_path, task, info, result, None, None, **NONE)
  assert line.startswith("text_lm: step 10; validation loss 2; workdir") and "eval.py" not in line
  cfg.test_fraction = 0.1
  assert f"test: python eval.py --workdir={tmp_path} --split=test" in summary_line(
      tmp_path, tasks.make_task(cfg), info, result, None, None, **NONE
  )


def test_the_plotted_schemes_are_plot_positional_s():
  from fastpos.plots import positional
  from fastpos.train.trainer import PLOTTED_SCHEMES

  assert PLOTTED_SCHEMES == positional.SCHEMES


def test_the_writer_keeps_the_mean_tokens_per_second_across_a_resume(tmp_path):
  """The summary's tokens/s is the writer's running mean: it counts the training rows the
  stopped run wrote up to the resumed step, never those after it."""
  rows = [
      {"step": 50, "split": "train", "tokens_per_second": 1000.0},
      {"step": 100, "split": "train", "tokens_per_second": 3000.0},
      {"step": 100, "split": "validation", "accuracy": 0.5},
      {"step": 150, "split": "train", "tokens_per_second": 9000.0},  # after the checkpoint
  ]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  writer = MetricWriter(tmp_path, 200, resume_step=100)
  try:
    assert writer.mean_tokens_per_second() == 2000.0
    writer.write(150, "train", {"loss": 1.0}, tokens_per_second=5000.0)
    writer.write(150, "validation", {"loss": 1.0})
    assert writer.mean_tokens_per_second() == 3000.0
  finally:
    writer.close()
  (tmp_path / "new").mkdir()
  fresh = MetricWriter(tmp_path / "new", 10)
  assert fresh.mean_tokens_per_second() is None
  fresh.close()


def test_the_line_reads_the_changes_it_is_handed_not_the_disk(tmp_path):
  """The config changes come from the trainer's record (what it read and appended), and the
  plotted schemes from the run's config: the line does not read config.json or
  config_changes.jsonl."""
  task = types.SimpleNamespace(task_name="listops", metric="accuracy", has_split=lambda s: False)
  info = TaskInfo(kind="lm", vocab_size=20, num_classes=0, max_length=4)
  result = {"step": 7, "validation": {"accuracy": 0.5}}
  change = {"field": "seed", "old": 0, "new": 1, "affects_results": True}
  entries = [{"step": 4, "checkpoint": 3, "changes": [change]}]
  (tmp_path / "config_changes.jsonl").write_text("not json\n")  # never read
  (tmp_path / "config.json").write_text("not json")
  line = summary_line(
      tmp_path, task, info, result, None, None, positional="fastrpb", changes=entries
  )
  assert "config changed at step 4: seed 0 -> 1 (config_changes.jsonl)" in line
  assert f"plots: python scripts/plot_positional.py {tmp_path}" in line
  assert "config changed" not in summary_line(
      tmp_path, task, info, result, None, None, positional="rope", changes=[]
  )
