"""Sequence packing: several examples per row, kept apart by segment ids.

With ``config.data.pack`` a batch's rows each hold several examples back to back (first-fit
decreasing), with ``segment_ids`` (1, 2, ... per example, 0 on padding) and ``positions``
(in-segment) beside the examples' token fields: the model keeps the segments apart
(``fastpos.ops.segments``; cells that cannot pack exactly refuse before compiling).

Language models (``lm``): the token fields (``inputs`` / ``mask`` / ``targets`` / ``score``)
are concatenated; the row weight ``[rows]`` is 1 (0 for fillers). Evaluation is not packed.

Classification (``classify``): at most ``config.data.pack_segments`` = S examples per row. A
row carries ``inputs`` / ``mask`` ``[L]`` with ``segment_ids`` / ``positions``, and per slot
``targets`` ``[S]``, ``segment_mask`` ``[S]`` (True where the slot holds an example) and
``weight`` ``[S]`` (0 for empty slots and filler rows): the classifier pools each segment
(``fastpos.models.transformer.Classifier``) and returns ``[rows, S, classes]``; the loss and
accuracy count each example once. With ``model.pooling = "cls"`` each example takes one slot
more, its first (input 0, ``mask`` False, position 0), where the model puts the CLS token;
the row length L is then ``task.max_length + 1``, the model's own length. Evaluation is packed
too: the examples the unpacked batches would score (the first ``limit`` batches' worth when
limited), in order, packed into rows and cut into batches, the last filled with weight-0 rows:
each example is scored exactly once. Retrieval (two documents per example) is not packed.

Training: the endless shuffled example sequence (from ``config.seed``) is read in windows of
``bucket_window * batch_size`` examples; each window (with the examples the previous window
left over) is packed into rows and cut into whole batches, and the examples of the rows that
do not fill a whole batch go on to the next window: no training row is a filler. Batch b is
a pure function of b (windows are packed in order from the first, their batch counts kept),
so the grain iterator's position restores the same stream exactly. Each process reads the
rows of its row group (``sharding.data_reader``).
"""

from __future__ import annotations

import threading

import grain
import ml_collections
import numpy as np

from fastpos.positional import compatibility
from fastpos.tasks.base import ArraySource
from fastpos.train import bucketing, sharding

PACKED_KINDS = ("lm", "classify")


def enabled(cfg: ml_collections.ConfigDict) -> bool:
  data = cfg.get("data") or {}
  return bool(data.get("pack", False))


def max_segments(cfg: ml_collections.ConfigDict, kind: str) -> int | None:
  """Examples per row at most: ``config.data.pack_segments`` for classify, None (as many as
  fit) for lm."""
  return int(cfg.data.get("pack_segments", 8)) if kind == "classify" else None


def cls_slot(cfg: ml_collections.ConfigDict, kind: str) -> int:
  """1 when each packed example starts with a slot for the CLS token, else 0."""
  return int(kind == "classify" and cfg.model.get("pooling", "mean") == "cls")


def check_config(
    cfg: ml_collections.ConfigDict, kind: str, max_length: int, model, seq_devices: int = 1
) -> None:
  """Stops with one clear message when packing is asked of a task or model that cannot take
  it exactly (before anything is read or compiled)."""
  if not enabled(cfg):
    return
  if kind not in PACKED_KINDS:
    why = (
        "a retrieval example is two documents pooled into one pair (packing is not built "
        "for the dual encoder)"
        if kind == "retrieval"
        else f"packing serves {' / '.join(PACKED_KINDS)} tasks"
    )
    raise ValueError(
        f"config.data.pack=True but {cfg.task.name!r} is a {kind!r} task: {why}. "
        "Set config.data.pack=False; for variable-length classify / retrieval tasks use "
        "config.data.bucket_lengths."
    )
  if bucketing.bucket_lengths(cfg, max_length):
    raise ValueError(
        "config.data.pack=True and config.data.bucket_lengths are both set; choose one."
    )
  att = getattr(model, "attention", None)
  if att is None or (kind == "classify" and not hasattr(model, "pooling")):
    raise ValueError(
        "config.data.pack=True needs a fastpos model (DecoderLM, Classifier) that reads "
        "segment_ids."
    )
  att.plan(
      compatibility.Setting(
          seq=seq_devices, packed=True, memory=bool(getattr(model, "memory_length", 0))
      )
  )


def pack_rows(lengths: np.ndarray, row_length: int, limit: int | None = None) -> list[list[int]]:
  """First-fit decreasing: the positions of ``lengths`` grouped into rows of total length
  <= ``row_length`` and at most ``limit`` entries (None: no limit), longest first (ties in
  input order). Deterministic."""
  rows: list[list[int]] = []
  room: list[int] = []
  cap = limit or len(lengths) or 1
  for i in np.argsort(-np.asarray(lengths), kind="stable"):
    n = int(lengths[i])
    fits = next((r for r, left in enumerate(room) if left >= n and len(rows[r]) < cap), None)
    if fits is None:
      rows.append([int(i)])
      room.append(row_length - n)
    else:
      rows[fits].append(int(i))
      room[fits] -= n
  return rows


class Layout:
  """How a split's examples go into packed rows: the row length, the per-example lengths
  (slots taken, the CLS slot included), the slots per row and which fields are tokens."""

  def __init__(self, source: ArraySource, cfg: ml_collections.ConfigDict, kind: str):
    self.source = source
    self.kind = kind
    self.cls = cls_slot(cfg, kind)
    length = source.arrays["inputs"].shape[1]
    self.row_length = length + self.cls
    self.limit = max_segments(cfg, kind)
    self.sizes = bucketing.example_lengths(source)  # real tokens, CLS slot not counted
    self.token_fields = [
        k for k, v in source.arrays.items() if v.ndim >= 2 and v.shape[1] == length
    ]

  def rows(self, examples: np.ndarray) -> list[list[int]]:
    """``examples`` (indices into the source) grouped into packed rows."""
    examples = np.asarray(examples, np.int64)
    grouped = pack_rows(self.sizes[examples] + self.cls, self.row_length, self.limit)
    return [[int(examples[i]) for i in r] for r in grouped]

  def row(self, examples: list[int]) -> dict[str, np.ndarray]:
    """One packed row (module docstring) holding ``examples`` back to back."""
    first = self.source[examples[0]]
    out = {
        k: np.zeros((self.row_length, *first[k].shape[1:]), first[k].dtype)
        for k in self.token_fields
    }
    ids = np.zeros(self.row_length, np.int32)
    pos = np.zeros(self.row_length, np.int32)
    per_slot = {}
    if self.limit is not None:
      per_slot = {
          k: np.zeros((self.limit, *np.shape(v)), np.asarray(v).dtype)
          for k, v in first.items()
          if k not in self.token_fields
      }
    at = 0
    for s, e in enumerate(examples, 1):
      ex, n = self.source[e], int(self.sizes[e])
      for k in out:  # the CLS slot (when any) keeps input 0 and mask False
        out[k][at + self.cls : at + self.cls + n] = ex[k][:n]
      ids[at : at + self.cls + n] = s
      pos[at : at + self.cls + n] = np.arange(self.cls + n)
      for k in per_slot:
        per_slot[k][s - 1] = ex[k]
      at += self.cls + n
    out.update(segment_ids=ids, positions=pos)
    if self.limit is not None:
      used = np.arange(self.limit) < len(examples)
      out.update(per_slot, segment_mask=used)
    return out

  def batch(self, rows: list[list[int]], real: np.ndarray) -> dict[str, np.ndarray]:
    """The packed rows stacked, with ``weight`` (rows ``[R]`` for lm, slots ``[R, S]`` for
    classify) 0 where ``real`` ``[R]`` is False."""
    packed = [self.row(r) for r in rows]
    batch = {k: np.stack([p[k] for p in packed]) for k in packed[0]}
    real = np.asarray(real, np.float32)
    if self.limit is None:
      batch["weight"] = real
    else:
      batch["weight"] = batch["segment_mask"] * real[:, None]
    return batch


def _mine(items: list, reader: tuple[int, int]) -> slice:
  """The slice of a global batch's rows that this process's row group reads (``reader``:
  ``sharding.data_reader``)."""
  index, procs = reader
  local = len(items) // procs
  return slice(index * local, (index + 1) * local)


def source_kind(source: ArraySource) -> str:
  """The packed layout a source takes: "lm" (targets per token) or "classify" (one target
  per example; a retrieval pair is refused before, by ``check_config``)."""
  return "lm" if source.arrays["targets"].ndim >= 2 else "classify"


def train_batches(
    source: ArraySource, cfg: ml_collections.ConfigDict, start: int = 0
) -> grain.MapDataset:
  """Global batch b (random access, endless) of packed training rows, this process's rows."""
  layout = Layout(source, cfg, source_kind(source))
  n, global_batch = len(source), cfg.batch_size
  per_window = int(cfg.data.get("bucket_window", 1)) * global_batch
  order = grain.MapDataset.range(n).seed(cfg.seed).shuffle().repeat()
  cache: dict[int, list[list[int]]] = {}
  carried: dict[int, list[int]] = {0: []}  # examples window w takes over from window w - 1
  first_batch = [0]  # first_batch[w]: the first batch of window w (windows packed in order)
  lock = threading.Lock()
  reader = sharding.data_reader(cfg)

  def window_rows(w: int) -> list[list[int]]:
    """Window w's rows that fill whole batches; the rest's examples go on to window w + 1."""
    if w not in cache:
      idx = carried[w] + [order[start + w * per_window + i] for i in range(per_window)]
      rows = layout.rows(np.array(idx, np.int64))
      whole = len(rows) // global_batch * global_batch
      cache[w] = rows[:whole]
      carried[w + 1] = [e for r in rows[whole:] for e in r]
      for old in [k for k in cache if k < w - 2]:
        del cache[old]
    return cache[w]

  def locate(b: int) -> tuple[int, int]:
    with lock:
      while first_batch[-1] <= b:
        w = len(first_batch) - 1
        first_batch.append(first_batch[-1] + len(window_rows(w)) // global_batch)
      w = int(np.searchsorted(first_batch, b, side="right")) - 1
      return w, b - first_batch[w]

  def make(b: int) -> dict[str, np.ndarray]:
    w, j = locate(b)
    with lock:
      rows = window_rows(w)[j * global_batch : (j + 1) * global_batch]
    mine = _mine(rows, reader)
    return layout.batch(rows[mine], np.ones(len(rows), bool)[mine])

  return grain.MapDataset.range(2**62).map(make)


def eval_batches(
    source: ArraySource, cfg: ml_collections.ConfigDict, total: int
) -> grain.MapDataset:
  """The packed evaluation batches (module docstring) of the examples that ``total``
  unpacked batches would score, this process's rows."""
  layout = Layout(source, cfg, "classify")
  global_batch = cfg.eval_batch_size or cfg.batch_size
  covered = min(len(source), total * global_batch)
  rows = layout.rows(np.arange(covered))
  reader = sharding.data_reader(cfg)

  def make(b: int) -> dict[str, np.ndarray]:
    chunk = rows[b * global_batch : (b + 1) * global_batch]
    real = np.arange(global_batch) < len(chunk)
    chunk = chunk + [chunk[0]] * (global_batch - len(chunk))
    mine = _mine(chunk, reader)
    return layout.batch(chunk[mine], real[mine])

  return grain.MapDataset.range(-(-len(rows) // global_batch)).map(make)
