"""The train state and the optimizer: AdamW, warmup + cosine / linear decay, clipping.

``TrainState`` holds what a train step changes besides the carry: the step, the parameters,
the optimizer state and the model's other variable collections (e.g. BatchNorm's
``batch_stats``). The model itself is not in the state (it is static). A checkpoint saves the
state together with the step's carry (``fastpos.train.steps``: a Transformer-XL memory, or
``{}``), as ``checkpoint_tree`` lays them out, so that a resumed run continues with the memory
it stopped with.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax


@flax.struct.dataclass
class TrainState:
  """step: int32 scalar; params; opt_state; collections: non-param variables (may be {})."""

  step: jax.Array
  params: Any
  opt_state: Any
  collections: Any


# The carry's name in a checkpoint's state tree (checkpoints have always called it so).
CARRY_KEY = "memory"


def checkpoint_tree(state: TrainState, carry: Any) -> dict[str, Any]:
  """What a checkpoint's ``state`` item holds: the fields of ``state`` and ``carry`` (under
  ``CARRY_KEY``); arrays or ``jax.ShapeDtypeStruct`` alike."""
  return {
      "step": state.step,
      "params": state.params,
      "opt_state": state.opt_state,
      "collections": state.collections,
      CARRY_KEY: carry,
  }


def from_checkpoint_tree(tree: dict[str, Any]) -> tuple[TrainState, Any]:
  """Inverse of ``checkpoint_tree``: (state, carry)."""
  fields = {k: tree[k] for k in ("step", "params", "opt_state", "collections")}
  return TrainState(**fields), tree.get(CARRY_KEY, {})


def make_schedule(cfg: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then cosine / linear decay, constant or inverse square
  root (in steps)."""
  peak = cfg.optimizer.learning_rate
  warmup = cfg.schedule.warmup_steps
  decay_steps = max(cfg.num_train_steps - warmup, 1)
  end = peak * cfg.schedule.end_factor
  name = cfg.schedule.name
  if name == "cosine":
    after = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.schedule.end_factor)
  elif name == "linear":
    after = optax.linear_schedule(peak, end, decay_steps)
  elif name == "constant":
    after = optax.constant_schedule(peak)
  elif name == "rsqrt":
    # fairseq's inverse_sqrt: peak * sqrt(warmup / step) after the warmup (step counted from
    # the start of training; end_factor unused).
    w = max(warmup, 1)
    after = lambda count: peak * jnp.sqrt(
        w / jnp.maximum(jnp.asarray(count, jnp.float32) + w, 1.0)
    )  # noqa: E731
  else:
    raise ValueError(
        f"unknown config.schedule.name {name!r}; valid: cosine, linear, constant, " f"rsqrt."
    )
  if warmup <= 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def _path_names(path) -> list[str]:
  names = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        names.append(str(getattr(key, attr)))
        break
  return names


def decay_mask(params: Any, no_decay: str) -> Any:
  """True for parameters that get weight decay: >= 2-d and no path component matching a
  pattern of ``no_decay`` (comma-separated fnmatch patterns, e.g. ``*bias*,pos_*``)."""
  patterns = [p.strip() for p in no_decay.split(",") if p.strip()]

  def decays(path, leaf) -> bool:
    if jnp.ndim(leaf) < 2:
      return False
    return not any(fnmatch.fnmatchcase(name, pat) for name in _path_names(path) for pat in patterns)

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW with the schedule of ``cfg.schedule``, clipping and the weight-decay mask."""
  opt = cfg.optimizer
  chain = []
  if opt.grad_clip_norm > 0:
    chain.append(optax.clip_by_global_norm(opt.grad_clip_norm))
  chain.append(
      optax.adamw(
          make_schedule(cfg),
          b1=opt.b1,
          b2=opt.b2,
          eps=opt.eps,
          weight_decay=opt.weight_decay,
          mask=lambda params: decay_mask(params, opt.no_decay),
      )
  )
  return optax.chain(*chain)
