"""The pure step functions: loss and metrics, ``train_step`` and ``eval_step``.

``make_train_step(model, tx, kind, grad_accum_steps)`` returns
``train_step(state, batch, rng) -> (state, metrics)`` (the metrics include
``tokens_per_step``, the batch's real tokens); the trainer jits it with shardings and a donated
state. Its randomness is ``fold_in(rng, state.step)``, so a resumed run draws the same dropout
masks as an uninterrupted one.

With a Transformer-XL memory (``memory=True``) the train step reads ``state.memory``, empties
the rows whose ``batch["reset"]`` is True (see ``fastpos.train.data``) and stores the new
memory in the returned state; the memory is an input, never differentiated, so no gradient
flows into earlier segments, as in Transformer-XL. The eval step takes and returns it:
``eval_step(state, batch, memory) -> (metrics, memory)``.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fastpos.train.state import TrainState

MODEL_INPUTS = ("inputs", "mask", "inputs2", "mask2", "segment_ids", "positions")


def model_inputs(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The fields the model sees (never the targets or the example weights)."""
  return {k: batch[k] for k in MODEL_INPUTS if k in batch}


def loss_and_metrics(
    logits: jax.Array, batch: dict[str, jax.Array], kind: str
) -> tuple[jax.Array, dict[str, tuple[jax.Array, jax.Array]]]:
  """Summed cross-entropy and the (sum, count) metrics of one batch.

  Args:
    logits: ``[b, classes]`` (classify / retrieval) or ``[b, N, vocab]`` (lm).
    batch: ``targets`` ``[b]`` or ``[b, N]``, ``weight`` ``[b]`` (0 for padded examples) and,
      for lm, ``mask`` ``[b, N]`` (the scored tokens; ``score`` when present, e.g. a
      sliding-window evaluation whose context tokens are real but not scored, or the answer
      tokens of a recall task, ``fastpos.tasks.mqar``, whose accuracy is then on answers only).
    kind: the task kind.

  Returns:
    (loss_sum, {"loss": (sum, count), "accuracy": (sum, count)}); padded examples and tokens
    are removed with ``where`` so that whatever their logits are, they add exactly 0.
  """
  logits = logits.astype(jnp.float32)
  targets = batch["targets"]
  weight = batch["weight"].astype(jnp.float32)
  if kind == "lm":  # "score": the scored tokens of a sliding-window evaluation, else "mask"
    weight = jnp.where(batch.get("score", batch["mask"]), weight[:, None], 0.0)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  ce = log_z - target_logit
  real = weight > 0
  loss_sum = jnp.sum(jnp.where(real, weight * ce, 0.0))
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  count = jnp.sum(weight)
  metrics = {
      "loss": (loss_sum, count),
      "accuracy": (jnp.sum(jnp.where(real, weight * correct, 0.0)), count),
  }
  return loss_sum, metrics


def real_tokens(batch: dict[str, jax.Array]) -> jax.Array:
  """The batch's real (unpadded) tokens as a float32 scalar: the True entries of ``mask``
  (and ``mask2``, a retrieval pair's second input) in examples of nonzero ``weight``; for lm
  the mask marks the scored target tokens."""
  real = batch["weight"] > 0
  total = jnp.zeros((), jnp.float32)
  for key in ("mask", "mask2"):
    if key in batch:
      m = batch[key]
      keep = real.reshape(real.shape + (1,) * (m.ndim - 1))
      total = total + jnp.sum(jnp.logical_and(m, keep).astype(jnp.float32))
  return total


def _split_rngs(rng: jax.Array) -> dict[str, jax.Array]:
  dropout, features = jax.random.split(rng)
  return {"dropout": dropout, "features": features}


def reset_memory(memory: Any, reset: jax.Array) -> Any:
  """``memory`` with the rows where ``reset`` ``[b]`` is True emptied (every leaf zero, i.e.
  states 0 and mask False: what ``DecoderLM.init_memory`` gives), as a constant."""
  keep = jnp.logical_not(reset)

  def one(x):
    k = keep.reshape(keep.shape + (1,) * (x.ndim - 1))
    return jnp.where(k, jax.lax.stop_gradient(x), jnp.zeros_like(x))

  return jax.tree.map(one, memory)


def _split_micro(x: jax.Array, k: int) -> jax.Array:
  """``[B, ...]`` -> ``[k, B / k, ...]``; row r goes to micro-batch r mod k."""
  return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)


def _merge_micro(x: jax.Array) -> jax.Array:
  """Inverse of ``_split_micro``."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def make_train_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    kind: str,
    grad_accum_steps: int = 1,
    *,
    memory: bool = False,
) -> Callable:
  """``train_step(state, batch, rng) -> (state, metrics)`` (see the module docstring).

  With ``grad_accum_steps = k > 1`` the batch ``[B, ...]`` is split into k micro-batches of
  B / k examples (example r goes to micro-batch r mod k, so every device keeps its rows),
  gradients of the summed losses are added over a ``lax.scan`` and divided once by the total
  weight: the update equals the full-batch one up to round-off, with 1/k of the activations.
  The memory rows (``memory=True``) are split and put back the same way.
  """

  def micro_step(params, collections, batch, mem, rng):
    def loss_fn(p):
      mutable = list(collections)
      kwargs = {"memory": mem} if memory else {}
      out = model.apply(
          {"params": p, **collections},
          model_inputs(batch),
          train=True,
          rngs=_split_rngs(rng),
          mutable=mutable if mutable else False,
          **kwargs,
      )
      out, new_collections = out if mutable else (out, {})
      logits, new_mem = out if memory else (out, {})
      loss_sum, metrics = loss_and_metrics(logits, batch, kind)
      return loss_sum, (metrics, dict(new_collections), new_mem)

    (_, (metrics, new_collections, new_mem)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params
    )
    return grads, metrics, new_collections, jax.lax.stop_gradient(new_mem)

  def train_step(
      state: TrainState, batch: dict[str, jax.Array], rng: jax.Array
  ) -> tuple[TrainState, dict[str, Any]]:
    step_rng = jax.random.fold_in(rng, state.step)
    mem = reset_memory(state.memory, batch["reset"]) if memory else {}
    if grad_accum_steps == 1:
      grads, metrics, collections, mem = micro_step(
          state.params, state.collections, batch, mem, step_rng
      )
    else:
      k = grad_accum_steps
      micro = jax.tree.map(lambda x: _split_micro(x, k), batch)
      micro_mem = jax.tree.map(lambda x: _split_micro(x, k), mem)
      first = jax.tree.map(lambda x: x[0], (micro, micro_mem))
      shapes = jax.eval_shape(micro_step, state.params, state.collections, *first, step_rng)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[:2])

      def body(carry, xs):
        grads_acc, metrics_acc, collections = carry
        mb, m_mem, i = xs
        g, m, collections, new_mem = micro_step(
            state.params, collections, mb, m_mem, jax.random.fold_in(step_rng, i)
        )
        return (
            jax.tree.map(jnp.add, grads_acc, g),
            jax.tree.map(jnp.add, metrics_acc, m),
            collections,
        ), new_mem

      (grads, metrics, collections), new_mems = jax.lax.scan(
          body, (zeros[0], zeros[1], state.collections), (micro, micro_mem, jnp.arange(k))
      )
      mem = jax.tree.map(_merge_micro, new_mems)
    count = jnp.maximum(metrics["loss"][1], 1.0)
    grads = jax.tree.map(lambda g: g / count.astype(g.dtype), grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics)
    metrics["grad_norm"] = (optax.tree.norm(grads).astype(jnp.float32), jnp.ones((), jnp.float32))
    metrics["tokens_per_step"] = (real_tokens(batch), jnp.ones((), jnp.float32))
    new_state = state.replace(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        collections=collections,
        memory=mem if memory else state.memory,
    )
    return new_state, metrics

  return train_step


def make_eval_step(model: nn.Module, kind: str, *, memory: bool = False) -> Callable:
  """``eval_step(state, batch) -> metrics`` (deterministic: no dropout, running statistics);
  with ``memory=True``: ``eval_step(state, batch, memory) -> (metrics, new_memory)``, the
  rows of ``batch["reset"]`` emptied first (the train state's memory is not used)."""

  def eval_step(state: TrainState, batch: dict[str, jax.Array], mem: Any = None):
    rngs = _split_rngs(jax.random.PRNGKey(0))
    variables = {"params": state.params, **state.collections}
    if not memory:
      logits = model.apply(variables, model_inputs(batch), train=False, rngs=rngs)
      return loss_and_metrics(logits, batch, kind)[1]
    logits, new_mem = model.apply(
        variables,
        model_inputs(batch),
        train=False,
        rngs=rngs,
        memory=reset_memory(mem, batch["reset"]),
    )
    return loss_and_metrics(logits, batch, kind)[1], new_mem

  return eval_step
