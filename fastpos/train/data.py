"""Host input pipelines (grain) over a task's random-access sources.

Training: the split is shuffled (a fresh order every epoch, from ``config.seed``), repeated
forever and cut into global batches; process p of P reads rows ``[p * B/P, (p+1) * B/P)`` of
every global batch, so the batches are the same for any number of hosts (with a "seq" mesh
axis across processes, p and P count row groups: ``sharding.data_reader``). The iterator's
position is part of every checkpoint. Evaluation: the split in order; the last batch is filled
up with copies of real examples given ``weight`` 0.

Stream batching (language models with a Transformer-XL memory, as Transformer-XL's
LMOrderedIterator): the S segments of a split are dealt into B = batch size contiguous streams
of T = ceil(S / B) segments, and step t takes segment t of every stream, so row r of step t + 1
continues row r of step t. The B*T - S slots past the last segment are copies with ``weight``
0; ``reset`` ``[B]`` is True at t = 0 (that row's memory is emptied). Training repeats the T
steps in the same order each epoch (shuffling would break the streams).
"""

from __future__ import annotations

import functools
import math
from typing import Iterator

import grain
import ml_collections
import numpy as np

from fastpos.tasks.base import ArraySource
from fastpos.train import bucketing, packing, sharding

_ENDLESS = 2**62  # batches of a training iterator: more than any run reads


def _read_options(cfg: ml_collections.ConfigDict) -> grain.ReadOptions:
  return grain.ReadOptions(num_threads=cfg.data.num_threads, prefetch_buffer_size=cfg.data.prefetch)


def train_iterator(source: ArraySource, cfg: ml_collections.ConfigDict, start: int = 0):
  """An endless grain iterator of this process's rows of each global training batch.

  The examples form one endless sequence (the split shuffled afresh every epoch); global batch
  b holds examples ``[start + b * B, start + (b + 1) * B)`` of it, B = ``cfg.batch_size``.
  ``start`` (in examples) lets a run resumed with another batch size carry on at the example
  where the checkpointed run stopped. Yields dicts of numpy arrays ``[B / process_count, ...]``
  (the task's fields plus ``weight``); ``get_state()`` / ``set_state()`` give its exact
  position in batches (``{"next_index": b}``). With ``config.data.bucket_lengths`` the batches
  are length-bucketed instead (``fastpos.train.bucketing``); with ``config.data.pack``, packed
  (``fastpos.train.packing``); the state is the same.
  """
  if packing.enabled(cfg):
    return iter(packing.train_batches(source, cfg, start).to_iter_dataset(_read_options(cfg)))
  if bucketing.bucket_lengths(cfg, source.arrays["inputs"].shape[1]):
    return iter(bucketing.train_batches(source, cfg, start).to_iter_dataset(_read_options(cfg)))
  index, procs = sharding.data_reader(cfg)
  global_batch = cfg.batch_size
  local = global_batch // procs
  offset = start + index * local
  examples = grain.MapDataset.source(source).seed(cfg.seed).shuffle().repeat()

  def make(b: int) -> dict[str, np.ndarray]:
    rows = [examples[offset + b * global_batch + i] for i in range(local)]
    batch = {k: np.stack([ex[k] for ex in rows]) for k in rows[0]}
    batch["weight"] = np.ones(local, np.float32)
    return batch

  ds = grain.MapDataset.range(_ENDLESS).map(make)
  return iter(ds.to_iter_dataset(_read_options(cfg)))


def num_eval_batches(n: int, global_batch: int, limit: int = 0) -> int:
  """Batches that cover ``n`` examples (at most ``limit`` when ``limit`` > 0)."""
  total = math.ceil(n / global_batch)
  return min(total, limit) if limit > 0 else total


def eval_iterator(
    source: ArraySource, cfg: ml_collections.ConfigDict, limit: int = 0
) -> Iterator[dict[str, np.ndarray]]:
  """This process's rows of the evaluation batches, in order, the last one padded.

  Global batch b holds examples ``[b * B, (b + 1) * B)``; rows past the end of the split
  repeat real examples (so every model input is well formed) with ``weight`` 0. With
  ``config.data.bucket_lengths``: the same examples in length order, each batch cut to its
  bucket length (``fastpos.train.bucketing``); with ``config.data.pack`` on a classification
  task: the same examples packed (``fastpos.train.packing``), each scored once.
  """
  n = len(source)
  global_batch = cfg.eval_batch_size or cfg.batch_size
  if packing.enabled(cfg) and packing.source_kind(source) == "classify":
    ds = packing.eval_batches(source, cfg, num_eval_batches(n, global_batch, limit))
    return iter(ds.to_iter_dataset(_read_options(cfg)))
  if bucketing.bucket_lengths(cfg, source.arrays["inputs"].shape[1]):
    ds = bucketing.eval_batches(source, cfg, num_eval_batches(n, global_batch, limit))
    return iter(ds.to_iter_dataset(_read_options(cfg)))
  index, procs = sharding.data_reader(cfg)
  local = global_batch // procs
  offset = index * local

  def make(b: int) -> dict[str, np.ndarray]:
    rows = b * global_batch + offset + np.arange(local)
    examples = [source[int(r % n)] for r in rows]
    batch = {k: np.stack([ex[k] for ex in examples]) for k in examples[0]}
    batch["weight"] = (rows < n).astype(np.float32)
    return batch

  total = num_eval_batches(n, global_batch, limit)
  ds = grain.MapDataset.range(total).map(make)
  return iter(ds.to_iter_dataset(_read_options(cfg)))


def num_stream_steps(n: int, num_streams: int) -> int:
  """Steps that cover ``n`` segments dealt into ``num_streams`` streams: ceil(n / streams)."""
  return math.ceil(n / num_streams)


def _stream_batch(
    source: ArraySource, t: int, num_streams: int, reader: tuple[int, int]
) -> dict[str, np.ndarray]:
  """This process's rows (``reader``: ``sharding.data_reader``) of step ``t`` of the stream
  layout (module docstring)."""
  n = len(source)
  steps = num_stream_steps(n, num_streams)
  index, procs = reader
  local = num_streams // procs
  rows = index * local + np.arange(local)
  index = rows * steps + int(t)
  examples = [source[int(i % n)] for i in index]
  batch = {k: np.stack([ex[k] for ex in examples]) for k in examples[0]}
  batch["weight"] = (index < n).astype(np.float32)
  batch["reset"] = np.full(local, int(t) == 0)
  return batch


def stream_train_iterator(source: ArraySource, cfg: ml_collections.ConfigDict):
  """An endless grain iterator of stream batches (module docstring), this process's rows.

  Yields dicts of numpy arrays ``[batch_size / process_count, ...]`` with ``weight`` and
  ``reset``; ``get_state()`` / ``set_state()`` give its exact position.
  """
  steps = num_stream_steps(len(source), cfg.batch_size)
  ds = (
      grain.MapDataset.range(steps)
      .repeat()
      .map(
          functools.partial(
              _stream_batch, source, num_streams=cfg.batch_size, reader=sharding.data_reader(cfg)
          )
      )
  )
  return iter(ds.to_iter_dataset(_read_options(cfg)))


def stream_eval_iterator(
    source: ArraySource, cfg: ml_collections.ConfigDict, limit: int = 0
) -> Iterator[dict[str, np.ndarray]]:
  """The stream batches of an evaluation, in order (at most ``limit`` steps when > 0)."""
  global_batch = cfg.eval_batch_size or cfg.batch_size
  total = num_eval_batches(len(source), global_batch, limit)  # ceil(n / B) = the stream steps
  ds = grain.MapDataset.range(total).map(
      functools.partial(
          _stream_batch, source, num_streams=global_batch, reader=sharding.data_reader(cfg)
      )
  )
  return iter(ds.to_iter_dataset(_read_options(cfg)))
