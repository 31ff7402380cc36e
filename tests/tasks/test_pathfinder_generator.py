"""The Pathfinder generator: deterministic, balanced, the pathfinder task's examples, and the
original generator's statistics (tests/testdata/pathfinder_reference/, made by the original's
own code: see its README.md)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from configs import pathfinder_generated
from fastpos import tasks
from fastpos.tasks import base, pathfinder, pathfinder_stats
from fastpos.tasks import pathfinder_generator as pg
from fastpos.train import cli, train_and_evaluate

ROOT = Path(__file__).resolve().parents[2]

REFERENCE = ROOT / "tests" / "testdata" / "pathfinder_reference"


def test_bad_settings_name_the_valid_choices():
  with pytest.raises(ValueError, match=r"resolution 128 .*valid choices: 32, 64"):
    pg.settings(128, "hard")
  with pytest.raises(ValueError, match=r"difficulty 'medium'.*easy, intermediate, hard"):
    pg.generate(4, difficulty="medium")
  with pytest.raises(ValueError, match=r"unknown difficulty='x'; valid: easy, .*curv_baseline"):
    pathfinder_generated.get_config("difficulty=x")
  with pytest.raises(ValueError, match=r"unknown resolution=128; valid: 32, 64"):
    pathfinder_generated.get_config("resolution=128")
  cfg = tasks.task_config("pathfinder_generated")
  cfg.resolution = 48
  with pytest.raises(ValueError, match="valid choices: 32, 64"):
    tasks.task_info(cfg)
  with pytest.raises(ValueError, match="num_examples"):
    pg.generate(-1)


def test_lra_folder_names_select_the_difficulty():
  assert pathfinder_generated.get_config("difficulty=curv_contour_length_9").task.difficulty == (
      "intermediate"
  )


def test_same_seed_same_images_other_seed_other_images(monkeypatch):
  monkeypatch.setattr(pg, "CHUNK", 16)  # three chunks: each its own stream
  a = pg.generate(40, difficulty="easy", seed=3)
  b = pg.generate(40, difficulty="easy", seed=3)
  c = pg.generate(40, difficulty="easy", seed=4)
  assert a["images"].shape == (40, 32, 32) and a["images"].dtype == np.uint8
  assert a["labels"].dtype == np.uint8 and set(np.unique(a["labels"])) <= {0, 1}
  assert a["num_distractors"].shape == (40,)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert (a["images"] != c["images"]).any((1, 2)).all()  # every image differs
  assert (a["images"][:16] != a["images"][16:32]).any((1, 2)).all()  # chunks differ
  # byte-scaled like the original: background 0, brightest pixel 255
  assert (a["images"].min((1, 2)) == 0).all() and (a["images"].max((1, 2)) == 255).all()


def test_worker_processes_give_the_same_images(monkeypatch):
  monkeypatch.setattr(pg, "CHUNK", 8)
  one = pg.generate(20, difficulty="easy", seed=5)
  two = pg.generate(20, difficulty="easy", seed=5, num_workers=2)
  for k in one:
    np.testing.assert_array_equal(one[k], two[k])


def test_labels_are_balanced():
  labels = pg.generate(600, difficulty="easy", seed=11)["labels"]
  assert abs(labels.mean() - 0.5) < 0.065  # 3 standard deviations of a fair coin's mean


def test_64_pixel_images():
  out = pg.generate(6, resolution=64, difficulty="easy", seed=0)
  assert out["images"].shape == (6, 64, 64) and out["images"].dtype == np.uint8
  assert (out["images"].max((1, 2)) == 255).all()


def test_task_gives_pathfinders_examples_from_disjoint_streams(tmp_path):
  cfg = tasks.task_config("pathfinder_generated")
  cfg.update(difficulty="easy", num_train=12, num_validation=6, num_test=6, cache_dir=str(tmp_path))
  task = tasks.make_task(cfg)
  assert task.generated
  assert task.info == pathfinder.task_info(32) and task.info.grid == (32, 32)
  train = task.source("train").arrays
  want = pg.generate(12, difficulty="easy", seed=base.split_seed(0, "train"))
  expected = pathfinder.examples(want["images"], want["labels"])
  for k in ("inputs", "mask", "targets"):
    np.testing.assert_array_equal(train[k], expected[k])
  assert train["inputs"].shape == (12, 1024) and train["inputs"].min() >= 1
  val = task.source("validation").arrays["inputs"]
  assert not (train["inputs"][:, None, :] == val[None, :, :]).all(-1).any()
  files = sorted(os.listdir(tmp_path))
  assert len(files) == 2 and all(f.startswith("pathfinder_generated_v") for f in files)
  stamp = [os.stat(tmp_path / f).st_mtime_ns for f in files]
  again = tasks.make_task(cfg).source("train").arrays  # read from the cache
  np.testing.assert_array_equal(again["inputs"], train["inputs"])
  assert [os.stat(tmp_path / f).st_mtime_ns for f in files] == stamp


def test_components_counts_8_connected_blobs():
  img = np.zeros((1, 6, 6), bool)
  img[0, 0, 0] = img[0, 1, 1] = True  # diagonal: one component
  img[0, 4, 0:3] = True
  img[0, 0, 5] = img[0, 5, 5] = True
  assert pathfinder_stats.components(img).tolist() == [4]


ALPHA = 0.01
SCALARS = ("lit", "bright", "mean", "dashes", "distractors")


def _p_values(setting: pg.Settings, seed: int) -> dict[str, float]:
  ref = pathfinder_stats.load(str(REFERENCE / "ref32_intermediate_stats.npz"))
  out = pg.generate(400, setting=setting, seed=seed)
  ours = pathfinder_stats.statistics(out["images"], out["labels"], out["num_distractors"])
  return {k: pathfinder_stats.ks_2samp(ref[k], ours[k])[1] for k in SCALARS}


def test_statistics_match_the_original_generator():
  """400 images of the original (curv_contour_length_9, 32 x 32) against 400 of ours: no KS
  test rejects at ALPHA / 5 (Bonferroni over the five statistics)."""
  p = _p_values(pg.settings(32, "intermediate"), seed=0)
  assert min(p.values()) > ALPHA / len(SCALARS), p


def test_a_wrong_contour_length_is_rejected():
  """The same test tells the original's curv_contour_length_9 from ours at contour length 6."""
  wrong = dataclasses.replace(pg.settings(32, "intermediate"), contour_length=6)
  p = _p_values(wrong, seed=0)
  assert p["lit"] < ALPHA / len(SCALARS) and p["bright"] < ALPHA / len(SCALARS), p


# Slow (a training run); the default run keeps a tiny run end to end (tests/train/test_exits.py)
# and this task's batches (the tests above).
@pytest.mark.slow
def test_tiny_config_trains_two_steps(tmp_path, monkeypatch):
  monkeypatch.setenv("FASTPOS_DATA_DIR", str(tmp_path / "no_data"))
  cfg = cli.load_config(
      f"{ROOT / 'configs' / 'pathfinder_generated.py'}:tiny",
      [
          ("num_train_steps", "2"),
          ("log_every_steps", "1"),
          ("eval_every_steps", "2"),
          ("checkpoint_every_steps", "2"),
          ("task.cache_dir", str(tmp_path / "cache")),
      ],
  )
  r = train_and_evaluate(cfg, tmp_path / "work")
  assert r["step"] == 2 and np.isfinite(r["validation"]["loss"])
