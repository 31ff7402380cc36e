"""LRA Text: byte-level sentiment classification of IMDB movie reviews (task "lra_text").

Source: the Long Range Arena's text task (Tay et al. 2021, Sec. 3.2) on the IMDB reviews of
Maas et al. (2011): tfds ``imdb_reviews/plain_text`` 1.0.0 (train 25,000 / test 25,000, 0 =
neg, 1 = pos), prepared by ``python scripts/download_data.py lra_text --data_dir DIR`` and read
through ``tfds.data_source`` (no TensorFlow).

IMDB has no validation split: ``validation_fraction`` (0.1) of train is held out with a seeded
permutation (train 22,500 / validation 2,500 / test 25,000); LRA itself validates on test,
which here never picks a model. As LRA's ``ByteTextEncoder``: the review's UTF-8 bytes, HTML
and all, id = byte + 1 (vocabulary 257, 0 is padding), truncated to ``max_length`` bytes (LRA:
4,000; one warning per split counts the truncated reviews, or ``on_overflow="error"`` raises)
and zero-padded; a cut may split a multi-byte character (``decode``'s ``errors``). The bytes of
each tfds split are cached once (``fastpos.tasks.tfds_source``).
"""

from __future__ import annotations

from typing import Any, Sequence

import ml_collections
import numpy as np
from absl import logging

from fastpos import fields
from fastpos.tasks import base, tfds_source
from fastpos.tasks.info import TaskInfo

TFDS_NAME = "imdb_reviews/plain_text"
VOCAB_SIZE = 257  # 256 byte values + padding
NUM_CLASSES = 2
ON_OVERFLOW = base.ON_OVERFLOW
CACHE_VERSION = 1
# The tfds split each task split is read from (validation is carved from train).
TFDS_SPLIT = {"train": "train", "validation": "train", "test": "test"}


def encode(text: str | bytes) -> np.ndarray:
  """Token ids of a text, int32 ``[num_bytes]``: its UTF-8 bytes + 1 (never 0)."""
  if isinstance(text, str):
    text = text.encode("utf-8")
  if not isinstance(text, (bytes, bytearray)):
    raise ValueError(f"encode expects str or bytes, got {type(text).__name__}.")
  return np.frombuffer(bytes(text), np.uint8).astype(np.int32) + 1


def decode(ids: Sequence[int] | np.ndarray, errors: str = "strict") -> str:
  """The text of token ids ``[length]``; trailing padding (id 0) is dropped.

  ``errors`` is passed to ``bytes.decode`` ("replace" for rows whose truncation cut a
  multi-byte character). Raises ValueError for ids outside [0, 257) or padding followed by a
  real token.
  """
  ids = np.asarray(ids)
  if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
    raise ValueError(
        f"decode expects a 1-D integer sequence, got dtype {ids.dtype} and shape " f"{ids.shape}."
    )
  bad = np.nonzero((ids < 0) | (ids >= VOCAB_SIZE))[0]
  if bad.size:
    raise ValueError(
        f"token id {int(ids[bad[0]])} at position {int(bad[0])} is outside the "
        f"byte vocabulary (valid ids: 0..{VOCAB_SIZE - 1})."
    )
  real = np.nonzero(ids)[0]
  n = int(real[-1]) + 1 if real.size else 0
  inner_pad = np.nonzero(ids[:n] == 0)[0]
  if inner_pad.size:
    raise ValueError(
        f"padding id 0 at position {int(inner_pad[0])} comes before a real token "
        f"(padding may only trail)."
    )
  return (ids[:n] - 1).astype(np.uint8).tobytes().decode("utf-8", errors=errors)


def _review_bytes(example: Any, index: int, split: str) -> bytes:
  text = example["text"]
  if isinstance(text, str):  # tfds mock data give str; the array_record files give bytes
    text = text.encode("utf-8")
  elif isinstance(text, np.ndarray) and text.shape == ():
    text = text.item()
  if not isinstance(text, bytes):
    raise ValueError(
        f"{TFDS_NAME} {split} example {index}: 'text' is a "
        f"{type(text).__name__}, expected bytes."
    )
  if not text:
    raise ValueError(f"{TFDS_NAME} {split} example {index}: empty review.")
  return text


def read_reviews(source: Sequence[Any], split: str, max_length: int) -> dict[str, np.ndarray]:
  """Every review of a tfds ``imdb_reviews`` data source as arrays.

  Returns:
    ``bytes`` uint8 ``[n, max_length]`` (the first ``max_length`` bytes, then 0),
    ``lengths`` int64 ``[n]`` (the full byte length, before truncation),
    ``labels`` int8 ``[n]`` (0 = neg, 1 = pos).
  """
  n = len(source)
  data = np.zeros((n, max_length), np.uint8)
  lengths = np.empty(n, np.int64)
  labels = np.empty(n, np.int8)
  for start, chunk in tfds_source.iter_chunks(source):
    for i, ex in enumerate(chunk, start):
      b = _review_bytes(ex, i, split)
      m = min(len(b), max_length)
      data[i, :m] = np.frombuffer(b, np.uint8, count=m)
      lengths[i] = len(b)
      label = int(ex["label"])
      if label not in (0, 1):
        raise ValueError(f"{TFDS_NAME} {split} example {i}: label {label} is not 0 or 1.")
      labels[i] = label
  return {"bytes": data, "lengths": lengths, "labels": labels}


def to_ids(data: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """Token ids uint16 ``[n, L]`` from bytes ``[n, L]`` and full lengths ``[n]``: byte + 1 on
  the first ``min(length, L)`` positions, 0 after."""
  width = data.shape[1]
  ids = np.empty(data.shape, np.uint16)  # one pass over memory: this runs on every load
  ids[...] = data
  ids += 1
  for i in np.nonzero(lengths < width)[0]:
    ids[i, lengths[i] :] = 0
  return ids


class TextTask(base.Task):
  """LRA byte-level text classification on IMDB (module docstring): 2 classes, accuracy."""

  task_name = "lra_text"
  config_fields = {
      **tfds_source.FIELDS,
      "max_length": fields.integer(4000, 1),  # bytes per review, padded / truncated (LRA: 4000)
      # Longer reviews: "truncate" (LRA) or "error".
      "on_overflow": fields.string("truncate", ON_OVERFLOW),
  }

  @classmethod
  def info_from_config(cls, cfg: ml_collections.ConfigDict) -> TaskInfo:
    ml = cfg.max_length
    if isinstance(ml, bool) or not isinstance(ml, (int, np.integer)) or ml < 1:
      raise ValueError(f"lra_text: max_length must be an integer >= 1, got {ml!r}.")
    if cfg.on_overflow not in ON_OVERFLOW:
      raise ValueError(
          f"lra_text: unknown on_overflow {cfg.on_overflow!r}; valid choices: "
          f"{', '.join(ON_OVERFLOW)}."
      )
    tfds_source.check_fraction_and_seed(cfg.validation_fraction, cfg.validation_seed)
    return TaskInfo(
        kind="classify", vocab_size=VOCAB_SIZE, num_classes=NUM_CLASSES, max_length=int(ml)
    )

  def __init__(self, cfg: ml_collections.ConfigDict):
    super().__init__(cfg)
    self._raw: dict[str, dict[str, np.ndarray]] = {}  # tfds split -> cached arrays

  def raw_split(self, tfds_split: str) -> dict[str, np.ndarray]:
    """The cached arrays of a tfds split (``read_reviews``), read or built once."""
    if tfds_split not in self._raw:
      cfg = self.cfg
      max_length = self.info.max_length
      self._raw[tfds_split] = tfds_source.cached_split(
          task=self.task_name,
          name=TFDS_NAME,
          split=tfds_split,
          data_dir=cfg.data_dir or None,
          cache_dir=cfg.cache_dir or None,
          params={"len": max_length},
          version=CACHE_VERSION,
          fields=("bytes", "lengths", "labels"),
          build=lambda src, s: read_reviews(src, s, max_length),
      )
    return self._raw[tfds_split]

  def load_split(self, split: str) -> dict[str, np.ndarray]:
    raw = self.raw_split(TFDS_SPLIT[split])
    idx = tfds_source.split_indices(
        split, raw["labels"].shape[0], self.cfg.validation_fraction, self.cfg.validation_seed
    )
    lengths = raw["lengths"][idx]
    max_length = self.info.max_length
    long = np.nonzero(lengths > max_length)[0]
    if long.size:
      if self.cfg.on_overflow == "error":
        i = int(long[0])
        raise ValueError(
            f"lra_text {split} example {i} ({TFDS_NAME} {TFDS_SPLIT[split]} example "
            f"{int(idx[i])}) has {int(lengths[i])} bytes, more than max_length={max_length} "
            f"(on_overflow='error'; 'truncate' keeps the first max_length bytes, as LRA does)."
        )
      logging.warning(
          "lra_text %s: truncated %d of %d examples to %d tokens (bytes), as LRA " "does.",
          split,
          long.size,
          idx.size,
          max_length,
      )
    return {
        "inputs": to_ids(raw["bytes"][idx], lengths),
        "targets": raw["labels"][idx].astype(np.int32),
    }
