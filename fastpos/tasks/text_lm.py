"""Your own text as a causal language-modelling task (task "text_lm"), byte or word level.

Input: ``config.task.paths``, UTF-8 text files and / or folders, comma-separated. A folder
gives every file under it whose name matches one of ``config.task.include``'s fnmatch patterns
(comma-separated; ``*.txt`` by default), hidden files and folders left out, sorted by relative
path; a file named directly is read whatever its name. The files, in the order named, are read
as one text: each file's bytes, with a newline appended when they do not end in one (an empty
file adds nothing). A missing path, a folder with no matching file, an empty text or a file
that is not UTF-8 stops with one error naming the path and the fix.

Split (deterministic; nothing random, nothing depends on the level): the text's ``n`` bytes are
cut into three contiguous parts, train first, then validation, then test (nanoGPT cuts its
Shakespeare the same way: the first 90% trains, the last 10% validates). Validation starts at
byte ``round((1 - v - t) n)`` and test at ``round((1 - t) n)`` (``v = validation_fraction``,
``t = test_fraction``; ``t = 0``: no test split), each cut moved forward to the start of the
next line, so no line, word or character is cut and both levels see the same text per split.

Levels (``config.task.level``):

- ``byte``: as LRA Text reads its reviews (``fastpos.tasks.text.encode``): id = UTF-8 byte + 1,
  257 ids, 0 is padding. The stream is the bytes themselves, so nothing is cached.
- ``word``: as WikiText-103 reads its files (``fastpos.tasks.wikitext``): every line gives its
  whitespace-separated words (case kept) and one ``<eos>``; the vocabulary (``<pad>``,
  ``<unk>``, ``<eos>``, then the ``vocab_size - 3`` most frequent train words by count, ties by
  word) comes from the train part only; other words become ``<unk>``. Tokenising is pure
  Python, so the vocabulary and the id streams are cached as WikiText-103's are
  (``wikitext.Corpus``) in ``config.task.cache_dir`` (default:
  ``paths.cache_dir``: ``~/.cache/fastpos/text_lm``, never the text's folder), keyed by the
  files' paths, sizes and modification times, the level, ``vocab_size`` and the fractions.

Examples and evaluation are WikiText-103's (``wikitext.segments`` / ``wikitext.windows``):
consecutive segments of ``segment_length`` tokens with next-token targets, and on validation /
test optionally sliding windows every ``eval_stride`` tokens, each scoring its last
``eval_stride`` positions. The metric is the loss in nats per token (per byte at byte level;
nanoGPT's character-level figure is the same quantity on ASCII text); perplexity is reported
beside it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import os
from typing import Any, Iterator, Sequence

import ml_collections
import numpy as np

from fastpos import fields
from fastpos.tasks import base, paths
from fastpos.tasks import text as byte_text
from fastpos.tasks import wikitext as wt
from fastpos.tasks.info import TaskInfo

TASK = "text_lm"
LEVELS = ("byte", "word")
CACHE_VERSION = 1
_FIELD_HINT = (
    "set config.task.paths to UTF-8 text files and / or folders, comma-separated "
    "(e.g. --config.task.paths=~/books/emma.txt,~/notes)"
)


# ------------------------------------------------------------------------------ files


def _patterns(include: str) -> list[str]:
  return [p.strip() for p in include.split(",") if p.strip()] or ["*"]


def _folder_files(folder: str, patterns: Sequence[str]) -> list[str]:
  """Files under ``folder`` whose names match a pattern, sorted by relative path; hidden
  files and folders (a leading ".") left out."""
  out = []
  for root, dirs, files in os.walk(folder):
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    out += [
        os.path.join(root, f)
        for f in sorted(files)
        if not f.startswith(".") and any(fnmatch.fnmatch(f, p) for p in patterns)
    ]
  for path in out:
    _require_regular(path)
  return sorted(out, key=lambda p: os.path.relpath(p, folder).split(os.sep))


def text_files(spec: str, include: str = "*.txt") -> list[str]:
  """The absolute paths of the files ``config.task.paths`` names (module docstring), in the
  order read. A file reached twice (named twice, or named and inside a folder named) is an
  error: its text would sit in two places, e.g. in train and in validation."""
  names = [p.strip() for p in str(spec).split(",") if p.strip()]
  if not names:
    raise ValueError(f"{TASK}: config.task.paths is empty; {_FIELD_HINT}.")
  files: list[str] = []
  for name in names:
    path = os.path.abspath(os.path.expanduser(name))
    if os.path.isdir(path):
      found = _folder_files(path, _patterns(include))
      if not found:
        raise FileNotFoundError(
            f"{TASK}: the folder {path!r} (config.task.paths) holds no file matching "
            f"config.task.include={include!r}; set config.task.include to patterns of its "
            f"files' names, comma-separated (e.g. '*.md,*.rst'; '*': every file)."
        )
      files += found
    elif os.path.isfile(path):
      if os.path.getsize(path) == 0:
        raise ValueError(
            f"{TASK}: {path!r} (config.task.paths) is empty; name a file that "
            f"holds text, or leave it out."
        )
      files.append(path)
    else:
      _require_regular(path)
      raise FileNotFoundError(
          f"{TASK}: {path!r} (config.task.paths) does not exist; " f"{_FIELD_HINT}."
      )
  seen: dict[str, str] = {}
  for path in files:
    real = os.path.realpath(path)
    if real in seen:
      raise ValueError(
          f"{TASK}: config.task.paths reaches {real!r} twice ({seen[real]!r} and {path!r}): "
          "its text would be read twice, into train and validation alike; name each file once."
      )
    seen[real] = path
  return files


def _require_regular(path: str) -> None:
  """ValueError when ``path`` is a FIFO, a device or a socket (reading it would block or
  never end)."""
  what = paths.special_file(path)
  if what:
    raise ValueError(
        f"{TASK}: {path!r} (config.task.paths) is not a regular file ({what}); {_FIELD_HINT}."
    )


def read_text(files: Sequence[str], digests: list[str] | None = None) -> bytes:
  """The files' bytes as one text, a newline after each that lacks one; checks UTF-8 and that
  no two files hold the same bytes (their text would be in two splits). ``digests``: the
  SHA-256 of each file's bytes is appended to it, in order."""
  parts, by_digest = [], {}
  for path in files:
    with open(path, "rb") as f:
      data = f.read()
    sha = hashlib.sha256(data).hexdigest()
    if sha in by_digest:
      raise ValueError(
          f"{TASK}: {by_digest[sha]!r} and {path!r} (config.task.paths) hold the same text: "
          "it would be read twice, into train and validation alike; leave one out."
      )
    by_digest[sha] = path
    if digests is not None:
      digests.append(sha)
    try:
      data.decode("utf-8")
    except UnicodeDecodeError as e:
      line = data.count(b"\n", 0, e.start) + 1
      raise ValueError(
          f"{TASK}: {path!r} is not UTF-8 text ({e.reason} at byte {e.start}, line {line}). "
          f"Convert it (e.g. `iconv -f latin1 -t utf-8`) or leave it out of "
          f"config.task.paths / config.task.include."
      ) from None
    parts.append(data if not data or data.endswith(b"\n") else data + b"\n")
  text = b"".join(parts)
  if not text:
    raise ValueError(
        f"{TASK}: the files of config.task.paths hold no text ({len(files)} "
        f"file(s), all empty); {_FIELD_HINT}."
    )
  return text


def _line_start(text: bytes, pos: int) -> int:
  """The first line start at or after byte ``pos`` (``len(text)`` if none)."""
  if pos <= 0 or text[pos - 1 : pos] == b"\n":
    return max(pos, 0)
  end = text.find(b"\n", pos)
  return len(text) if end < 0 else end + 1


def split_bounds(
    text: bytes, validation_fraction: float, test_fraction: float
) -> dict[str, tuple[int, int]]:
  """Byte ranges ``[start, end)`` of train / validation / test (module docstring)."""
  n = len(text)
  cut_val = _line_start(text, int(np.floor((1 - validation_fraction - test_fraction) * n + 0.5)))
  cut_test = max(cut_val, _line_start(text, int(np.floor((1 - test_fraction) * n + 0.5))))
  if test_fraction == 0:
    cut_test = n
  return {"train": (0, cut_val), "validation": (cut_val, cut_test), "test": (cut_test, n)}


def _word_chunks(text: str) -> Iterator[list[str]]:
  """WikiText-103's words (``wikitext.line_words``) of whole lines, a few MB at a time."""
  f = io.StringIO(text)
  while lines := f.readlines(1 << 23):
    yield wt.line_words("".join(lines))


# ---------------------------------------------------------------------------- checks


def _is_int(value) -> bool:
  return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _check_config(cfg: ml_collections.ConfigDict) -> None:
  if cfg.level not in LEVELS:
    raise ValueError(
        f"{TASK}: unknown config.task.level {cfg.level!r}; valid choices: " f"{', '.join(LEVELS)}."
    )
  if not isinstance(cfg.paths, str) or not isinstance(cfg.include, str):
    raise ValueError(
        f"{TASK}: config.task.paths and config.task.include are comma-separated "
        f"strings; got {cfg.paths!r} and {cfg.include!r}."
    )
  v, t = cfg.validation_fraction, cfg.test_fraction
  for name, value, low in (("validation_fraction", v, "(0"), ("test_fraction", t, "[0")):
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not ((0 < value < 1) if low == "(0" else (0 <= value < 1))
    ):
      raise ValueError(
          f"{TASK}: config.task.{name} must be a number in {low}, 1); got " f"{value!r}."
      )
  if v + t >= 1:
    raise ValueError(
        f"{TASK}: validation_fraction + test_fraction = {v + t:g} leaves no "
        f"train text; their sum must be below 1."
    )
  if not _is_int(cfg.segment_length) or cfg.segment_length < 1:
    raise ValueError(
        f"{TASK}: config.task.segment_length must be an integer >= 1; got "
        f"{cfg.segment_length!r}."
    )
  stride = cfg.eval_stride
  if not _is_int(stride) or not 0 <= stride <= cfg.segment_length:
    raise ValueError(
        f"{TASK}: config.task.eval_stride must be an integer in [0, "
        f"segment_length={cfg.segment_length}] (0: non-overlapping segments); "
        f"got {stride!r}."
    )


def vocab_size_of(cfg: ml_collections.ConfigDict) -> int:
  """The number of ids: 257 at byte level; ``config.task.vocab_size`` at word level."""
  size = cfg.vocab_size
  if cfg.level == "byte":
    if size not in (0, byte_text.VOCAB_SIZE) or isinstance(size, bool):
      raise ValueError(
          f"{TASK}: level='byte' has {byte_text.VOCAB_SIZE} ids (bytes + "
          f"padding); set config.task.vocab_size to 0 or "
          f"{byte_text.VOCAB_SIZE}, not {size!r}."
      )
    return byte_text.VOCAB_SIZE
  if not _is_int(size) or size < wt.NUM_SPECIAL + 1:
    raise ValueError(
        f"{TASK}: level='word' needs config.task.vocab_size, an integer >= "
        f"{wt.NUM_SPECIAL + 1} (padding, <unk>, <eos> and the most frequent train words); got "
        f"{size!r}. A value above what the train text gives stops naming the largest one."
    )
  return int(size)


# ---------------------------------------------------------------------------- corpus


class TextCorpus(wt.Corpus):
  """WikiText-103's cached vocabulary and id streams (``wikitext.Corpus``) over the train /
  validation / test parts of the user's text.

  Args:
    files: the files read (``text_files``); their paths, sizes and dates key the cache.
    part: split -> the split's text (str, whole lines); called only to build the cache.
    cache_dir: the cache folder.
    vocab_size: number of ids.
    fractions: (validation_fraction, test_fraction), part of the key.
  """

  label = TASK

  def __init__(
      self,
      files: Sequence[str],
      part,
      cache_dir: str,
      vocab_size: int,
      fractions: tuple[float, float],
  ):
    super().__init__(None, cache_dir, vocab_size)
    self.files, self.part, self.fractions = list(files), part, tuple(fractions)

  def _vocab_key(self) -> dict:
    stats = [os.stat(p) for p in self.files]
    return {
        "version": CACHE_VERSION,
        "task": TASK,
        "level": "word",
        "vocab_size": self.vocab_size,
        "fractions": list(self.fractions),
        "files": [[p, s.st_size, s.st_mtime_ns] for p, s in zip(self.files, stats)],
    }

  def _split_key(self, split: str) -> dict:
    return {**self._vocab_key(), "split": split}

  def _build_vocabulary(self) -> tuple[list[str], np.ndarray, np.ndarray]:
    source = f"the train split of config.task.paths ({len(self.files)} file(s))"
    return wt.vocabulary_from_words(_word_chunks(self.part("train")), self.vocab_size, source)

  def _encode_split(self, split: str) -> tuple[np.ndarray, int]:
    return wt.encode_words(
        _word_chunks(self.part(split)),
        self.vocabulary(),
        wt.stream_dtype(self.vocab_size),
        f"the {split} split of config.task.paths",
    )


# ------------------------------------------------------------------------------ task


class TextLmTask(base.Task):
  """Causal language modelling on the user's UTF-8 text (module docstring); metric: loss."""

  task_name = TASK
  config_fields = {
      # UTF-8 text files and / or folders, comma-separated, read in this order (required).
      "paths": fields.string("", valid="UTF-8 text files and / or folders, comma-separated"),
      # In folders: file-name patterns, comma-separated ("*": every file).
      "include": fields.string("*.txt", valid="comma-separated fnmatch patterns"),
      # "byte" (UTF-8 bytes + 1, 257 ids) or "word" (WikiText-103's rules).
      "level": fields.string("byte", LEVELS),
      # Ids. byte: 0 (= 257). word: padding, <unk>, <eos> and the vocab_size - 3 most
      # frequent train words (the rest -> <unk>); above what the train text gives is an
      # error naming it.
      "vocab_size": fields.integer(0, 0),
      # Contiguous byte fractions of the text (train first), cut at line starts; test may
      # be 0; validation_fraction + test_fraction < 1.
      "validation_fraction": fields.number(0.1, 0, 1, low_open=True, high_open=True),
      "test_fraction": fields.number(0.1, 0, 1, high_open=True),
      "cache_dir": fields.path(trajectory=False),  # word level: vocabulary + id streams
      "segment_length": fields.integer(256, 1),  # tokens per example (the model's max_length)
      # Validation / test: 0 = non-overlapping segments; S in (0, segment_length) = windows
      # every S tokens, each scoring its last S (every token once, >= L - S of context).
      "eval_stride": fields.integer(0, 0),
  }
  generated = True  # nothing to download: the user's own files
  metric = "loss"
  metric_mode = "min"

  @classmethod
  def info_from_config(cls, cfg: ml_collections.ConfigDict) -> TaskInfo:
    _check_config(cfg)
    return TaskInfo(
        kind="lm", vocab_size=vocab_size_of(cfg), num_classes=0, max_length=int(cfg.segment_length)
    )

  def __init__(self, cfg: ml_collections.ConfigDict):
    super().__init__(cfg)
    self._files: list[str] | None = None
    self._text: bytes | None = None
    self._bounds: dict[str, tuple[int, int]] | None = None
    self._corpus: TextCorpus | None = None
    self._digests: list[str] = []  # SHA-256 of each file's bytes, as read

  def files(self) -> list[str]:
    """The files read, in order (``text_files``)."""
    if self._files is None:
      self._files = text_files(self.cfg.paths, self.cfg.include)
    return self._files

  def has_split(self, split: str) -> bool:
    """False for the test split when ``test_fraction`` is 0 (it holds out none)."""
    return super().has_split(split) and not (split == "test" and self.cfg.test_fraction == 0)

  def split_text(self, split: str) -> bytes:
    """The UTF-8 bytes of ``split`` (whole lines); an empty split (test when test_fraction is
    0, or a text with too few lines) raises a ValueError naming the fraction to change."""
    split = _check_split(split)
    if self._text is None:
      self._digests = []
      self._text = read_text(self.files(), self._digests)
      self._bounds = split_bounds(self._text, self.cfg.validation_fraction, self.cfg.test_fraction)
    start, end = self._bounds[split]
    if end - start == 0:
      raise ValueError(self._empty(split))
    return self._text[start:end]

  def _empty(self, split: str) -> str:
    if split == "test" and self.cfg.test_fraction == 0:
      return (
          f"{TASK}: config.task.test_fraction=0 holds out no test split; set it above 0 "
          f"(the split changes, so retrain)."
      )
    lines = self._text.count(b"\n") if self._text is not None else 0
    return (
        f"{TASK}: the {split} split of the text of config.task.paths has nothing to "
        f"predict (cuts fall at line starts; the text has {lines} lines); {_fix(split)}."
    )

  def _word_corpus(self) -> TextCorpus:
    if self._corpus is None:
      cache = self.cfg.cache_dir or paths.cache_dir(TASK)
      self._corpus = TextCorpus(
          self.files(),
          lambda s: self.split_text(s).decode("utf-8"),
          cache,
          self.info.vocab_size,
          (self.cfg.validation_fraction, self.cfg.test_fraction),
      )
    return self._corpus

  def fingerprint(self) -> dict[str, Any]:
    """The settings, the SHA-256 of each file's bytes (read once: the text is kept) and, at
    word level, of the vocabulary (ids are positions in it)."""
    if self._text is None:  # a cached word-level stream does not read the text
      self.split_text("train")
    out = {
        **super().fingerprint(),
        "files": [[p, d] for p, d in zip(self.files(), self._digests)],
    }
    if self.cfg.level == "word":
      words = "\n".join(self.vocabulary()).encode("utf-8")
      out["vocabulary"] = hashlib.sha256(words).hexdigest()
    return out

  def vocabulary(self) -> list[str] | None:
    """Word level: the words by id (0 ``<pad>``, 1 ``<unk>``, 2 ``<eos>``); byte level: None."""
    return self._word_corpus().vocabulary() if self.cfg.level == "word" else None

  def token_stream(self, split: str) -> np.ndarray:
    """The split as one id stream (uint16 / uint32 ``[n]``)."""
    if self.cfg.level == "byte":
      return byte_text.encode(self.split_text(split)).astype(np.uint16)
    split = _check_split(split)
    if split == "test" and self.cfg.test_fraction == 0:
      raise ValueError(self._empty(split))
    return self._word_corpus().stream(split)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """The text of ids ``[n]`` (byte: undecodable bytes replaced; word: words joined by
    spaces, ``<eos>`` kept)."""
    if self.cfg.level == "byte":
      return byte_text.decode(np.asarray(ids), errors="replace")
    return " ".join(wt.decode(ids, self.vocabulary()))

  def load_split(self, split: str) -> dict[str, np.ndarray]:
    length, stride = int(self.cfg.segment_length), int(self.cfg.eval_stride)
    stream = self.token_stream(split)
    if stream.size < 2:
      raise ValueError(self._empty(split))
    if split != "train" and 0 < stride < length:
      return wt.windows(stream, length, stride)
    return wt.segments(stream, length)


def _fix(split: str) -> str:
  if split == "train":
    return "lower config.task.validation_fraction / test_fraction or give more text"
  return f"raise config.task.{split}_fraction or give more text"


def _check_split(split: str) -> str:
  if split not in base.SPLITS:
    raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(base.SPLITS)}.")
  return split
