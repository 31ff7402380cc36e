"""What every task gives the trainer: its ``TaskInfo``, random-access splits and a metric.

A task is data plus a metric; it is not a training loop (README "Design"). Each split is a
random-access source (``len(source)``, ``source[i]`` -> one example as a dict of numpy arrays)
that grain reads. Every example of a task has the same fields and fixed shapes:

- ``inputs`` int32 ``[max_length]``: token ids, 0 is padding;
- ``mask`` bool ``[max_length]``: True for real tokens;
- ``targets`` int32 ``[]`` (classify / retrieval: the class) or ``[max_length]`` (lm: the next
  token at each position, scored where ``mask`` is True);
- retrieval tasks add ``inputs2`` / ``mask2`` (the second document).

The trainer adds ``weight`` (1.0 for a real example, 0.0 for the padding that fills the last
evaluation batch).

A task's config fields (the ``config.task`` block of an experiment) are declared by its class,
each with its default, comment and valid values (``Task.config_fields``, ``fastpos.fields``;
``default_config()`` builds the block); the class must be able to say its ``TaskInfo`` from
that config alone (``info_from_config``), without reading any data, so that models can be
built and configs checked before data are loaded.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import numpy as np

from fastpos import fields
from fastpos.tasks.info import TaskInfo

if TYPE_CHECKING:  # annotations only: importing fastpos.tasks needs numpy alone
  import ml_collections

SPLITS = ("train", "validation", "test")

# Fields every example must carry, by task kind.
REQUIRED_FIELDS = {
    "classify": ("inputs", "mask", "targets"),
    "retrieval": ("inputs", "mask", "inputs2", "mask2", "targets"),
    "lm": ("inputs", "mask", "targets"),
}
ON_OVERFLOW = ("truncate", "error")  # what a task does with a longer example


def split_sizes() -> dict[str, fields.Field]:
  """The ``num_train`` / ``num_validation`` / ``num_test`` fields of a task reading files:
  examples per split, 0 meaning the loader's default (all of a file)."""
  return {k: fields.integer(0, 0) for k in ("num_train", "num_validation", "num_test")}


class ArraySource:
  """A split held as numpy arrays with a common first axis, read one example at a time.

  Args:
    arrays: name -> array ``[n, ...]``. ``mask`` (``mask2``) is derived as ``inputs != 0``
      (``inputs2 != 0``) when absent.
  """

  def __init__(self, arrays: Mapping[str, np.ndarray]):
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    for key, mask_key in (("inputs", "mask"), ("inputs2", "mask2")):
      if key in arrays and mask_key not in arrays:
        arrays[mask_key] = arrays[key] != 0
    sizes = {k: v.shape[0] for k, v in arrays.items()}
    if len(set(sizes.values())) != 1:
      raise ValueError(f"ArraySource: arrays of different lengths {sizes}.")
    for key in ("inputs", "inputs2", "targets"):
      if key in arrays:
        arrays[key] = arrays[key].astype(np.int32)
    for key in ("mask", "mask2"):
      if key in arrays:
        arrays[key] = arrays[key].astype(bool)
    self.arrays = arrays
    self._len = next(iter(sizes.values()))

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {k: v[index] for k, v in self.arrays.items()}

  def __repr__(self) -> str:
    shapes = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self.arrays.items())
    return f"ArraySource({shapes})"


class Task(abc.ABC):
  """Base class of a task. Subclasses set ``task_name`` and implement the abstract methods.

  Class attributes:
    task_name: the registry name (``config.task.name``).
    metric: the validation metric that picks the best checkpoint (a key of the evaluation
      metrics: "accuracy", "loss" or "perplexity").
    metric_mode: "max" or "min" for ``metric``.
    generated: True when there is nothing to download (the task makes its data itself, or
      reads the user's own files).
    config_fields: the fields of its ``config.task`` block besides ``name`` (name ->
      ``fastpos.fields.Field``), in their printed order, each with its comment.
  """

  task_name: ClassVar[str]
  config_fields: ClassVar[Mapping[str, fields.Field]]
  generated: ClassVar[bool] = False
  metric: ClassVar[str] = "accuracy"
  metric_mode: ClassVar[str] = "max"

  def __init__(self, cfg: ml_collections.ConfigDict):
    self.cfg = cfg
    self.info = self.info_from_config(cfg)
    self._sources: dict[str, ArraySource] = {}

  @classmethod
  def default_config(cls) -> ml_collections.ConfigDict:
    """The task's ``config.task`` block with defaults (``name`` first, then
    ``config_fields``)."""
    import ml_collections  # pylint: disable=import-outside-toplevel (numpy alone at import)

    return ml_collections.ConfigDict({"name": cls.task_name, **fields.defaults(cls.config_fields)})

  @classmethod
  @abc.abstractmethod
  def info_from_config(cls, cfg: ml_collections.ConfigDict) -> TaskInfo:
    """The ``TaskInfo`` implied by the config, without reading data."""

  @abc.abstractmethod
  def load_split(self, split: str) -> Mapping[str, np.ndarray]:
    """Reads or generates one split as arrays ``[n, ...]`` (see the module docstring)."""

  def fingerprint(self) -> dict[str, Any]:
    """What the task's examples are made from, as JSON values, for the run's record
    (``fastpos.train.identity``): a resume whose fingerprint differs trains on other data.
    Here, the task's config fields that change its examples (a generated task's generator
    settings); a task that reads files adds what they hold (cheaply: after ``source``
    has read them)."""
    values = json.loads(json.dumps(self.cfg.to_dict(), default=str))
    settings = {
        k: v
        for k, v in values.items()
        if k != "name"
        and (k not in self.config_fields or self.config_fields[k].affects({"task": values}))
    }
    return {"task": self.task_name, "settings": settings}

  def has_split(self, split: str) -> bool:
    """Whether the config gives ``split`` any examples (decided without reading data)."""
    return split in SPLITS

  def source(self, split: str) -> ArraySource:
    """The split as a random-access source (loaded once, then cached)."""
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}.")
    if split not in self._sources:
      src = ArraySource(self.load_split(split))
      self._check(src, split)
      self._sources[split] = src
    return self._sources[split]

  def _check(self, src: ArraySource, split: str) -> None:
    """Checks a loaded split against the task's ``TaskInfo`` (shapes, ids in range)."""
    info = self.info
    missing = [k for k in REQUIRED_FIELDS[info.kind] if k not in src.arrays]
    if missing:
      raise ValueError(f"task {self.task_name!r}, split {split!r}: missing fields {missing}.")
    if len(src) == 0:
      raise ValueError(f"task {self.task_name!r}, split {split!r} has no examples.")
    for key in ("inputs", "inputs2"):
      if key not in src.arrays:
        continue
      x = src.arrays[key]
      if x.ndim != 2 or x.shape[1] != info.max_length:
        raise ValueError(
            f"task {self.task_name!r}, split {split!r}: {key} has shape "
            f"{x.shape}; expected [n, {info.max_length}]."
        )
      if x.min() < 0 or x.max() >= info.vocab_size:
        raise ValueError(
            f"task {self.task_name!r}, split {split!r}: token ids outside "
            f"[0, {info.vocab_size})."
        )
    t = src.arrays["targets"]
    if info.kind != "lm" and (t.min() < 0 or t.max() >= info.num_classes):
      raise ValueError(
          f"task {self.task_name!r}, split {split!r}: targets outside " f"[0, {info.num_classes})."
      )


def file_digest(path: str | os.PathLike) -> str:
  """SHA-256 (hex) of a file's bytes, read in 8 MB pieces (a task's data fingerprint)."""
  sha = hashlib.sha256()
  with open(path, "rb") as f:
    while piece := f.read(1 << 23):
      sha.update(piece)
  return sha.hexdigest()


def split_seed(seed: int, split: str) -> np.random.SeedSequence:
  """An independent random stream per (seed, split), so splits never share examples."""
  return np.random.SeedSequence([seed, SPLITS.index(split)])
