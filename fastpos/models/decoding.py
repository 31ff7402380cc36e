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

What each layer keeps, and its cost per token: the README's "Decoding" table (softmax: a key /
value cache; linear kernels: a fixed-size recurrent state; FastRPB adds a value cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from fastpos import positional
from fastpos.ops import decoding as dec_ops
from fastpos.ops import features as feature_ops


@dataclasses.dataclass(frozen=True)
class Step:
  """What a layer needs to know in a decoding call: ``offset``, the slot of the first new token
  (int32 scalar, traced under jit), and ``cache_length`` (T, only when the cache is created)."""

  offset: Any
  cache_length: int | None = None


def sum_terms(terms):
  """The sum of the terms that are not None (None when all are)."""
  terms = [t for t in terms if t is not None]
  if not terms:
    return None
  out = terms[0]
  for t in terms[1:]:
    out = out + t
  return out


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


def attention_step(
    layer, q, k, v, mask, schemes, step: Step, *, deterministic: bool, reference: bool
):
  """The decoding form of ``Attention``: q, k, v ``[b, L, h, d]`` projections of the L new
  tokens (v zero at padding), ``mask [b, L]`` or None, the layer's schemes. Returns the
  attention output ``[b, L, h, d]`` before the output projection; updates the layer's cache."""
  cfg = layer.cfg
  b, n, h, d = v.shape
  if cfg.grid is not None:
    raise ValueError("decoding is defined for 1D causal models; the layer was built 2D.")
  if not cfg.causal:
    raise ValueError("decoding needs a causal (lm) model.")
  real = jnp.ones((b, n), bool) if mask is None else mask
  cache = _Cache(layer, step)
  t = step.cache_length
  ctx = positional.Context(
      causal=True, reference=reference, deterministic=deterministic, length=n, offset=step.offset
  )
  pre = [s for s in schemes if "features" in s.hooks and s.feature_stage == "pre_phi"]
  post = [s for s in schemes if "features" in s.hooks and s.feature_stage == "post_phi"]
  kv_schemes = [s for s in schemes if "kv" in s.hooks]
  log_decay = sum_terms(
      [s.kv(positional.Context(causal=True, length=1)).log_decay for s in kv_schemes]
  )
  has_table = any(
      s.kv(positional.Context(causal=True, length=1)).log_table is not None for s in kv_schemes
  )
  needs_values = any("output" in s.hooks for s in schemes)

  def table_rows(length):
    table = sum_terms(
        [s.kv(positional.Context(causal=True, length=length)).log_table for s in kv_schemes]
    )
    return positional.offset_rows(table, step.offset, n)  # [h, L, T]

  for s in pre:
    q, k = s.features(q, k, ctx)

  values = real_all = None
  if cfg.kernel.is_softmax or needs_values or has_table:  # per-slot caches
    real_var = cache.get("real", (b, t), bool)
    real_all = cache.write(real_var, real)
    values = cache.write(cache.get("value", (b, t, h, d), v.dtype), v)
    t = cache.length(real_var)

  if cfg.kernel.is_softmax:
    for s in post:
      q, k = s.features(q, k, ctx)
    keys = cache.write(cache.get("key", (b, t, h, k.shape[-1]), k.dtype), k)
    terms = [s.logits(q, keys, ctx) for s in schemes if "logits" in s.hooks]
    if has_table:
      terms.append(table_rows(t)[None])
    if log_decay is not None:
      dist = jnp.maximum((step.offset + jnp.arange(n))[:, None] - jnp.arange(t)[None, :], 0)
      terms.append((log_decay[:, None, None] * dist[None].astype(log_decay.dtype))[None])
    out = dec_ops.softmax_step(
        q, keys, values, real_all, offset=step.offset, bias=sum_terms(terms), scale=d**-0.5
    )
  else:
    out = _linear(
        layer,
        cache,
        q,
        k,
        v,
        real,
        post,
        ctx,
        step,
        log_decay,
        table_rows(t) if has_table else None,
        deterministic,
        real_all,
        values,
    )

  for s in schemes:
    if "output" in s.hooks:
      out = out + s.output(values, ctx).astype(out.dtype)
  return out


def _linear(
    layer,
    cache,
    q,
    k,
    v,
    real,
    post,
    ctx,
    step,
    log_decay,
    log_rows,
    deterministic,
    real_all,
    values,
):
  spec = layer.cfg.kernel
  b, n, h, d = v.shape
  dim = q.shape[-1]
  state = jnp.promote_types(q.dtype, jnp.float32)
  q, k = q.astype(state), k.astype(state)
  if spec.kernel.estimates_softmax:
    q, k = q * dim**-0.25, k * dim**-0.25
  q = jnp.where(real[:, :, None, None], q, 0)
  k = jnp.where(real[:, :, None, None], k, 0)
  if spec.kernel.needs_projection and spec.redraw and not deterministic:
    raise ValueError("decoding draws no features: call it with train=False.")
  projection = layer.feature_projection(spec, dim, state, deterministic=True)
  fq = feature_ops.feature_map(
      spec.name, q, projection=projection, is_query=True, mask=real, nu=spec.nu
  )
  e, s_log, eps_add = dec_ops.key_parts(spec.name, k, projection=projection, nu=spec.nu)
  # Key features as a exp(s - c) + b (b = eps_add, after the map); the hooks are linear.
  num = [fq, e, None if not eps_add else jnp.full_like(e, eps_add)]
  den = None

  def hook(s, parts):
    qf, a, bb = parts
    qf2, a2 = s.features(qf, a, ctx)
    return [qf2, a2, None if bb is None else s.features(qf, bb, ctx)[1]]

  for s in post:
    if s.keeps_nonnegative:
      if den is not None:
        den = hook(s, den)
      num = hook(s, num)
    else:
      if den is None:
        den = list(num)
      num = hook(s, num)
  den = num if den is None else den
  keys = dict(num_a=num[1], num_b=num[2], den_a=den[1], den_b=den[2], s=s_log)
  mq, md = num[1].shape[-1], den[1].shape[-1]
  eps = spec.eps

  if log_rows is not None:  # a general relative table: cache the key features
    t = log_rows.shape[-1]
    full = {}
    for name, part in keys.items():
      if part is None:
        full[name] = None
        continue
      shape = (b, t, h) + part.shape[3:]
      full[name] = cache.write(cache.get(f"phi_{name}", shape, state), part)
    full["real"], full["v"] = real_all, values
    return dec_ops.linear_cached_step(
        full, num[0], den[0], log_rows=log_rows, log_decay=log_decay, offset=step.offset, eps=eps
    )

  shapes = dict(
      num_a=(b, h, mq, d),
      num_b=(b, h, mq, d),
      den_a=(b, h, md),
      den_b=(b, h, md),
      scale=(b, h),
      seen=(b,),
  )
  variables = {
      name: cache.get(name, shape, bool if name == "seen" else state)
      for name, shape in shapes.items()
      if not (name.endswith("_b") and keys[name] is None)
  }
  current = {name: (variables[name].value if name in variables else None) for name in shapes}
  out, new = dec_ops.linear_step(
      current, num[0], den[0], keys, v, real, log_decay=log_decay, eps=eps
  )
  for name, var in variables.items():
    var.value = new[name].astype(var.value.dtype)
  return out


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
