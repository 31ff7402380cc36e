"""LRA Pathfinder: metadata reader, LRA's split order, PNG decoding, cache, errors, and a
2-step run with a 2D positional scheme on fixture images.

The fixtures are written here into tmp_path in the release's layout
(``lra_release/pathfinder32/curv_contour_length_14/{metadata/<k>.npy, imgs/<i>/sample_<j>.png}``,
metadata as text lines ``imgs/<i> sample_<j>.png <j> <label> ...``). Pixel (0, 0) of fixture
image number ``g`` is ``g`` and pixel (0, 1) is ``100 * label``, so that every decoded row can
be traced back to its file. LRA's order is recomputed with tfds' own hashing code
(``tensorflow_datasets.core.hashing``) and slicing rounding.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from PIL import Image
from tensorflow_datasets.core import hashing as tfds_hashing
from tensorflow_datasets.core import splits as tfds_splits

from fastpos import tasks
from fastpos.tasks import pathfinder as pf
from fastpos.train import train_and_evaluate
from fastpos.train.config import base_config

RES = 32
FILES = {0: 11, 1: 10}  # metadata file -> lines: 21 examples
EMPTY = 13  # this example's PNG is an empty file (as in the release), dropped after slicing


def _label(g: int) -> int:
  return (g * 7 + 1) % 3 % 2


def _image(g: int) -> np.ndarray:
  rng = np.random.default_rng(g)
  img = rng.integers(0, 256, (RES, RES), dtype=np.uint8)
  img[0, 0], img[0, 1] = g, 100 * _label(g)
  return img


def make_release(root, difficulty: str = "hard", files=None) -> list[dict]:
  """Writes the fixture dataset; returns one dict per metadata line, in file order."""
  files = FILES if files is None else files
  folder = os.path.join(root, "lra_release", f"pathfinder{RES}", pf.DIFFICULTIES[difficulty])
  os.makedirs(os.path.join(folder, "metadata"), exist_ok=True)
  out, g = [], 0
  for k, count in files.items():
    lines = []
    for line_no in range(1, count + 1):
      sub, name = f"imgs/{k}", f"sample_{line_no - 1}.png"
      os.makedirs(os.path.join(folder, sub), exist_ok=True)
      path = os.path.join(folder, sub, name)
      if g == EMPTY:
        open(path, "wb").close()
      else:
        Image.fromarray(_image(g), mode="L").save(path)
      lines.append(f"{sub} {name} {line_no - 1} {_label(g)} 14 2 1.5\n")
      out.append({"g": g, "key": f"{sub}_{name}_{line_no}", "label": _label(g)})
      g += 1
    with open(os.path.join(folder, "metadata", f"{k}.npy"), "w") as f:
      f.write("".join(lines))
  return out


@pytest.fixture
def root(tmp_path):
  root = str(tmp_path / "data")
  make_release(root)
  return root


def _cfg(root, **kw):
  cfg = tasks.task_config("pathfinder")
  cfg.update({"data_dir": root, "num_threads": 2, **kw})
  return cfg


def _expected_lra(examples, salt="hard"):
  """Split -> fixture numbers, from tfds' code: md5-salted key order, "closest" bounds."""
  hasher = tfds_hashing.Hasher(salt)
  order = sorted(examples, key=lambda e: hasher.hash_key(e["key"]))
  n = len(order)
  bounds = {"train": (0, 80), "validation": (80, 90), "test": (90, 100)}
  out = {}
  for split, (a, b) in bounds.items():
    lo, hi = (tfds_splits._pct_to_abs_closest(a, n), tfds_splits._pct_to_abs_closest(b, n))
    out[split] = [e["g"] for e in order[lo:hi] if e["g"] != EMPTY]
  return out


# ---------------------------------------------------------------------------- info


def test_info_and_grid():
  info = tasks.task_info(_cfg(""))
  assert (info.kind, info.vocab_size, info.num_classes) == ("classify", 257, 2)
  assert info.max_length == 1024 and info.grid == (32, 32)
  pathx = tasks.task_info(_cfg("", resolution=128))
  assert pathx.max_length == 16384 and pathx.grid == (128, 128)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("resolution", 31, r"unknown resolution 31; valid choices: 32, 64, 128, 256"),
        ("difficulty", "medium", r"unknown difficulty 'medium'; valid choices: easy, intermediate"),
        ("split_order", "random", r"unknown split_order 'random'; valid choices: lra, metadata"),
        ("num_threads", 0, r"num_threads must be an integer >= 1"),
    ],
)
def test_bad_config(field, value, match):
  cfg = _cfg("")
  cfg[field] = value
  with pytest.raises(ValueError, match=match):
    tasks.make_task(cfg)


# --------------------------------------------------------------------------- splits


def test_splits_follow_lra_order(root, tmp_path):
  examples = make_release(str(tmp_path / "again"))  # the same fixture, for its key list
  want = _expected_lra(examples)
  assert sum(len(v) for v in want.values()) == 20  # 21 lines, one empty PNG dropped
  task = tasks.make_task(_cfg(root))
  for split in ("train", "validation", "test"):
    src = task.source(split)
    x, m, y = src.arrays["inputs"], src.arrays["mask"], src.arrays["targets"]
    n = len(want[split])
    assert x.shape == (n, RES * RES) and x.dtype == np.int32
    assert m.shape == (n, RES * RES) and m.dtype == bool and m.all()  # every pixel is real
    assert y.shape == (n,) and y.dtype == np.int32
    got = [int(row[0]) - 1 for row in x]  # pixel (0, 0) = fixture number, id = pixel + 1
    assert got == want[split]
    for row, label, g in zip(x, y, got):
      np.testing.assert_array_equal(row.reshape(RES, RES) - 1, _image(g))  # raster order
      assert label == _label(g) and row[1] - 1 == 100 * label
  sizes = [len(want[s]) for s in ("train", "validation", "test")]
  assert sum(sizes) == 20 and sizes[0] >= 16  # 17 / 2 / 2 slices of 21, less the empty one


def test_lra_order_matches_tfds_hashing():
  examples = [pf.Example(f"imgs/{i % 3}_sample_{i}.png_{i + 1}", "", 0, "") for i in range(50)]
  hasher = tfds_hashing.Hasher("hard")
  want = sorted(examples, key=lambda e: hasher.hash_key(e.key))
  assert pf.lra_order(examples, "hard") == want
  assert pf.lra_order(examples, "easy") != want  # the split name salts the hash
  for n in (1, 7, 10, 21, 199_999, 200_000):
    bounds = pf.split_bounds(n)
    assert bounds["train"] == (0, tfds_splits._pct_to_abs_closest(80, n))
    assert bounds["validation"][0] == bounds["train"][1]
    assert bounds["test"] == (tfds_splits._pct_to_abs_closest(90, n), n)
  assert pf.split_bounds(200_000)["validation"] == (160_000, 180_000)


def test_metadata_order_and_difficulty(tmp_path):
  root = str(tmp_path / "data")
  examples = make_release(root, difficulty="easy")
  task = tasks.make_task(_cfg(root, difficulty="easy", split_order="metadata"))
  got = {
      s: [int(r[0]) - 1 for r in task.source(s).arrays["inputs"]]
      for s in ("train", "validation", "test")
  }
  gs = [e["g"] for e in examples]
  assert got == {
      "train": [g for g in gs[:17] if g != EMPTY],
      "validation": gs[17:19],
      "test": gs[19:],
  }
  with pytest.raises(FileNotFoundError, match="curv_contour_length_14"):  # "hard" is absent
    tasks.make_task(_cfg(root)).source("train")


def test_cache_hit_and_invalidation(root, tmp_path, monkeypatch):
  monkeypatch.setenv("FASTPOS_CACHE_DIR", str(tmp_path / "caches"))
  first = pf.load_split("test", data_dir=root, num_threads=1)
  assert not os.path.exists(os.path.join(root, "cache"))  # nothing written into the data
  cache = os.path.join(tmp_path, "caches", "pathfinder")
  files = sorted(os.listdir(cache))
  assert len(files) == 3 and all(f.startswith("pathfinder_v1_32_hard_lra_") for f in files)

  def boom(*args, **kwargs):
    raise AssertionError("the cache should have been used")

  with monkeypatch.context() as m:
    m.setattr(pf, "build_splits", boom)
    for split in ("test", "train"):
      again = pf.load_split(split, data_dir=root)
      if split == "test":
        for k in first:
          np.testing.assert_array_equal(first[k], again[k])
          assert first[k].dtype == again[k].dtype
  # Rewriting the metadata (one example fewer) rebuilds; the old files stay valid.
  meta = os.path.join(pf.dataset_dir(root, 32, "hard"), "metadata", "1.npy")
  with open(meta) as f:
    lines = f.readlines()
  with open(meta, "w") as f:
    f.writelines(lines[:-1])
  total = sum(
      len(pf.load_split(s, data_dir=root)["targets"]) for s in ("train", "validation", "test")
  )
  assert total == 19 and len(os.listdir(cache)) == 6
  assert not [f for f in os.listdir(cache) if f.startswith(".tmp")]


# --------------------------------------------------------------------------- errors


def _folder(root):
  return pf.dataset_dir(root, 32, "hard")


def _rewrite_meta(root, text):
  with open(os.path.join(_folder(root), "metadata", "0.npy"), "w") as f:
    f.write(text)


@pytest.mark.parametrize(
    "text, match",
    [
        ("imgs/0 sample_0.png 0 1\nimgs/0 sample_1.png 1\n", r"0\.npy:2: expected at least 4"),
        ("imgs/0 sample_0.png 0 2\n", r"0\.npy:1: label '2' is not 0 or 1"),
        ("imgs/0 sample_0.png 0 1\nimgs/0 sample_1.png 1 0", r"0\.npy: does not end in a newline"),
        (
            "imgs/0 sample_0.png 0 1\nimgs/9 sample_0.png 0 1\n",
            r"imgs/9/sample_0\.png' \(listed at .*0\.npy:2\) does not exist",
        ),
    ],
)
def test_bad_metadata_names_file_and_line(root, text, match):
  _rewrite_meta(root, text)
  with pytest.raises(ValueError, match=match):
    pf.load_split("train", data_dir=root)


@pytest.mark.parametrize(
    "kind, match",
    [
        ("garbage", r"sample_0\.png' \(listed at .*0\.npy:1\) is not a readable PNG"),
        ("size", r"sample_0\.png' .* is 16x32; expected 32x32"),
        ("16bit", r"sample_0\.png' .* has mode 'I;16'"),
    ],
)
def test_bad_png_names_the_file(root, kind, match):
  path = os.path.join(_folder(root), "imgs", "0", "sample_0.png")
  if kind == "garbage":
    with open(path, "wb") as f:
      f.write(b"\x89PNG\r\n\x1a\n" + bytes(range(40)))
  elif kind == "size":
    Image.fromarray(np.zeros((32, 16), np.uint8), mode="L").save(path)
  else:
    Image.fromarray(np.zeros((32, 32), np.uint16)).save(path)
  _rewrite_meta(root, "imgs/0 sample_0.png 0 1\n")
  with pytest.raises(ValueError, match=match):
    pf.load_split("train", data_dir=root)


def test_colour_png_is_converted_to_gray(tmp_path):
  rgb = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
  wide = rgb.astype(np.int64)
  path = str(tmp_path / "c.png")
  Image.fromarray(rgb, mode="RGB").save(path)
  gray = pf.decode_png(path, 32)
  want = (wide[..., 0] * 299 + wide[..., 1] * 587 + wide[..., 2] * 114 + 500) // 1000
  assert gray.dtype == np.uint8 and np.abs(gray.astype(int) - want).max() <= 1


def test_missing_data_names_path_and_command(tmp_path):
  task = tasks.make_task(_cfg(str(tmp_path), resolution=128))
  with pytest.raises(FileNotFoundError) as e:
    task.source("train")
  msg = str(e.value)
  folder = os.path.join(str(tmp_path), "lra_release", "pathfinder128", "curv_contour_length_14")
  assert folder in msg
  assert f"python scripts/download_data.py pathfinder --data_dir {tmp_path}`" in msg


# ------------------------------------------------------------------------ end to end


# Slow (a training run); the default run keeps a tiny run end to end (tests/train/test_exits.py)
# and this task's batches (the tests above).
@pytest.mark.slow
def test_train_and_evaluate_two_steps_with_2d_scheme(root, tmp_path):
  c = base_config("pathfinder")
  c.task.update(data_dir=root, num_threads=1)
  c.model.update(
      num_layers=1, embed_dim=16, num_heads=2, mlp_dim=16, dropout_rate=0.0, positional="fastrpb"
  )
  c.batch_size = 4
  c.num_train_steps = 2
  c.schedule.update(name="constant", warmup_steps=1)
  c.log_every_steps = 1
  c.eval_every_steps = 2
  c.checkpoint_every_steps = 2
  c.async_checkpoints = False
  c.data.num_threads = 1
  result = train_and_evaluate(c, tmp_path / "workdir")
  assert result["step"] == 2
  n_val = len(tasks.make_task(c.task).source("validation"))
  assert result["validation"]["num_examples"] == n_val
  assert np.isfinite(result["train"]["loss"]) and np.isfinite(result["validation"]["loss"])
