"""The tfds-backed tasks: "lra_text" (IMDB bytes), "lra_image" (CIFAR-10 grayscale), "mnist".

Nothing is downloaded. Two kinds of data:

- ``prepared``: tiny datasets in tfds's real on-disk format (array_record files and
  ``dataset_info.json`` under ``<root>/tfds/<name>/<version>/``), written into a temporary folder
  by the real tfds builders (``imdb_reviews``, ``cifar10``, ``mnist``) whose download step is
  replaced by a few examples chosen here. They are read through the same
  ``tfds.data_source`` path as the real data, so contents can be checked exactly.
- ``mocked_tfds``: ``tfds.testing.mock_data`` (random examples of the right features) for
  shapes and the end-to-end training runs. tfds 4.9.10's mock sets ``__getitems__`` on a
  MagicMock as a plain attribute, so it is never bound and batched reads fail; the helper
  routes ``BaseDataSource.__getitems__`` to single reads while mocked (a test-only patch of the
  mock's gap; the real reader's batched path is exercised by the prepared datasets).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import PIL.Image
import pytest
import tensorflow_datasets as tfds

from fastpos import tasks
from fastpos.tasks import image, text, tfds_source
from fastpos.tasks.info import TaskInfo
from fastpos.train import train_and_evaluate
from tests.train.common import tiny_config

# ------------------------------------------------------------------------ fixture data

# Reviews of different lengths and scripts; the NUL byte and the multi-byte characters check
# that ids are bytes + 1 and that the mask comes from the length, not from the byte values.
IMDB_TRAIN = [
    ("A fine film.", 1),
    ("Terrible.<br /><br />Avoid it.", 0),
    ("Caf\u00e9 scenes were lovely \u2014 the rest, not so much.", 0),
    ("\u65e5\u672c\u306e\u6620\u753b\u3002 Great acting!", 1),
    ("Emoji review \U0001F600\U0001F600 ten out of ten", 1),
    ("nul\x00byte inside", 0),
    ("x" * 39, 1),
    ("y" * 40, 0),
    ("z" * 41, 1),
    ("Long and boring. " * 5, 0),
    ("short", 1),
    ("Twelfth review, quite average overall.", 0),
]
IMDB_TEST = [
    ("Test one, good.", 1),
    ("Test two: bad bad bad bad bad bad bad bad.", 0),
    ("tr\u00e8s bien", 1),
    ("meh", 0),
    ("The finale " * 6, 1),
]
TEXT_MAX = 40  # bytes: 3 of the 12 train reviews and 2 of the 5 test reviews are longer

# CIFAR-10: image i is filled with CIFAR_COLORS[i], except pixel (1, 3) which is pure red.
CIFAR_COLORS = [(10 * i, 200 - 15 * i, 30 + 20 * i) for i in range(10)]
CIFAR_TEST_COLORS = [(255, 255, 255), (0, 0, 0), (90, 60, 30), (17, 171, 71)]
RED_AT = (1, 3)
# MNIST: image i is filled with 20 * i, except pixel (2, 5) which is 255 - i.
MNIST_MARK = (2, 5)
NUM_MNIST_TRAIN, NUM_MNIST_TEST = 10, 4


def gray64(rgb) -> int:
  """Independent reference of LRA's grayscale in float64: floor(luma / 255 * 255.5)."""
  r, g, b = (float(c) for c in rgb)
  return int(np.floor((0.2989 * r + 0.5870 * g + 0.1140 * b) / 255.0 * 255.5))


def _cifar_image(color):
  img = np.empty((32, 32, 3), np.uint8)
  img[...] = color
  img[RED_AT] = (255, 0, 0)
  return img


def _mnist_image(i):
  img = np.full((28, 28), 20 * i, np.uint8)
  img[MNIST_MARK] = 255 - i
  return img


def _write_datasets(tfds_dir: str) -> None:
  """Prepares the three datasets with the real builders and the examples above.

  _NO_CODE_PATH: the builders download nothing, so they need no checksums file; without a
  ``code_path`` tfds does not look for one (its lookup imports ``importlib_resources``, which
  this environment does not install).
  """
  from tensorflow_datasets.datasets.imdb_reviews import imdb_reviews_dataset_builder as imdb
  from tensorflow_datasets.image_classification import cifar, mnist

  def examples(rows):
    return ((f"k{i}", row) for i, row in enumerate(rows))

  class Imdb(imdb.Builder, skip_registration=True):
    name = "imdb_reviews"
    code_path = None  # see _NO_CODE_PATH

    @classmethod
    def _get_pkg_dir_path(cls):  # the real builder's metadata files
      return imdb.Builder._get_pkg_dir_path()

    def _split_generators(self, dl_manager):
      return {
          s: examples({"text": t, "label": y} for t, y in rows)
          for s, rows in (("train", IMDB_TRAIN), ("test", IMDB_TEST))
      }

  class Cifar(cifar.Cifar10, skip_registration=True):
    name = "cifar10"
    code_path = None

    def _split_generators(self, dl_manager):
      def rows(colors):  # PIL images: tfds encodes them to PNG without TensorFlow
        return (
            {"id": f"img{i}", "image": PIL.Image.fromarray(_cifar_image(c)), "label": i % 10}
            for i, c in enumerate(colors)
        )

      return {"train": examples(rows(CIFAR_COLORS)), "test": examples(rows(CIFAR_TEST_COLORS))}

  class Mnist(mnist.MNIST, skip_registration=True):
    name = "mnist"
    code_path = None

    def _split_generators(self, dl_manager):
      def rows(n):
        return ({"image": PIL.Image.fromarray(_mnist_image(i)), "label": i % 10} for i in range(n))

      return {"train": examples(rows(NUM_MNIST_TRAIN)), "test": examples(rows(NUM_MNIST_TEST))}

  Imdb(data_dir=tfds_dir, config="plain_text").download_and_prepare(file_format="array_record")
  Cifar(data_dir=tfds_dir).download_and_prepare(file_format="array_record")
  Mnist(data_dir=tfds_dir).download_and_prepare(file_format="array_record")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
  """A data root holding the three tiny prepared datasets (tfds/...)."""
  root = tmp_path_factory.mktemp("tfds_root")
  _write_datasets(str(root / "tfds"))
  return str(root)


MOCK_FOLDERS = ("imdb_reviews/plain_text/1.0.0", "cifar10/3.0.2", "mnist/3.0.1")


@contextlib.contextmanager
def mocked_tfds(root, num_examples: int):
  """tfds mock data for every dataset; ``root`` gets placeholder version folders so that the
  tasks' on-disk check passes (mock_data ignores data_dir)."""
  for folder in MOCK_FOLDERS:
    os.makedirs(os.path.join(root, "tfds", folder), exist_ok=True)
    Path(root, "tfds", folder, "dataset_info.json").write_text("{}")
  single = lambda self, keys: [self[k] for k in keys]  # noqa: E731 (see module docstring)
  with (
      tfds.testing.mock_data(num_examples=num_examples, policy=tfds.testing.MockPolicy.USE_CODE),
      mock.patch("tensorflow_datasets.core.data_sources.base.BaseDataSource.__getitems__", single),
  ):
    yield


def _cfg(name, root, **kw):
  cfg = tasks.task_config(name)
  cfg.data_dir = str(root)
  cfg.update(kw)
  return cfg


def _warnings(caplog):
  return [
      r.getMessage()
      for r in caplog.records
      if r.levelname == "WARNING" and "OpenCV" not in r.getMessage()
  ]


def _boom(*args, **kwargs):
  raise AssertionError("tfds should not have been called")


# ---------------------------------------------------------------------------- lra_text


def test_text_config_and_info():
  cfg = tasks.task_config("lra_text")
  assert tasks.task_info(cfg) == TaskInfo("classify", 257, 2, 4000)
  assert (cfg.max_length, cfg.validation_fraction, cfg.on_overflow) == (4000, 0.1, "truncate")
  for field, value, match in [
      ("max_length", 0, "max_length must be an integer >= 1, got 0"),
      ("on_overflow", "drop", "unknown on_overflow 'drop'; valid choices: truncate, error"),
      ("validation_fraction", 0.0, r"validation_fraction must be a number in \(0, 1\), got 0.0"),
      ("validation_fraction", 1.0, r"validation_fraction must be a number in \(0, 1\)"),
      ("validation_seed", -1, "validation_seed must be an integer >= 0, got -1"),
  ]:
    bad = tasks.task_config("lra_text")
    bad[field] = value
    with pytest.raises(ValueError, match=match):
      tasks.make_task(bad)
  bad = tasks.task_config("lra_text")
  bad.max_lenght = 10
  with pytest.raises(ValueError, match=r"unknown field\(s\) \['max_lenght'\]"):
    tasks.make_task(bad)


def test_byte_round_trip():
  for t, _ in IMDB_TRAIN + IMDB_TEST:
    ids = text.encode(t)
    assert ids.dtype == np.int32 and ids.min() >= 1 and ids.max() <= 256
    np.testing.assert_array_equal(ids, np.frombuffer(t.encode("utf-8"), np.uint8) + 1)
    assert text.decode(ids) == t
    assert text.decode(np.pad(ids, (0, 7))) == t  # trailing padding is dropped
  assert text.encode(b"\x00\xff").tolist() == [1, 256]
  cut = text.encode("\u00e9t\u00e9")[:1]  # half of a 2-byte character
  with pytest.raises(UnicodeDecodeError):
    text.decode(cut)
  assert text.decode(cut, errors="replace") == "\ufffd"
  with pytest.raises(ValueError, match="token id 257 at position 1"):
    text.decode([5, 257])
  with pytest.raises(ValueError, match="padding id 0 at position 1 comes before"):
    text.decode([5, 0, 6])


def test_text_reads_the_prepared_files(prepared, caplog):
  cfg = _cfg("lra_text", prepared, max_length=TEXT_MAX, validation_fraction=0.25)
  task = tasks.make_task(cfg)
  labels = dict(IMDB_TRAIN)
  seen = {}
  with caplog.at_level("WARNING"):
    for split, n in (("train", 9), ("validation", 3), ("test", len(IMDB_TEST))):
      src = task.source(split)
      x, y, m = src.arrays["inputs"], src.arrays["targets"], src.arrays["mask"]
      assert x.shape == (n, TEXT_MAX) and x.dtype == np.int32
      assert y.shape == (n,) and y.dtype == np.int32 and m.dtype == bool
      rows = []
      for row, mask, label in zip(x, m, y):
        length = int(mask.sum())
        assert mask[:length].all() and not mask[length:].any()  # real bytes, then padding
        assert np.all(row[mask] >= 1) and np.all(row[~mask] == 0)
        raw = (row[:length] - 1).astype(np.uint8).tobytes()
        rows.append((raw, int(label)))
      seen[split] = rows
  # Every train review is in exactly one of train / validation, with its label, truncated to
  # TEXT_MAX bytes; the test split is the test reviews.
  full = {t.encode("utf-8")[:TEXT_MAX]: t for t, _ in IMDB_TRAIN}
  carved = [r for s in ("train", "validation") for r, _ in seen[s]]
  assert sorted(carved) == sorted(full)
  for s in ("train", "validation"):
    for raw, label in seen[s]:
      assert label == labels[full[raw]]
  assert sorted(r for r, _ in seen["test"]) == sorted(
      t.encode("utf-8")[:TEXT_MAX] for t, _ in IMDB_TEST
  )
  # Untruncated rows decode back to the review.
  src = task.source("train")
  for row in src.arrays["inputs"]:
    if row[-1] == 0:
      assert text.decode(row) in labels
  # One warning per split with the count of reviews longer than TEXT_MAX bytes.
  long = {t.encode("utf-8")[:TEXT_MAX] for t, _ in IMDB_TRAIN if len(t.encode("utf-8")) > TEXT_MAX}
  assert len(long) == 3
  warns = _warnings(caplog)
  for s in ("train", "validation"):
    k = sum(r in long for r, _ in seen[s])
    want = [w for w in warns if w.startswith(f"lra_text {s}:")]
    if k:
      assert want == [
          f"lra_text {s}: truncated {k} of {len(seen[s])} examples to {TEXT_MAX} "
          f"tokens (bytes), as LRA does."
      ]
    else:
      assert want == []
  assert [w for w in warns if w.startswith("lra_text test:")] == [
      f"lra_text test: truncated 2 of 5 examples to {TEXT_MAX} tokens (bytes), as LRA does."
  ]


def test_validation_is_seeded_and_disjoint(prepared):
  def parts(seed):
    task = tasks.make_task(
        _cfg("lra_text", prepared, max_length=64, validation_fraction=0.25, validation_seed=seed)
    )
    return {
        s: {row.tobytes() for row in task.source(s).arrays["inputs"]}
        for s in ("train", "validation")
    }

  a, b, c = parts(0), parts(0), parts(1)
  assert a == b  # deterministic for a seed
  assert not a["train"] & a["validation"] and len(a["train"] | a["validation"]) == 12
  assert c["validation"] != a["validation"] and len(c["validation"]) == 3
  idx = tfds_source.carve_validation(12, 0.25, 0)
  assert sorted(np.concatenate([idx["train"], idx["validation"]]).tolist()) == list(range(12))
  with pytest.raises(ValueError, match="validation_fraction=0.01 of 12 training examples"):
    tfds_source.carve_validation(12, 0.01, 0)


def test_text_overflow_error(prepared):
  task = tasks.make_task(_cfg("lra_text", prepared, max_length=TEXT_MAX, on_overflow="error"))
  with pytest.raises(
      ValueError,
      match=r"lra_text test example \d \(imdb_reviews/plain_text test "
      r"example \d\) has \d+ bytes, more than max_length=40",
  ):
    task.source("test")
  ok = tasks.make_task(_cfg("lra_text", prepared, max_length=200, on_overflow="error"))
  assert ok.source("test").arrays["inputs"].shape == (5, 200)


def test_text_cache_hit(prepared, tmp_path, monkeypatch, caplog):
  cache = tmp_path / "cache"
  cfg = _cfg("lra_text", prepared, max_length=TEXT_MAX, cache_dir=str(cache))
  first = {s: tasks.make_task(cfg).source(s).arrays for s in ("train", "test")}
  files = sorted(os.listdir(cache))
  assert len(files) == 2 and files[0].startswith(f"lra_text_v{text.CACHE_VERSION}_test_len40_")
  monkeypatch.setattr(tfds_source, "open_split", _boom)
  caplog.clear()
  with caplog.at_level("WARNING"):
    again = tasks.make_task(cfg)
    for s in ("train", "test"):
      for k in ("inputs", "targets", "mask"):
        np.testing.assert_array_equal(again.source(s).arrays[k], first[s][k])
  assert len([w for w in _warnings(caplog) if "lra_text test: truncated 2 of 5" in w]) == 1
  monkeypatch.undo()
  tasks.make_task(_cfg("lra_text", prepared, max_length=41, cache_dir=str(cache))).source(
      "test"
  )  # another length is another file
  assert len(os.listdir(cache)) == 3 and not [f for f in os.listdir(cache) if ".tmp" in f]
  # The default cache folder is $FASTPOS_CACHE_DIR/lra_text, nothing under the data root.
  monkeypatch.setenv("FASTPOS_CACHE_DIR", str(tmp_path / "caches"))
  tasks.make_task(_cfg("lra_text", prepared, max_length=16)).source("test")
  assert any(
      f.startswith("lra_text_v1_test_len16_") for f in os.listdir(tmp_path / "caches" / "lra_text")
  )
  assert not os.path.exists(os.path.join(prepared, "cache"))
  # A corrupt cache file is named, not silently rebuilt.
  victim = cache / files[0]
  victim.write_bytes(victim.read_bytes()[:100])
  with pytest.raises(ValueError, match=rf"cache file .*{files[0]}.* is unreadable"):
    tasks.make_task(cfg).source("test")


# --------------------------------------------------------------------------- images


def test_grayscale_formula():
  pixels = np.array(
      [[255, 255, 255], [0, 0, 0], [255, 0, 0], [0, 255, 0], [0, 0, 255], [10, 200, 30]], np.uint8
  )
  # By hand: 0.2989 * 255.5 = 76.37, 0.5870 * 255.5 = 149.98, 0.1140 * 255.5 = 29.13;
  # (10, 200, 30): (2.989 + 117.4 + 3.42) / 255 * 255.5 = 124.05; white: 0.9999 * 255.5.
  assert image.rgb_to_grayscale(pixels).tolist() == [255, 0, 76, 149, 29, 124]
  rng = np.random.default_rng(0)
  rgb = rng.integers(0, 256, (4000, 3)).astype(np.uint8)
  ours = image.rgb_to_grayscale(rgb).astype(int)
  exact = (rgb.astype(np.float64) @ np.array([0.2989, 0.5870, 0.1140])) / 255 * 255.5
  clear = np.abs(exact - np.round(exact)) > 1e-4  # away from an integer boundary
  assert clear.mean() > 0.99
  np.testing.assert_array_equal(ours[clear], np.floor(exact[clear]).astype(int))
  assert np.abs(ours - np.floor(exact)).max() <= 1
  with pytest.raises(ValueError, match=r"expects uint8 \[..., 3\]"):
    image.rgb_to_grayscale(np.zeros((2, 4), np.uint8))


@pytest.mark.parametrize(
    "name,n_train,n_val,n_test,grid",
    [
        ("lra_image", 8, 2, 4, (32, 32)),
        ("mnist", 8, 2, 4, (28, 28)),
    ],
)
def test_images_from_prepared_files(prepared, name, n_train, n_val, n_test, grid):
  task = tasks.make_task(_cfg(name, prepared, validation_fraction=0.2))
  h, w = grid
  assert task.info == TaskInfo("classify", 257, 10, h * w, grid)
  mark = RED_AT if name == "lra_image" else MNIST_MARK
  found = {}
  for split, n in (("train", n_train), ("validation", n_val), ("test", n_test)):
    src = task.source(split)
    x, y, m = src.arrays["inputs"], src.arrays["targets"], src.arrays["mask"]
    assert x.shape == (n, h * w) and x.dtype == np.int32 and m.all() and m.shape == x.shape
    assert y.shape == (n,) and y.dtype == np.int32
    assert x.min() >= 1 and x.max() <= 256
    imgs = image.decode(x, grid)  # [n, H, W] intensities, raster order undone
    for img, label in zip(imgs, y):
      background = int(img[0, 0])
      special = int(img[mark])
      # Every pixel but the marked one is the background; the mark sits at (row, col).
      assert np.count_nonzero(img != background) == (special != background)
      found.setdefault(split, []).append((background, special, int(label)))
  if name == "lra_image":
    red = gray64((255, 0, 0))
    want_train = sorted((gray64(c), red, i % 10) for i, c in enumerate(CIFAR_COLORS))
    want_test = sorted((gray64(c), red, i % 10) for i, c in enumerate(CIFAR_TEST_COLORS))
    assert red == 76
  else:
    want_train = sorted((20 * i, 255 - i, i % 10) for i in range(NUM_MNIST_TRAIN))
    want_test = sorted((20 * i, 255 - i, i % 10) for i in range(NUM_MNIST_TEST))
  assert sorted(found["train"] + found["validation"]) == want_train
  assert sorted(found["test"]) == want_test


def test_image_ids_and_raster_order():
  gray = np.arange(6, dtype=np.uint8).reshape(1, 2, 3) * 40
  ids = image.encode(gray)
  assert ids.tolist() == [[1, 41, 81, 121, 161, 201]]  # row by row, intensity + 1
  np.testing.assert_array_equal(image.decode(ids, (2, 3)), gray)
  with pytest.raises(ValueError, match="decode expects ids in 1..256"):
    image.decode(np.zeros((1, 6), np.int32), (2, 3))


def test_image_config_errors():
  cfg = tasks.task_config("mnist")
  assert "max_length" not in cfg  # the length is the image's
  cfg.validation_fraction = 1.5
  with pytest.raises(ValueError, match=r"validation_fraction must be a number in \(0, 1\)"):
    tasks.make_task(cfg)


def test_image_cache_hit(prepared, tmp_path, monkeypatch):
  cfg = _cfg("lra_image", prepared, cache_dir=str(tmp_path))
  first = tasks.make_task(cfg).source("validation").arrays
  assert sorted(os.listdir(tmp_path))[0].startswith("lra_image_v1_train_")
  monkeypatch.setattr(tfds_source, "open_split", _boom)
  again = tasks.make_task(cfg).source("validation").arrays
  for k in ("inputs", "targets", "mask"):
    np.testing.assert_array_equal(again[k], first[k])


# ------------------------------------------------------------------------- mock data


@pytest.mark.parametrize("name,length", [("lra_text", 24), ("lra_image", 1024), ("mnist", 784)])
def test_mock_data_shapes(tmp_path, monkeypatch, name, length):
  monkeypatch.setenv("FASTPOS_CACHE_DIR", str(tmp_path / "caches"))
  kw = {"max_length": length} if name == "lra_text" else {}
  cfg = _cfg(name, tmp_path, validation_fraction=0.25, **kw)
  with mocked_tfds(tmp_path, 20):
    task = tasks.make_task(cfg)
    for split, n in (("train", 15), ("validation", 5), ("test", 20)):
      src = task.source(split)
      assert len(src) == n
      ex = src[0]
      assert ex["inputs"].shape == (length,) and ex["inputs"].dtype == np.int32
      assert ex["mask"].shape == (length,) and ex["mask"].dtype == bool
      assert ex["targets"].shape == () and ex["targets"].dtype == np.int32
      np.testing.assert_array_equal(src.arrays["mask"], src.arrays["inputs"] != 0)
  assert os.listdir(tmp_path / "caches" / name)  # cached under $FASTPOS_CACHE_DIR/<task>
  assert not os.path.exists(tmp_path / "cache")


def test_missing_data_message(tmp_path, monkeypatch):
  monkeypatch.setattr(tfds, "data_source", _boom)  # checked before tfds is asked
  for name, folder in (
      ("lra_text", "imdb_reviews/plain_text"),
      ("lra_image", "cifar10"),
      ("mnist", "mnist"),
  ):
    task = tasks.make_task(_cfg(name, tmp_path))
    with pytest.raises(FileNotFoundError) as e:
      task.source("train")
    msg = str(e.value)
    assert repr(os.path.join(str(tmp_path), "tfds", *folder.split("/"))) in msg
    assert f"`python scripts/download_data.py {name} --data_dir {tmp_path}`" in msg
  # A folder without a prepared version (an interrupted preparation) is missing data too.
  (tmp_path / "tfds" / "mnist" / "incomplete.ABC_3.0.1").mkdir(parents=True)
  with pytest.raises(
      FileNotFoundError,
      match=r"mnist/<version>/dataset_info\.json.*holds no "
      r"prepared version.*download_data\.py mnist",
  ):
    tasks.make_task(_cfg("mnist", tmp_path)).source("test")
  # The trainer stops before anything is built or written.
  cfg = tiny_config()
  cfg.task = _cfg("lra_text", tmp_path / "nowhere", max_length=16)
  with pytest.raises(FileNotFoundError, match=r"nowhere/tfds/imdb_reviews/plain_text"):
    train_and_evaluate(cfg, tmp_path / "workdir")
  assert not list((tmp_path / "workdir").glob("checkpoints/*"))


def test_broken_dataset_message(prepared, tmp_path):
  shutil.copytree(os.path.join(prepared, "tfds", "mnist"), tmp_path / "tfds" / "mnist")
  version = tmp_path / "tfds" / "mnist" / "3.0.1"
  for shard in version.glob("mnist-train.array_record*"):
    shard.unlink()
  task = tasks.make_task(_cfg("mnist", tmp_path))
  assert task.source("test").arrays["inputs"].shape == (NUM_MNIST_TEST, 784)
  with pytest.raises(
      ValueError,
      match=r"'mnist' in '.*mnist/3\.0\.1' cannot be read .*"
      r"mnist-train\.array_record.*incomplete or corrupt.*"
      r"download_data\.py mnist --data_dir",
  ):
    task.source("train")


def _train_two_steps(tmp_path, task_cfg, **model):
  # Pre-LayerNorm without dropout: the cheapest tiny model to compile.
  model = {"norm": "pre", "dropout_rate": 0.0, **model}
  cfg = tiny_config(num_train_steps=2, **{f"model.{k}": v for k, v in model.items()})
  cfg.task = task_cfg
  out = train_and_evaluate(cfg, tmp_path / "workdir")
  assert out["step"] == 2
  assert np.isfinite(out["train"]["loss"]) and np.isfinite(out["validation"]["loss"])
  assert 0.0 <= out["validation"]["accuracy"] <= 1.0
  return out


# Slow (a training run); the default run keeps a tiny run end to end (tests/train/test_exits.py)
# and this task's batches (the tests above).
@pytest.mark.slow
def test_train_two_steps_lra_text(tmp_path):
  with mocked_tfds(tmp_path, 16):
    out = _train_two_steps(
        tmp_path, _cfg("lra_text", tmp_path, max_length=32, validation_fraction=0.25)
    )
  assert out["validation"]["num_examples"] == 4


@pytest.mark.slow  # 1024 tokens and a 2D scheme: the compile takes a while on a small CPU
def test_train_two_steps_lra_image_fastrpb(tmp_path):
  with mocked_tfds(tmp_path, 16):
    out = _train_two_steps(
        tmp_path, _cfg("lra_image", tmp_path, validation_fraction=0.25), positional="fastrpb"
    )
  saved = json.loads((tmp_path / "workdir" / "config.json").read_text())
  assert saved["model"]["positional"] == "fastrpb" and saved["task"]["name"] == "lra_image"
  assert out["validation"]["num_examples"] == 4
