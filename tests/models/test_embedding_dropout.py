"""The tower's embedding dropout is the blocks' boolean-mask ``Dropout``: nn.Dropout's name,
random stream and numbers (a run's results do not change), without its float mask."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.models import TaskInfo, blocks, build_model, model_config
from fastpos.models import transformer as transformer_lib


def _model_and_batch(kind):
  c = model_config()
  c.kernel, c.positional = "elu1", "absolute"
  c.num_layers, c.embed_dim, c.num_heads, c.mlp_dim = 1, 16, 2, 16
  c.dropout_rate, c.max_length = 0.25, 16
  info = TaskInfo(kind=kind, vocab_size=13, max_length=16, num_classes=0 if kind == "lm" else 3)
  model = build_model(c, info)
  toks = jnp.asarray(np.random.default_rng(0).integers(1, 13, (2, 16)), jnp.int32)
  return model, {"inputs": toks, "mask": toks != 0}


def _loss_and_grads(model, batch, params):
  """Loss and gradients of a train step, dropout on; the tower's Dropout class is read while
  this traces."""

  def loss(p):
    out = model.apply({"params": p}, batch, train=True, rngs={"dropout": jax.random.key(5)})
    out = out[0] if isinstance(out, tuple) else out
    return jnp.sum(out**2)

  return jax.value_and_grad(loss)(params)


class _NoDropout(nn.Module):
  rate: float

  def __call__(self, x, *, deterministic: bool):
    return x


def test_embedding_dropout_keeps_nn_dropout_numbers():
  """Loss and gradients of a jitted train step are bit-identical to nn.Dropout's."""
  assert transformer_lib.Dropout is blocks.Dropout
  model, batch = _model_and_batch("lm")
  params = jax.jit(model.init)(jax.random.key(0), batch)["params"]

  @jax.jit  # the three train steps in one compiled program, each traced with its Dropout
  def steps(params):
    ours = _loss_and_grads(model, batch, params)
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(transformer_lib, "Dropout", nn.Dropout)
      theirs = _loss_and_grads(model, batch, params)
      mp.setattr(transformer_lib, "Dropout", _NoDropout)
      none = _loss_and_grads(model, batch, params)
    return ours, theirs, none

  ours, theirs, none = jax.tree.map(np.asarray, steps(params))
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
    np.testing.assert_array_equal(a, b)
  assert none[0] != ours[0]  # the embedding dropout acts: not a vacuous check
