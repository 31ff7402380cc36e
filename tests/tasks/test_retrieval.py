"""LRA Retrieval (AAN pairs): TSV reader, byte tokens, masks, truncation, cache, errors, the
pair order through the trainer's pipelines, and a 2-step dual-encoder run on the fixtures.

The fixtures (fastpos/tasks/samples/retrieval/lra_release/tsv_data/new_aan_pairs.*.tsv) are in the
release's format: no header, ``label<TAB>id1<TAB>id2<TAB>text1<TAB>text2``; every text starts
with a tag ``[<file><row><a|b>]`` so that a row of a batch can be traced back to its line.
"""

from __future__ import annotations

import os
import re
import shutil

import ml_collections
import numpy as np
import pytest

from fastpos import tasks
from fastpos.tasks import retrieval as rt
from fastpos.tasks.paths import SAMPLES
from fastpos.train import data as data_lib
from fastpos.train import train_and_evaluate
from fastpos.train.config import base_config

FIXTURES = os.path.join(SAMPLES, "retrieval")
FILE_STEM = {"train": "train", "validation": "eval", "test": "test"}
SIZES = {"train": 12, "validation": 6, "test": 5}
TAG = re.compile(rb"^\[(train|eval|test)(\d+)([ab])\] ")


@pytest.fixture
def root(tmp_path):
  """A data root holding a copy of the fixtures."""
  shutil.copytree(FIXTURES, tmp_path / "data")
  return str(tmp_path / "data")


def _rows(split):
  """(label, text1, text2) of the fixture file, read here with plain string operations."""
  path = os.path.join(FIXTURES, "lra_release", "tsv_data", f"new_aan_pairs.{FILE_STEM[split]}.tsv")
  with open(path, "rb") as f:
    lines = f.read().split(b"\n")
  assert lines[-1] == b""
  out = []
  for line in lines[:-1]:
    label, _, _, t1, t2 = line.split(b"\t")
    out.append((int(float(label)), t1, t2))
  return out


def _cfg(root, **kw):
  cfg = tasks.task_config("lra_retrieval")
  cfg.update({"data_dir": root, "max_length": 256, **kw})
  return cfg


def _trace(ids):
  """(file, row, side) of an encoded document, from its tag."""
  m = TAG.match(rt.decode(ids))
  assert m, rt.decode(ids)[:30]
  return m.group(1).decode(), int(m.group(2)), m.group(3).decode()


# ------------------------------------------------------------------------- tokens


def test_encode_decode_round_trip():
  text = "na\u00efve r\u00e9sum\u00e9 \x00\xff".encode("utf-8") + bytes([0, 255, 9])
  ids = rt.encode(text)
  assert ids.dtype == np.int32 and ids.min() >= 1 and ids.max() <= 256
  np.testing.assert_array_equal(ids, np.frombuffer(text, np.uint8).astype(np.int32) + 1)
  assert rt.decode(np.concatenate([ids, np.zeros(5, np.int32)])) == text
  assert rt.encode("\u00e9").tolist() == [0xC3 + 1, 0xA9 + 1]  # UTF-8 bytes, not characters
  with pytest.raises(ValueError, match="outside"):
    rt.decode(np.array([3, 257]))
  with pytest.raises(ValueError, match="padding id 0 at position 1"):
    rt.decode(np.array([3, 0, 4]))


def test_read_tsv_columns():
  rows = list(rt.read_tsv(rt.tsv_path(FIXTURES, "validation")))
  want = _rows("validation")
  assert len(rows) == len(want) == SIZES["validation"]
  for (line_no, label, id1, id2, t1, t2), (wl, w1, w2), i in zip(rows, want, range(len(want))):
    assert line_no == i + 1 and label == wl and t1 == w1 and t2 == w2
    assert re.fullmatch(r"P\d\d-\d+", id1) and re.fullmatch(r"W\d\d-\d+", id2)
  assert {r[1] for r in rows} == {0, 1}  # the eval file writes labels as 0.0 / 1.0


# -------------------------------------------------------------------------- splits


@pytest.mark.parametrize("split", list(SIZES))
def test_splits_shapes_masks_labels(root, split):
  task = tasks.make_task(_cfg(root))
  assert task.info.kind == "retrieval" and task.info.vocab_size == 257
  assert task.info.num_classes == 2 and task.info.max_length == 256
  src = task.source(split)
  a = src.arrays
  assert set(a) == {"inputs", "mask", "inputs2", "mask2", "targets"}
  n = SIZES[split]
  for k in ("inputs", "inputs2"):
    assert a[k].shape == (n, 256) and a[k].dtype == np.int32
  for k in ("mask", "mask2"):
    assert a[k].shape == (n, 256) and a[k].dtype == bool
  assert a["targets"].shape == (n,) and a["targets"].dtype == np.int32
  for i, (label, t1, t2) in enumerate(_rows(split)):
    assert a["targets"][i] == label
    for key, mkey, text in (("inputs", "mask", t1), ("inputs2", "mask2", t2)):
      row, mask = a[key][i], a[mkey][i]
      assert mask.sum() == len(text) and mask[: len(text)].all()  # real bytes first
      np.testing.assert_array_equal(row[~mask], 0)  # then padding
      assert rt.decode(row) == text
  ex = src[2]
  assert ex["inputs"].shape == (256,) and ex["targets"].shape == ()
  # Validation is the eval file, never the test file.
  assert _trace(task.source("validation").arrays["inputs"][0])[0] == "eval"


def test_truncation_warns_once_with_counts(root, caplog):
  rows = _rows("train")
  max_length = 80
  pairs = sum(len(t1) > max_length or len(t2) > max_length for _, t1, t2 in rows)
  docs = sum((len(t1) > max_length) + (len(t2) > max_length) for _, t1, t2 in rows)
  assert 0 < pairs < len(rows) and docs > pairs  # the fixture has short and long documents
  caplog.clear()
  with caplog.at_level("WARNING"):
    data = rt.load_split("train", data_dir=root, max_length=max_length)
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert warnings == [
      f"lra_retrieval train: truncated {pairs} of {len(rows)} examples to "
      f"{max_length} tokens ({docs} of {2 * len(rows)} documents were longer)."
  ]
  for i, (_, t1, t2) in enumerate(rows):
    assert rt.decode(data["inputs"][i]) == t1[:max_length]
    assert rt.decode(data["inputs2"][i]) == t2[:max_length]
  long_line = (
      next(i for i, (_, t1, t2) in enumerate(rows) if len(t1) > max_length or len(t2) > max_length)
      + 1
  )
  with pytest.raises(
      ValueError,
      match=rf"new_aan_pairs\.train\.tsv:{long_line}: text[12] has "
      rf"\d+ bytes, more than max_length=80",
  ):
    rt.load_split("train", data_dir=root, max_length=max_length, on_overflow="error")
  caplog.clear()
  with caplog.at_level("WARNING"):  # everything fits: no warning
    rt.load_split("train", data_dir=root, max_length=256)
  assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_num_examples(root):
  task = tasks.make_task(_cfg(root, num_train=5, num_test=2))
  assert len(task.source("train")) == 5 and len(task.source("test")) == 2
  assert len(task.source("validation")) == SIZES["validation"]
  assert [_trace(r)[1] for r in task.source("train").arrays["inputs"]] == [0, 1, 2, 3, 4]
  with pytest.raises(ValueError, match="num_examples=13 but .* holds 12 pairs"):
    rt.load_split("train", data_dir=root, num_examples=13)


def test_cache_hit_is_used_and_keyed(root, tmp_path, monkeypatch):
  monkeypatch.setenv("FASTPOS_CACHE_DIR", str(tmp_path / "caches"))
  cache = os.path.join(tmp_path, "caches", "lra_retrieval")
  first = rt.load_split("test", data_dir=root, max_length=100)
  files = os.listdir(cache)
  assert len(files) == 1 and files[0].startswith("aan_v1_test_max100")

  def boom(*args, **kwargs):
    raise AssertionError("the cache should have been used")

  with monkeypatch.context() as m:
    m.setattr(rt, "_tokenise", boom)
    second = rt.load_split("test", data_dir=root, max_length=100)
  for k in first:
    np.testing.assert_array_equal(first[k], second[k])
    assert first[k].dtype == second[k].dtype
  rt.load_split("test", data_dir=root, max_length=101)  # another length: another file
  rt.load_split("test", data_dir=root, max_length=100, num_examples=2)
  assert len(os.listdir(cache)) == 3
  assert not [f for f in os.listdir(cache) if f.startswith(".tmp")]
  assert not os.path.exists(os.path.join(root, "cache"))  # nothing written into the data
  # A changed file is read again; an explicit cache_dir is used instead of the default.
  path = rt.tsv_path(root, "test")
  with open(path, "wb") as f:
    f.write(b"1\tA\tB\tfirst doc\tsecond doc\n")
  other = os.path.join(root, "elsewhere")
  third = rt.load_split("test", data_dir=root, max_length=100, cache_dir=other)
  assert third["targets"].tolist() == [1] and rt.decode(third["inputs2"][0]) == b"second doc"
  assert len(os.listdir(other)) == 1


@pytest.mark.parametrize(
    "body, match",
    [
        (b"1\tA\tB\tonly four\n", r":1: expected 5 tab-separated columns .*got 4"),
        (b"1\tA\tB\tx\ty\n0\tA\tB\tx\ty\tz\n", r":2: expected 5 tab-separated columns .*got 6"),
        (b"1\tA\tB\tx\ty\n2\tA\tB\tx\ty\n", r":2: label b'2' is not 0 or 1"),
        (b"1\tA\tB\tx\ty\n\n1\tA\tB\tx\ty\n", r":2: empty line"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, body, match):
  path = rt.tsv_path(str(tmp_path), "train")
  os.makedirs(os.path.dirname(path))
  with open(path, "wb") as f:
    f.write(body)
  with pytest.raises(ValueError, match=r"new_aan_pairs\.train\.tsv" + match):
    rt.load_split("train", data_dir=str(tmp_path), max_length=8)


def test_crlf_lines_are_read(tmp_path):
  path = rt.tsv_path(str(tmp_path), "validation")
  os.makedirs(os.path.dirname(path))
  with open(path, "wb") as f:
    f.write(b"0.0\tA\tB\tab\tcd\r\n1.0\tC\tD\tef\tgh\r\n")
  data = rt.load_split("validation", data_dir=str(tmp_path), max_length=4)
  assert data["targets"].tolist() == [0, 1]
  assert rt.decode(data["inputs2"][1]) == b"gh" and data["mask2"][1].sum() == 2


def test_missing_data_names_path_and_command(tmp_path):
  task = tasks.make_task(_cfg(str(tmp_path)))
  with pytest.raises(FileNotFoundError) as e:
    task.source("train")
  msg = str(e.value)
  assert os.path.join(str(tmp_path), "lra_release", "tsv_data", "new_aan_pairs.train.tsv") in msg
  assert f"python scripts/download_data.py lra_retrieval --data_dir {tmp_path}`" in msg


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("max_length", 0, "max_length must be an integer >= 1"),
        ("on_overflow", "drop", "valid choices: truncate, error"),
        ("num_validation", -1, "num_validation must be an integer >= 0"),
    ],
)
def test_bad_config(field, value, match):
  cfg = _cfg("")
  cfg[field] = value
  with pytest.raises(ValueError, match=match):
    tasks.make_task(cfg)


def test_bad_split_argument(root):
  with pytest.raises(ValueError, match="valid splits: train, validation, test"):
    rt.load_split("eval", data_dir=root)


# --------------------------------------------------------- through the trainer's pipelines


def _pipeline_cfg(batch_size):
  c = ml_collections.ConfigDict()
  c.seed = 3
  c.batch_size = batch_size
  c.eval_batch_size = 0
  c.data = ml_collections.ConfigDict(dict(num_threads=1, prefetch=2))
  return c


def test_pair_order_and_labels_survive_batching(root):
  task = tasks.make_task(_cfg(root, max_length=48))
  labels = {s: [r[0] for r in _rows(s)] for s in SIZES}
  # Training: shuffled, repeated batches; every row's two documents and label stay together.
  it = data_lib.train_iterator(task.source("train"), _pipeline_cfg(4))
  seen = []
  for _ in range(6):  # two epochs of 12
    batch = next(it)
    assert batch["inputs"].shape == (4, 48) and batch["inputs2"].shape == (4, 48)
    assert batch["targets"].shape == (4,) and batch["weight"].tolist() == [1.0] * 4
    for x1, x2, m1, m2, y in zip(
        batch["inputs"], batch["inputs2"], batch["mask"], batch["mask2"], batch["targets"]
    ):
      f1, i1, s1 = _trace(x1)
      f2, i2, s2 = _trace(x2)
      assert (f1, s1, f2, s2) == ("train", "a", "train", "b") and i1 == i2
      assert y == labels["train"][i1]
      np.testing.assert_array_equal(m1, x1 != 0)
      np.testing.assert_array_equal(m2, x2 != 0)
      seen.append(i1)
  assert sorted(seen[:12]) == list(range(12)) and sorted(seen[12:]) == list(range(12))
  assert seen[:12] != list(range(12))  # it was shuffled
  # Evaluation: in order, the last batch filled with weight-0 copies.
  rows, weights = [], []
  for batch in data_lib.eval_iterator(task.source("test"), _pipeline_cfg(4)):
    for x1, x2, y, w in zip(batch["inputs"], batch["inputs2"], batch["targets"], batch["weight"]):
      (_, i1, _), (_, i2, _) = _trace(x1), _trace(x2)
      assert i1 == i2 and y == labels["test"][i1]
      rows.append(i1)
      weights.append(w)
  assert rows[:5] == [0, 1, 2, 3, 4] and weights == [1.0] * 5 + [0.0] * 3


# Slow (a training run); the default run keeps a tiny run end to end (tests/train/test_exits.py)
# and this task's batches (the tests above).
@pytest.mark.slow
def test_train_and_evaluate_two_steps(root, tmp_path):
  c = base_config("lra_retrieval")
  c.task.update(data_dir=root, max_length=32)
  c.model.update(
      num_layers=1,
      embed_dim=16,
      num_heads=2,
      mlp_dim=16,
      dropout_rate=0.0,
      kernel="softmax",
      positional="none",
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
  assert result["validation"]["num_examples"] == SIZES["validation"]
  assert 0.0 <= result["validation"]["accuracy"] <= 1.0
  assert np.isfinite(result["train"]["loss"]) and np.isfinite(result["validation"]["loss"])
