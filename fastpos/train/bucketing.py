"""Length bucketing: batches padded to the shortest of a few lengths that holds them.

Variable-length classification tasks (ListOps, Text, Retrieval) store every example padded to
``task.max_length``; most of a batch's token slots are then padding, computed and thrown
away. With ``config.data.bucket_lengths`` (e.g. ``(32, 48, 64)``; ``task.max_length`` is
always added) a batch is cut to the shortest bucket length that holds its longest example, so
the train step compiles once per bucket length and runs on fewer slots. The cut removes only
padding: a real token's output is unchanged (every model masks padded keys).

Training: the endless shuffled sequence of examples (as without bucketing, from
``config.seed``) is read in windows of ``W = bucket_window`` global batches; each window is
sorted by length, cut into W batches of similar lengths, and those W batches are taken in an
order drawn from (seed, window). Batch b is a pure function of b, so the grain iterator's
position (``{"next_index": b}``) restores the same stream exactly, and every example is still
seen once per pass over the windows. Evaluation: the examples (the first ``limit`` batches'
worth when limited, as without bucketing) sorted by length and cut into batches, the last one
filled with copies of real examples given ``weight`` 0: every example is scored exactly once.
"""

from __future__ import annotations

import functools

import grain
import ml_collections
import numpy as np

from fastpos.tasks.base import ArraySource
from fastpos.train import sharding

SEQUENCE_FIELDS = ("inputs", "mask", "inputs2", "mask2")  # cut to the bucket length
BUCKETED_KINDS = ("classify", "retrieval")


def bucket_lengths(cfg: ml_collections.ConfigDict, max_length: int) -> tuple[int, ...]:
  """The batch lengths of ``config.data.bucket_lengths``, ``max_length`` added; () when off.

  Raises:
    ValueError: a length outside [1, max_length], not increasing, or a window < 1.
  """
  data = cfg.get("data") or {}
  raw = tuple(data.get("bucket_lengths", ()) or ())
  if not raw:
    return ()
  if any(not isinstance(x, (int, np.integer)) or isinstance(x, bool) for x in raw):
    raise ValueError(
        f"config.data.bucket_lengths={raw!r} must be integers in "
        f"[1, task.max_length={max_length}]."
    )
  lengths = tuple(int(x) for x in raw)
  if any(not 1 <= x <= max_length for x in lengths):
    raise ValueError(
        f"config.data.bucket_lengths={lengths} must lie in [1, task.max_length=" f"{max_length}]."
    )
  if any(a >= b for a, b in zip(lengths, lengths[1:])):
    raise ValueError(f"config.data.bucket_lengths={lengths} must be strictly increasing.")
  window = data.get("bucket_window", 1)
  if not isinstance(window, (int, np.integer)) or window < 1:
    raise ValueError(f"config.data.bucket_window={window!r} must be an integer >= 1.")
  return lengths if lengths[-1] == max_length else (*lengths, max_length)


def check_config(
    cfg: ml_collections.ConfigDict, kind: str, max_length: int, grid, seq_devices: int = 1
) -> None:
  """Stops with one clear message when bucketing is asked of a task or mesh that cannot
  take it (before anything is read or compiled)."""
  lengths = bucket_lengths(cfg, max_length)
  if not lengths:
    return
  if kind not in BUCKETED_KINDS or grid is not None:
    what = "an image task (fixed length)" if grid is not None else f"a {kind!r} task"
    raise ValueError(
        f"config.data.bucket_lengths is set but {cfg.task.name!r} is {what}; "
        f"bucketing serves variable-length {' / '.join(BUCKETED_KINDS)} tasks. "
        "Set config.data.bucket_lengths=()."
    )
  bad = [x for x in lengths if x % seq_devices]
  if bad:
    raise ValueError(
        f"config.mesh.seq={seq_devices} must divide every bucket length; "
        f"{bad} of config.data.bucket_lengths={lengths} do not."
    )


def example_lengths(source: ArraySource) -> np.ndarray:
  """Each example's length ``[n]`` int: one past its last real token (``mask``, and
  ``mask2`` when present), so cutting there removes padding only."""
  out = np.zeros(len(source), np.int64)
  for key in ("mask", "mask2"):
    if key in source.arrays:
      m = source.arrays[key].astype(bool)
      last = m.shape[1] - np.argmax(m[:, ::-1], axis=1)
      out = np.maximum(out, np.where(m.any(axis=1), last, 0))
  return out


def fit(length: int, lengths: tuple[int, ...]) -> int:
  """The shortest of ``lengths`` (increasing) that is >= ``length``."""
  return lengths[int(np.searchsorted(lengths, length))]


def cut(batch: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
  """``batch`` with its token fields ``[b, max_length]`` cut to ``[b, length]``."""
  return {k: v[:, :length] if k in SEQUENCE_FIELDS else v for k, v in batch.items()}


def _gather(source: ArraySource, rows: np.ndarray) -> dict[str, np.ndarray]:
  examples = [source[int(r)] for r in rows]
  return {k: np.stack([ex[k] for ex in examples]) for k in examples[0]}


def _local(rows: np.ndarray, reader: tuple[int, int]) -> np.ndarray:
  """The slice of a global batch's rows that this process's row group reads (``reader``:
  ``sharding.data_reader``; processes holding blocks of the same rows read the same rows)."""
  index, procs = reader
  local = len(rows) // procs
  return rows[index * local : (index + 1) * local]


def train_batches(
    source: ArraySource, cfg: ml_collections.ConfigDict, start: int = 0
) -> grain.MapDataset:
  """Global batch b (a random-access, endless dataset) of bucketed training: this process's
  rows cut to the bucket length, with ``weight`` 1 (module docstring)."""
  n, global_batch = len(source), cfg.batch_size
  lengths = bucket_lengths(cfg, source.arrays["inputs"].shape[1])
  sizes = example_lengths(source)
  window = int(cfg.data.get("bucket_window", 1))
  order = grain.MapDataset.range(n).seed(cfg.seed).shuffle().repeat()
  reader = sharding.data_reader(cfg)

  @functools.lru_cache(maxsize=4)  # the W batches of a window are read one after another
  def window_rows(w: int) -> np.ndarray:
    first = start + w * window * global_batch
    idx = np.array([order[first + i] for i in range(window * global_batch)], np.int64)
    idx = idx[np.argsort(sizes[idx], kind="stable")].reshape(window, global_batch)
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 1, w]))
    return idx[rng.permutation(window)]

  def make(b: int) -> dict[str, np.ndarray]:
    rows = window_rows(b // window)[b % window]
    batch = _gather(source, _local(rows, reader))
    batch["weight"] = np.ones(len(batch["inputs"]), np.float32)
    return cut(batch, fit(int(sizes[rows].max()), lengths))

  return grain.MapDataset.range(2**62).map(make)


def eval_batches(
    source: ArraySource, cfg: ml_collections.ConfigDict, total: int
) -> grain.MapDataset:
  """The ``total`` bucketed evaluation batches (module docstring), this process's rows."""
  n = len(source)
  global_batch = cfg.eval_batch_size or cfg.batch_size
  lengths = bucket_lengths(cfg, source.arrays["inputs"].shape[1])
  sizes = example_lengths(source)
  covered = min(n, total * global_batch)  # the examples the unbucketed batches would score
  order = np.argsort(sizes[:covered], kind="stable")
  reader = sharding.data_reader(cfg)

  def make(b: int) -> dict[str, np.ndarray]:
    slots = b * global_batch + np.arange(global_batch)
    rows = order[slots % covered]  # fillers past the end: real (short) examples, weight 0
    batch = _gather(source, _local(rows, reader))
    batch["weight"] = _local(slots < covered, reader).astype(np.float32)
    return cut(batch, fit(int(sizes[rows].max()), lengths))

  return grain.MapDataset.range(total).map(make)
