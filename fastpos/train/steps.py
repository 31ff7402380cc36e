"""The pure step functions: loss and metrics, ``train_step`` and ``eval_step``.

One signature for every model::

  train_step(state, batch, carry, rng) -> (state, metrics, carry)
  eval_step(state, batch, carry) -> (metrics, carry)

The carry is what a model takes from one batch to the next: ``{}`` (an empty pytree, passed
through untouched) for every model but a language model with a Transformer-XL memory, whose
carry is that memory (``DecoderLM.init_memory``). The trainer jits the steps with shardings and
a donated state and never asks which kind of carry it holds. The metrics include
``tokens_per_step``, the batch's real tokens. A train step's randomness is
``fold_in(rng, state.step)``, so a resumed run draws the same dropout masks as an
uninterrupted one.

With a memory, each step first empties the carry's rows whose ``batch["reset"]`` is True (see
``fastpos.train.data``); the memory is an input, never differentiated, so no gradient flows
into earlier segments, as in Transformer-XL.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fastpos.train.state import TrainState

MODEL_INPUTS = (
    "inputs",
    "mask",
    "inputs2",
    "mask2",
    "segment_ids",
    "positions",
    "segment_mask",
)


def model_inputs(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The fields the model sees (never the targets or the example weights)."""
  return {k: batch[k] for k in MODEL_INPUTS if k in batch}


def carries_memory(model: nn.Module, kind: str) -> bool:
  """Whether ``model`` carries a Transformer-XL memory from batch to batch (a ``DecoderLM``
  with ``memory_length > 0``): its carry is the memory, its batches stream batches."""
  return kind == "lm" and getattr(model, "memory_length", 0) > 0


def empty_carry(model: nn.Module, kind: str, rows: int) -> Any:
  """The carry a run (or an evaluation) starts from for ``rows`` batch rows: an empty memory,
  or ``{}`` for a model that carries nothing."""
  return model.init_memory(rows) if carries_memory(model, kind) else {}


def loss_and_metrics(
    logits: jax.Array, batch: dict[str, jax.Array], kind: str
) -> tuple[jax.Array, dict[str, tuple[jax.Array, jax.Array]]]:
  """Summed cross-entropy and the (sum, count) metrics of one batch.

  Args:
    logits: ``[b, classes]`` (classify / retrieval), ``[b, S, classes]`` (packed classify:
      one per segment slot) or ``[b, N, vocab]`` (lm).
    batch: ``targets`` ``[b]``, ``[b, S]`` or ``[b, N]``, ``weight`` ``[b]`` (0 for padded
      examples; ``[b, S]`` for packed classify, 0 for empty slots) and,
      for lm, ``mask`` ``[b, N]`` (the scored tokens; ``score`` when present, e.g. a
      sliding-window evaluation whose context tokens are real but not scored, or the answer
      tokens of a recall task, ``fastpos.tasks.mqar``, whose accuracy is then on answers only).
    kind: the task kind.

  Returns:
    (loss_sum, {"loss": (sum, count), "accuracy": (sum, count)}); padded examples and tokens
    are removed with ``where`` so that whatever their logits are, they add exactly 0.
  """
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
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
  (and ``mask2``, a retrieval pair's second input) in examples of nonzero ``weight`` (in
  packed classification, in segments of nonzero weight); for lm the mask marks the scored
  target tokens."""
  if batch["weight"].ndim == 2:  # packed classification: a weight per segment slot
    ids = batch["segment_ids"]
    w = jnp.take_along_axis(batch["weight"], jnp.maximum(ids - 1, 0), axis=1)
    return jnp.sum((batch["mask"] & (ids > 0) & (w > 0)).astype(jnp.float32))
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


def _applier(model: nn.Module, kind: str) -> Callable:
  """``apply(variables, batch, carry, **kwargs) -> (output, carry)``: ``model.apply`` with the
  carry threaded through (the memory's reset rows emptied first), whatever the model carries.
  ``output`` is what ``model.apply`` returns besides the carry (with ``mutable``: the output
  and the updated collections)."""
  if not carries_memory(model, kind):
    return lambda variables, batch, carry, **kw: (
        model.apply(variables, model_inputs(batch), **kw),
        carry,
    )

  def apply(variables, batch, carry, **kw):
    memory = reset_memory(carry, batch["reset"])
    out = model.apply(variables, model_inputs(batch), memory=memory, **kw)
    if kw.get("mutable"):  # ((logits, memory), collections)
      (logits, memory), collections = out
      return (logits, collections), jax.lax.stop_gradient(memory)
    logits, memory = out
    return logits, jax.lax.stop_gradient(memory)

  return apply


def _split_micro(x: jax.Array, k: int) -> jax.Array:
  """``[B, ...]`` -> ``[k, B / k, ...]``; row r goes to micro-batch r mod k."""
  return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)


def _merge_micro(x: jax.Array) -> jax.Array:
  """Inverse of ``_split_micro``."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _make_micro_step(model: nn.Module, kind: str) -> Callable:
  """``micro_step(params, collections, batch, carry, rng) -> (grads, metrics, collections,
  carry)``: the gradient of one (micro-)batch's summed loss."""
  apply = _applier(model, kind)

  def micro_step(params, collections, batch, carry, rng):
    def loss_fn(p):
      mutable = list(collections)
      out, new_carry = apply(
          {"params": p, **collections},
          batch,
          carry,
          train=True,
          rngs=_split_rngs(rng),
          mutable=mutable if mutable else False,
      )
      logits, new_collections = out if mutable else (out, {})
      loss_sum, metrics = loss_and_metrics(logits, batch, kind)
      return loss_sum, (metrics, dict(new_collections), new_carry)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, (metrics, new_collections, new_carry)), grads = grad_fn(params)
    return grads, metrics, new_collections, new_carry

  return micro_step


def _accumulate(micro_step: Callable, k: int) -> Callable:
  """``micro_step`` over k micro-batches of a batch (and of the carry's rows), gradients and
  metrics summed in a ``lax.scan``; the same signature and outputs as ``micro_step``."""

  def step(params, collections, batch, carry, rng):
    micro, micro_carry = jax.tree.map(lambda x: _split_micro(x, k), (batch, carry))
    first = jax.tree.map(lambda x: x[0], (micro, micro_carry))
    shapes = jax.eval_shape(micro_step, params, collections, *first, rng)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[:2])

    def body(acc, xs):
      grads_acc, metrics_acc, colls = acc
      mb, m_carry, i = xs
      g, m, colls, new_carry = micro_step(params, colls, mb, m_carry, jax.random.fold_in(rng, i))
      return (jax.tree.map(jnp.add, grads_acc, g), jax.tree.map(jnp.add, metrics_acc, m), colls), (
          new_carry
      )

    (grads, metrics, colls), new_carries = jax.lax.scan(
        body, (zeros[0], zeros[1], collections), (micro, micro_carry, jnp.arange(k))
    )
    return grads, metrics, colls, jax.tree.map(_merge_micro, new_carries)

  return step


def make_train_step(
    model: nn.Module, tx: optax.GradientTransformation, kind: str, grad_accum_steps: int = 1
) -> Callable:
  """``train_step(state, batch, carry, rng) -> (state, metrics, carry)`` (module docstring).

  With ``grad_accum_steps = k > 1`` the batch ``[B, ...]`` is split into k micro-batches of
  B / k examples (example r goes to micro-batch r mod k, so every device keeps its rows),
  gradients of the summed losses are added over a ``lax.scan`` and divided once by the total
  weight: the update equals the full-batch one up to round-off, with 1/k of the activations.
  The carry's rows (a memory) are split and put back the same way.
  """
  grads_of = _make_micro_step(model, kind)
  if grad_accum_steps > 1:
    grads_of = _accumulate(grads_of, grad_accum_steps)

  def train_step(
      state: TrainState, batch: dict[str, jax.Array], carry: Any, rng: jax.Array
  ) -> tuple[TrainState, dict[str, Any], Any]:
    step_rng = jax.random.fold_in(rng, state.step)
    grads, metrics, collections, carry = grads_of(
        state.params, state.collections, batch, carry, step_rng
    )
    count = jnp.maximum(metrics["loss"][1], 1.0)
    grads = jax.tree.map(lambda g: g / count.astype(g.dtype), grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    one = jnp.ones((), jnp.float32)
    metrics = {
        **metrics,
        "grad_norm": (optax.tree.norm(grads).astype(jnp.float32), one),
        "tokens_per_step": (real_tokens(batch), one),
    }
    new_state = state.replace(
        step=state.step + 1,
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
        collections=collections,
    )
    return new_state, metrics, carry

  return train_step


def make_eval_step(model: nn.Module, kind: str) -> Callable:
  """``eval_step(state, batch, carry) -> (metrics, carry)`` (deterministic: no dropout,
  running statistics)."""
  apply = _applier(model, kind)

  def eval_step(state: TrainState, batch: dict[str, jax.Array], carry: Any):
    rngs = _split_rngs(jax.random.PRNGKey(0))
    variables = {"params": state.params, **state.collections}
    logits, carry = apply(variables, batch, carry, train=False, rngs=rngs)
    return loss_and_metrics(logits, batch, kind)[1], carry

  return eval_step


def without_carry(train_step: Callable) -> Callable:
  """``train_step`` of a model that carries nothing, as ``(state, batch, rng) -> (state,
  metrics)`` (benchmarks that time or compile the step alone)."""
  return lambda state, batch, rng: train_step(state, batch, {}, rng)[:2]
