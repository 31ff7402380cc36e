"""Incremental decoding of YOUR causal model built from fastpos attention layers.

``DecoderLM`` decodes itself (``init_cache`` / ``decode=True``). A model of your own needs
one thing: its ``__call__`` takes a ``decode`` keyword (default None) and passes it on to
every fastpos attention layer (``Attention``, ``Block``) it calls. ``CachedDecoding`` then
builds the layers' decoding state (Flax's ``cache`` collection: a key / value cache for
softmax, a fixed-size state for linear kernels; the table of docs/decoding.md) and feeds it
new tokens, tracking the position; each step runs under ``jax.jit`` and ``lax.scan``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fastpos.models.decoding import Step


class CachedDecoding:
  """Decodes a causal ``module`` whose ``__call__(x, ..., decode=None)`` passes ``decode`` to
  each of its fastpos attention layers (built ``causal=True``, 1D).

  Args:
    module: the Flax module.
    max_length: T, the most positions the cache holds (<= the layers' ``max_length``).

  The state is a dict ``{"cache": <the cache collection>, "index": int32 scalar}`` (a
  pytree: carry it through ``jax.lax.scan``). ``step`` places its L inputs at positions
  ``index .. index + L - 1`` and returns the module's outputs for them: with one prompt
  call, then one token per call, the outputs equal the module's full causal forward at the
  same positions (positions past T are not checked under jit: keep ``index + L <= T``).

  Example::

      class MyLM(nn.Module):                      # your model: pass `decode` on
        @nn.compact
        def __call__(self, tokens, mask=None, decode=None):   # tokens [b, L] int32
          x = nn.Embed(100, 32)(tokens)
          x = x + fastpos.attention(32, 4, kernel="elu1", positional="rope", causal=True,
                                    max_length=64)(x, mask=mask, decode=decode)
          return nn.Dense(100)(x)                 # [b, L, 100] float32

      model = MyLM()
      prompt = jnp.array([[5, 9, 2], [7, 1, 4]])                 # [2, 3] int32 token ids
      params = jax.jit(model.init)(jax.random.key(0), prompt)  # one program, not op by op
      dec = fastpos.CachedDecoding(model, max_length=64)
      step = jax.jit(dec.step)                                   # one program per input length
      state = dec.init(prompt)                                   # zeros, for a batch of 2
      logits, state = step(params, state, prompt)                # [2, 3, 100]
      next_token = jnp.argmax(logits[:, -1:], axis=-1)           # [2, 1]
      logits, state = step(params, state, next_token)            # [2, 1, 100]
      int(state["index"])                                        # 4
  """

  def __init__(self, module: nn.Module, max_length: int):
    if not isinstance(module, nn.Module):
      raise ValueError(f"CachedDecoding takes a Flax linen module; got {type(module).__name__}.")
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
      raise ValueError(f"CachedDecoding: max_length must be an int >= 1; got {max_length!r}.")
    self.module = module
    self.max_length = max_length

  def init(self, example, **kwargs) -> dict[str, Any]:
    """The empty decoding state (zeros, shaped without compute) for inputs like ``example``
    (``[batch, L, ...]``; its batch size is the state's, L does not matter). ``kwargs`` go to
    the module's call as in ``step``."""
    step = Step(offset=jnp.zeros((), jnp.int32), cache_length=self.max_length)
    shapes = jax.eval_shape(
        lambda x: self.module.init(jax.random.key(0), x, decode=step, **kwargs), example
    )
    if "cache" not in shapes:
      raise ValueError(
          f"{type(self.module).__name__} made no decoding cache: its __call__ must pass "
          "decode= to every fastpos attention layer (built causal=True)."
      )
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes["cache"])
    return {"cache": zeros, "index": jnp.zeros((), jnp.int32)}

  def step(self, variables: dict, state: dict[str, Any], x, **kwargs):
    """``(outputs for x, new state)``: ``x [batch, L, ...]`` are the next L inputs (a prompt,
    or one token); ``kwargs`` go to the module's call (e.g. ``mask [batch, L]``, False for
    left padding of a prompt). Jit it, or call it inside your jitted function."""
    out, upd = self.module.apply(
        {**variables, "cache": state["cache"]},
        x,
        decode=Step(offset=state["index"]),
        mutable=["cache"],
        **kwargs,
    )
    length = jax.tree.leaves(x)[0].shape[1]
    return out, {"cache": upd["cache"], "index": state["index"] + length}


__all__ = ["CachedDecoding"]
