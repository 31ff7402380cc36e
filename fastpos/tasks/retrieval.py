"""LRA Retrieval: does one paper cite the other? Byte-level document pairs of the ACL Anthology
Network (AAN), read by a dual encoder.

Source: Long Range Arena (Tay et al. 2021, Sec. 3.3), built on AAN (Radev et al. 2013).
``python scripts/download_data.py lra_retrieval --data_dir DIR`` unpacks the release's
``DIR/lra_release/tsv_data/new_aan_pairs.{train,eval,test}.tsv`` (~147K / 18K / 17K pairs as
commonly reported; the loader logs the counts); validation is LRA's ``eval`` file, never test.

As LRA's ``tokenizer='char'``: each text is its raw bytes, id = byte + 1 (vocabulary 257, 0 is
padding), cut to ``max_length`` bytes (LRA: 4000; almost every paper is longer, so truncation
is the normal case) and zero-padded. Target: 1 when the pair is linked by a citation. The
tokenised bytes are cached once per split (``load_split``).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterator

import ml_collections
import numpy as np
from absl import logging

from fastpos import fields
from fastpos.tasks import base, paths
from fastpos.tasks.info import TaskInfo

TASK = "lra_retrieval"
SPLITS = base.SPLITS
TSV_SUBDIR = "tsv_data"  # under the data root's lra_release/
TSV_FILES = {
    "train": "new_aan_pairs.train.tsv",
    "validation": "new_aan_pairs.eval.tsv",
    "test": "new_aan_pairs.test.tsv",
}
COLUMNS = ("label", "id1", "id2", "text1", "text2")
VOCAB_SIZE = 257  # byte + 1; 0 is padding
NUM_CLASSES = 2
ON_OVERFLOW = base.ON_OVERFLOW
CACHE_VERSION = 1
_LABELS = {b"0": 0, b"1": 1, b"0.0": 0, b"1.0": 1}


# ------------------------------------------------------------------------- tokens


def encode(text: bytes | str) -> np.ndarray:
  """Token ids of a document, int32 ``[num_bytes]``: byte + 1 (a str is UTF-8 encoded)."""
  if isinstance(text, str):
    text = text.encode("utf-8")
  if not isinstance(text, (bytes, bytearray)):
    raise ValueError(f"encode expects bytes or str, got {type(text).__name__}.")
  return np.frombuffer(bytes(text), np.uint8).astype(np.int32) + 1


def decode(ids: np.ndarray) -> bytes:
  """The bytes of token ids ``[length]``; trailing padding (0) is dropped.

  Raises ValueError for ids outside [0, 257) or padding followed by a real token.
  """
  ids = np.asarray(ids)
  if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
    raise ValueError(
        f"decode expects a 1-D integer sequence, got dtype {ids.dtype} and shape " f"{ids.shape}."
    )
  bad = np.nonzero((ids < 0) | (ids >= VOCAB_SIZE))[0]
  if bad.size:
    raise ValueError(
        f"token id {int(ids[bad[0]])} at position {int(bad[0])} is outside " f"[0, {VOCAB_SIZE})."
    )
  real = np.nonzero(ids)[0]
  n = int(real[-1]) + 1 if real.size else 0
  if np.any(ids[:n] == 0):
    pos = int(np.nonzero(ids[:n] == 0)[0][0])
    raise ValueError(f"padding id 0 at position {pos} comes before a real token.")
  return (ids[:n] - 1).astype(np.uint8).tobytes()


# ------------------------------------------------------------------------ files


def tsv_dir(data_dir: str | os.PathLike | None) -> str:
  """``<root>/lra_release/tsv_data``: the folder of the AAN TSVs under the data root."""
  return paths.task_path(data_dir, paths.LRA_SUBDIR, TSV_SUBDIR)


def tsv_path(data_dir: str | os.PathLike | None, split: str) -> str:
  """The TSV of ``split`` under the data root."""
  _check_split(split)
  return os.path.join(tsv_dir(data_dir), TSV_FILES[split])


def _bad_line(path: str, line_no: int, what: str) -> ValueError:
  return ValueError(
      f"{path}:{line_no}: {what} The file is damaged or is not an LRA Retrieval "
      "TSV: re-fetch it (`python scripts/download_data.py lra_retrieval`) or fix "
      "that line."
  )


def read_tsv(path: str | os.PathLike) -> Iterator[tuple[int, int, str, str, bytes, bytes]]:
  """(line number, label, id1, id2, text1, text2) of every line of an AAN pairs TSV.

  The format of LRA's ``matching/input_pipeline.py``: no header, one pair per line, five
  tab-separated columns ``label, id1, id2, text1, text2``, no quoting. Lines end in ``\\n`` (a
  trailing ``\\r`` is dropped); the label is 0 or 1 (``0`` / ``1`` or ``0.0`` / ``1.0``, as LRA
  reads it as a float). Texts are the raw bytes of their column. Raises FileNotFoundError for
  a missing file and ValueError naming the file and line for a line without five columns or
  with a bad label.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"LRA Retrieval file {path!r} not found.")
  for line_no, line in paths.read_lines(path):
    if not line:
      raise _bad_line(
          path, line_no, "empty line (expected 5 tab-separated columns " f"{', '.join(COLUMNS)})."
      )
    cols = line.split(b"\t")
    if len(cols) != len(COLUMNS):
      raise _bad_line(
          path,
          line_no,
          f"expected {len(COLUMNS)} tab-separated columns "
          f"({', '.join(COLUMNS)}), got {len(cols)}.",
      )
    label = _LABELS.get(cols[0].strip())
    if label is None:
      raise _bad_line(path, line_no, f"label {cols[0][:20]!r} is not 0 or 1.")
    yield (
        line_no,
        label,
        cols[1].decode("utf-8", "replace"),
        cols[2].decode("utf-8", "replace"),
        cols[3],
        cols[4],
    )


# ----------------------------------------------------------------------- splits


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}.")


def _check_int(name: str, value, low: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
    raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")


def _check_args(split, max_length, num_examples, on_overflow) -> None:
  _check_split(split)
  _check_int("max_length", max_length, 1)
  _check_int("num_examples", num_examples, 0)
  if on_overflow not in ON_OVERFLOW:
    raise ValueError(
        f"unknown on_overflow {on_overflow!r}; valid choices: " f"{', '.join(ON_OVERFLOW)}."
    )


def _cache_file(cache_dir: str, key: dict) -> str:
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
  return os.path.join(
      cache_dir,
      f"aan_v{CACHE_VERSION}_{key['split']}_max{key['max_length']}_"
      f"n{key['num_examples']}_{key['on_overflow']}_{digest}.npz",
  )


def _warn_truncated(split: str, pairs: int, docs: int, n: int, max_length: int) -> None:
  logging.warning(
      "lra_retrieval %s: truncated %d of %d examples to %d tokens (%d of %d "
      "documents were longer).",
      split,
      pairs,
      n,
      max_length,
      docs,
      2 * n,
  )


def _tokenise(
    path: str, split: str, max_length: int, num_examples: int, on_overflow: str
) -> dict[str, np.ndarray]:
  rows = []
  for line_no, label, _, _, text1, text2 in read_tsv(path):
    if on_overflow == "error":
      for name, text in (("text1", text1), ("text2", text2)):
        if len(text) > max_length:
          raise ValueError(
              f"{path}:{line_no}: {name} has {len(text)} bytes, more than "
              f"max_length={max_length} (on_overflow='error'; 'truncate' keeps "
              f"the first max_length bytes)."
          )
    # Only what is kept is held (the full lengths are counted for the warning).
    rows.append(
        (
            label,
            text1[:max_length],
            text2[:max_length],
            (len(text1) > max_length) + (len(text2) > max_length),
        )
    )
    if num_examples and len(rows) == num_examples:
      break
  if num_examples > len(rows):
    raise ValueError(f"num_examples={num_examples} but {path!r} holds {len(rows)} pairs.")
  if not rows:
    raise ValueError(f"{path!r} holds no pairs.")
  n = len(rows)
  out = {
      "bytes1": np.zeros((n, max_length), np.uint8),
      "bytes2": np.zeros((n, max_length), np.uint8),
      "length1": np.zeros(n, np.int32),
      "length2": np.zeros(n, np.int32),
      "targets": np.zeros(n, np.uint8),
  }
  long_docs = 0
  long_pairs = 0
  for i, (label, text1, text2, over) in enumerate(rows):
    for j, text in ((1, text1), (2, text2)):
      out[f"bytes{j}"][i, : len(text)] = np.frombuffer(text, np.uint8)
      out[f"length{j}"][i] = len(text)
    long_docs += over
    long_pairs += over > 0
    out["targets"][i] = label
  out["num_truncated"] = np.array([long_pairs, long_docs], np.int64)
  return out


def _ids(raw: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  mask = np.arange(raw.shape[1])[None, :] < lengths[:, None]
  return np.where(mask, raw.astype(np.int32) + 1, 0).astype(np.int32), mask


def load_split(
    split: str,
    *,
    data_dir: str | os.PathLike | None,
    max_length: int = 4000,
    num_examples: int = 0,
    cache_dir: str | None = None,
    on_overflow: str = "truncate",
) -> dict[str, np.ndarray]:
  """One split: ``inputs`` / ``inputs2`` int32 ``[n, max_length]`` (byte + 1, 0-padded),
  ``mask`` / ``mask2`` bool ``[n, max_length]``, ``targets`` int32 ``[n]`` (0 or 1), in the
  file's order (row i of every array is line i of the TSV).

  Args:
    split: "train", "validation" (LRA's ``eval`` file) or "test".
    data_dir: the data root (``paths.data_root``); the file is ``tsv_path(data_dir, split)``.
    max_length: bytes kept per document (LRA: 4000).
    num_examples: the first ``num_examples`` pairs of the file (0: all).
    cache_dir: folder of the tokenised cache ("" / None: ``paths.cache_dir(TASK)``):
      tokenising ~330K documents takes tens of seconds, so each split is saved once as uint8
      bytes + lengths (~1.2 GB for train at 4000) in an ``.npz`` named by a hash of everything
      that changes it (file path, size and date, the other arguments, ``CACHE_VERSION``).
    on_overflow: a document longer than ``max_length``: "truncate" (one counted warning per
      split) or "error".
  """
  _check_args(split, max_length, num_examples, on_overflow)
  path = tsv_path(data_dir, split)
  paths.require(TASK, path, data_dir, f"the LRA Retrieval (AAN) {split} pairs")
  st = os.stat(path)
  key = {
      "version": CACHE_VERSION,
      "split": split,
      "path": os.path.abspath(path),
      "size": st.st_size,
      "mtime_ns": st.st_mtime_ns,
      "max_length": int(max_length),
      "num_examples": int(num_examples),
      "on_overflow": on_overflow,
  }
  cache_dir = os.fspath(cache_dir) if cache_dir else paths.cache_dir(TASK)
  cache_path = _cache_file(cache_dir, key)
  stored = None
  if os.path.exists(cache_path):
    stored = _load_cache(cache_path, key)
    logging.info(
        "lra_retrieval %s: %d pairs from the cache %s",
        split,
        stored["targets"].shape[0],
        cache_path,
    )
  if stored is None:
    stored = _tokenise(path, split, max_length, num_examples, on_overflow)
    paths.save_npz_atomic(cache_path, {**stored, "key": np.array(json.dumps(key, sort_keys=True))})
    logging.info(
        "lra_retrieval %s: tokenised %d pairs of %s; cached in %s",
        split,
        stored["targets"].shape[0],
        path,
        cache_path,
    )
  pairs, docs = (int(x) for x in stored["num_truncated"])
  if pairs:
    _warn_truncated(split, pairs, docs, stored["targets"].shape[0], max_length)
  inputs, mask = _ids(stored["bytes1"], stored["length1"])
  inputs2, mask2 = _ids(stored["bytes2"], stored["length2"])
  return {
      "inputs": inputs,
      "mask": mask,
      "inputs2": inputs2,
      "mask2": mask2,
      "targets": stored["targets"].astype(np.int32),
  }


def _load_cache(path: str, key: dict) -> dict[str, np.ndarray]:
  try:
    with np.load(path, allow_pickle=False) as z:
      stored = {k: z[k] for k in z.files}
  except (OSError, ValueError, EOFError) as e:
    raise ValueError(
        f"lra_retrieval cache file {path!r} is unreadable ({e}); delete it to " f"rebuild."
    ) from None
  want = json.dumps(key, sort_keys=True)
  fields = {"bytes1", "bytes2", "length1", "length2", "targets", "num_truncated", "key"}
  if set(stored) != fields or str(stored["key"]) != want:
    raise ValueError(
        f"lra_retrieval cache file {path!r} does not hold the split asked for "
        f"({want}); delete it to rebuild."
    )
  n = stored["targets"].shape[0]
  shape = (n, key["max_length"])
  if (
      stored["bytes1"].shape != shape
      or stored["bytes2"].shape != shape
      or stored["bytes1"].dtype != np.uint8
      or stored["length1"].shape != (n,)
      or stored["length2"].shape != (n,)
  ):
    raise ValueError(
        f"lra_retrieval cache file {path!r} has arrays of the wrong shape; delete "
        f"it to rebuild."
    )
  return stored


# ------------------------------------------------------------------------- task


class RetrievalTask(base.Task):
  """LRA Retrieval (AAN): 2-class classification of a pair of byte-level documents."""

  task_name = TASK
  config_fields = {
      # Data root (fastpos.tasks.paths; "" = $FASTPOS_DATA_DIR, else ~/fastpos_data): reads
      # <root>/lra_release/tsv_data/new_aan_pairs.{train,eval,test}.tsv.
      "data_dir": fields.path(),
      "cache_dir": fields.path(trajectory=False),  # tokenised splits ("" = paths.cache_dir)
      "max_length": fields.integer(4000, 1),  # bytes kept per document (LRA: 4000)
      # Longer documents: "truncate" (counted warning) or "error".
      "on_overflow": fields.string("truncate", ON_OVERFLOW),
      # Pairs per split: the first n lines of the file; 0 = all (LRA: ~147K / 18K / 17K).
      **base.split_sizes(),
  }

  @classmethod
  def info_from_config(cls, cfg: ml_collections.ConfigDict) -> TaskInfo:
    _check_int("max_length", cfg.max_length, 1)
    for name in ("num_train", "num_validation", "num_test"):
      _check_int(name, cfg[name], 0)
    if cfg.on_overflow not in ON_OVERFLOW:
      raise ValueError(
          f"unknown on_overflow {cfg.on_overflow!r}; valid choices: " f"{', '.join(ON_OVERFLOW)}."
      )
    return TaskInfo(
        kind="retrieval", vocab_size=VOCAB_SIZE, num_classes=NUM_CLASSES, max_length=cfg.max_length
    )

  def load_split(self, split: str) -> dict[str, np.ndarray]:
    cfg = self.cfg
    n = {"train": cfg.num_train, "validation": cfg.num_validation, "test": cfg.num_test}[split]
    return load_split(
        split,
        data_dir=cfg.data_dir or None,
        max_length=cfg.max_length,
        num_examples=n,
        cache_dir=cfg.cache_dir or None,
        on_overflow=cfg.on_overflow,
    )
