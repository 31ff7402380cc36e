"""WikiText-103: vocabulary, id streams, segments, cache, errors, stream batching, one run.

The fixture (fastpos/tasks/samples/wikitext/wikitext-103/wiki.{train,valid,test}.tokens) is a few
lines per split in the release's format: a leading space on every line, ``= Title =`` and
``= = Section = =`` headings, blank lines, ``@-@`` / ``@.@`` / ``@,@``, ``<unk>``, a non-ASCII
word; validation and test hold words that train does not. Expected values are computed here
from the files with ``collections.Counter`` and line-by-line reading, independently of the
module's one-pass reader. The Transformer-XL memory runs (exact resume, memory carried across
training and evaluation batches) are in tests/train/test_memory.py.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from fastpos import tasks
from fastpos.tasks import wikitext as wt
from fastpos.tasks.paths import SAMPLES
from fastpos.train import data as data_lib
from fastpos.train import train_and_evaluate
from fastpos.train.config import base_config

ROOT = os.path.join(SAMPLES, "wikitext")
FILES = {split: os.path.join(ROOT, "wikitext-103", name) for split, name in wt.FILES.items()}
L = 8  # segment length of most tests


def _tokens(path):
  """The file's words with <eos> after every line (blank lines too)."""
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      out += line.split() + ["<eos>"]
  return out


TRAIN = _tokens(FILES["train"])
COUNTS = collections.Counter(TRAIN)
WORDS = ["<pad>", "<unk>", "<eos>"] + sorted(
    (w for w in COUNTS if w not in ("<unk>", "<eos>")), key=lambda w: (-COUNTS[w], w)
)
V = len(WORDS)  # 143 for this fixture


def _cfg(cache_dir, **kw):
  c = tasks.task_config("wikitext103")
  c.update(data_dir=ROOT, cache_dir=str(cache_dir), segment_length=L, vocab_size=V)
  c.update(**kw)
  return c


@pytest.fixture
def task(tmp_path):
  return tasks.make_task(_cfg(tmp_path / "cache"))


def test_fixture_is_the_release_format():
  assert V == 143 and len(TRAIN) == 288 and COUNTS["<eos>"] == 22 and COUNTS["<unk>"] == 3
  lines = Path(FILES["train"]).read_text(encoding="utf-8").split("\n")
  assert lines[0] == " " and lines[1] == " = Harbour Light = " and lines[-1] == ""
  assert {"@-@", "@.@", "@,@", "Zürich", "="} <= set(TRAIN)


def test_vocabulary_is_train_only_ordered_and_deterministic(tmp_path):
  a = tasks.make_task(_cfg(tmp_path / "a"))
  b = tasks.make_task(_cfg(tmp_path / "b"))
  assert a.vocabulary() == b.vocabulary() == WORDS
  vocab = a.vocabulary()
  assert vocab[:3] == ["<pad>", "<unk>", "<eos>"]
  counts = [COUNTS[w] for w in vocab[3:]]
  assert counts == sorted(counts, reverse=True)
  # By count, ties by the word: "," and "and" both occur 10 times.
  assert vocab[3:9] == ["=", ".", "the", ",", "and", "The"]
  valid_only = set(_tokens(FILES["validation"])) - set(TRAIN)
  assert "Mill" in valid_only and not valid_only & set(vocab)
  assert a.info.kind == "lm" and a.info.vocab_size == V and a.info.max_length == L
  assert a.metric == "perplexity" and a.metric_mode == "min"


def test_streams_round_trip_and_unknown_words_become_unk(task):
  train = task.token_stream("train")
  assert train.dtype == np.uint16 and train.size == len(TRAIN)
  assert wt.decode(train, task.vocabulary()) == TRAIN
  np.testing.assert_array_equal(wt.encode(TRAIN, task.vocabulary()), train)
  assert np.count_nonzero(train == wt.EOS_ID) == 22 and np.all(train != wt.PAD_ID)
  for split in ("validation", "test"):
    words = _tokens(FILES[split])
    ids = task.token_stream(split)
    want = [w if w in WORDS else "<unk>" for w in words]
    assert wt.decode(ids, task.vocabulary()) == want
    assert sum(w not in WORDS for w in words) > 0  # the fixture has unknown words
    assert np.count_nonzero(ids == wt.UNK_ID) == want.count("<unk>")
  assert wt.encode(["Harbour", "Atlantis"], task.vocabulary()).tolist() == [
      WORDS.index("Harbour"),
      wt.UNK_ID,
  ]


def test_segments_continue_the_stream(task):
  for split in ("train", "validation", "test"):
    stream = task.token_stream(split).astype(np.int64)
    n = stream.size
    src = task.source(split)
    x, y, m = (src.arrays[k] for k in ("inputs", "targets", "mask"))
    s = math.ceil((n - 1) / L)
    assert x.shape == y.shape == m.shape == (s, L)
    assert x.dtype == y.dtype == np.int32 and m.dtype == bool
    flat_x, flat_y, flat_m = x.reshape(-1), y.reshape(-1), m.reshape(-1)
    np.testing.assert_array_equal(flat_x[: n - 1], stream[:-1])
    np.testing.assert_array_equal(flat_y[: n - 1], stream[1:])
    # The target of a segment's last position is the next segment's first input.
    np.testing.assert_array_equal(y[:-1, -1], x[1:, 0])
    assert flat_m.sum() == n - 1 and np.all(flat_m[: n - 1])
    assert np.all(flat_x[n - 1 :] == 0) and np.all(flat_y[n - 1 :] == 0)
    ex = src[0]
    assert set(ex) == {"inputs", "targets", "mask"} and ex["targets"].shape == (L,)


def test_cache_hit_rebuilds_nothing_and_a_changed_file_rebuilds(tmp_path, monkeypatch):
  root = tmp_path / "data"
  shutil.copytree(ROOT, root)
  cfg = _cfg(tmp_path / "cache", data_dir=str(root))
  first = tasks.make_task(cfg)
  arrays = {s: first.source(s).arrays for s in tasks.SPLITS}
  files = sorted(os.listdir(tmp_path / "cache"))
  assert len(files) == 4 and not any(f.startswith(".tmp") for f in files)

  def fail(*args, **kwargs):
    raise AssertionError("rebuilt although cached")

  monkeypatch.setattr(wt, "build_vocabulary", fail)
  monkeypatch.setattr(wt, "_encode_file", fail)
  second = tasks.make_task(cfg)
  for split in tasks.SPLITS:
    for key, value in second.source(split).arrays.items():
      np.testing.assert_array_equal(value, arrays[split][key])
  assert second.vocabulary() == WORDS
  monkeypatch.undo()
  # A different file (here: the same text, a new modification time) is a different key.
  path = root / "wikitext-103" / "wiki.test.tokens"
  os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
  third = tasks.make_task(cfg)
  np.testing.assert_array_equal(third.source("test").arrays["inputs"], arrays["test"]["inputs"])
  assert len(os.listdir(tmp_path / "cache")) == 5


def test_missing_file_names_the_path_and_the_command(tmp_path):
  task = tasks.make_task(_cfg(tmp_path / "cache", data_dir=str(tmp_path)))
  want = os.path.join(str(tmp_path), "wikitext-103", "wiki.train.tokens")
  with pytest.raises(FileNotFoundError) as e:
    task.source("validation")
  assert repr(want) in str(e.value)
  assert f"python scripts/download_data.py wikitext103 --data_dir {tmp_path}" in str(e.value)


def test_vocab_size_caps_and_checks(tmp_path):
  small = tasks.make_task(_cfg(tmp_path / "small", vocab_size=20))
  assert small.vocabulary() == WORDS[:20]
  ids = small.token_stream("train")
  kept = set(WORDS[:20])
  assert wt.decode(ids, small.vocabulary()) == [w if w in kept else "<unk>" for w in TRAIN]
  too_big = tasks.make_task(_cfg(tmp_path / "big", vocab_size=V + 1))
  with pytest.raises(ValueError, match=rf"vocab_size={V + 1}.*set config.task.vocab_size={V}"):
    too_big.source("train")
  for field, value in (("segment_length", 0), ("vocab_size", 3), ("segment_length", -4)):
    with pytest.raises(ValueError, match=f"config.task.{field} must be an integer"):
      tasks.make_task(_cfg(tmp_path, **{field: value}))


def test_bad_files(tmp_path, caplog):
  folder = tmp_path / "wikitext-103"
  folder.mkdir()
  shutil.copy(FILES["validation"], folder / "wiki.valid.tokens")
  (folder / "wiki.train.tokens").write_bytes(" = A = \n caf\xe9 \n".encode("latin-1"))
  task = tasks.make_task(_cfg(tmp_path / "cache", data_dir=str(tmp_path)))
  with pytest.raises(ValueError, match=r"wiki.train.tokens' is not UTF-8 text"):
    task.source("train")
  (folder / "wiki.train.tokens").write_text(" \n")
  with pytest.raises(ValueError, match="vocab_size=143, but .* has only 0 word types"):
    task.source("train")
  # A last line without its newline still ends in <eos>, with a warning (truncated copy?).
  (folder / "wiki.train.tokens").write_text(" a b \n c")
  with caplog.at_level(logging.WARNING):
    task = tasks.make_task(_cfg(tmp_path / "cache", data_dir=str(tmp_path), vocab_size=6))
    assert wt.decode(task.token_stream("train"), task.vocabulary()) == [
        "a",
        "b",
        "<eos>",
        "c",
        "<eos>",
    ]
  assert "has no newline" in caplog.text


def test_stream_batches_continue_row_by_row(task):
  cfg = base_config("wikitext103")
  cfg.update(batch_size=4, eval_batch_size=3)
  cfg.data.num_threads = 1
  src = task.source("train")  # 36 segments: 4 streams of 9
  s = len(src)
  steps = data_lib.num_stream_steps(s, 4)
  assert (s, steps) == (36, 9)
  it = data_lib.stream_train_iterator(src, cfg)
  batches = [next(it) for _ in range(steps + 2)]
  for t, b in enumerate(batches[:steps]):
    assert b["inputs"].shape == (4, L) and np.all(b["weight"] == 1.0)
    assert np.all(b["reset"] == (t == 0))
    for r in range(4):
      np.testing.assert_array_equal(b["inputs"][r], src.arrays["inputs"][r * steps + t])
    if t:  # row r continues row r of the step before
      np.testing.assert_array_equal(b["inputs"][:, 0], batches[t - 1]["targets"][:, -1])
  seen = np.concatenate([b["inputs"] for b in batches[:steps]])
  assert sorted(map(tuple, seen)) == sorted(map(tuple, src.arrays["inputs"]))
  for a, b in zip(batches[steps:], batches[:2]):  # the next epoch: same order, reset again
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  state = it.get_state()
  again = data_lib.stream_train_iterator(src, cfg)
  again.set_state(state)
  np.testing.assert_array_equal(next(again)["inputs"], next(it)["inputs"])
  # Evaluation: 3 streams of ceil(36 / 3) = 12, once; (validation) 7 segments -> 3 streams
  # of 3, the last 2 slots padding with weight 0.
  val = task.source("validation")
  assert len(val) == 7
  ev = list(data_lib.stream_eval_iterator(val, cfg))
  assert len(ev) == 3
  weights = np.stack([b["weight"] for b in ev], axis=1)  # [stream, step]
  np.testing.assert_array_equal(weights, [[1, 1, 1], [1, 1, 1], [1, 0, 0]])
  np.testing.assert_array_equal(ev[1]["inputs"][2], val.arrays["inputs"][7 % 7])
  np.testing.assert_array_equal(ev[2]["inputs"][1], val.arrays["inputs"][5])
  assert [bool(b["reset"].all()) for b in ev] == [True, False, False]
  assert len(list(data_lib.stream_eval_iterator(val, cfg, limit=2))) == 2


# Slow (a training run); the default run keeps a tiny run end to end (tests/train/test_exits.py)
# and this task's batches (the tests above).
@pytest.mark.slow
def test_train_and_evaluate_two_steps(tmp_path):
  """No memory: shuffled segments through a tiny causal decoder; perplexity reported."""
  c = base_config("wikitext103")
  c.task.update(data_dir=ROOT, cache_dir=str(tmp_path / "cache"), segment_length=L, vocab_size=V)
  c.model.update(
      num_layers=1, embed_dim=16, num_heads=2, mlp_dim=16, dropout_rate=0.0, positional="none"
  )
  c.update(
      batch_size=4,
      num_train_steps=2,
      log_every_steps=1,
      eval_every_steps=2,
      checkpoint_every_steps=2,
  )
  c.schedule.update(name="constant", warmup_steps=0)
  c.data.num_threads = 1
  r = train_and_evaluate(c, tmp_path / "work")
  val = r["validation"]
  assert r["step"] == 2 and val["num_examples"] == len(_tokens(FILES["validation"])) - 1
  assert np.isfinite(val["loss"]) and val["perplexity"] == pytest.approx(math.exp(val["loss"]))
  assert r["train"]["perplexity"] == pytest.approx(math.exp(r["train"]["loss"]))
  assert r["best"]["perplexity"] == val["perplexity"]
  assert r["carry"] == {}


def test_fingerprint_holds_what_the_train_and_validation_files_hold(tmp_path):
  """An edit of the train or validation file changes the run's data fingerprint (a resume on
  it is refused); the test file, which training never reads, does not."""
  root = tmp_path / "data"
  shutil.copytree(ROOT, root)
  cfg = _cfg(tmp_path / "cache", data_dir=str(root))
  before = tasks.make_task(cfg).fingerprint()
  assert before == tasks.make_task(cfg).fingerprint()
  folder = root / "wikitext-103"
  with open(folder / "wiki.test.tokens", "a", encoding="utf-8") as f:
    f.write(" an extra test line\n")
  assert tasks.make_task(cfg).fingerprint() == before
  for name in ("wiki.valid.tokens", "wiki.train.tokens"):
    text = (folder / name).read_text(encoding="utf-8")
    (folder / name).write_text(text.replace(" the ", " a ", 1), encoding="utf-8")
    after = tasks.make_task(cfg).fingerprint()
    assert after != before, name
    before = after
