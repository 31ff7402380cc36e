"""``train_and_evaluate(config, workdir)`` and ``evaluate(config, workdir, split)``.

One trainer for every task and model. Order of work: everything that can be wrong with the
config or the workdir is checked first (task name, model build and shapes, kernel / scheme
names, batch sizes against devices, a checkpoint of another model, missing data), then the
steps are compiled, then the loop runs:

  train_step (jit, donated state) -> every log_every_steps: check finiteness, log
  -> every eval_every_steps: validation metrics, best checkpoint -> every
  checkpoint_every_steps / at the end / on SIGTERM: checkpoint.

A run resumes from the newest checkpoint in the workdir: parameters, optimizer state, step,
data position and RNG, so that the resumed run is bitwise the uninterrupted one on CPU.

Language models with a Transformer-XL memory (``model.memory_length > 0``): the data come as
stream batches (``data.stream_train_iterator``: row r of step t + 1 continues row r of step t),
the memory for the next training batch lives in ``TrainState.memory`` (checkpointed, so a
resumed run carries on with it; sharded over "data" like a batch), and each evaluation starts
from an empty memory and carries it across its batches in order
(``data.stream_eval_iterator``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import threading
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from fastpos import tasks
from fastpos.models.config import TaskInfo
from fastpos.train import data as data_lib
from fastpos.train import metrics as metrics_lib
from fastpos.train import sharding as sharding_lib
from fastpos.train.checkpoint import Checkpoints, config_meta
from fastpos.train.errors import NonFiniteLossError
from fastpos.train.state import TrainState, make_optimizer, make_schedule
from fastpos.train.steps import make_eval_step, make_train_step


class _Run:
  """Everything built (and checked) from a config before anything is compiled."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str | Path,
               model: nn.Module | None, *, read_only: bool = False):
    cfg = config.copy_and_resolve_references()
    for name in ("num_train_steps", "log_every_steps", "eval_every_steps",
                 "checkpoint_every_steps", "keep_checkpoints"):
      if cfg[name] < 1:
        raise ValueError(f"config.{name} must be >= 1; got {cfg[name]}.")
    self.cfg = cfg
    self.workdir = Path(workdir)
    self.task = tasks.make_task(cfg.task)  # unknown / not-built task names stop here
    self.info: TaskInfo = self.task.info
    if model is None:
      from fastpos.models import build_model  # pylint: disable=import-outside-toplevel
      model = build_model(cfg.model, self.info)  # unknown kernel / scheme names stop here
    self.model = model
    # A Transformer-XL memory carried across batches (DecoderLM with memory_length > 0).
    self.memory = self.info.kind == "lm" and getattr(model, "memory_length", 0) > 0
    self.mesh = sharding_lib.make_mesh(cfg)
    sharding_lib.check_batch_sizes(cfg, self.mesh)
    self.tx = make_optimizer(cfg)
    self.schedule = make_schedule(cfg)
    self.init_rng, self.train_rng = jax.random.split(jax.random.PRNGKey(cfg.seed))
    self.batch_sharding = sharding_lib.batch_sharding(self.mesh)
    self.replicated = sharding_lib.replicated(self.mesh)
    # Traces the model once (no compilation): shape and compatibility errors surface here.
    abstract = jax.eval_shape(self._init, self.init_rng)
    self.state_sharding = sharding_lib.tree_shardings(abstract, self.mesh, cfg.mesh.rules)
    # The memory has the batch's rows: split over "data" like a batch, whatever the rules say.
    self.state_sharding = self.state_sharding.replace(
        memory=jax.tree.map(lambda _: self.batch_sharding, abstract.memory))
    self.abstract_state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract,
        self.state_sharding)
    self.ckpts = Checkpoints(self.workdir, cfg, read_only=read_only)
    self.ckpts.check_compatible(cfg, self.info)
    self.num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))

  def dummy_batch(self) -> dict[str, jax.Array]:
    n = self.info.max_length
    batch = {"inputs": jnp.ones((1, n), jnp.int32), "mask": jnp.ones((1, n), bool)}
    if self.info.kind == "retrieval":
      batch.update(inputs2=batch["inputs"], mask2=batch["mask"])
    return batch

  def _init(self, rng: jax.Array) -> TrainState:
    params_rng, dropout_rng, features_rng = jax.random.split(rng, 3)
    variables = self.model.init(
        {"params": params_rng, "dropout": dropout_rng, "features": features_rng},
        self.dummy_batch(), train=False)
    variables = dict(variables)
    params = variables.pop("params")
    memory = self.model.init_memory(self.cfg.batch_size) if self.memory else {}
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=self.tx.init(params), collections=variables, memory=memory)

  def init_state(self) -> TrainState:
    return jax.jit(self._init, out_shardings=self.state_sharding)(self.init_rng)

  def compile_eval(self):
    step = make_eval_step(self.model, self.info.kind, memory=self.memory)
    if self.memory:
      return jax.jit(step, in_shardings=(self.state_sharding, self.batch_sharding,
                                         self.batch_sharding),
                     out_shardings=(self.replicated, self.batch_sharding))
    return jax.jit(step, in_shardings=(self.state_sharding, self.batch_sharding),
                   out_shardings=self.replicated)

  @functools.cached_property
  def empty_eval_memory(self):
    """() -> an empty memory for one evaluation batch, sharded like a batch."""
    size = self.cfg.eval_batch_size or self.cfg.batch_size
    return jax.jit(lambda: self.model.init_memory(size), out_shardings=self.batch_sharding)

  def train_iterator(self, source):
    if self.memory:
      return data_lib.stream_train_iterator(source, self.cfg)
    return data_lib.train_iterator(source, self.cfg)

  def evaluate_split(self, eval_step, state: TrainState, split: str,
                     limit: int = 0) -> dict[str, float]:
    total = None
    source = self.task.source(split)
    if self.memory:  # stream batches, from an empty memory carried across them in order
      memory = self.empty_eval_memory()
      batches = data_lib.stream_eval_iterator(source, self.cfg, limit)
    else:
      batches = data_lib.eval_iterator(source, self.cfg, limit)
    for local in batches:
      batch = sharding_lib.global_batch(local, self.batch_sharding)
      if self.memory:
        step_metrics, memory = eval_step(state, batch, memory)
      else:
        step_metrics = eval_step(state, batch)
      total = metrics_lib.add(total, step_metrics)
    out = metrics_lib.summarize(total, perplexity=self.info.kind == "lm")
    out["num_examples"] = float(jax.device_get(total["loss"][1]))
    return out

  def precision(self):
    p = self.cfg.precision
    return contextlib.nullcontext() if p == "default" else jax.default_matmul_precision(p)


class _StopOnSigterm:
  """Turns SIGTERM (preemption) into a request to save and exit after the current step."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def stop_now(self, step: int, every: int) -> bool:
    """Whether to stop after ``step``. With several processes the hosts agree every ``every``
    steps (one all-gather), so that all of them save the same step and exit together."""
    if jax.process_count() == 1:
      return self.requested
    if step % every:
      return False
    votes = multihost_utils.process_allgather(np.int32(self.requested))
    return bool(np.any(votes))

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def _better(value: float, best: float | None, mode: str) -> bool:
  if not np.isfinite(value):
    return False
  return best is None or (value > best if mode == "max" else value < best)


def _write_json(path: Path, obj: Any) -> None:
  if jax.process_index() == 0:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(obj if isinstance(obj, str) else json.dumps(obj, indent=2))
    tmp.replace(path)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | Path, *,
                       model: nn.Module | None = None) -> dict[str, Any]:
  """Trains per ``config`` in ``workdir``, resuming from its newest checkpoint.

  Args:
    config: the run's config (``configs/*.py``).
    workdir: checkpoints, ``metrics.jsonl``, ``tensorboard/`` and ``config.json`` go here.
    model: a linen module to train instead of ``build_model(config.model, task.info)``
      (tests use this to inject a throwaway model).

  Returns:
    {"step", "train": last logged training metrics, "validation": last validation metrics,
    "best": {"step", metric}, "stopped_early": bool (SIGTERM), "state": the final
    ``TrainState``}.

  Raises:
    NonFiniteLossError: the loss or gradient norm became NaN / Inf (names the step and the
      last good checkpoint, which is left intact).
  """
  metrics_lib.quiet_library_logs()
  run = _Run(config, workdir, model)
  cfg = run.cfg
  train_src = run.task.source("train")  # a missing dataset stops here, before compiling
  val_src = run.task.source("validation")
  _write_json(run.workdir / "config.json", cfg.to_json_best_effort(indent=2))
  logging.info("task %s: %d train / %d validation examples; model: %d parameters; %d devices "
               "(mesh %s), %d process(es)", cfg.task.name, len(train_src), len(val_src),
               run.num_params, jax.device_count(), dict(run.mesh.shape), jax.process_count())

  train_iter = run.train_iterator(train_src)
  best_metric, best_value = run.task.metric, None
  train_rng = run.train_rng
  if run.ckpts.latest_step() is not None:
    state, meta = run.ckpts.restore(run.abstract_state, train_iter)
    train_rng = jnp.asarray(np.asarray(meta["rng"], np.uint32))
    best_meta = run.ckpts.read_meta("best")
    if best_meta is not None:
      best_value = best_meta["metrics"][best_metric]
    logging.info("resumed from %s/%d", run.ckpts.latest_dir, meta["step"])
  else:
    state = run.init_state()

  train_step = jax.jit(
      make_train_step(run.model, run.tx, run.info.kind, cfg.grad_accum_steps,
                      memory=run.memory),
      in_shardings=(run.state_sharding, run.batch_sharding, run.replicated),
      out_shardings=(run.state_sharding, run.replicated), donate_argnums=0)
  eval_step = run.compile_eval()
  writer = metrics_lib.MetricWriter(run.workdir, cfg.num_train_steps)
  step = int(jax.device_get(state.step))
  last_good = run.ckpts.latest_step()
  meta_base = {"rng": np.asarray(jax.device_get(train_rng)).tolist(),
               "config": config_meta(cfg, run.info)}
  result: dict[str, Any] = {"train": {}, "validation": {}, "stopped_early": False}
  pending_steps: list[int] = []
  pending: list[dict] = []
  first_step = step
  writer.start_timer(step)

  try:
    with _StopOnSigterm() as sigterm, run.precision():
      while step < cfg.num_train_steps:
        batch = sharding_lib.global_batch(next(train_iter), run.batch_sharding)
        state, step_metrics = train_step(state, batch, train_rng)
        step += 1
        if step == first_step + 1:  # steps/s from here on: the first step includes compiling
          jax.block_until_ready(step_metrics)
          writer.start_timer(step)
        pending_steps.append(step)
        pending.append(step_metrics)
        stop = sigterm.stop_now(step, cfg.log_every_steps)
        last = step == cfg.num_train_steps
        do_eval = step % cfg.eval_every_steps == 0 or last
        do_save = step % cfg.checkpoint_every_steps == 0 or last or do_eval or stop
        if step % cfg.log_every_steps == 0 or do_save:
          bad = metrics_lib.first_nonfinite(pending_steps, pending)
          if bad is not None:
            run.ckpts.wait()
            where = (f"The last good checkpoint is step {last_good} in {run.ckpts.latest_dir} "
                     "(left intact)" if last_good is not None else
                     "No checkpoint had been saved yet")
            raise NonFiniteLossError(
                f"loss or gradient became NaN/Inf at step {bad}; training stopped. {where}. "
                "Lower the learning rate, enable clipping (optimizer.grad_clip_norm) or "
                "check the data.")
          summary = metrics_lib.summarize(
              jax.tree.map(lambda *xs: sum(xs), *pending) if len(pending) > 1 else pending[0],
              perplexity=run.info.kind == "lm")
          summary["learning_rate"] = float(run.schedule(step - 1))
          rate = writer.steps_per_second(step)
          writer.write(step, "train", summary, steps_per_second=rate)
          writer.progress(step, summary, rate)
          result["train"] = summary
          pending_steps, pending = [], []
        meta = {**meta_base, "step": step}
        if do_eval:
          val = run.evaluate_split(eval_step, state, "validation", cfg.num_eval_batches)
          writer.write(step, "validation", val)
          logging.info("step %d validation: %s", step,
                       " ".join(f"{k}={v:.4g}" for k, v in val.items()))
          result["validation"] = val
          if _better(val[best_metric], best_value, run.task.metric_mode):
            best_value = val[best_metric]
            run.ckpts.save_best(step, state, {**meta, "metrics": val})
        if do_save:
          run.ckpts.save(step, state, train_iter, meta)
          last_good = step
        if do_eval or do_save:
          writer.start_timer(step)  # steps/s counts training steps, not evaluation or saving
        if stop:
          logging.warning("SIGTERM: saved step %d in %s; exiting.", step, run.ckpts.latest_dir)
          result["stopped_early"] = True
          break
  finally:
    run.ckpts.wait()
    run.ckpts.close()
    writer.close()
  result["step"] = step
  result["best"] = {"step": run.ckpts.best_step(), best_metric: best_value}
  result["state"] = state
  return result


def evaluate(config: ml_collections.ConfigDict, workdir: str | Path, split: str = "test", *,
             checkpoint: str = "best", model: nn.Module | None = None) -> dict[str, Any]:
  """Evaluates a trained workdir on ``split``; writes ``<workdir>/results_<split>.json``.

  Args:
    config: the config the workdir was trained with.
    workdir: a workdir written by ``train_and_evaluate``.
    split: "test" (default), "validation" or "train".
    checkpoint: "best" (the best on validation; the latest when no evaluation ran yet) or
      "latest".
    model: as in ``train_and_evaluate``.

  Returns:
    The metrics with ``split``, ``step`` and ``checkpoint`` (which one was used).
  """
  if checkpoint not in ("best", "latest"):
    raise ValueError(f"checkpoint must be 'best' or 'latest'; got {checkpoint!r}.")
  if split not in tasks.SPLITS:
    raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(tasks.SPLITS)}.")
  metrics_lib.quiet_library_logs()
  run = _Run(config, workdir, model, read_only=True)
  which = "best" if checkpoint == "best" and run.ckpts.best_step() is not None else "latest"
  if run.ckpts.latest_step() is None and which == "latest":
    raise FileNotFoundError(
        f"no checkpoint in {run.ckpts.latest_dir}; train first: python train.py "
        f"--config=... --workdir={workdir}")
  run.task.source(split)
  state, meta = run.ckpts.restore(run.abstract_state, which=which)
  run.ckpts.close()
  with run.precision():
    out = run.evaluate_split(run.compile_eval(), state, split)
  results = {"split": split, "step": int(meta["step"]), "checkpoint": which,
             "task": run.cfg.task.name, **out}
  _write_json(run.workdir / f"results_{split}.json", results)
  logging.info("%s on %s (checkpoint %s, step %d): %s", run.cfg.task.name, split, which,
               results["step"], " ".join(f"{k}={v:.4g}" for k, v in out.items()))
  return results
