"""``load(workdir)``: a trained run's model, parameters, config and task, in one call.

The checkpoint is restored through ``fastpos.train.checkpoint`` (the trainer's own reader):
its digests are checked (a checkpoint whose arrays or metadata differ from what was saved is
refused, naming the arrays), and it must belong to the workdir's config (model and task) and
run (``fastpos.train.identity``: a checkpoint of another run is refused). The
arrays come back replicated over this process's devices, whatever the device count of the run
that saved them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fastpos import tasks
from fastpos.models import build_model
from fastpos.train import cli, identity, launches
from fastpos.train import config as config_lib
from fastpos.train import metrics as metrics_lib
from fastpos.train import state as state_lib
from fastpos.train import workdir as workdir_lib
from fastpos.train.checkpoint import (
    CheckpointLoadError,
    Checkpoints,
    check_expected,
    config_meta,
)
from fastpos.train.errors import RunError
from fastpos.train.state import TrainState, make_optimizer

CHECKPOINTS = ("best", "latest")


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
    RunError (a ValueError for a bad argument): no such workdir, no config.json, no
    checkpoint, no checkpoint at ``step`` (naming the steps there), a damaged checkpoint
    (``CheckpointLoadError`` / ``DigestMismatch`` naming what differs), a checkpoint of another
    model or task, a run trained by an older fastpos whose model computes another function now
    (``fastpos.train.launches.check_format``).

  Example::

      model, params, config, task = fastpos.load(workdir)    # a train.py --workdir
      tokens = jnp.array([[5, 9, 2, 7]])                                  # [b, N] ids
      logits = model.apply({"params": params}, {"inputs": tokens})   # [b, N, vocab] (an LM)
      words = task.vocabulary()            # word-level LM tasks: the words by id
  """
  if checkpoint not in CHECKPOINTS:
    raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINTS)}; got {checkpoint!r}.")
  if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
    raise ValueError(f"step must be None (the newest) or an int >= 0; got {step!r}.")
  workdir = Path(workdir)
  cfg = _config(workdir) if config is None else config
  cfg = cfg.copy_and_resolve_references()
  config_lib.validate(cfg)
  task = tasks.make_task(cfg.task)
  model = build_model(cfg.model, task.info)
  abstract = _abstract_state(cfg, model, task.info)
  with metrics_lib.quiet_library_logs():
    state, meta, path = _restore(workdir, cfg, task, abstract, step, checkpoint)
  trained = launches.checkpoint_format(workdir, meta)
  launches.check_format(workdir, cfg, "load", trained=trained)
  state, _ = state_lib.from_checkpoint_tree(state)
  variables = {"params": state.params, **dict(state.collections)}
  return Loaded(model, state.params, cfg, task, variables, int(meta["step"]), str(path))


def _config(workdir: Path) -> ml_collections.ConfigDict:
  if not workdir.is_dir():
    what = (
        "is a symlink loop"
        if workdir_lib.is_symlink_loop(workdir)
        else "is a file"
        if workdir.exists()
        else "does not exist"
    )
    raise RunError(f"workdir {workdir} {what}; give the folder a train.py run wrote.")
  spec = workdir / "config.json"
  if not spec.is_file():
    raise RunError(
        f"workdir {workdir} has no config.json (train.py writes it when a run starts); give "
        "the workdir of a run, or its config with config=."
    )
  return cli.load_config(str(spec))


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


def _restore(workdir: Path, cfg, task, abstract, step, which):
  ckpts = Checkpoints(workdir, cfg, read_only=True)
  try:
    # A checkpoint of another run, or one the run's record does not account for, is refused.
    expect = {**config_meta(cfg, task.info), "run": identity.read_record(workdir).check}
    if step is not None:
      return _restore_step(ckpts, abstract, step, expect)
    if ckpts.latest_step() is None and ckpts.best_step() is None:
      raise RunError(
          f"no checkpoint in {workdir} (checkpoints/ and best/ are empty or missing); train "
          f"first: python train.py --config=... --workdir={workdir}"
      )
    which = "best" if which == "best" and ckpts.best_step() is not None else "latest"
    try:
      found = ckpts.restore_newest(abstract, which, expect=expect)
    except CheckpointLoadError as e:
      hint = (
          " Or load the newest checkpoint: checkpoint='latest' (scripts: --checkpoint=latest)."
          if which == "best"
          else ""
      )
      raise CheckpointLoadError(f"{e}{hint}") from None
    return found.state, found.meta, found.path
  finally:
    ckpts.close()


def _restore_step(ckpts: Checkpoints, abstract, step: int, expect):
  """The checkpoint at ``step`` (checkpoints/, else best/), verified; no fallback."""
  for which in CHECKPOINTS[::-1]:
    if step in ckpts.steps(which):
      path = (ckpts.latest_dir if which == "latest" else ckpts.best_dir) / str(step)
      check_expected(ckpts.read_meta(which, step), expect, ckpts.latest_dir, path)
      state, meta = ckpts.restore(abstract, which=which, step=step)
      return state, meta, path
  have = sorted(set(ckpts.steps("latest")) | set(ckpts.steps("best")))
  raise RunError(
      f"no checkpoint at step {step} in {ckpts.latest_dir.parent}; its steps: "
      f"{', '.join(map(str, have)) or '(none)'}."
  )


__all__ = ["Loaded", "load"]
