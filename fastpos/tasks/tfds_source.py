"""Reading tensorflow-datasets splits without TensorFlow: what the tfds-backed tasks share.

The text and image tasks read the array_record files that ``scripts/download_data.py``
prepares under ``DIR/tfds/<dataset>[/<config>]/<version>/`` with ``tfds.data_source`` (random
access; TensorFlow is neither needed nor imported).

- ``prepared_version`` checks that a prepared version is on disk *before* tfds is called, and
  raises ``fastpos.tasks.paths.missing_data`` when it is not; tfds is then called with
  ``download=False`` and that version pinned, so it never downloads and never asks GCS for
  metadata (which it does for a version it cannot find).
- ``cached_split`` turns one tfds split into numpy arrays once (slow: every example is
  deserialised in Python) and caches them atomically, keyed by the task's parameters, the cache
  format version and the dataset files' paths, sizes and dates.
- ``carve_validation``: a validation split carved from train with a fixed seed (the sources
  have none, and the test split never picks a model).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
from absl import logging

from fastpos import fields
from fastpos.tasks import paths

READ_CHUNK = 1024  # examples fetched per data-source call

# The config.task fields of a task read through tfds (lra_text, lra_image, mnist).
FIELDS = {
    # Data root holding tfds/<dataset>/ ("": $FASTPOS_DATA_DIR, else ~/fastpos_data).
    "data_dir": fields.path(),
    "cache_dir": fields.path(trajectory=False),  # decoded splits are cached here ("": default)
    # Share of tfds train held out as the validation split (0.1: LRA's train[90%:]).
    "validation_fraction": fields.number(0.1, 0, 1, low_open=True, high_open=True),
    "validation_seed": fields.seed(),  # which train examples are held out (not the training seed)
}
_VERSION_RE = re.compile(r"^\d+\.\d+\.\d+$")


def dataset_folder(data_dir: str | None, name: str) -> str:
  """``<root>/tfds/<dataset>[/<config>]`` for a tfds name ``"dataset[/config]"``."""
  return paths.task_path(data_dir, paths.TFDS_SUBDIR, *name.split("/"))


def prepared_version(task: str, name: str, data_dir: str | None) -> str:
  """The newest prepared version (``"1.0.0"``) of tfds dataset ``name`` under the data root.

  Raises ``paths.missing_data`` when the dataset's folder is missing or holds no version folder
  with a ``dataset_info.json`` (an interrupted preparation leaves only ``incomplete.*``).
  """
  folder = dataset_folder(data_dir, name)
  if not os.path.isdir(folder):
    raise paths.missing_data(task, folder, data_dir, f"tfds dataset {name!r}")
  versions = []
  for entry in os.listdir(folder):
    if _VERSION_RE.match(entry) and os.path.isfile(
        os.path.join(folder, entry, "dataset_info.json")
    ):
      versions.append((tuple(int(p) for p in entry.split(".")), entry))
  if not versions:
    raise paths.missing_data(
        task,
        os.path.join(folder, "<version>", "dataset_info.json"),
        data_dir,
        f"{folder!r} holds no prepared version of tfds dataset {name!r}",
    )
  return max(versions)[1]


def fingerprint(folder: str) -> list[list]:
  """[relative path, size, mtime_ns] of every file under ``folder``, sorted."""
  out = []
  for root, _, files in os.walk(folder):
    for f in files:
      p = os.path.join(root, f)
      st = os.stat(p)
      out.append([os.path.relpath(p, folder), st.st_size, st.st_mtime_ns])
  return sorted(out)


def open_split(
    task: str, name: str, version: str, split: str, data_dir: str | None
) -> Sequence[Any]:
  """``tfds.data_source`` of one split (random access; examples are dicts of numpy values).

  Call ``prepared_version`` first (it is what makes this call safe from downloads).
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top (slow import)

  folder = dataset_folder(data_dir, name)
  try:
    return tfds.data_source(
        f"{name}:{version}",
        split=split,
        data_dir=paths.task_path(data_dir, paths.TFDS_SUBDIR),
        download=False,
        try_gcs=False,
    )
  except NotImplementedError as e:  # prepared in another format (tfds's default: tfrecord)
    raise ValueError(
        f"task {task!r}: tfds dataset {name!r} in {os.path.join(folder, version)!r} is not in "
        f"the array_record format that random access needs ({e}). Delete {folder!r} and "
        f"prepare it again with `{paths.fetch_command(task, data_dir)}`."
    ) from e
  except Exception as e:  # a missing shard, an unreadable dataset_info.json, ...
    raise broken_dataset(task, name, os.path.join(folder, version), data_dir, e) from e


def broken_dataset(
    task: str, name: str, folder: str, data_dir: str | None, error: BaseException
) -> ValueError:
  """The error for a prepared tfds dataset that cannot be read (incomplete or corrupt)."""
  return ValueError(
      f"task {task!r}: tfds dataset {name!r} in {folder!r} cannot be read "
      f"({type(error).__name__}: {error}); its files are incomplete or corrupt. Delete "
      f"{os.path.dirname(folder)!r} and fetch it again with "
      f"`{paths.fetch_command(task, data_dir)}`."
  )


def iter_chunks(source: Sequence[Any], chunk: int = READ_CHUNK) -> Iterator[tuple[int, list[Any]]]:
  """(index of the first example, examples) over ``source`` in order, ``chunk`` at a time."""
  n = len(source)
  for start in range(0, n, chunk):
    keys = list(range(start, min(n, start + chunk)))
    items = source.__getitems__(keys)
    if len(items) != len(keys):
      raise ValueError(
          f"data source {source!r} returned {len(items)} examples for "
          f"{len(keys)} keys starting at {start}."
      )
    yield start, list(items)


def carve_validation(n: int, fraction: float, seed: int) -> dict[str, np.ndarray]:
  """Indices of a seeded random validation split carved from ``n`` training examples.

  ``round(fraction * n)`` examples (at least 1, at most n - 1) drawn by
  ``np.random.default_rng(seed).permutation(n)`` go to "validation", the rest to "train";
  both index arrays are sorted (the source's order is kept), disjoint and cover ``range(n)``.
  """
  n_val = int(np.floor(fraction * n + 0.5))
  if not 1 <= n_val <= n - 1:
    raise ValueError(
        f"validation_fraction={fraction} of {n} training examples gives "
        f"{n_val} validation examples; it must leave at least one example in "
        f"each of train and validation."
    )
  perm = np.random.default_rng(seed).permutation(n)
  return {"train": np.sort(perm[n_val:]), "validation": np.sort(perm[:n_val])}


def split_indices(split: str, n: int, fraction: float, seed: int) -> np.ndarray:
  """Indices into the tfds split that ``split`` reads: all ``n`` of "test"; the carved part
  (``carve_validation``) of the ``n`` train examples for "train" / "validation"."""
  if split == "test":
    return np.arange(n)
  if split not in ("train", "validation"):
    raise ValueError(f"unknown split {split!r}; valid splits: train, validation, test.")
  return carve_validation(n, fraction, seed)[split]


def check_fraction_and_seed(fraction, seed) -> None:
  """ValueError unless 0 < ``fraction`` < 1 and ``seed`` is an integer >= 0."""
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (0 < fraction < 1):
    raise ValueError(f"validation_fraction must be a number in (0, 1), got {fraction!r}.")
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f"validation_seed must be an integer >= 0, got {seed!r}.")


def _load(path: str, key_json: str, names: Sequence[str]) -> dict[str, np.ndarray]:
  try:
    with np.load(path, allow_pickle=False) as z:
      stored = {k: z[k] for k in z.files}
  except Exception as e:  # truncated / not an npz: zipfile, EOF, pickle errors
    raise ValueError(
        f"cache file {path!r} is unreadable ({type(e).__name__}: {e}); delete it " f"to rebuild."
    ) from None
  if set(stored) != set(names) | {"key"} or str(stored["key"]) != key_json:
    raise ValueError(
        f"cache file {path!r} does not hold the arrays asked for ({key_json}); "
        f"delete it to rebuild."
    )
  return {k: stored[k] for k in names}


def cached_split(
    *,
    task: str,
    name: str,
    split: str,
    data_dir: str | None,
    cache_dir: str | None,
    params: Mapping[str, Any],
    version: int,
    fields: Sequence[str],
    build: Callable[[Sequence[Any], str], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
  """The arrays ``build(source, split)`` makes of tfds split ``split``, cached.

  Args:
    task: the task's registry name (messages, cache file names, default cache folder).
    name: the tfds name, ``"dataset[/config]"``.
    split: the tfds split ("train", "test").
    data_dir: the data root (``config.task.data_dir``; "" / None: the default root).
    cache_dir: the cache folder; "" / None: ``paths.cache_dir(task)``.
    params: the task's parameters that change the arrays (JSON-able); part of the key.
    version: the task's cache format version; part of the key.
    fields: the names of the arrays ``build`` returns.
    build: reads the data source and returns the arrays (numpy, no object arrays).

  Missing data raise ``paths.missing_data`` before tfds is called.
  """
  tfds_version = prepared_version(task, name, data_dir)
  folder = os.path.join(dataset_folder(data_dir, name), tfds_version)
  key = {
      "task": task,
      "cache_version": int(version),
      "tfds_name": name,
      "tfds_version": tfds_version,
      "split": split,
      "params": dict(params),
      "folder": os.path.abspath(folder),  # one cache folder serves every data root
      "files": fingerprint(folder),
  }
  key_json = json.dumps(key, sort_keys=True)
  digest = hashlib.sha256(key_json.encode()).hexdigest()[:16]
  cache_root = cache_dir or paths.cache_dir(task)
  desc = "_".join(f"{k}{v}" for k, v in sorted(params.items()))
  path = os.path.join(
      os.fspath(cache_root), f"{task}_v{version}_{split}{'_' + desc if desc else ''}_{digest}.npz"
  )
  if os.path.exists(path):
    t = time.time()
    out = _load(path, key_json, fields)
    logging.info(
        "%s: %s split of %s:%s read from the cache %s (%.1f s)",
        task,
        split,
        name,
        tfds_version,
        path,
        time.time() - t,
    )
    return out
  t = time.time()
  source = open_split(task, name, tfds_version, split, data_dir)
  logging.info(
      "%s: preprocessing %d examples of %s:%s %s (once; cached afterwards)",
      task,
      len(source),
      name,
      tfds_version,
      split,
  )
  try:
    out = build(source, split)
  except (RuntimeError, OSError) as e:  # array_record / PNG decoding errors of a bad shard
    raise broken_dataset(task, name, folder, data_dir, e) from e
  if sorted(out) != sorted(fields):
    raise RuntimeError(
        f"internal error: {task} built arrays {sorted(out)}, not " f"{sorted(fields)}."
    )
  paths.save_npz_atomic(path, {**out, "key": np.array(key_json)})
  logging.info(
      "%s: %s split of %s:%s preprocessed in %.1f s and cached at %s",
      task,
      split,
      name,
      tfds_version,
      time.time() - t,
      path,
  )
  return out
