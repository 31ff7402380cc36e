"""The run description: everything built (and checked) from a config before the loop starts.

``build_run(config, workdir, model)`` checks the config against the task, the model and the
devices (task name, model build and shapes, kernel / scheme names, batch sizes against the
mesh, bucketing and packing) and returns a frozen ``Run``: the task, the model, the mesh and
shardings, the abstract train state and carry, and the jitted steps (compiled at their first
call, saying so). Nothing in it changes while the loop runs; what does (the state, the carry,
the data position) is the loop's (``fastpos.train.loop``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from fastpos import tasks
from fastpos.models import build_model
from fastpos.tasks.info import TaskInfo
from fastpos.train import bucketing, packing
from fastpos.train import config as config_lib
from fastpos.train import feed as feed_lib
from fastpos.train import metrics as metrics_lib
from fastpos.train import sharding as sharding_lib
from fastpos.train import state as state_lib
from fastpos.train.checkpoint import config_meta
from fastpos.train.state import TrainState, make_optimizer, make_schedule
from fastpos.train.steps import make_eval_step, make_train_step


class SaysCompiling:
  """A jitted step that logs "compiling the <name> step..." before its first compilation and
  the seconds it took after it: a run is otherwise silent for the tens of seconds a model's
  first compile takes. The compile is done ahead of the call (``lower().compile()``), whose
  executable jit's own cache then serves, so the time is compilation only."""

  def __init__(self, name: str, jitted):
    self.name, self._jitted, self._compiled = name, jitted, False

  def __call__(self, *args):
    if not self._compiled:
      logging.info("compiling the %s step...", self.name)
      start = time.perf_counter()
      self._jitted.lower(*args).compile()
      logging.info("compiled the %s step in %.1f s", self.name, time.perf_counter() - start)
      self._compiled = True
    return self._jitted(*args)


@dataclasses.dataclass(frozen=True)
class Shardings:
  """state: of the ``TrainState``; carry: of the steps' carry (its rows split over "data"
  like a batch's); batch: of a batch's rows; batch_in: of a batch as the steps take it (the
  tokens also over "seq"); replicated."""

  state: Any
  carry: Any
  batch: Any
  batch_in: Any
  replicated: Any


@dataclasses.dataclass(frozen=True)
class Run:
  """The frozen description of a run (``build_run``).

  abstract / abstract_carry: the train state and the carry as sharded
  ``jax.ShapeDtypeStruct``s. train_step(state, batch, carry, rng) -> (state, metrics, carry)
  and eval_step(state, batch, carry) -> (metrics, carry): jitted with the shardings, the
  state donated to the train step (``fastpos.train.steps``).
  """

  cfg: ml_collections.ConfigDict
  workdir: Path
  task: Any
  info: TaskInfo
  model: nn.Module
  mesh: jax.sharding.Mesh
  feed: feed_lib.Feed
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  init_rng: jax.Array
  train_rng: jax.Array
  shardings: Shardings
  abstract: TrainState
  abstract_carry: Any
  num_params: int
  train_step: Callable
  eval_step: Callable
  all_finite: Callable  # tree -> bool scalar: every inexact leaf finite
  eval_carry: Callable  # () -> the empty carry of one evaluation batch, sharded

  @property
  def checkpoint_abstract(self) -> dict[str, Any]:
    """The abstract tree a checkpoint restores into (``state.checkpoint_tree``)."""
    return state_lib.checkpoint_tree(self.abstract, self.abstract_carry)

  @property
  def expect(self) -> dict[str, Any]:
    """What this run's checkpoints belong to (``checkpoint.config_meta``)."""
    return config_meta(self.cfg, self.info)

  def init_state(self) -> tuple[TrainState, Any]:
    """(state, carry) of a run from scratch, sharded."""
    init = _initializer(self.model, self.tx, self.info)
    state = jax.jit(init, out_shardings=self.shardings.state)(self.init_rng)
    carry = jax.jit(
        lambda: self.feed.empty_carry(self.cfg.batch_size), out_shardings=self.shardings.carry
    )()
    return state, carry

  def precision(self):
    p = self.cfg.precision
    return contextlib.nullcontext() if p == "default" else jax.default_matmul_precision(p)

  def state_is_good(self, state: TrainState, carry: Any, batch) -> bool:
    """Whether ``state`` may be saved: parameters, optimizer state and other collections
    finite, and a finite loss on ``batch`` (the batch the step just trained on, with the carry
    after it; evaluation mode, as ``evaluate`` would score it). Huge but finite weights pass
    the first test and fail the second."""
    finite = self.all_finite((state.params, state.opt_state, state.collections))
    out, _ = self.eval_step(state, batch, carry)
    loss_sum, count = jax.device_get(out["loss"])
    return bool(jax.device_get(finite)) and bool(np.isfinite(loss_sum)) and count > 0

  def evaluate_split(self, state: TrainState, split: str, limit: int = 0) -> dict[str, float]:
    """The metrics of ``split`` (its first ``limit`` batches when > 0), with
    ``num_examples``: every batch in order, the carry starting empty and carried across."""
    total, carry = None, self.eval_carry()
    for local in self.feed.evaluation(self.task.source(split), limit):
      batch = sharding_lib.global_batch(local, self.shardings.batch)
      step_metrics, carry = self.eval_step(state, batch, carry)
      total = metrics_lib.add(total, step_metrics)
    out = metrics_lib.summarize(total, perplexity=self.info.kind == "lm")
    out["num_examples"] = float(jax.device_get(total["loss"][1]))
    return out


def build_run(
    config: ml_collections.ConfigDict, workdir: str | Path, model: nn.Module | None = None
) -> Run:
  """Checks ``config`` (and ``model``, built from it when None) and describes the run; nothing
  is compiled or written. Bad task, kernel or scheme names, incompatible pairs, shapes and
  batch sizes that do not fit the devices stop here."""
  # Each value against its declared range (fastpos.config_schema), unless the command line's
  # config_of validated this config as it stands.
  cfg = config_lib.checked(config)
  task = tasks.make_task(cfg.task)  # unknown / not-built task names stop here
  info: TaskInfo = task.info
  if model is None:
    # Bad kernel / scheme names or options and incompatible pairs stop here.
    model = build_model(cfg.model, info)
  feed = feed_lib.make_feed(cfg, model, info)
  mesh = _checked_mesh(cfg, info, model)
  tx = make_optimizer(cfg)
  init_rng, train_rng = jax.random.split(jax.random.PRNGKey(cfg.seed))
  # Traces the model once (no compilation): shape errors surface here, before compiling.
  abstract = jax.eval_shape(_initializer(model, tx, info), init_rng)
  abstract_carry = jax.eval_shape(lambda: feed.empty_carry(cfg.batch_size))
  shardings = _shardings(cfg, mesh, abstract, abstract_carry)
  train_step, eval_step = _jit_steps(cfg, mesh, model, tx, info, shardings)
  eval_rows = cfg.eval_batch_size or cfg.batch_size
  return Run(
      cfg=cfg,
      workdir=Path(workdir),
      task=task,
      info=info,
      model=model,
      mesh=mesh,
      feed=feed,
      tx=tx,
      schedule=make_schedule(cfg),
      init_rng=init_rng,
      train_rng=train_rng,
      shardings=shardings,
      abstract=_with_shardings(abstract, shardings.state),
      abstract_carry=_with_shardings(abstract_carry, shardings.carry),
      num_params=sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params)),
      train_step=train_step,
      eval_step=eval_step,
      all_finite=jax.jit(_all_finite, out_shardings=shardings.replicated),
      eval_carry=jax.jit(lambda: feed.empty_carry(eval_rows), out_shardings=shardings.batch),
  )


def _checked_mesh(cfg: ml_collections.ConfigDict, info: TaskInfo, model: nn.Module):
  """The device mesh, after checking that the batches, the sequence split, bucketing and
  packing fit it."""
  mesh = sharding_lib.make_mesh(cfg)
  sharding_lib.check_batch_sizes(cfg, mesh)
  sharding_lib.check_seq_split(mesh, info.max_length, model)
  seq = sharding_lib.seq_size(mesh)
  bucketing.check_config(cfg, info.kind, info.max_length, info.grid, seq)
  packing.check_config(cfg, info.kind, info.max_length, model, seq)
  return mesh


def _dummy_batch(info: TaskInfo) -> dict[str, jax.Array]:
  n = info.max_length
  batch = {"inputs": jnp.ones((1, n), jnp.int32), "mask": jnp.ones((1, n), bool)}
  if info.kind == "retrieval":
    batch.update(inputs2=batch["inputs"], mask2=batch["mask"])
  return batch


def _initializer(model: nn.Module, tx: optax.GradientTransformation, info: TaskInfo) -> Callable:
  """rng -> the ``TrainState`` of a run from scratch."""

  def init(rng: jax.Array) -> TrainState:
    params_rng, dropout_rng, features_rng = jax.random.split(rng, 3)
    variables = model.init(
        {"params": params_rng, "dropout": dropout_rng, "features": features_rng},
        _dummy_batch(info),
        train=False,
    )
    variables = dict(variables)
    params = variables.pop("params")
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        collections=variables,
    )

  return init


def _shardings(cfg, mesh, abstract: TrainState, abstract_carry: Any) -> Shardings:
  batch = sharding_lib.batch_sharding(mesh)
  return Shardings(
      state=sharding_lib.tree_shardings(abstract, mesh, cfg.mesh.rules),
      # The carry has the batch's rows: split over "data" like a batch, whatever the rules say.
      carry=jax.tree.map(lambda _: batch, abstract_carry),
      batch=batch,
      batch_in=sharding_lib.batch_in_sharding(mesh),
      replicated=sharding_lib.replicated(mesh),
  )


def _with_shardings(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings
  )


def _jit_steps(cfg, mesh, model, tx, info: TaskInfo, sh: Shardings) -> tuple[Callable, Callable]:
  """(train_step, eval_step) jitted with the run's shardings (compiled at the first call)."""
  train = sharding_lib.in_seq_mesh(
      make_train_step(model, tx, info.kind, cfg.grad_accum_steps), mesh
  )
  evaluate = sharding_lib.in_seq_mesh(make_eval_step(model, info.kind), mesh)
  train_step = jax.jit(
      train,
      in_shardings=(sh.state, sh.batch_in, sh.carry, sh.replicated),
      out_shardings=(sh.state, sh.replicated, sh.carry),
      donate_argnums=0,
  )
  eval_step = jax.jit(
      evaluate,
      in_shardings=(sh.state, sh.batch_in, sh.batch),
      out_shardings=(sh.replicated, sh.batch),
  )
  return SaysCompiling("train", train_step), SaysCompiling("eval", eval_step)


def _all_finite(tree) -> jax.Array:
  leaves = [
      jnp.all(jnp.isfinite(x))
      for x in jax.tree.leaves(tree)
      if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)
