"""WikiText-103: word-level language modelling from the raw release files.

Source: Merity et al. 2017, "Pointer Sentinel Mixture Models" (arXiv:1609.07843), the tokenised
release ``wikitext-103-v1.zip`` (s3.amazonaws.com/research.metamind.io/wikitext/, the link the
PermuteFormer paper gives). Fetch it with
``python scripts/download_data.py wikitext103 --data_dir DIR``; the task reads::

    DIR/wikitext-103/wiki.train.tokens   train       (about 1.8M lines, 103M tokens)
    DIR/wikitext-103/wiki.valid.tokens   validation  (about 3.8k lines, 218k tokens)
    DIR/wikitext-103/wiki.test.tokens    test        (about 4.4k lines, 246k tokens)

(Merity et al. count 103,227,021 / 217,646 / 245,569 tokens; not re-measured here: the real
files were not available where this was written). At ``segment_length = 512`` that is about
200k train segments (int32 inputs and targets: about 0.4 GB each). The files are already
tokenised by the dataset's authors: words separated by spaces, rare words replaced by
``<unk>``, numbers split with ``@,@`` / ``@.@`` / ``@-@``, headings as `` = Title = `` lines,
blank lines between paragraphs. The release's train vocabulary is 267,735 word types
(``<unk>`` included), each seen at least 3 times.

Preprocessing, exactly (the word streams are those of Transformer-XL's
``Vocab.encode_file(add_eos=True)`` and of fairseq's binariser; the id numbering is ours):

- each file is read as UTF-8 text, line by line as Python's text mode splits lines (``\\n``,
  ``\\r\\n``); EVERY line, blank ones included, gives its words (``str.split()``: any run of
  Unicode whitespace separates words, nothing else is touched, case is kept) followed by one
  ``<eos>``; a blank line is a lone ``<eos>``. A last line without a newline still gets its
  ``<eos>`` (with a warning: the release's files end in a newline, so this hints at a
  truncated copy). A literal ``<eos>`` word in the text is the same token.
- the vocabulary comes from the train file only: id 0 = padding (``<pad>``, never in a
  stream), 1 = ``<unk>``, 2 = ``<eos>``, then every other train word ordered by count
  (descending), ties by the word (Python string order), so ids are deterministic. The default
  ``vocab_size = 267_737`` (padding + ``<eos>`` + the release's 267,735 word types) keeps
  every train word; a smaller ``vocab_size`` keeps the ``vocab_size - 3`` most frequent words
  and maps the rest to ``<unk>``. ``vocab_size`` must be known without reading the data
  (``info_from_config``), so a value larger than the train file gives is an error that names
  the right one.
- validation / test words that are not in the vocabulary become ``<unk>`` (counted in the log).
- each split is one token stream ``t_0 .. t_{n-1}`` (lines concatenated in file order). Example
  ``s`` is the segment of ``L = segment_length`` positions starting at ``s * L``: ``inputs[s, i]
  = t_{sL+i}``, ``targets[s, i] = t_{sL+i+1}``, for the ``n - 1`` positions that have a next
  token; the last segment is padded (``inputs = targets = 0``, ``mask = False``). So every token
  but the first is a target exactly once, and segment ``s + 1`` continues segment ``s``
  (Transformer-XL's LMOrderedIterator cuts the stream the same way). ``mask`` is True for
  real, scored positions. Perplexity (``exp`` of the mean cross-entropy over all scored tokens,
  ``<eos>`` included, as the papers count) comes from the trainer for kind "lm".
- sliding-window evaluation (``config.task.eval_stride = S``, 0 < S < L; validation and test
  only): window ``w`` starts at ``w * S``; the first scores all its positions, each later one
  only its last S, so every target is scored once with at least L - S tokens before it
  (PermuteFormer's protocol: L = 512, S = 256). The scored positions are ``score``; ``mask``
  stays True on every real input, which the model attends to. 0 (default) or L: the
  non-overlapping segments above.

With a Transformer-XL memory (``config.model.memory_length > 0``) the trainer reads the segments
as ``batch_size`` contiguous streams (``fastpos.train.data.stream_train_iterator``); without
memory, training shuffles the segments like any other examples.

Cache: tokenising is pure Python (about 7 s for a synthetic 50 MB, 9.3M-token, 244k-word
train file on a loaded 2-core CPU, so roughly 1-2 minutes for the release's ~0.5 GB train
file), so the vocabulary (``vocab_<key>.json``) and every split's id stream
(``<split>_<key>.npy``, uint32 for the full vocabulary, uint16 when ``vocab_size <= 65536``)
are written once under ``config.task.cache_dir`` (default ``DIR/cache/wikitext103``). The key
hashes the cache version, ``vocab_size`` and the name, size and modification time of each
file it was built from; writes are atomic (temporary file, then ``os.replace``). A cached load reads
the stream and cuts it into segments, numpy only: 0.1 s for the 50 MB file above, about 5 s
for a 105M-token stream (most of it ``base.ArraySource``'s int32 copies).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Iterator, Sequence

import ml_collections
import numpy as np
from absl import logging

from fastpos.models.config import TaskInfo
from fastpos.tasks import base, paths

TASK = "wikitext103"
FILES = {"train": "wiki.train.tokens", "validation": "wiki.valid.tokens",
         "test": "wiki.test.tokens"}
PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"
PAD_ID, UNK_ID, EOS_ID = 0, 1, 2
NUM_SPECIAL = 3
# 267,735 word types of the release (<unk> included) + <eos> + padding.
RELEASE_VOCAB_SIZE = 267_737
CACHE_VERSION = 1
_READ_CHARS = 1 << 23  # whole lines read at a time (about 8 MB of text)


# ------------------------------------------------------------------------- reading

def _chunks(path: str) -> Iterator[list[str]]:
  """The file's lines, a few MB at a time; a decoding error names the file and the line."""
  with open(path, "r", encoding="utf-8") as f:
    line = 1
    while True:
      try:
        lines = f.readlines(_READ_CHARS)
      except UnicodeDecodeError as e:
        raise ValueError(
            f"{path!r} is not UTF-8 text (in the lines from line {line} on: {e.reason} at "
            f"byte {e.start} of the block read). Re-fetch the WikiText-103 release.") from e
      if not lines:
        return
      yield lines
      line += len(lines)


def _words(path: str) -> Iterator[list[str]]:
  """Lists of words with ``<eos>`` after every line (module docstring), chunk by chunk."""
  eos = f" {EOS} "
  lines_seen = 0
  for lines in _chunks(path):
    lines_seen += len(lines)
    text = "".join(lines)
    if not text.endswith("\n"):
      logging.warning("WikiText-103: %s: the last line (line %d) has no newline; the "
                      "release's files end in one, so the file may be truncated.", path,
                      lines_seen)
      text += "\n"
    yield text.replace("\n", eos).split()


def _file_key(path: str) -> dict:
  st = os.stat(path)
  return {"file": os.path.basename(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _digest(key: dict) -> str:
  return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]




def stream_dtype(vocab_size: int) -> np.dtype:
  """The smallest unsigned dtype that holds ids ``< vocab_size``."""
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# ---------------------------------------------------------------------- vocabulary

def build_vocabulary(train_path: str, vocab_size: int) -> tuple[list[str], np.ndarray,
                                                                  np.ndarray]:
  """Reads the train file once: (words by id, counts by id, the train id stream).

  Words get provisional ids in order of first appearance while reading; the counts then
  give the final order (``<unk>`` = 1, ``<eos>`` = 2, the rest by count descending, then by
  word) and one table lookup renumbers the stream. Words beyond the ``vocab_size - 3`` most
  frequent map to ``<unk>``.
  """
  index: dict[str, int] = {}
  parts = []
  for words in _words(train_path):
    setdefault = index.setdefault
    parts.append(np.array([setdefault(w, len(index)) for w in words], np.int64))
  stream = np.concatenate(parts) if parts else np.zeros(0, np.int64)
  if stream.size == 0:
    raise ValueError(f"{train_path!r} holds no text.")
  counts = np.bincount(stream, minlength=len(index))
  seen = list(index)
  others = sorted((i for i, w in enumerate(seen) if w not in (UNK, EOS)),
                  key=lambda i: (-counts[i], seen[i]))
  full = NUM_SPECIAL + len(others)
  if vocab_size > full:
    raise ValueError(
        f"config.task.vocab_size={vocab_size}, but {train_path!r} has only {len(others)} "
        f"word types besides <unk> / <eos>, i.e. {full} ids with padding, <unk> and <eos> "
        f"(the WikiText-103 release gives {RELEASE_VOCAB_SIZE}); set "
        f"config.task.vocab_size={full} or less.")
  kept = others[:vocab_size - NUM_SPECIAL]
  remap = np.full(len(seen), UNK_ID, np.int64)
  remap[kept] = np.arange(NUM_SPECIAL, vocab_size)
  remap[index[EOS]] = EOS_ID
  words = [PAD, UNK, EOS] + [seen[i] for i in kept]
  final_counts = np.bincount(remap, weights=counts, minlength=vocab_size).astype(np.int64)
  return words, final_counts, remap[stream].astype(stream_dtype(vocab_size))


def encode(words: Sequence[str], vocab: Sequence[str]) -> np.ndarray:
  """Ids of ``words`` (int32 ``[len(words)]``) in ``vocab``; unknown words -> ``<unk>``."""
  lookup = {w: i for i, w in enumerate(vocab) if i != PAD_ID}
  return np.array([lookup.get(w, UNK_ID) for w in words], np.int32)


def decode(ids: Sequence[int] | np.ndarray, vocab: Sequence[str]) -> list[str]:
  """Words of ``ids``; padding (0) is dropped."""
  return [vocab[int(i)] for i in np.asarray(ids).reshape(-1) if int(i) != PAD_ID]


def _encode_file(path: str, vocab: Sequence[str], dtype: np.dtype) -> tuple[np.ndarray, int]:
  """(id stream of ``path`` in ``vocab``, number of words mapped to ``<unk>``)."""
  lookup = {w: i for i, w in enumerate(vocab) if i != PAD_ID}
  parts, unknown = [], 0
  for words in _words(path):
    ids = np.array([lookup.get(w, -1) for w in words], np.int64)
    missing = ids < 0
    unknown += int(missing.sum())
    ids[missing] = UNK_ID
    parts.append(ids.astype(dtype))
  stream = np.concatenate(parts) if parts else np.zeros(0, dtype)
  if stream.size == 0:
    raise ValueError(f"{path!r} holds no text.")
  return stream, unknown


# ---------------------------------------------------------------------------- cache

class Corpus:
  """The vocabulary and the id streams of one data root, built once and cached.

  Args:
    data_dir: the data root (``paths.data_root``); files under ``wikitext-103/``.
    cache_dir: where the cache lives ("" / None: ``paths.cache_dir(data_dir, TASK)``).
    vocab_size: number of ids (module docstring).
  """

  def __init__(self, data_dir: str | None, cache_dir: str | None, vocab_size: int):
    self.data_dir = data_dir or None
    self.cache_dir = os.fspath(cache_dir) if cache_dir else paths.cache_dir(self.data_dir, TASK)
    self.vocab_size = vocab_size
    self._vocab: list[str] | None = None

  def path(self, split: str) -> str:
    """The release file of ``split``; raises ``paths.missing_data`` when it is absent."""
    if split not in FILES:
      raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(FILES)}.")
    path = paths.task_path(self.data_dir, paths.WIKITEXT_SUBDIR, FILES[split])
    return paths.require(TASK, path, self.data_dir, f"WikiText-103 {split} file")

  def _vocab_key(self) -> dict:
    return {"version": CACHE_VERSION, "vocab_size": self.vocab_size,
            "train": _file_key(self.path("train"))}

  def _cache_file(self, name: str, key: dict, ext: str) -> str:
    return os.path.join(self.cache_dir, f"{name}_{_digest(key)}.{ext}")

  def _build_train(self, vocab_file: str, train_file: str) -> np.ndarray:
    path = self.path("train")
    logging.info("WikiText-103: building the vocabulary from %s (once; cached in %s)", path,
                 self.cache_dir)
    words, counts, stream = build_vocabulary(path, self.vocab_size)
    record = {"key": self._vocab_key(), "words": words, "counts": counts.tolist()}
    paths.save_atomic(train_file, lambda f: np.save(f, stream))
    paths.save_atomic(vocab_file, lambda f: f.write(json.dumps(record).encode("utf-8")))
    logging.info("WikiText-103: %d ids, train stream of %d tokens (%d <unk>) cached in %s",
                 len(words), stream.size, counts[UNK_ID], self.cache_dir)
    self._vocab = words
    return stream

  def vocabulary(self) -> list[str]:
    """The words by id (``[vocab_size]``; id 0 is ``<pad>``)."""
    if self._vocab is None:
      key = self._vocab_key()
      vocab_file = self._cache_file("vocab", key, "json")
      if not os.path.exists(vocab_file):
        self._build_train(vocab_file, self._cache_file("train", key, "npy"))
      else:
        try:
          with open(vocab_file, encoding="utf-8") as f:
            record = json.load(f)
        except ValueError as e:  # bad JSON or not UTF-8: a damaged cache file
          raise ValueError(f"WikiText-103 cache file {vocab_file!r} is damaged ({e}); delete "
                           "it to rebuild.") from None
        if record.get("key") != key or len(record.get("words", ())) != self.vocab_size:
          raise ValueError(f"WikiText-103 cache file {vocab_file!r} does not hold the "
                           f"vocabulary of {key}; delete it to rebuild.")
        self._vocab = record["words"]
    return self._vocab

  def stream(self, split: str) -> np.ndarray:
    """The id stream of ``split`` (uint16 / uint32 ``[n]``), from the cache or built."""
    key = self._vocab_key()
    if split == "train":
      file = self._cache_file("train", key, "npy")
      vocab_file = self._cache_file("vocab", key, "json")
      if os.path.exists(file) and os.path.exists(vocab_file):
        return self._load(file, split)
      return self._build_train(vocab_file, file)
    split_key = {**key, split: _file_key(self.path(split))}
    file = self._cache_file(split, split_key, "npy")
    if os.path.exists(file):
      return self._load(file, split)
    stream, unknown = _encode_file(self.path(split), self.vocabulary(),
                                   stream_dtype(self.vocab_size))
    paths.save_atomic(file, lambda f: np.save(f, stream))
    logging.info("WikiText-103 %s: %d tokens, %d words not in the train vocabulary -> <unk>; "
                 "cached in %s", split, stream.size, unknown, file)
    return stream

  def _load(self, file: str, split: str) -> np.ndarray:
    stream = np.load(file, allow_pickle=False)
    want = stream_dtype(self.vocab_size)
    if stream.dtype != want or stream.ndim != 1 or stream.size < 2:
      raise ValueError(f"WikiText-103 cache file {file!r} holds {stream.dtype}{stream.shape}, "
                       f"not a {want} token stream; delete it to rebuild.")
    logging.info("WikiText-103 %s: %d tokens from the cache %s", split, stream.size, file)
    return stream


def segments(stream: np.ndarray, segment_length: int) -> dict[str, np.ndarray]:
  """The stream cut into consecutive segments (module docstring).

  Returns ``inputs``, ``targets`` int32 and ``mask`` bool, each ``[S, segment_length]`` with
  ``S = ceil((n - 1) / segment_length)``.
  """
  n = int(stream.size)
  if n < 2:
    raise ValueError(f"a token stream of {n} token(s) has nothing to predict.")
  s = math.ceil((n - 1) / segment_length)
  out = {"inputs": np.zeros((s, segment_length), np.int32),
         "targets": np.zeros((s, segment_length), np.int32),
         "mask": np.zeros((s, segment_length), bool)}
  out["inputs"].reshape(-1)[:n - 1] = stream[:-1]
  out["targets"].reshape(-1)[:n - 1] = stream[1:]
  out["mask"].reshape(-1)[:n - 1] = True
  return out


def windows(stream: np.ndarray, segment_length: int, stride: int) -> dict[str, np.ndarray]:
  """Sliding windows of ``segment_length`` every ``stride`` tokens (module docstring): the
  arrays of ``segments`` plus ``score`` (bool: the positions this window scores)."""
  n, length = int(stream.size), segment_length
  if n < 2:
    raise ValueError(f"a token stream of {n} token(s) has nothing to predict.")
  if not 0 < stride <= length:
    raise ValueError(f"eval_stride must be in (0, segment_length={length}]; got {stride}.")
  count = 1 + max(0, math.ceil((n - 1 - length) / stride))
  pos = np.arange(count)[:, None] * stride + np.arange(length)[None, :]   # input positions
  real = pos < n - 1
  take = np.minimum(pos, n - 2)
  out = {"inputs": np.where(real, stream[take], 0).astype(np.int32),
         "targets": np.where(real, stream[take + 1], 0).astype(np.int32), "mask": real}
  first = np.arange(count)[:, None] == 0
  out["score"] = real & (first | (np.arange(length)[None, :] >= length - stride))
  return out


# ----------------------------------------------------------------------------- task

class WikiTextTask(base.Task):
  """WikiText-103 word-level language modelling (module docstring); metric: perplexity."""
  task_name = TASK
  metric = "perplexity"
  metric_mode = "min"

  @classmethod
  def default_config(cls) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = cls.task_name
    c.data_dir = ""  # data root holding wikitext-103/wiki.*.tokens ("" = $FASTPOS_DATA_DIR)
    c.cache_dir = ""  # vocabulary + id streams ("" = <data root>/cache/wikitext103)
    # Tokens per example (the model's max_length; Transformer-XL's tgt_len). 512 as in the
    # PermuteFormer and LRPE WikiText-103 runs (fairseq tokens_per_sample).
    c.segment_length = 512
    # Ids: padding, <unk>, <eos> and the vocab_size - 3 most frequent train words (the rest
    # -> <unk>). 267_737 keeps every word of the release; it must not exceed what the train
    # file gives (the error names that number).
    c.vocab_size = RELEASE_VOCAB_SIZE
    # Validation / test: 0 = non-overlapping segments; S in (0, segment_length) = windows
    # every S tokens, each scoring its last S (every token once, >= L - S tokens of context).
    c.eval_stride = 0
    return c

  @classmethod
  def info_from_config(cls, cfg: ml_collections.ConfigDict) -> TaskInfo:
    for name, low in (("segment_length", 1), ("vocab_size", NUM_SPECIAL + 1)):
      value = cfg[name]
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"wikitext103: config.task.{name} must be an integer >= {low}; got "
                         f"{value!r}.")
    stride = cfg.get("eval_stride", 0)
    if (isinstance(stride, bool) or not isinstance(stride, (int, np.integer))
        or not 0 <= stride <= cfg.segment_length):
      raise ValueError(f"wikitext103: config.task.eval_stride must be an integer in [0, "
                       f"segment_length={cfg.segment_length}] (0: non-overlapping segments); "
                       f"got {stride!r}.")
    return TaskInfo(kind="lm", vocab_size=int(cfg.vocab_size), num_classes=0,
                    max_length=int(cfg.segment_length))

  def __init__(self, cfg: ml_collections.ConfigDict):
    super().__init__(cfg)
    self.corpus = Corpus(cfg.data_dir or None, cfg.cache_dir or None, int(cfg.vocab_size))

  def vocabulary(self) -> list[str]:
    """The words by id (id 0 = ``<pad>``, 1 = ``<unk>``, 2 = ``<eos>``)."""
    return self.corpus.vocabulary()

  def token_stream(self, split: str) -> np.ndarray:
    """The split as one id stream ``[n]`` (``<eos>`` after every line)."""
    return self.corpus.stream(_check_split(split))

  def load_split(self, split: str) -> dict[str, np.ndarray]:
    length, stride = int(self.cfg.segment_length), int(self.cfg.get("eval_stride", 0))
    if split != "train" and 0 < stride < length:
      return windows(self.token_stream(split), length, stride)
    return segments(self.token_stream(split), length)


def _check_split(split: str) -> str:
  if split not in base.SPLITS:
    raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(base.SPLITS)}.")
  return split
