"""Your own Flax model with fastpos attention: a bidirectional encoder and a causal LM.

Both learn to copy the token at a fixed relative offset (the next token for the encoder, which
sees the future; the previous one for the causal model), a task only positional information
solves. The script trains both with optax, then checks what the layer promises: padding never
changes the outputs at real tokens, a causal output never depends on a later input (by
gradients), and the causal model decodes token by token (``fastpos.CachedDecoding``) to the
logits of its full forward.

Run: python examples/own_model.py [--steps 300 --kernel elu1 --positional rope,fastrpb]
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import fastpos

VOCAB, LENGTH = 16, 32


class Model(nn.Module):
  """tokens ``[batch, N]`` -> logits ``[batch, N, VOCAB]``: embed, pre-LN attention + MLP
  blocks, output projection. ``decode`` is passed on to the attention layers (decoding)."""

  kernel: str
  positional: tuple[str, ...]
  causal: bool
  width: int = 32
  heads: int = 2
  layers: int = 1

  @nn.compact
  def __call__(self, tokens, mask=None, decode=None, shift=None):
    x = nn.Embed(VOCAB, self.width)(tokens)
    if shift is not None:  # [batch, N, width] added to the embeddings (gradients w.r.t. inputs)
      x = x + shift
    for _ in range(self.layers):
      attn = fastpos.attention(
          self.width,
          self.heads,
          kernel=self.kernel,
          positional=self.positional,
          causal=self.causal,
          max_length=LENGTH,
      )
      x = x + attn(nn.LayerNorm()(x), mask=mask, decode=decode)
      x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(nn.LayerNorm()(x))))
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def batch(key, size: int, causal: bool):
  """Random tokens; the target at i is the token at i - 1 (causal) or i + 1 (bidirectional);
  ``weights`` drop the position without one."""
  tokens = jax.random.randint(key, (size, LENGTH), 1, VOCAB)
  if causal:
    targets = jnp.pad(tokens[:, :-1], ((0, 0), (1, 0)))
    weights = jnp.arange(LENGTH) > 0
  else:
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    weights = jnp.arange(LENGTH) < LENGTH - 1
  return tokens, targets, jnp.broadcast_to(weights, tokens.shape)


def train(model: Model, steps: int, seed: int = 0):
  """Trains ``steps`` AdamW steps; returns (params, accuracy on a fresh batch)."""
  key = jax.random.key(seed)
  params = model.init(key, jnp.ones((1, LENGTH), jnp.int32))
  opt = optax.adamw(3e-3)
  opt_state = opt.init(params)

  def loss_fn(params, tokens, targets, weights):
    logits = model.apply(params, tokens)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(losses * weights) / jnp.sum(weights)

  @jax.jit
  def step(params, opt_state, key):
    grads = jax.grad(loss_fn)(params, *batch(key, 32, model.causal))
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for i in range(steps):
    params, opt_state = step(params, opt_state, jax.random.fold_in(key, i))
  tokens, targets, weights = batch(jax.random.fold_in(key, steps), 256, model.causal)
  hits = (jnp.argmax(jax.jit(model.apply)(params, tokens), -1) == targets) * weights
  return params, float(jnp.sum(hits) / jnp.sum(weights))


def check_padding(model: Model, params) -> float:
  """Largest change of the real tokens' outputs when 8 padded tokens are appended."""
  tokens = jax.random.randint(jax.random.key(1), (2, LENGTH - 8), 1, VOCAB)
  padded = jnp.pad(tokens, ((0, 0), (0, 8)))
  apply = jax.jit(model.apply)
  short = apply(params, tokens)
  long = apply(params, padded, mask=padded != 0)[:, : LENGTH - 8]
  return float(jnp.max(jnp.abs(short - long)))


def check_causal(model: Model, params) -> float:
  """Largest gradient of output position 10 with respect to the inputs after it."""
  tokens = jax.random.randint(jax.random.key(2), (1, LENGTH), 1, VOCAB)
  shift = jnp.zeros((1, LENGTH, model.width))
  grad = jax.jit(jax.grad(lambda s: jnp.sum(model.apply(params, tokens, shift=s)[0, 10])))(shift)
  return float(jnp.max(jnp.abs(grad[0, 11:])))


def check_decoding(model: Model, params) -> float:
  """Largest relative difference of the decoded logits (a prompt of 8, then one token per
  step) from the full causal forward."""
  tokens = jax.random.randint(jax.random.key(3), (2, LENGTH), 1, VOCAB)
  full = jax.jit(model.apply)(params, tokens)
  dec = fastpos.CachedDecoding(model, max_length=LENGTH)
  state = dec.init(tokens[:, :1])
  step = jax.jit(dec.step)
  outs, state = step(params, state, tokens[:, :8])
  outs = [outs]
  for i in range(8, LENGTH):
    out, state = step(params, state, tokens[:, i : i + 1])
    outs.append(out)
  got = jnp.concatenate(outs, axis=1)
  return float(jnp.max(jnp.abs(got - full)) / jnp.max(jnp.abs(full)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=300, help="training steps per model")
  parser.add_argument("--kernel", default="elu1", help="softmax or a feature map")
  parser.add_argument("--positional", default="rope,fastrpb", help="scheme names, comma-joined")
  parser.add_argument("--min_accuracy", type=float, default=0.9, help="what training must reach")
  args = parser.parse_args()
  schemes = tuple(args.positional.split(","))
  for causal in (False, True):
    model = Model(args.kernel, schemes, causal)
    params, accuracy = train(model, args.steps)
    pad = check_padding(model, params)
    name = "causal" if causal else "bidirectional"
    print(f"{name} {args.kernel} + {'+'.join(schemes)}: copy accuracy {accuracy:.3f}")
    print(f"  padding: largest change of real outputs {pad:.2e}")
    assert accuracy >= args.min_accuracy, f"accuracy {accuracy} < {args.min_accuracy}"
    assert pad < 1e-4, pad
    if causal:
      leak = check_causal(model, params)
      err = check_decoding(model, params)
      print(f"  causality: largest gradient from a later input {leak:.2e}")
      print(f"  decoding: largest relative difference from the full forward {err:.2e}")
      assert leak == 0.0, leak
      assert err < 1e-4, err


if __name__ == "__main__":
  main()
