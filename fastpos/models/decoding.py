"""Incremental decoding of ``DecoderLM``: a ``cache`` collection, a prompt prefill, then steps.

In the style of Flax's own examples (lm1b): the state lives in the ``cache`` collection and
every call with ``decode=True`` reads it and returns it updated::

    cache = model.init_cache(batch_size, max_length)
    logits, upd = model.apply({"params": params, "cache": cache}, {"inputs": prompt,
                              "mask": prompt_mask}, decode=True, mutable=["cache"])
    cache = upd["cache"]                       # then one token per call, same form

A call with L tokens (a prompt prefill, or L = 1 per step) places them at the next L slots
(``cache["index"]``) and returns their next-token logits ``[b, L, vocab]``; under ``jax.jit``
and ``lax.scan`` (``step_fn``, ``generate``) it is one compiled step. Slot = position: every
scheme sees the token's slot as its absolute position, and padding (mask False) is a slot that
no later token sees. Prompts of different lengths are LEFT-padded, so every row continues at
the same slot and its real tokens stay contiguous (relative schemes then see the offsets an
unpadded row would; an absolute embedding sees the padded slot numbers). The decoded logits
equal the full causal forward of the same padded batch and mask at every real position.

Each layer runs its schemes' hooks through the dispatcher of the full forward
(``fastpos.models.hooks.run``) along a ``StepPath``: the cache replaces the sequence as the
source of keys and values, and ``fastpos.ops.decoding``'s steps replace the full ops.

What each layer keeps, and its cost per token: the "Decoding" table of docs/decoding.md
(softmax: a key / value cache; linear kernels: a fixed-size recurrent state; FastRPB adds a
value cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from fastpos import positional
from fastpos.models import hooks as hooks_lib
from fastpos.ops import decoding as dec_ops


@dataclasses.dataclass(frozen=True)
class Step:
  """What a layer needs to know in a decoding call: ``offset``, the slot of the first new token
  (int32 scalar, traced under jit), and ``cache_length`` (T, only when the cache is created)."""

  offset: Any
  cache_length: int | None = None


class _Cache:
  """The layer's ``cache`` variables: created (zeros) at init, required afterwards."""

  def __init__(self, layer, step: Step):
    self.layer, self.step = layer, step

  def get(self, name: str, shape, dtype):
    name = f"cached_{name}"  # apart from the layer's submodules (key, value, ...)
    layer = self.layer
    if not layer.is_initializing() and not layer.has_variable("cache", name):
      raise ValueError(
          f"decoding needs a cache: build it with model.init_cache(batch_size, "
          f"max_length) and pass it as the 'cache' collection (no cache variable "
          f"{name!r} in {'/'.join(layer.scope.path)})."
      )
    if any(s is None for s in shape):
      shape = (0,)  # the variable exists: its stored shape is used
    return layer.variable("cache", name, jnp.zeros, tuple(shape), dtype)

  def length(self, var) -> int:
    return var.value.shape[1]

  def write(self, var, new):
    """Writes ``new [b, L, ...]`` at slots offset..offset+L-1 (axis 1)."""
    zero = jnp.zeros((), jnp.int32)
    start = (zero, jnp.asarray(self.step.offset, jnp.int32)) + (zero,) * (new.ndim - 2)
    var.value = jax.lax.dynamic_update_slice(var.value, new.astype(var.value.dtype), start)
    return var.value


class StepPath:
  """A decoding call's ``fastpos.models.hooks.Path``: the L new tokens at slots
  ``step.offset + i`` against the layer's cache, which they are written into first.

  Softmax keeps per-slot key / value caches; linear kernels keep a fixed-size recurrent state
  (``fastpos.ops.decoding.linear_step``), or per-slot key features when a ``kv`` table weighs
  every past key anew at each query (``linear_cached_step``); ``output`` hooks see the value
  cache. ``layer`` is the ``Attention`` module whose ``cache`` collection holds the state.
  """

  def __init__(self, layer, hooks, v, mask, step: Step, *, deterministic: bool, reference: bool):
    cfg = layer.cfg
    b, n, h, d = v.shape
    _check_decodable(cfg, deterministic)
    self.kernel, self.head_dim, self.step = cfg.kernel, d, step
    self.mask = jnp.ones((b, n), bool) if mask is None else mask
    self.cache = _Cache(layer, step)
    self.ctx = positional.Context(
        causal=True, reference=reference, deterministic=deterministic, length=n, offset=step.offset
    )
    probe = hooks.mix(positional.Context(causal=True, length=1))
    self.log_decay, has_table = probe.log_decay, probe.log_table is not None
    self.values = self.real = self.log_rows = None
    self.output_term = None
    t = step.cache_length
    if cfg.kernel.is_softmax or hooks.output or has_table:  # per-slot caches
      real_var = self.cache.get("real", (b, t), bool)
      self.real = self.cache.write(real_var, self.mask)
      self.values = self.cache.write(self.cache.get("value", (b, t, h, d), v.dtype), v)
      t = self.cache.length(real_var)
    if has_table:
      table = hooks.mix(positional.Context(causal=True, length=t)).log_table
      self.log_rows = positional.offset_rows(table, step.offset, n)  # [h, L, T]
    self.v, self.t = v, t

  def keys(self, k):
    b, _, h, f = k.shape
    return self.cache.write(self.cache.get("key", (b, self.t, h, f), k.dtype), k)

  def bias_terms(self, q) -> list:
    """The ``kv`` table's rows for the new tokens, and the decay as (i-j) log r."""
    del q
    terms = [] if self.log_rows is None else [self.log_rows[None]]
    if self.log_decay is not None:
      pos = self.step.offset + jnp.arange(self.mask.shape[1])
      dist = jnp.maximum(pos[:, None] - jnp.arange(self.t)[None, :], 0)
      terms.append((self.log_decay[:, None, None] * dist[None].astype(self.log_decay.dtype))[None])
    return terms

  def softmax(self, q, keys, bias):
    return dec_ops.softmax_step(
        q,
        keys,
        self.values,
        self.real,
        offset=self.step.offset,
        bias=bias,
        scale=self.head_dim**-0.5,
    )

  def key_features(self, k, projection):
    """phi(k) split as ``e exp(s - c) + eps_add`` (``fastpos.ops.decoding.key_parts``): both
    parts go through the hooks, which are linear in the keys."""
    e, s_log, eps_add = dec_ops.key_parts(self.kernel, k, projection=projection, nu=self.kernel.nu)
    b = None if not eps_add else jnp.full_like(e, eps_add)
    return hooks_lib.KeyFeatures((e, b), log_scale=s_log)

  def linear(self, num, den, keys, dtype):
    den = num if den is None else den
    parts = dict(
        num_a=num[1][0], num_b=num[1][1], den_a=den[1][0], den_b=den[1][1], s=keys.log_scale
    )
    if self.log_rows is not None:  # a general relative table: cache the key features
      return self._cached(num[0], den[0], parts, dtype)
    return self._recurrent(num[0], den[0], parts, dtype)

  def _cached(self, fq, dq, parts, dtype):
    b, _, h, _ = fq.shape
    full = {}
    for name, part in parts.items():
      shape = None if part is None else (b, self.t, h) + part.shape[3:]
      full[name] = (
          None
          if part is None
          else self.cache.write(self.cache.get(f"phi_{name}", shape, dtype), part)
      )
    full["real"], full["v"] = self.real, self.values
    return dec_ops.linear_cached_step(
        full,
        fq,
        dq,
        log_rows=self.log_rows,
        log_decay=self.log_decay,
        offset=self.step.offset,
        eps=self.kernel.eps,
    )

  def _recurrent(self, fq, dq, parts, dtype):
    b, _, h, _ = fq.shape
    d, mq, md = self.head_dim, parts["num_a"].shape[-1], parts["den_a"].shape[-1]
    shapes = dict(
        num_a=(b, h, mq, d),
        num_b=(b, h, mq, d),
        den_a=(b, h, md),
        den_b=(b, h, md),
        scale=(b, h),
        seen=(b,),
    )
    variables = {
        name: self.cache.get(name, shape, bool if name == "seen" else dtype)
        for name, shape in shapes.items()
        if not (name.endswith("_b") and parts[name] is None)
    }
    current = {name: (variables[name].value if name in variables else None) for name in shapes}
    out, new = dec_ops.linear_step(
        current, fq, dq, parts, self.v, self.mask, log_decay=self.log_decay, eps=self.kernel.eps
    )
    for name, var in variables.items():
      var.value = new[name].astype(var.value.dtype)
    return out


def _check_decodable(cfg, deterministic: bool) -> None:
  """What runs decoding is the plan's (``AttentionConfig.plan``, called by the layer); the
  call must not ask for a feature redraw."""
  kernel = cfg.kernel
  if kernel.needs_projection and kernel.redraw and not deterministic:
    raise ValueError("decoding draws no features: call it with train=False.")


# ---------------------------------------------------------------------------------------------
# User-facing helpers
# ---------------------------------------------------------------------------------------------
def step_fn(model):
  """``step(params, cache, tokens [b, L], mask [b, L]) -> (logits [b, L, V], cache)``, jitted
  (prefill with L = prompt length, then L = 1 per token)."""

  @jax.jit
  def step(params, cache, tokens, mask):
    logits, upd = model.apply(
        {"params": params, "cache": cache},
        {"inputs": tokens, "mask": mask},
        decode=True,
        mutable=["cache"],
    )
    return logits, upd["cache"]

  return step


def cache_bytes(cache) -> int:
  """Total bytes of a decoding state (what a generated token keeps in memory)."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)))
