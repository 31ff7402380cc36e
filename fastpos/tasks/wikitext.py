"""WikiText-103: word-level language modelling on the release's tokenised files.

Source: Merity et al. 2017 (arXiv:1609.07843), ``wikitext-103-v1.zip``, fetched by
``python scripts/download_data.py wikitext103 --data_dir DIR``; the task reads
``DIR/wikitext-103/wiki.{train,valid,test}.tokens`` (the words are already tokenised).

Each file becomes one token stream, as Transformer-XL's and fairseq's preprocessing make it:
every line, blank ones included, gives its words and one ``<eos>`` (``_words``). The
vocabulary comes from the train file only, in a deterministic order (``build_vocabulary``);
other words become ``<unk>``. Example ``s`` is the stream's ``s``-th segment of
``segment_length`` tokens with next-token targets, so segment ``s + 1`` continues segment ``s``
(``segments``); with a Transformer-XL memory the trainer reads the segments as contiguous
streams (``fastpos.train.data.stream_train_iterator``), else it shuffles them. Perplexity
counts ``<eos>``, as the papers do.

Tokenising is pure Python (1-2 minutes for the release's train file), so the vocabulary and
the id streams are built once and cached (``Corpus``).

Sliding-window evaluation (``config.task.eval_stride = S``, 0 < S < L; validation and test):
window ``w`` starts at ``w * S`` and scores only its last S positions (the first window all),
so every target is scored once with at least L - S tokens before it (``windows``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Iterable, Iterator, Sequence

import ml_collections
import numpy as np
from absl import logging

from fastpos import fields
from fastpos.tasks import base, paths
from fastpos.tasks.info import TaskInfo

TASK = "wikitext103"
FILES = {
    "train": "wiki.train.tokens",
    "validation": "wiki.valid.tokens",
    "test": "wiki.test.tokens",
}
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
            f"byte {e.start} of the block read). Re-fetch the WikiText-103 release."
        ) from e
      if not lines:
        return
      yield lines
      line += len(lines)


def _words(path: str) -> Iterator[list[str]]:
  """Lists of words with ``<eos>`` after every line, chunk by chunk.

  Lines are split as Python's text mode splits them (``\\n``, ``\\r\\n``); EVERY line, blank
  ones included, gives its words (``str.split()``: any run of whitespace separates words,
  case is kept) and one ``<eos>``, so a blank line is a lone ``<eos>``. A last line without a
  newline still gets its ``<eos>``, with a warning (the release's files end in one). A literal
  ``<eos>`` in the text is the same token.
  """
  lines_seen = 0
  for lines in _chunks(path):
    lines_seen += len(lines)
    text = "".join(lines)
    if not text.endswith("\n"):
      logging.warning(
          "WikiText-103: %s: the last line (line %d) has no newline; the "
          "release's files end in one, so the file may be truncated.",
          path,
          lines_seen,
      )
      text += "\n"
    yield line_words(text)


def line_words(text: str) -> list[str]:
  """The words of whole lines (``text`` ends in a newline), ``<eos>`` after every line
  (``_words``' rule: ``str.split()`` words, a blank line is a lone ``<eos>``)."""
  return text.replace("\n", f" {EOS} ").split()


def _file_key(path: str) -> dict:
  st = os.stat(path)
  # The absolute path: one cache folder serves every data root.
  return {"file": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _digest(key: dict) -> str:
  return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def stream_dtype(vocab_size: int) -> np.dtype:
  """The smallest unsigned dtype that holds ids ``< vocab_size``."""
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# ---------------------------------------------------------------------- vocabulary


def build_vocabulary(train_path: str, vocab_size: int) -> tuple[list[str], np.ndarray, np.ndarray]:
  """Reads the train file once: (words by id, counts by id, the train id stream)
  (``vocabulary_from_words`` of its words)."""
  return vocabulary_from_words(
      _words(train_path),
      vocab_size,
      repr(train_path),
      f" (the WikiText-103 release gives {RELEASE_VOCAB_SIZE})",
  )


def vocabulary_from_words(
    chunks: Iterable[list[str]], vocab_size: int, source: str, hint: str = ""
) -> tuple[list[str], np.ndarray, np.ndarray]:
  """(words by id, counts by id, the id stream) of the training words, read once.

  ``chunks`` are lists of words (``line_words``); ``source`` names them in errors and ``hint``
  follows the number of ids the text gives.

  Words get provisional ids in order of first appearance while reading; the counts then
  give the final order (``<pad>`` = 0, never in a stream, ``<unk>`` = 1, ``<eos>`` = 2, the rest
  by count descending, then by word) and one table lookup renumbers the stream. Words beyond
  the ``vocab_size - 3`` most frequent map to ``<unk>``. ``vocab_size`` is a config field
  (models are built before data are read), so one larger than the train file gives is an
  error naming the right value (267,737 for the release: its 267,735 word types, ``<unk>``
  included, plus ``<eos>`` and padding).
  """
  index: dict[str, int] = {}
  parts = []
  for words in chunks:
    setdefault = index.setdefault
    parts.append(np.array([setdefault(w, len(index)) for w in words], np.int64))
  stream = np.concatenate(parts) if parts else np.zeros(0, np.int64)
  if stream.size == 0:
    raise ValueError(f"{source} holds no text.")
  counts = np.bincount(stream, minlength=len(index))
  seen = list(index)
  others = sorted(
      (i for i, w in enumerate(seen) if w not in (UNK, EOS)), key=lambda i: (-counts[i], seen[i])
  )
  full = NUM_SPECIAL + len(others)
  if vocab_size > full:
    raise ValueError(
        f"config.task.vocab_size={vocab_size}, but {source} has only {len(others)} word "
        f"types besides <unk> / <eos>, i.e. {full} ids with padding, <unk> and <eos>{hint}; "
        f"set config.task.vocab_size={full} or less."
    )
  kept = others[: vocab_size - NUM_SPECIAL]
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
  return encode_words(_words(path), vocab, dtype, repr(path))


def encode_words(
    chunks: Iterable[list[str]], vocab: Sequence[str], dtype: np.dtype, source: str
) -> tuple[np.ndarray, int]:
  """(id stream of the words ``chunks`` in ``vocab``, number of words mapped to ``<unk>``);
  ``source`` names them in errors."""
  lookup = {w: i for i, w in enumerate(vocab) if i != PAD_ID}
  parts, unknown = [], 0
  for words in chunks:
    ids = np.array([lookup.get(w, -1) for w in words], np.int64)
    missing = ids < 0
    unknown += int(missing.sum())
    ids[missing] = UNK_ID
    parts.append(ids.astype(dtype))
  stream = np.concatenate(parts) if parts else np.zeros(0, dtype)
  if stream.size == 0:
    raise ValueError(f"{source} holds no text.")
  return stream, unknown


# ---------------------------------------------------------------------------- cache


class Corpus:
  """The vocabulary and the id streams of one data root, built once and cached.

  The cache holds ``vocab_<key>.json`` and each split's ``<split>_<key>.npy`` (uint16 when
  ``vocab_size <= 65536``, else uint32); the key hashes the cache version, ``vocab_size`` and
  the absolute path, size and modification time of each file it was built from, and writes are
  atomic. A cached load is numpy only (about 5 s for a 105M-token stream). Another text source
  (``fastpos.tasks.text_lm``) overrides the hooks ``_vocab_key``, ``_split_key``,
  ``_build_vocabulary``, ``_encode_split`` and ``label``.

  Args:
    data_dir: the data root (``paths.data_root``); files under ``wikitext-103/``.
    cache_dir: where the cache lives ("" / None: ``paths.cache_dir(TASK)``, never the data root).
    vocab_size: number of ids (``build_vocabulary``).
  """

  label = "WikiText-103"  # names the corpus in logs and errors

  def __init__(self, data_dir: str | None, cache_dir: str | None, vocab_size: int):
    self.data_dir = data_dir or None
    self.cache_dir = os.fspath(cache_dir) if cache_dir else paths.cache_dir(TASK)
    self.vocab_size = vocab_size
    self._vocab: list[str] | None = None

  def path(self, split: str) -> str:
    """The release file of ``split``; raises ``paths.missing_data`` when it is absent."""
    if split not in FILES:
      raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(FILES)}.")
    path = paths.task_path(self.data_dir, paths.WIKITEXT_SUBDIR, FILES[split])
    return paths.require(TASK, path, self.data_dir, f"WikiText-103 {split} file")

  def _vocab_key(self) -> dict:
    return {
        "version": CACHE_VERSION,
        "vocab_size": self.vocab_size,
        "train": _file_key(self.path("train")),
    }

  def _split_key(self, split: str) -> dict:
    return {**self._vocab_key(), split: _file_key(self.path(split))}

  def _build_vocabulary(self) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(words by id, counts by id, the train id stream): ``build_vocabulary``."""
    path = self.path("train")
    logging.info(
        "%s: building the vocabulary from %s (once; cached in %s)", self.label, path, self.cache_dir
    )
    return build_vocabulary(path, self.vocab_size)

  def _encode_split(self, split: str) -> tuple[np.ndarray, int]:
    """(the id stream of a split other than train, words mapped to ``<unk>``)."""
    return _encode_file(self.path(split), self.vocabulary(), stream_dtype(self.vocab_size))

  def _cache_file(self, name: str, key: dict, ext: str) -> str:
    return os.path.join(self.cache_dir, f"{name}_{_digest(key)}.{ext}")

  def _build_train(self, vocab_file: str, train_file: str) -> np.ndarray:
    words, counts, stream = self._build_vocabulary()
    record = {"key": self._vocab_key(), "words": words, "counts": counts.tolist()}
    paths.save_atomic(train_file, lambda f: np.save(f, stream))
    paths.save_atomic(vocab_file, lambda f: f.write(json.dumps(record).encode("utf-8")))
    logging.info(
        "%s: %d ids, train stream of %d tokens (%d <unk>) cached in %s",
        self.label,
        len(words),
        stream.size,
        counts[UNK_ID],
        self.cache_dir,
    )
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
          raise ValueError(
              f"{self.label} cache file {vocab_file!r} is damaged ({e}); " "delete it to rebuild."
          ) from None
        if record.get("key") != key or len(record.get("words", ())) != self.vocab_size:
          raise ValueError(
              f"{self.label} cache file {vocab_file!r} does not hold the "
              f"vocabulary of {key}; delete it to rebuild."
          )
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
    file = self._cache_file(split, self._split_key(split), "npy")
    if os.path.exists(file):
      return self._load(file, split)
    stream, unknown = self._encode_split(split)
    paths.save_atomic(file, lambda f: np.save(f, stream))
    logging.info(
        "%s %s: %d tokens, %d words not in the train vocabulary -> <unk>; cached in " "%s",
        self.label,
        split,
        stream.size,
        unknown,
        file,
    )
    return stream

  def _load(self, file: str, split: str) -> np.ndarray:
    stream = np.load(file, allow_pickle=False)
    want = stream_dtype(self.vocab_size)
    if stream.dtype != want or stream.ndim != 1 or stream.size < 2:
      raise ValueError(
          f"{self.label} cache file {file!r} holds {stream.dtype}"
          f"{stream.shape}, not a {want} token stream; delete it to rebuild."
      )
    logging.info("%s %s: %d tokens from the cache %s", self.label, split, stream.size, file)
    return stream


def segments(stream: np.ndarray, segment_length: int) -> dict[str, np.ndarray]:
  """The stream ``t_0 .. t_{n-1}`` cut into consecutive segments of ``L = segment_length``.

  Segment ``s`` has ``inputs[s, i] = t_{sL+i}`` and ``targets[s, i] = t_{sL+i+1}`` for the
  ``n - 1`` positions that have a next token; the last segment is padded (0, ``mask`` False).
  Every token but the first is a target exactly once (Transformer-XL's LMOrderedIterator cuts
  the stream the same way).

  Returns ``inputs``, ``targets`` int32 and ``mask`` bool, each ``[S, segment_length]`` with
  ``S = ceil((n - 1) / segment_length)``.
  """
  n = int(stream.size)
  if n < 2:
    raise ValueError(f"a token stream of {n} token(s) has nothing to predict.")
  s = math.ceil((n - 1) / segment_length)
  out = {
      "inputs": np.zeros((s, segment_length), np.int32),
      "targets": np.zeros((s, segment_length), np.int32),
      "mask": np.zeros((s, segment_length), bool),
  }
  out["inputs"].reshape(-1)[: n - 1] = stream[:-1]
  out["targets"].reshape(-1)[: n - 1] = stream[1:]
  out["mask"].reshape(-1)[: n - 1] = True
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
  pos = np.arange(count)[:, None] * stride + np.arange(length)[None, :]  # input positions
  real = pos < n - 1
  take = np.minimum(pos, n - 2)
  out = {
      "inputs": np.where(real, stream[take], 0).astype(np.int32),
      "targets": np.where(real, stream[take + 1], 0).astype(np.int32),
      "mask": real,
  }
  first = np.arange(count)[:, None] == 0
  out["score"] = real & (first | (np.arange(length)[None, :] >= length - stride))
  return out


# ----------------------------------------------------------------------------- task


class WikiTextTask(base.Task):
  """WikiText-103 word-level language modelling; metric: perplexity."""

  task_name = TASK
  config_fields = {
      "data_dir": fields.path(),  # data root holding wikitext-103/wiki.*.tokens ("": default)
      "cache_dir": fields.path(trajectory=False),  # vocabulary + id streams ("" = default)
      # Tokens per example (the model's max_length; Transformer-XL's tgt_len). 512 as in the
      # PermuteFormer and LRPE WikiText-103 runs (fairseq tokens_per_sample).
      "segment_length": fields.integer(512, 1),
      # Ids: padding, <unk>, <eos> and the vocab_size - 3 most frequent train words (the
      # rest -> <unk>). 267_737 keeps every word of the release; it must not exceed what the
      # train file gives (the error names that number).
      "vocab_size": fields.integer(RELEASE_VOCAB_SIZE, 4),
      # Validation / test: 0 = non-overlapping segments; S in (0, segment_length) = windows
      # every S tokens, each scoring its last S (every token once, >= L - S of context).
      "eval_stride": fields.integer(0, 0),
  }
  metric = "perplexity"
  metric_mode = "min"

  @classmethod
  def info_from_config(cls, cfg: ml_collections.ConfigDict) -> TaskInfo:
    for name, low in (("segment_length", 1), ("vocab_size", NUM_SPECIAL + 1)):
      value = cfg[name]
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(
            f"wikitext103: config.task.{name} must be an integer >= {low}; got " f"{value!r}."
        )
    stride = cfg.get("eval_stride", 0)
    if (
        isinstance(stride, bool)
        or not isinstance(stride, (int, np.integer))
        or not 0 <= stride <= cfg.segment_length
    ):
      raise ValueError(
          f"wikitext103: config.task.eval_stride must be an integer in [0, "
          f"segment_length={cfg.segment_length}] (0: non-overlapping segments); "
          f"got {stride!r}."
      )
    return TaskInfo(
        kind="lm", vocab_size=int(cfg.vocab_size), num_classes=0, max_length=int(cfg.segment_length)
    )

  def __init__(self, cfg: ml_collections.ConfigDict):
    super().__init__(cfg)
    self.corpus = Corpus(cfg.data_dir or None, cfg.cache_dir or None, int(cfg.vocab_size))

  def vocabulary(self) -> list[str]:
    """The words by id (id 0 = ``<pad>``, 1 = ``<unk>``, 2 = ``<eos>``)."""
    return self.corpus.vocabulary()

  def fingerprint(self) -> dict[str, Any]:
    """The settings and the SHA-256 of the train and validation files' bytes (what a training
    run reads; the vocabulary is built from the train file)."""
    out = super().fingerprint()
    files = [self.corpus.path(s) for s in ("train", "validation")]
    out["files"] = [[p, base.file_digest(p)] for p in files]
    return out

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
