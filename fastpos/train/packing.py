"""Sequence packing for language-model tasks: several examples per row, kept apart.

With ``config.data.pack`` a training batch's rows each hold several examples back to back
(first-fit decreasing), with ``segment_ids`` (1, 2, ... per example, 0 on padding) and
``positions`` (in-segment) beside the examples' ``inputs`` / ``mask`` / ``targets`` (and
``score``): the model keeps the segments apart (``fastpos.ops.segments``; cells that cannot
pack exactly refuse before compiling).

Training: the endless shuffled example sequence (from ``config.seed``) is read in windows of
``bucket_window * batch_size`` examples; each window is packed into rows and cut into batches
(the window's last batch filled with copies of its first row given ``weight`` 0). Batch b is a
pure function of b (windows are packed in order, their batch counts kept), so the grain
iterator's position restores the same stream exactly. Evaluation keeps its unpacked batches.
"""

from __future__ import annotations

import threading

import grain
import jax
import ml_collections
import numpy as np

from fastpos.ops import segments
from fastpos.tasks.base import ArraySource
from fastpos.train import bucketing

TOKEN_FIELDS = ("inputs", "mask", "targets", "score")  # [N] per example: concatenated


def enabled(cfg: ml_collections.ConfigDict) -> bool:
  data = cfg.get("data") or {}
  return bool(data.get("pack", False))


def check_config(
    cfg: ml_collections.ConfigDict, kind: str, max_length: int, model, seq_devices: int = 1
) -> None:
  """Stops with one clear message when packing is asked of a task or model that cannot take
  it exactly (before anything is read or compiled)."""
  if not enabled(cfg):
    return
  if kind != "lm":
    raise ValueError(
        f"config.data.pack=True but {cfg.task.name!r} is a {kind!r} task; packing "
        "serves lm tasks (packed classification is not built): use "
        "config.data.bucket_lengths."
    )
  if bucketing.bucket_lengths(cfg, max_length):
    raise ValueError(
        "config.data.pack=True and config.data.bucket_lengths are both set; " "choose one."
    )
  att = getattr(model, "attention", None)
  if att is None:
    raise ValueError(
        "config.data.pack=True needs a fastpos model (DecoderLM) that reads " "segment_ids."
    )
  segments.check_packable(
      att.kernel.name,
      [p.name for p in att.positional],
      causal=att.causal,
      grid=att.grid,
      memory_length=getattr(model, "memory_length", 0),
      split=seq_devices > 1,
  )


def pack_rows(lengths: np.ndarray, row_length: int) -> list[list[int]]:
  """First-fit decreasing: the positions of ``lengths`` grouped into rows of total length
  <= ``row_length`` (longest first; ties in input order). Deterministic."""
  rows: list[list[int]] = []
  room: list[int] = []
  for i in np.argsort(-np.asarray(lengths), kind="stable"):
    n = int(lengths[i])
    fits = next((r for r, left in enumerate(room) if left >= n), None)
    if fits is None:
      rows.append([int(i)])
      room.append(row_length - n)
    else:
      rows[fits].append(int(i))
      room[fits] -= n
  return rows


def packed_row(
    source: ArraySource, examples: list[int], sizes: np.ndarray, row_length: int
) -> dict[str, np.ndarray]:
  """One row ``[row_length]`` per field holding ``examples`` back to back, with
  ``segment_ids`` and ``positions``."""
  first = source[examples[0]]
  row = {k: np.zeros_like(first[k]) for k in TOKEN_FIELDS if k in first}
  ids = np.zeros(row_length, np.int32)
  pos = np.zeros(row_length, np.int32)
  at = 0
  for s, e in enumerate(examples, 1):
    ex, n = source[e], int(sizes[e])
    for k in row:
      row[k][at : at + n] = ex[k][:n]
    ids[at : at + n] = s
    pos[at : at + n] = np.arange(n)
    at += n
  return {**row, "segment_ids": ids, "positions": pos}


def train_batches(
    source: ArraySource, cfg: ml_collections.ConfigDict, start: int = 0
) -> grain.MapDataset:
  """Global batch b (random access, endless) of packed training rows, this process's rows."""
  n, global_batch = len(source), cfg.batch_size
  row_length = source.arrays["inputs"].shape[1]
  sizes = bucketing.example_lengths(source)
  per_window = int(cfg.data.get("bucket_window", 1)) * global_batch
  order = grain.MapDataset.range(n).seed(cfg.seed).shuffle().repeat()
  cache: dict[int, list[list[int]]] = {}
  first_batch = [0]  # first_batch[w]: the first batch of window w (windows packed in order)
  lock = threading.Lock()

  def window_rows(w: int) -> list[list[int]]:
    if w not in cache:
      idx = [order[start + w * per_window + i] for i in range(per_window)]
      cache[w] = [[idx[i] for i in r] for r in pack_rows(sizes[idx], row_length)]
      for old in [k for k in cache if k < w - 2]:
        del cache[old]
    return cache[w]

  def locate(b: int) -> tuple[int, int]:
    with lock:
      while first_batch[-1] <= b:
        w = len(first_batch) - 1
        first_batch.append(first_batch[-1] + -(-len(window_rows(w)) // global_batch))
      w = int(np.searchsorted(first_batch, b, side="right")) - 1
      return w, b - first_batch[w]

  def make(b: int) -> dict[str, np.ndarray]:
    w, j = locate(b)
    with lock:
      rows = window_rows(w)[j * global_batch : (j + 1) * global_batch]
    weight = np.zeros(global_batch, np.float32)
    weight[: len(rows)] = 1.0
    rows = rows + [rows[0]] * (global_batch - len(rows))  # fillers: real rows, weight 0
    local = len(rows) // jax.process_count()
    mine = slice(jax.process_index() * local, (jax.process_index() + 1) * local)
    packed = [packed_row(source, r, sizes, row_length) for r in rows[mine]]
    batch = {k: np.stack([p[k] for p in packed]) for k in packed[0]}
    batch["weight"] = weight[mine]
    return batch

  return grain.MapDataset.range(2**62).map(make)
