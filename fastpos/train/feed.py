"""How batches reach the steps: the one place that knows whether a model carries a memory.

A model that carries nothing reads plain batches (shuffled for training, from any example
position, so a run may resume with another batch size or process count). A language model
with a Transformer-XL memory reads stream batches (``fastpos.train.data``: row r of step t + 1
continues row r of step t), which fix their layout: a resume keeps the batch size and the
process count. Both give the steps' uniform signature a carry to start from
(``fastpos.train.steps.empty_carry``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator

import flax.linen as nn
import ml_collections

from fastpos.tasks.info import TaskInfo
from fastpos.train import data as data_lib
from fastpos.train import steps as steps_lib


@dataclasses.dataclass(frozen=True)
class Feed:
  """train(source, start) -> endless iterator of this process's rows, from example ``start``
  (a checkpointable grain iterator); evaluation(source, limit) -> the evaluation batches in
  order (at most ``limit`` when > 0); empty_carry(rows) -> the carry a run or an evaluation
  starts from; fixed_layout: a checkpointed data position carries over only to the same batch
  size and process count."""

  train: Callable[[Any, int], Any]
  evaluation: Callable[[Any, int], Iterator[dict]]
  empty_carry: Callable[[int], Any]
  fixed_layout: bool


def make_feed(cfg: ml_collections.ConfigDict, model: nn.Module, info: TaskInfo) -> Feed:
  """The feed of ``model`` on a task of ``info``; ValueError for a config the stream batches
  cannot serve (overlapping evaluation windows)."""
  empty = functools.partial(steps_lib.empty_carry, model, info.kind)
  if not steps_lib.carries_memory(model, info.kind):
    return Feed(
        train=lambda source, start: data_lib.train_iterator(source, cfg, start),
        evaluation=lambda source, limit: data_lib.eval_iterator(source, cfg, limit),
        empty_carry=empty,
        fixed_layout=False,
    )
  if 0 < cfg.task.get("eval_stride", 0) < info.max_length:
    raise ValueError(
        "config.task.eval_stride > 0 (overlapping evaluation windows) cannot carry a "
        "Transformer-XL memory across segments; set it to 0 or model.memory_length to 0."
    )
  return Feed(
      train=functools.partial(_stream_train, cfg),
      evaluation=lambda source, limit: data_lib.stream_eval_iterator(source, cfg, limit),
      empty_carry=empty,
      fixed_layout=True,
  )


def _stream_train(cfg: ml_collections.ConfigDict, source, start: int):
  if start:  # a resume restores the iterator's own position instead (fixed_layout)
    raise ValueError(f"stream batches start at example 0; got start={start}.")
  return data_lib.stream_train_iterator(source, cfg)
