"""The training loop over a frozen ``Run``, from a ``Start`` (``fastpos.train.resume``)::

  train_step (jit, donated state) -> every log_every_steps: check finiteness, log
  -> every eval_every_steps: validation metrics, best checkpoint -> every
  checkpoint_every_steps / at the end / on SIGTERM: checkpoint.

Rows are logged at multiples of ``log_every_steps`` (and at the last step) and average the
steps since the previous multiple; the current window travels in the checkpoint, so a
resumed run logs what an uninterrupted one does. A checkpoint is saved only from a state that
is finite and whose loss, on the batch it was just trained on, is finite
(``Run.state_is_good``): a NaN stop leaves a checkpoint that evaluates and trains.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from fastpos import interrupts
from fastpos.train import metrics as metrics_lib
from fastpos.train import resume as resume_lib
from fastpos.train import sharding as sharding_lib
from fastpos.train import state as state_lib
from fastpos.train.checkpoint import Checkpoints, Restored, config_meta
from fastpos.train.errors import NonFiniteLossError
from fastpos.train.run import Run


def _stop_now(requests: interrupts.StopRequests, step: int, every: int) -> bool:
  """Whether to stop after ``step`` (a SIGTERM / SIGINT asked: ``fastpos.interrupts``). With
  several processes the hosts agree every ``every`` steps (one all-gather), so that all of
  them save the same step and exit together."""
  if jax.process_count() == 1:
    return requests.requested is not None
  if step % every:
    return False
  votes = multihost_utils.process_allgather(np.int32(requests.requested is not None))
  if np.any(votes) and requests.requested is None:
    requests.requested = "SIGTERM"  # another host was signalled
  return bool(np.any(votes))


@dataclasses.dataclass
class _Loop:
  """The loop's state: what changes from step to step (the run itself does not)."""

  start: resume_lib.Start
  meta: dict[str, Any]  # what every checkpoint's meta holds: the RNG key, the config blocks
  state: Any
  carry: Any
  first_step: int
  step: int
  window: list[dict]  # the metrics of the steps since the last logged multiple
  best_value: float | None
  last_good: int | None  # the newest step saved (or restored)
  unchecked: list[tuple[int, dict]] = dataclasses.field(default_factory=list)
  train: dict[str, float] = dataclasses.field(default_factory=dict)  # the last logged row
  validation: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Due:
  """What the step just taken is due for."""

  log: bool
  evaluate: bool
  save: bool


def train_loop(
    run: Run, ckpts: Checkpoints, writer: metrics_lib.MetricWriter, start: resume_lib.Start
) -> dict[str, Any]:
  """Trains from ``start`` to ``num_train_steps`` (or a stop signal); the result is what
  ``train_and_evaluate`` returns (its docstring)."""
  step = int(jax.device_get(start.state.step))
  loop = _Loop(
      start=start,
      meta={
          "rng": np.asarray(jax.device_get(start.rng)).tolist(),
          "config": config_meta(run.cfg, run.info),
      },
      state=start.state,
      carry=start.carry,
      first_step=step,
      step=step,
      window=list(start.window),
      best_value=start.best_value,
      last_good=step if start.restored is not None else None,
  )
  writer.start_timer(step)
  stopped_by = None  # the signal that stopped the loop early
  with interrupts.stop_requests() as signals, run.precision():
    while loop.step < run.cfg.num_train_steps:
      batch = _train_one(run, loop, writer)
      stop = _stop_now(signals, loop.step, run.cfg.log_every_steps)
      _after_step(run, ckpts, writer, loop, batch, _due(run.cfg, loop.step, stop))
      if stop:
        stopped_by = signals.requested
        logging.warning(
            "preempted at step %d (%s): saved %s/%d; restart to continue.",
            loop.step,
            signals.requested,
            ckpts.latest_dir,
            loop.step,
        )
        break
  return _result(run, ckpts, writer, loop, stopped_by)


def _train_one(run: Run, loop: _Loop, writer: metrics_lib.MetricWriter):
  """One train step; returns its batch."""
  batch = sharding_lib.global_batch(next(loop.start.batches), run.shardings.batch)
  loop.state, step_metrics, loop.carry = run.train_step(
      loop.state, batch, loop.carry, loop.start.rng
  )
  loop.step += 1
  if loop.step == loop.first_step + 1:  # steps/s from here on: the first step compiles
    jax.block_until_ready(step_metrics)
    writer.start_timer(loop.step)
  if loop.unchecked:  # at most two steps in flight: the host never runs far ahead
    jax.block_until_ready(loop.unchecked[-1][1])
  loop.window.append(step_metrics)
  loop.unchecked.append((loop.step, step_metrics))
  return batch


def _due(cfg, step: int, stop: bool) -> _Due:
  last = step == cfg.num_train_steps
  evaluate = step % cfg.eval_every_steps == 0 or last
  return _Due(
      # Rows at multiples of log_every_steps (and the last step): a resumed run logs the
      # windows of an uninterrupted one.
      log=step % cfg.log_every_steps == 0 or last,
      evaluate=evaluate,
      save=step % cfg.checkpoint_every_steps == 0 or last or evaluate or stop,
  )


def _after_step(run: Run, ckpts: Checkpoints, writer, loop: _Loop, batch, due: _Due) -> None:
  if due.log or due.save:
    steps, metrics = zip(*loop.unchecked)
    bad = metrics_lib.first_nonfinite(list(steps), list(metrics))
    if bad is not None:
      _stop_nonfinite(run, ckpts, loop, "loss or gradient", bad)
    loop.unchecked = []
  if due.log:
    _log(run, writer, loop)
  if due.save and not run.state_is_good(loop.state, loop.carry, batch):
    _stop_nonfinite(run, ckpts, loop, "the parameters after the step (or their loss)", loop.step)
  if not (due.evaluate or due.save):
    return
  meta = _checkpoint_meta(run, loop)
  if due.evaluate:
    _evaluate(run, ckpts, writer, loop, meta)
  if due.save:
    tree = state_lib.checkpoint_tree(loop.state, loop.carry)
    ckpts.save(loop.step, tree, loop.start.batches, meta)
    loop.last_good = loop.step
  writer.start_timer(loop.step)  # steps/s counts training steps, not evaluation or saving


def _log(run: Run, writer: metrics_lib.MetricWriter, loop: _Loop) -> None:
  summary = metrics_lib.summarize(
      resume_lib.sum_window(loop.window), perplexity=run.info.kind == "lm"
  )
  summary["learning_rate"] = float(run.schedule(loop.step - 1))
  rate = writer.steps_per_second(loop.step)
  tokens_rate = metrics_lib.tokens_per_second(rate, summary)
  writer.write(loop.step, "train", summary, steps_per_second=rate, tokens_per_second=tokens_rate)
  writer.progress(loop.step, summary, rate, tokens_rate)
  loop.train = summary
  if loop.step % run.cfg.log_every_steps == 0:
    loop.window = []


def _checkpoint_meta(run: Run, loop: _Loop) -> dict[str, Any]:
  return {
      **loop.meta,
      "step": loop.step,
      "data": loop.start.position.meta(run.cfg, loop.start.num_examples, loop.step),
      "log_window": resume_lib.window_meta(loop.window),
  }


def _evaluate(run: Run, ckpts: Checkpoints, writer, loop: _Loop, meta: dict[str, Any]) -> None:
  """Validation metrics, logged; the best checkpoint when they improve on it."""
  val = run.evaluate_split(loop.state, "validation", run.cfg.num_eval_batches)
  writer.write(loop.step, "validation", val)
  logging.info(
      "step %d validation: %s", loop.step, " ".join(f"{k}={v:.4g}" for k, v in val.items())
  )
  loop.validation = val
  value = val[run.task.metric]
  if np.isfinite(val["loss"]) and _better(value, loop.best_value, run.task.metric_mode):
    loop.best_value = value
    tree = state_lib.checkpoint_tree(loop.state, loop.carry)
    ckpts.save_best(loop.step, tree, {**meta, "metrics": val})


def _better(value: float, best: float | None, mode: str) -> bool:
  if not np.isfinite(value):
    return False
  return best is None or (value > best if mode == "max" else value < best)


def _result(run: Run, ckpts: Checkpoints, writer, loop: _Loop, signal_name) -> dict[str, Any]:
  return {
      "train": loop.train,
      "validation": loop.validation,
      "stopped_early": signal_name is not None,
      "signal": signal_name,
      "step": loop.step,
      "best": {"step": ckpts.best_step(), run.task.metric: loop.best_value},
      "tokens_per_second": writer.mean_tokens_per_second(),
      "state": loop.state,
      "carry": loop.carry,
  }


def _stop_nonfinite(run: Run, ckpts: Checkpoints, loop: _Loop, what: str, at: int):
  ckpts.wait()
  if loop.start.restored is not None and at == loop.first_step + 1:
    raise NonFiniteLossError(_blame_restored(loop.start.restored, what, at))
  raise NonFiniteLossError(_nonfinite_message(run, ckpts, what, at, loop.last_good))


def _blame_restored(restored: Restored, what: str, at: int) -> str:
  """The first step after a restore went NaN / Inf: the checkpoint is the suspect."""
  how = (
      "its digests verify, so it is as it was saved: was a setting changed on resume?"
      if restored.verified
      else "it was written without digests, so it is unverified"
  )
  return (
      f"{what} became NaN/Inf at step {at}, the first step after restoring {restored.path}; "
      f"training stopped. Suspect that checkpoint, not the learning rate ({how}). Move "
      "it aside to resume from the one before it, or use a new --workdir."
  )


def _nonfinite_message(
    run: Run, ckpts: Checkpoints, what: str, at: int, last_good: int | None
) -> str:
  """Why a run stopped on a NaN / Inf: the newest saved checkpoint whose digests verify is
  named as the last good one."""
  good, skipped = (
      ckpts.newest_verified(run.checkpoint_abstract, last_good)
      if last_good is not None
      else (None, [])
  )
  if good is not None:
    where = f"The last good checkpoint is step {good} in {ckpts.latest_dir} (verified, left intact)"
  else:
    where = (
        "No checkpoint had been saved yet"
        if last_good is None
        else f"No checkpoint in {ckpts.latest_dir} verifies"
    )
  if skipped:
    where += f"; newer ones do not verify: {'; '.join(skipped)}"
  return (
      f"{what} became NaN/Inf at step {at}; training stopped. {where}. Lower the learning "
      "rate, enable clipping (optimizer.grad_clip_norm) or check the data."
  )
