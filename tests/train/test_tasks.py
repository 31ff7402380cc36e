"""Tasks: the registry, the generated "majority" task, the ListOps wrapper, ArraySource checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fastpos import tasks
from fastpos.tasks import listops
from fastpos.tasks.base import ArraySource
from fastpos.tasks.info import TaskInfo
from fastpos.tasks.paths import SAMPLES
from fastpos.tasks.synthetic import generate
from fastpos.train import train_and_evaluate
from tests.train.common import tiny_config


def _synthetic(**kw):
  cfg = tasks.task_config("synthetic")
  cfg.update(num_train=50, num_validation=20, num_test=20, **kw)
  return tasks.make_task(cfg)


def test_synthetic_is_deterministic_and_splits_differ():
  a, b = _synthetic(), _synthetic()
  for split in tasks.SPLITS:
    for key in ("inputs", "targets", "mask"):
      np.testing.assert_array_equal(a.source(split).arrays[key], b.source(split).arrays[key])
  assert not np.array_equal(
      a.source("validation").arrays["inputs"], a.source("test").arrays["inputs"]
  )
  c = _synthetic(seed=1)
  assert not np.array_equal(a.source("train").arrays["inputs"], c.source("train").arrays["inputs"])


def test_synthetic_labels_are_strict_majorities():
  data = generate(300, vocab_size=10, num_classes=3, min_length=1, max_length=9, seed=5)
  x, y = data["inputs"], data["targets"]
  assert x.shape == (300, 9) and x.dtype == np.int32 and y.dtype == np.int32
  lengths = (x != 0).sum(1)
  assert lengths.min() >= 1 and lengths.max() <= 9
  np.testing.assert_array_equal(data["mask"], x != 0)
  for row, label in zip(x, y):
    assert np.all(row[: (row != 0).sum()] != 0) and np.all(row[(row != 0).sum() :] == 0)
    counts = np.bincount(row, minlength=10)[1:4]
    assert counts[label] > np.delete(counts, label).max()
  assert set(np.unique(y)) == {0, 1, 2}


def test_source_gives_one_example():
  task = _synthetic()
  src = task.source("test")
  ex = src[3]
  assert set(ex) == {"inputs", "targets", "mask"}
  assert ex["inputs"].shape == (task.info.max_length,) and ex["targets"].shape == ()
  assert len(src) == 20 and task.info.kind == "classify" and task.info.num_classes == 4


def test_registry_errors():
  with pytest.raises(ValueError, match=r"unknown task 'cifar'; valid tasks: synthetic, listops"):
    tasks.task_config("cifar")
  assert tasks.task_info(tasks.task_config("lra_text")).num_classes == 2  # no data read
  cfg = tasks.task_config("synthetic")
  cfg.num_trian = 5  # a typo must not be ignored
  with pytest.raises(ValueError, match=r"unknown field\(s\) \['num_trian'\]"):
    tasks.make_task(cfg)
  with pytest.raises(ValueError, match="unknown split 'dev'"):
    _synthetic().source("dev")


def test_array_source_checks():
  with pytest.raises(ValueError, match="different lengths"):
    ArraySource({"inputs": np.ones((3, 4)), "targets": np.ones(2)})
  task = _synthetic()

  class Broken(type(task)):

    def load_split(self, split):
      return {"inputs": np.ones((2, 32), np.int32), "targets": np.array([0, 9])}

  with pytest.raises(ValueError, match=r"targets outside \[0, 4\)"):
    Broken(task.cfg).source("train")


def _listops_cfg(**kw):
  cfg = tasks.task_config("listops")
  cfg.update(
      {
          "min_length": 10,
          "max_length": 40,
          "num_train": 30,
          "num_validation": 8,
          "num_test": 8,
          **kw,
      }
  )
  return cfg


def test_listops_task_wraps_the_generator():
  task = tasks.make_task(_listops_cfg())
  assert task.info == TaskInfo("classify", len(listops.VOCAB), 10, 40)
  src = task.source("validation")
  x, y = src.arrays["inputs"], src.arrays["targets"]
  assert x.shape == (8, 40) and x.dtype == np.int32 and y.shape == (8,)
  np.testing.assert_array_equal(src.arrays["mask"], x != 0)
  for row, label in zip(x, y):  # the labels are the values of the expressions
    assert listops.evaluate(listops.decode(row[row != 0])) == label
  again = tasks.make_task(_listops_cfg()).source("validation").arrays["inputs"]
  np.testing.assert_array_equal(again, x)


def test_missing_listops_files_stop_before_training(tmp_path):
  cfg = tiny_config()
  cfg.task = _listops_cfg(source="tsv", data_dir=str(tmp_path / "lra_release" / "listops"))
  with pytest.raises(FileNotFoundError, match=r"basic_train\.tsv"):
    train_and_evaluate(cfg, tmp_path / "workdir")
  assert not list((tmp_path / "workdir").glob("checkpoints/*"))


def test_listops_task_reads_the_release_files():
  data_dir = Path(SAMPLES) / "listops"
  for parens in (False, True):
    task = tasks.make_task(
        _listops_cfg(
            source="tsv", data_dir=str(data_dir), max_length=64, parens=parens, num_train=0
        )
    )
    src = task.source("train")
    x, y = src.arrays["inputs"], src.arrays["targets"]
    has_parens = np.isin(x, [listops.VOCAB.index("("), listops.VOCAB.index(")")]).any()
    assert has_parens == parens and len(src) > 0
    for row, label in zip(x, y):
      row = row[row != 0]
      if len(row) < 64:  # not truncated: the label is the expression's value
        assert listops.evaluate(listops.decode(row)) == label
