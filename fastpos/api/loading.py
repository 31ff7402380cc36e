"""``load(workdir)``: a trained run's model, parameters, config and task, in one call.

The workdir is read through its owner, ``fastpos.train.workdir.Workdir``: the run's config
(``config.json`` with its resumes' recorded changes) and the restore, which goes through the
trainer's own checkpoint reader: its digests are checked (a checkpoint whose arrays or
metadata differ from what was saved is refused, naming the arrays), and it must belong to the
workdir's config (model and task) and run (``fastpos.train.identity``: a checkpoint of another
run is refused). The arrays come back replicated over this process's devices, whatever the
device count of the run that saved them. Nothing of the trainer (its loop, its command line)
is imported.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fastpos import tasks
from fastpos.models import build_model
from fastpos.train import config as config_lib
from fastpos.train import metrics as metrics_lib
from fastpos.train import state as state_lib
from fastpos.train.checkpoint import config_meta
from fastpos.train.state import TrainState, make_optimizer
from fastpos.train.workdir import CHECKPOINTS, Workdir


@dataclasses.dataclass(frozen=True)
class Loaded:
  """A trained run. Unpacks as ``model, params, config, task = fastpos.load(workdir)``.

  Attributes:
    model: the Flax module (``DecoderLM``, ``Classifier`` or ``DualEncoder``).
    params: the ``params`` collection: ``model.apply({"params": params}, batch)``.
    config: the run's config (``config.json`` with its resumes' changes applied), completed.
    task: the task (``fastpos.tasks.Task``): ``task.info`` (vocab size, max length, kind),
      ``task.source(split)``, ``task.vocabulary()`` for word-level language models.
    variables: every collection (``{"params": ..., "batch_stats": ...}``): what
      ``model.apply`` takes for models with BatchNorm.
    step: the training step of the checkpoint.
    checkpoint: its path.

  Example::

      loaded = fastpos.load(workdir)
      model, params, config, task = loaded                # unpacks as a tuple
      isinstance(loaded.step, int), loaded.checkpoint.startswith(str(workdir))   # (True, True)
  """

  model: nn.Module
  params: Any
  config: ml_collections.ConfigDict
  task: Any
  variables: dict
  step: int
  checkpoint: str

  def __iter__(self) -> Iterator[Any]:
    return iter((self.model, self.params, self.config, self.task))


def load(
    workdir: str | os.PathLike,
    step: int | None = None,
    *,
    checkpoint: str = "best",
    config: ml_collections.ConfigDict | None = None,
) -> Loaded:
  """Restores a workdir written by ``train.py`` / ``fastpos.train_and_evaluate``.

  Args:
    workdir: the run's folder (it holds ``config.json`` and ``checkpoints/``).
    step: a training step to restore (from ``checkpoints/`` or ``best/``); None: the newest
      checkpoint that loads of the kind ``checkpoint`` names.
    checkpoint: with ``step=None``: "best" (best on validation; the newest checkpoint when no
      evaluation has run yet) or "latest".
    config: the run's config, when not its ``config.json`` (e.g. with overrides applied).

  Returns:
    ``Loaded``: ``model, params, config, task`` (unpacks as that tuple), plus ``variables``,
    ``step`` and ``checkpoint``.

  Raises:
    RunError (a ValueError for a bad argument): no such workdir, no config.json
    (``Workdir.require_run``), no checkpoint, no checkpoint at ``step`` (naming the steps
    there), a damaged checkpoint
    (``CheckpointLoadError`` / ``DigestMismatch`` naming what differs), a checkpoint of another
    model or task, a run trained by an older fastpos whose model computes another function now
    (``fastpos.train.launches.check_format``).

  Example::

      model, params, config, task = fastpos.load(workdir)    # a train.py --workdir
      tokens = jnp.array([[5, 9, 2, 7]])                                  # [b, N] ids
      logits = jax.jit(model.apply)({"params": params}, {"inputs": tokens})   # [b, N, vocab]
      words = task.vocabulary()            # word-level LM tasks: the words by id
  """
  if checkpoint not in CHECKPOINTS:
    raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINTS)}; got {checkpoint!r}.")
  if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
    raise ValueError(f"step must be None (the newest) or an int >= 0; got {step!r}.")
  run = Workdir(workdir)
  run.require_run(config_given=config is not None)
  cfg = run.config() if config is None else config
  cfg = config_lib.checked(cfg)  # validated once: generate.py's config_of did it already
  task = tasks.make_task(cfg.task)
  model = build_model(cfg.model, task.info)
  abstract = _abstract_state(cfg, model, task.info)
  with metrics_lib.quiet_library_logs():
    found = run.restore(
        abstract, checkpoint if step is None else step, expect=config_meta(cfg, task.info)
    )
  run.check_format(cfg, "load", found.meta)
  state, _ = state_lib.from_checkpoint_tree(found.state)
  variables = {"params": state.params, **dict(state.collections)}
  return Loaded(model, state.params, cfg, task, variables, found.step, str(found.path))


def _abstract_state(cfg, model: nn.Module, info) -> dict[str, Any]:
  """The checkpoint's state tree (``state.checkpoint_tree``: train state and carry) as shapes
  (no compute), every array replicated over all devices."""
  n = info.max_length
  batch = {"inputs": jnp.ones((1, n), jnp.int32), "mask": jnp.ones((1, n), bool)}
  if info.kind == "retrieval":
    batch.update(inputs2=batch["inputs"], mask2=batch["mask"])
  tx = make_optimizer(cfg)
  memory = info.kind == "lm" and getattr(model, "memory_length", 0) > 0

  def init(rng):
    params_rng, dropout_rng, features_rng = jax.random.split(rng, 3)
    rngs = {"params": params_rng, "dropout": dropout_rng, "features": features_rng}
    variables = dict(model.init(rngs, batch, train=False))
    params = variables.pop("params")
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        collections=variables,
    )
    return state_lib.checkpoint_tree(state, model.init_memory(cfg.batch_size) if memory else {})

  shapes = jax.eval_shape(init, jax.random.PRNGKey(0))
  sharding = NamedSharding(Mesh(np.array(jax.devices()), ("devices",)), PartitionSpec())
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)


__all__ = ["Loaded", "load"]
