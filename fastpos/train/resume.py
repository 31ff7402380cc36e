"""Where a run starts: from scratch, or from what a checkpoint restore found.

``start(run, ckpts, source)`` restores the newest checkpoint that loads (a damaged one is
reported and moved aside; ``fastpos.train.checkpoint``) and decides from what it found where
the training data continue. The data position is kept in examples: the same batch size,
process count and batching restore the saved iterator exactly; another batch size, process
count or bucketing starts a new iterator at the example where the checkpointed run stopped;
another training split size, or stream batches (a fixed layout) with another batch size or
process count, cannot carry the position over (RunError naming both values).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from fastpos.train import state as state_lib
from fastpos.train.checkpoint import Checkpoints, Restored
from fastpos.train.errors import RunError
from fastpos.train.identity import Record
from fastpos.train.run import Run
from fastpos.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class DataPosition:
  """Where the training iterator's batch 0 sits: at example ``start`` of the data stream, as
  training step ``start_step`` + 1 (both 0 for a run from scratch)."""

  start: int = 0
  start_step: int = 0

  def meta(self, cfg: ml_collections.ConfigDict, num_examples: int, step: int) -> dict:
    """The data position a checkpoint after ``step`` records, in examples."""
    meta = {
        "examples": self.start + (step - self.start_step) * cfg.batch_size,
        "start": self.start,
        "start_step": self.start_step,
        "batch_size": cfg.batch_size,
        "num_examples": num_examples,
    }
    cut = batching(cfg)
    return {**meta, "batching": cut} if cut else meta


@dataclasses.dataclass(frozen=True)
class Start:
  """What the loop starts from: the state and carry, the training RNG key, the training
  iterator and its ``DataPosition``, the log window carried over (a list of summed metrics),
  the best validation value so far, the restored checkpoint (None from scratch) and the
  training split's size."""

  state: TrainState
  carry: Any
  rng: jax.Array
  batches: Any
  position: DataPosition
  window: list[dict]
  best_value: float | None
  restored: Restored | None
  num_examples: int


def batching(cfg: ml_collections.ConfigDict) -> list:
  """How the training stream is cut into batches beyond its order: [] for plain batches, else
  the bucket lengths or "pack" (and the examples per packed row), and the window (another
  value maps a position to other batches)."""
  lengths = list(cfg.data.get("bucket_lengths", ()) or ())
  if cfg.data.get("pack", False):
    lengths = ["pack", f"segments={int(cfg.data.get('pack_segments', 8))}"]
  return [*lengths, int(cfg.data.get("bucket_window", 1))] if lengths else []


def start(
    run: Run, ckpts: Checkpoints, source, record: Record | None = None, data_changed: bool = False
) -> Start:
  """The loop's start: restored from the newest checkpoint that loads, else from scratch.
  ``record``: the workdir's run record; a checkpoint it does not account for (another run's,
  or the record edited or cut short) stops the resume (``identity.Record.check``).
  ``data_changed``: the training data changed and the change was accepted (``resume_data``)."""
  expect = run.expect
  if record is not None:
    expect = {**expect, "run": functools.partial(record.check, records=True)}
  found = ckpts.restore_newest(run.checkpoint_abstract, expect=expect)
  if found is None:
    state, carry = run.init_state()
    batches = run.feed.train(source, 0)
    return Start(state, carry, run.train_rng, batches, DataPosition(), [], None, None, len(source))
  state, carry = state_lib.from_checkpoint_tree(found.state)
  batches, position = resume_data(run, source, found, data_changed)
  return Start(
      state=state,
      carry=carry,
      rng=jnp.asarray(np.asarray(found.meta["rng"], np.uint32)),
      batches=batches,
      position=position,
      window=window_from_meta(found.meta.get("log_window")),
      best_value=_best_value(run, ckpts),
      restored=found,
      num_examples=len(source),
  )


def _best_value(run: Run, ckpts: Checkpoints) -> float | None:
  """The validation metric of the best checkpoint (None when there is none or it does not
  load: the next evaluation replaces it)."""
  try:
    meta = ckpts.read_meta("best")
  except Exception as e:  # pylint: disable=broad-except
    logging.warning(
        "the best checkpoint in %s does not load (%s); the next evaluation that improves on "
        "nothing replaces it.",
        ckpts.best_dir,
        e,
    )
    return None
  return None if meta is None else meta["metrics"][run.task.metric]


def resume_data(
    run: Run, source, found: Restored, data_changed: bool = False
) -> tuple[Any, DataPosition]:
  """(training iterator, its DataPosition) continuing the run that saved ``found``. A training
  split of another size is refused, unless ``data_changed`` (an accepted change of the data):
  then the new data are read from the example where the run stopped."""
  data, where = found.meta.get("data"), found.path
  if data is None:  # written before positions were kept in examples: batches of this size
    return _restored_iterator(run, source, found, 0), DataPosition()
  n, batch = len(source), run.cfg.batch_size
  if data["num_examples"] != n and data_changed and not run.feed.fixed_layout:
    logging.warning(
        "the training data changed (accepted): %d examples, %d before; resuming at example "
        "%d of the new data (step %d).",
        n,
        data["num_examples"],
        data["examples"],
        found.step,
    )
    return run.feed.train(source, data["examples"]), DataPosition(data["examples"], found.step)
  if data["num_examples"] != n:
    raise RunError(
        f"{where} was trained on a training split of {data['num_examples']} examples; it now "
        f"has {n}: the data position cannot carry over. Use the data the run started with, "
        "or a new --workdir."
    )
  same_batching = data.get("batching", []) == batching(run.cfg)
  if data["batch_size"] == batch and found.data_state is not None and same_batching:
    iterator = _restored_iterator(run, source, found, data["start"])
    return iterator, DataPosition(data["start"], data["start_step"])
  procs, saved_procs = jax.process_count(), found.data_processes
  if run.feed.fixed_layout:
    raise RunError(
        f"{where} was trained with config.batch_size={data['batch_size']} on {saved_procs} "
        f"process(es); now {batch} on {procs}. Stream batches (a Transformer-XL memory) keep "
        f"their layout: resume with --config.batch_size={data['batch_size']} on "
        f"{saved_procs} process(es), or use a new --workdir."
    )
  _log_moved_position(run.cfg, data, found.step, same_batching, saved_procs)
  return run.feed.train(source, data["examples"]), DataPosition(data["examples"], found.step)


def _restored_iterator(run: Run, source, found: Restored, start_example: int):
  """The training iterator from ``start_example``, at the position ``found`` saved."""
  if found.data_state is None:
    raise RunError(
        f"{found.path} has no data position for {jax.process_count()} process(es) (saved by "
        f"{found.data_processes}) and no record of it in examples: resume on the process "
        "count that saved it, or use a new --workdir."
    )
  iterator = run.feed.train(source, start_example)
  iterator.set_state(found.data_state)
  return iterator


def _log_moved_position(cfg, data: dict, step: int, same_batching: bool, saved_procs) -> None:
  if not same_batching:
    logging.warning(
        "config.data bucketing changed (%s -> %s): resuming at example %d of the "
        "training data (step %d).",
        data.get("batching", []),
        batching(cfg),
        data["examples"],
        step,
    )
  elif data["batch_size"] != cfg.batch_size:
    logging.warning(
        "config.batch_size changed from %d to %d: resuming at example %d of the "
        "training data (step %d).",
        data["batch_size"],
        cfg.batch_size,
        data["examples"],
        step,
    )
  else:
    logging.info(
        "%d process(es) now, %d when saved: resuming at example %d of the training "
        "data (step %d).",
        jax.process_count(),
        saved_procs,
        data["examples"],
        step,
    )


def sum_window(window: list[dict]) -> dict:
  # Left to right, in float32: a window restored from a checkpoint (its first entry) adds up
  # to the same bits as the uninterrupted run's.
  return jax.tree.map(lambda *xs: sum(xs), *window) if len(window) > 1 else window[0]


def window_meta(window: list[dict]) -> dict[str, list[float]] | None:
  """The summed metrics of the current log window, as JSON (float32 values, exact)."""
  if not window:
    return None
  total = jax.device_get(sum_window(window))
  return {k: [float(np.float32(s)), float(np.float32(c))] for k, (s, c) in total.items()}


def window_from_meta(saved: dict[str, list[float]] | None) -> list[dict]:
  if not saved:
    return []
  return [{k: (np.float32(s), np.float32(c)) for k, (s, c) in saved.items()}]
