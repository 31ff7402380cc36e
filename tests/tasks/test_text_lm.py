"""Your own text as a task (``text_lm``): file listing, the contiguous split, byte / word
streams, the word cache, errors, sliding-window evaluation against a direct one, and two
training steps through the trainer.

The text is generated here (seeded words, blank lines, non-ASCII characters, a file without
its last newline) and written to temporary folders; expected values are computed from the
written bytes independently of the module's reader.
"""

from __future__ import annotations

import collections
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos import tasks
from fastpos.models import build_model
from fastpos.tasks import text_lm
from fastpos.tasks import wikitext as wt
from fastpos.train import cli, train_and_evaluate
from fastpos.train.steps import loss_and_metrics

WORDS = ["the", "a", "harbour", "light", "Zürich", "naïve", "漢字", "sea", "ship", "and", ","]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lines(rng, n):
  out = []
  for _ in range(n):
    k = int(rng.integers(0, 9))  # 0: a blank line
    out.append(" ".join(rng.choice(WORDS, k)))
  return out


@pytest.fixture
def corpus(tmp_path):
  """A folder of generated text: two .txt files (one nested, one without its final newline),
  a .md file, a hidden file and a hidden folder; returns (folder, the bytes read in order)."""
  rng = np.random.default_rng(0)
  root = tmp_path / "texts"
  (root / "b_sub").mkdir(parents=True)
  (root / ".hidden").mkdir()
  a = "\n".join(_lines(rng, 60)) + "\n"
  b = "\n".join(_lines(rng, 50))  # no final newline: the reader adds one
  (root / "a.txt").write_text(a, encoding="utf-8")
  (root / "b_sub" / "b.txt").write_text(b, encoding="utf-8")
  (root / "c.md").write_text("not read with the default include\n")
  (root / ".h.txt").write_text("hidden\n")
  (root / ".hidden" / "x.txt").write_text("hidden\n")
  return root, (a + b + "\n").encode("utf-8")


def _cfg(paths, cache, **kw):
  c = tasks.task_config("text_lm")
  c.update(paths=str(paths), cache_dir=str(cache), segment_length=16)
  c.update(**kw)
  return c


def test_files_are_listed_in_order_with_patterns(corpus, tmp_path):
  root, _ = corpus
  assert text_lm.text_files(str(root)) == [str(root / "a.txt"), str(root / "b_sub" / "b.txt")]
  assert text_lm.text_files(str(root), "*.md, *.txt") == [
      str(root / "a.txt"),
      str(root / "b_sub" / "b.txt"),
      str(root / "c.md"),
  ]
  # A file named directly is read whatever its name, in the order named.
  assert text_lm.text_files(f"{root / 'c.md'},{root}") == [
      str(root / "c.md"),
      str(root / "a.txt"),
      str(root / "b_sub" / "b.txt"),
  ]
  # Reached twice (named, and in a folder named): its text would be in two splits.
  with pytest.raises(ValueError, match=r"reaches .*a.txt' twice"):
    text_lm.text_files(f"{root / 'c.md'},{root},{root / 'a.txt'}")


def test_split_is_contiguous_at_line_starts_and_deterministic(corpus, tmp_path):
  root, data = corpus
  task = tasks.make_task(_cfg(root, tmp_path / "c", validation_fraction=0.2, test_fraction=0.15))
  parts = [task.split_text(s) for s in tasks.SPLITS]
  assert b"".join(parts) == data  # disjoint, contiguous, train first, nothing lost
  n = len(data)
  for part, start_fraction in zip(parts[1:], (0.65, 0.85)):
    start = data.index(part) if part else n
    assert start == 0 or data[start - 1 : start] == b"\n"  # cut at a line start
    assert (
        0 <= start - round(start_fraction * n) < data[round(start_fraction * n) :].index(b"\n") + 2
    )  # the first line start at or after the fraction
  again = tasks.make_task(_cfg(root, tmp_path / "d", validation_fraction=0.2, test_fraction=0.15))
  for split in tasks.SPLITS:
    np.testing.assert_array_equal(again.token_stream(split), task.token_stream(split))
  word = tasks.make_task(
      _cfg(
          root,
          tmp_path / "e",
          validation_fraction=0.2,
          test_fraction=0.15,
          level="word",
          vocab_size=8,
      )
  )
  assert [word.split_text(s) for s in tasks.SPLITS] == parts  # the same text at both levels


def test_bytes_round_trip(corpus, tmp_path):
  root, data = corpus
  task = tasks.make_task(_cfg(root, tmp_path / "c"))
  streams = [task.token_stream(s) for s in tasks.SPLITS]
  assert task.info.vocab_size == 257 and all(s.dtype == np.uint16 for s in streams)
  whole = np.concatenate(streams)
  np.testing.assert_array_equal(whole, np.frombuffer(data, np.uint8).astype(np.int64) + 1)
  assert "".join(task.decode(s) for s in streams) == data.decode("utf-8")
  assert task.vocabulary() is None
  src = task.source("train")  # WikiText-103's segments of the stream
  x, y = src.arrays["inputs"].reshape(-1), src.arrays["targets"].reshape(-1)
  n = streams[0].size
  np.testing.assert_array_equal(x[: n - 1], streams[0][:-1])
  np.testing.assert_array_equal(y[: n - 1], streams[0][1:])
  assert not (tmp_path / "c").exists()  # bytes: nothing to cache


def test_words_vocabulary_from_train_only_round_trip_and_cache(corpus, tmp_path, monkeypatch):
  root, data = corpus
  cache = tmp_path / "cache"
  task = tasks.make_task(_cfg(root, cache, level="word", vocab_size=9))
  parts = [task.split_text(s).decode("utf-8") for s in tasks.SPLITS]
  words = {
      s: [w for line in p.split("\n")[:-1] for w in line.split() + ["<eos>"]]
      for s, p in zip(tasks.SPLITS, parts)
  }
  counts = collections.Counter(words["train"])
  ranked = sorted((w for w in counts if w != "<eos>"), key=lambda w: (-counts[w], w))
  assert task.vocabulary() == ["<pad>", "<unk>", "<eos>"] + ranked[:6]
  for split in tasks.SPLITS:
    want = [w if w in task.vocabulary() else "<unk>" for w in words[split]]
    assert wt.decode(task.token_stream(split), task.vocabulary()) == want
    assert task.decode(task.token_stream(split)) == " ".join(want)
  files = sorted(os.listdir(cache))
  assert len(files) == 4 and sorted(os.listdir(root)) == [
      ".h.txt",
      ".hidden",
      "a.txt",
      "b_sub",
      "c.md",
  ]  # nothing written beside the text

  def fail(*args, **kwargs):
    raise AssertionError("rebuilt although cached")

  monkeypatch.setattr(wt, "vocabulary_from_words", fail)
  monkeypatch.setattr(wt, "encode_words", fail)
  again = tasks.make_task(_cfg(root, cache, level="word", vocab_size=9))
  for split in tasks.SPLITS:
    np.testing.assert_array_equal(again.token_stream(split), task.token_stream(split))
  monkeypatch.undo()
  full = 3 + len(ranked)
  with pytest.raises(ValueError, match=rf"set config.task.vocab_size={full} or less"):
    tasks.make_task(_cfg(root, cache, level="word", vocab_size=full + 1)).source("train")


def test_errors_name_the_path_or_field_and_the_fix(tmp_path):
  missing = tmp_path / "nope.txt"
  with pytest.raises(
      FileNotFoundError,
      match=rf"'{missing}' \(config.task.paths\) does not " r"exist; set config.task.paths",
  ):
    tasks.make_task(_cfg(missing, tmp_path)).source("train")
  with pytest.raises(ValueError, match="config.task.paths is empty"):
    tasks.make_task(_cfg("", tmp_path)).source("train")
  folder = tmp_path / "docs"
  folder.mkdir()
  (folder / "a.rst").write_text("text\n")
  with pytest.raises(
      FileNotFoundError,
      match=r"holds no file matching " r"config.task.include='\*.txt'.*'\*.md,\*.rst'",
  ):
    tasks.make_task(_cfg(folder, tmp_path)).source("train")
  (folder / "empty.txt").write_text("")
  with pytest.raises(ValueError, match=r"empty.txt' \(config.task.paths\) is empty"):
    tasks.make_task(_cfg(folder / "empty.txt", tmp_path)).source("train")
  with pytest.raises(ValueError, match=r"hold no text \(1 file\(s\), all empty\)"):
    tasks.make_task(_cfg(folder, tmp_path)).source("train")
  (folder / "latin.txt").write_bytes("line one\ncaf\xe9\n".encode("latin-1"))
  with pytest.raises(
      ValueError, match=r"latin.txt' is not UTF-8 text \(.* at byte 12, line " r"2\). Convert it"
  ):
    tasks.make_task(_cfg(folder, tmp_path)).source("train")
  bad = [
      ({"level": "char"}, r"unknown config.task.level 'char'; valid choices: byte, word"),
      ({"validation_fraction": 0.0}, r"validation_fraction must be a number in \(0, 1\)"),
      ({"test_fraction": 1.0}, r"test_fraction must be a number in \[0, 1\)"),
      ({"validation_fraction": 0.6, "test_fraction": 0.4}, "their sum must be below 1"),
      ({"vocab_size": 300}, "level='byte' has 257 ids"),
      ({"level": "word"}, "level='word' needs config.task.vocab_size"),
      ({"eval_stride": 17}, r"eval_stride must be an integer in \[0, segment_length=16\]"),
      ({"segment_length": 0}, "segment_length must be an integer >= 1"),
  ]
  for fields, message in bad:
    with pytest.raises(ValueError, match=message):
      tasks.make_task(_cfg(folder, tmp_path, **fields))


def test_short_text_and_missing_test_split(tmp_path):
  path = tmp_path / "t.txt"
  path.write_text("one line only, no other\n")
  task = tasks.make_task(_cfg(path, tmp_path))
  assert len(task.source("train")) == 2  # the one line: validation and test cuts fall at its end
  with pytest.raises(
      ValueError,
      match="the validation split .* has nothing to predict .* 1 "
      "lines.*raise config.task.validation_fraction",
  ):
    task.source("validation")
  path.write_text("".join(f"line {i}\n" for i in range(40)))
  task = tasks.make_task(_cfg(path, tmp_path, test_fraction=0.0))
  assert len(task.source("validation")) > 0
  with pytest.raises(ValueError, match="test_fraction=0 holds out no test split"):
    task.source("test")


ROWS = 256  # every batch of the sliding-window test is padded to this: one compile


@pytest.fixture(scope="module")
def lm():
  """A tiny causal model (learned absolute positions: outputs depend on where a window
  starts) and its jitted logits ``[ROWS, 16] -> [ROWS, 16, 257]``."""
  cfg = cli.load_config(os.path.join(ROOT, "configs", "text_lm.py:tiny"))
  cfg.model.update(num_layers=1, embed_dim=16, num_heads=2, mlp_dim=16, positional="absolute")
  info = text_lm.TextLmTask.info_from_config(_cfg("unused", "unused"))
  model = build_model(cfg.model, info)
  x = jnp.ones((ROWS, info.max_length), jnp.int32)
  params = jax.jit(
      lambda: model.init(
          {"params": jax.random.PRNGKey(0)}, {"inputs": x, "mask": x > 0}, train=False
      )
  )()
  apply = jax.jit(lambda x: model.apply(params, {"inputs": x, "mask": x > 0}, train=False))
  score = jax.jit(lambda x, b: loss_and_metrics(apply(x), b, "lm")[1]["loss"])

  def pad(x):
    assert x.shape[0] <= ROWS
    return np.pad(np.asarray(x), ((0, ROWS - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))

  def logits(inputs):
    return np.asarray(apply(pad(inputs)), np.float64)[: inputs.shape[0]]

  def loss(arrays):  # (sum, count) of the trainer's loss over the rows (padded rows weigh 0)
    batch = {k: pad(v) for k, v in arrays.items()}
    batch["weight"] = pad(np.ones(arrays["inputs"].shape[0], np.float32))
    return tuple(float(v) for v in score(batch["inputs"], batch))

  return logits, loss


@pytest.mark.parametrize("stride", [0, 5])
def test_sliding_window_loss_equals_a_direct_evaluation(corpus, tmp_path, lm, stride):
  """Each scored target's log-probability, recomputed from its own context alone (the window
  start the protocol gives it, run through the model truncated and padded), sums to the
  loss the trainer's ``loss_and_metrics`` reads from the task's windows."""
  root, _ = corpus
  length = 16
  task = tasks.make_task(_cfg(root, tmp_path, eval_stride=stride, segment_length=length))
  logits, loss = lm
  arrays = task.source("validation").arrays
  if "score" not in arrays:  # non-overlapping segments: the same program, every real token
    arrays = {**arrays, "score": arrays["mask"]}
  total, count = loss(arrays)

  stream = task.token_stream("validation").astype(np.int32)
  n, step = stream.size, stride or length
  contexts = np.zeros((n - 1, length), np.int32)
  last = np.zeros(n - 1, np.int32)
  for i in range(n - 1):  # target stream[i + 1], scored by window w
    w = 0 if i < length else (i - length) // step + 1
    ctx = stream[w * step : i + 1]
    contexts[i, : ctx.size], last[i] = ctx, ctx.size - 1
  out = logits(contexts)[np.arange(n - 1), last]  # [n - 1, 257], float64
  top = out.max(-1)
  logp = out[np.arange(n - 1), stream[1:]] - top - np.log(np.exp(out - top[:, None]).sum(-1))
  want = -float(logp.sum())
  assert count == n - 1 and len(arrays["inputs"]) > (n - 1) // length
  assert abs(total - want) <= 1e-5 * abs(want), (total, want)


# Slow (a training run); the default run keeps a tiny run end to end (tests/train/test_exits.py)
# and this task's batches (the tests above).
@pytest.mark.slow
def test_train_and_evaluate_two_steps(corpus, tmp_path):
  root, data = corpus
  c = cli.load_config(os.path.join(ROOT, "configs", "text_lm.py:tiny"))
  c.task.update(
      paths=str(root), include="*.txt", cache_dir=str(tmp_path / "cache"), segment_length=16
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
  cut = text_lm.split_bounds(data, 0.1, 0.0)["validation"]
  assert r["step"] == 2 and val["num_examples"] == cut[1] - cut[0] - 1
  assert abs(val["loss"] - math.log(257)) < 0.5  # barely trained: near uniform over bytes
  assert val["perplexity"] == pytest.approx(math.exp(val["loss"]))
  assert r["best"]["loss"] == val["loss"]
