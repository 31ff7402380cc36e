"""Sampling from a causal ``DecoderLM``: ``generate(model, params, prompt, num_tokens)``.

A prefill call feeds the prompt to the model's decoding cache (``fastpos.models.decoding``),
then ``num_tokens - 1`` cached steps run in one compiled ``lax.scan``, each drawing a token
by temperature / top-k / top-p (nucleus) sampling, or greedily at temperature 0. Id 0
(padding) is never drawn. ``scripts/generate.py`` is the command line over it.

``generate`` runs outside ``jax.jit``: it checks its arguments' values (token ids, the total
length) and builds the cache before it calls the compiled loop, which it jits itself, so a
traced argument raises ValueError saying so. Inside your own jitted function, call the
compiled loop directly: ``make_generate(model, num_tokens, temperature=..., top_k=...,
top_p=...)`` returns ``gen(variables, cache, prompt, mask, key)`` (a cache from
``model.init_cache``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fastpos.models.transformer import DecoderLM

# The largest temperature: far above it sampling is uniform over the ids 1..V-1 already.
MAX_TEMPERATURE = 1e6


def sample_logits(logits, key, *, temperature: float, top_k: int, top_p: float):
  """One token id per row of ``logits [b, V]`` (id 0, padding, is never drawn). A huge
  temperature draws uniformly over the ids 1..V-1: the padding id is excluded after the
  scaling (dividing by a temperature near the float32 maximum flushes the scale to 0, and
  -inf * 0 would be NaN, which the draw would pick)."""
  logits = logits.astype(jnp.float32)
  if temperature == 0:
    return jnp.argmax(logits.at[:, 0].set(-jnp.inf), axis=-1)
  logits = (logits / temperature).at[:, 0].set(-jnp.inf)
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the likelier tokens
    sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
    logits = (
        jnp.full_like(logits, -jnp.inf)
        .at[jnp.arange(logits.shape[0])[:, None], order]
        .set(sorted_logits)
    )
  return jax.random.categorical(key, logits, axis=-1)


@functools.lru_cache(maxsize=16)
def make_generate(model: DecoderLM, num_tokens: int, **sampling):
  """``gen(variables, cache, prompt [b, P], mask [b, P], key) -> (tokens [b, num_tokens],
  logits [b, P + num_tokens - 1, V])``, jitted: a prefill, then ``num_tokens - 1`` cached
  steps in one ``lax.scan`` (one compile per model, length and sampling settings)."""

  def apply(variables, cache, tokens, mask):
    logits, upd = model.apply(
        {**variables, "cache": cache},
        {"inputs": tokens, "mask": mask},
        decode=True,
        mutable=["cache"],
    )
    return logits, upd["cache"]

  def gen(variables, cache, prompt, mask, key):
    logits, cache = apply(variables, cache, prompt, mask)
    first = sample_logits(logits[:, -1], jax.random.fold_in(key, 0), **sampling)
    ones = jnp.ones((prompt.shape[0], 1), bool)

    def body(carry, i):
      cache, token = carry
      step_logits, cache = apply(variables, cache, token[:, None], ones)
      nxt = sample_logits(step_logits[:, -1], jax.random.fold_in(key, i), **sampling)
      return (cache, nxt), (nxt, step_logits[:, 0])

    (_, _), (tokens, step_logits) = jax.lax.scan(body, (cache, first), jnp.arange(1, num_tokens))
    tokens = jnp.concatenate([first[:, None], jnp.moveaxis(tokens, 0, 1)], axis=1)
    return tokens, jnp.concatenate([logits, jnp.moveaxis(step_logits, 0, 1)], axis=1)

  return jax.jit(gen)


def check_outside_jit(**arguments) -> None:
  """Raises ValueError when an argument holds a traced value (a call under ``jax.jit``,
  ``vmap`` or ``grad``): ``generate`` checks values and compiles its own loop."""
  traced = [
      n
      for n, a in arguments.items()
      if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(a))
  ]
  if traced:
    raise ValueError(
        f"generate runs outside jax.jit (it checks the token ids and compiles its own loop); "
        f"traced here: {', '.join(traced)}. Call it outside jit, or call the compiled loop "
        "make_generate(model, num_tokens, temperature=, top_k=, top_p=)(variables, cache, "
        "prompt, mask, key) inside your jitted function (fastpos.api.generation)."
    )


def _number(name: str, value, low: float, high: float | None, *, low_open=False, kind=float):
  ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
  ok = ok and np.isfinite(value) and (value > low if low_open else value >= low)
  ok = ok and (high is None or value <= high) and (kind is float or float(value).is_integer())
  if not ok:
    what = "an integer" if kind is int else "a finite number"
    rng = f"{'>' if low_open else '>='} {low:g}" + ("" if high is None else f" and <= {high:g}")
    raise ValueError(f"generate: {name} must be {what} {rng}; got {value!r}.")


def check_sampling(num_tokens, temperature, top_k, top_p, vocab_size: int) -> None:
  """ValueError naming the first sampling setting out of its range."""
  _number("num_tokens", num_tokens, 1, None, kind=int)
  _number("temperature", temperature, 0, MAX_TEMPERATURE)
  _number("top_k", top_k, 0, vocab_size, kind=int)
  _number("top_p", top_p, 0, 1, low_open=True)


def _prompt(prompt, mask, vocab_size: int):
  prompt = np.asarray(prompt)
  if prompt.ndim == 1:
    prompt = prompt[None]
  if prompt.ndim != 2 or prompt.shape[1] < 1 or not np.issubdtype(prompt.dtype, np.integer):
    raise ValueError(
        f"generate: prompt must be integer token ids [batch, P] (or [P]), P >= 1; got "
        f"{prompt.dtype} {prompt.shape}."
    )
  if mask is None:
    mask = prompt != 0
  mask = np.asarray(mask)
  if mask.dtype != bool or mask.shape != prompt.shape:
    raise ValueError(
        f"generate: mask must be bool {prompt.shape} like the prompt (True for real tokens, "
        f"left padding False); got {mask.dtype} {mask.shape}."
    )
  if not mask[:, -1].all():
    raise ValueError("generate: prompts must be left-padded (each row's last token is real).")
  bad = prompt[mask & ((prompt < 1) | (prompt >= vocab_size))]
  if bad.size:
    raise ValueError(
        f"generate: token id {int(bad[0])} is out of range; ids are 1..{vocab_size - 1} "
        "(0 is padding)."
    )
  return jnp.asarray(prompt, jnp.int32), jnp.asarray(mask)


def generate(
    model: DecoderLM,
    params: Any,
    prompt,
    num_tokens: int,
    *,
    mask=None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    return_logits: bool = False,
):
  """Samples ``num_tokens`` tokens after ``prompt`` from a causal ``DecoderLM``.

  Args:
    model: a ``DecoderLM`` (e.g. from ``fastpos.load``).
    params: its ``params`` collection, or every variable collection ``{"params": ...}``.
    prompt: int ``[batch, P]`` (or ``[P]``) token ids, 1..vocab_size-1; rows of different
      lengths are LEFT-padded with 0.
    num_tokens: N >= 1 tokens to sample (P + N <= the model's max_length).
    mask: bool ``[batch, P]``, True for real prompt tokens (default: ``prompt != 0``).
    temperature: softmax temperature in [0, ``MAX_TEMPERATURE``]; 0 is greedy (argmax).
    top_k: sample among the k likeliest tokens (0: all).
    top_p: nucleus sampling: the smallest set of tokens whose probability reaches p (1: all).
    seed: the sampling seed (same seed, same tokens).
    return_logits: also return the logits the tokens were drawn from.

  Returns:
    int32 ``[batch, N]`` tokens, and with ``return_logits`` the next-token logits
    ``[batch, P + N - 1, vocab]`` (those of the prompt positions, then of each sampled token
    but the last): they equal the full causal forward of prompt + tokens.

  Raises:
    ValueError: a setting out of range, bad prompt ids or mask, a total length over the
      model's max_length, or a call under ``jax.jit`` (it compiles its own loop; inside jit
      use ``make_generate``, the module docstring).

  Example::

      cfg = fastpos.attention_config(32, 4, kernel="elu1", positional="rope", causal=True,
                                     max_length=64)
      model = fastpos.DecoderLM(cfg, vocab_size=100, num_layers=1, mlp_dim=64)
      params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"]
      tokens = fastpos.generate(model, params, jnp.array([[5, 9, 2]]), num_tokens=20,
                                temperature=0.8, top_k=40)          # [1, 20] int32
      # A trained run's model and params: fastpos.load (its docstring).
  """
  if not isinstance(model, DecoderLM):
    raise ValueError(
        f"generate samples from a causal fastpos.DecoderLM; got {type(model).__name__}."
    )
  check_outside_jit(
      params=params,
      prompt=prompt,
      mask=mask,
      num_tokens=num_tokens,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
      seed=seed,
  )
  check_sampling(num_tokens, temperature, top_k, top_p, model.vocab_size)
  prompt, mask = _prompt(prompt, mask, model.vocab_size)
  total = prompt.shape[1] + num_tokens
  if total > model.attention.max_length:
    raise ValueError(
        f"generate: prompt ({prompt.shape[1]} tokens) + num_tokens={num_tokens} = {total} "
        f"exceeds the model's max_length {model.attention.max_length}."
    )
  variables = params if "params" in params else {"params": params}
  gen = make_generate(
      model, int(num_tokens), temperature=float(temperature), top_k=int(top_k), top_p=float(top_p)
  )
  cache = model.init_cache(prompt.shape[0], total)
  tokens, logits = gen(variables, cache, prompt, mask, jax.random.key(seed))
  return (tokens, logits) if return_logits else tokens


__all__ = ["generate", "make_generate", "sample_logits"]
