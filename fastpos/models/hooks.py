"""The hook dispatcher: the one place the positional hooks of an attention layer run, in order.

``run`` is the order, written once for the full forward (``fastpos.models.attention``) and for a
decoding step (``fastpos.models.decoding``):

1. ``features`` hooks of stage ``pre_phi`` on q, k;
2. softmax kernel: ``features`` hooks of stage ``post_phi`` on q, k; the logits bias is the sum
   of the ``logits`` hooks and the path's terms (``kv`` tables as b_{j-i}, a decay, segments);
   the path's softmax.
   Linear kernels: q, k in float32 at least, scaled by d^-1/4 when phi estimates exp(q.k),
   padded rows zeroed; phi(q) and the path's key features; ``post_phi`` hooks on the features
   (a scheme that can change signs acts on the numerator's only: the denominator keeps the
   features before it, so it stays positive); the path's linear attention;
3. the ``output`` hooks' terms added.

What differs between the callers is a ``Path``: where keys and values come from (the sequence,
or a cache the new tokens are written into), how the ``kv`` tables become weights and which op
attends. Schemes are grouped by the hooks they list (``Hooks``), never by their names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax.numpy as jnp

from fastpos import positional
from fastpos.ops import features as feature_ops


def sum_terms(terms):
  """The sum of the terms that are not None, left to right (None when all are)."""
  terms = [t for t in terms if t is not None]
  if not terms:
    return None
  out = terms[0]
  for t in terms[1:]:
    out = out + t
  return out


@dataclasses.dataclass(frozen=True)
class KeyFeatures:
  """Key features of a linear kernel as the path forms them.

  Attributes:
    parts: ``[b, Lk, h, m]`` arrays (or None) whose sum (each part times its weight) is phi(k):
      ``(phi(k),)``, or ``(e, eps)`` for keys split as ``e exp(s - c) + eps``; the ``post_phi``
      hooks are linear in the keys and map each part.
    log_scale: ``[b, Lk, h]`` s of the split keys, or None.
    eps: the constant added to split keys inside the op (not mapped by the hooks), or 0.
  """

  parts: tuple
  log_scale: Any = None
  eps: float = 0.0


class Path(Protocol):
  """What differs between the full forward and a decoding step (``run`` calls these)."""

  ctx: positional.Context  # what the hooks see
  mask: Any  # [b, L] bool or None: the real rows of the new tokens (padded rows are zeroed)
  values: Any  # what the output hooks see, [b, Lk, h, d]
  output_term: Callable | None  # (scheme, values, ctx) -> term, replacing scheme.output

  def keys(self, k):
    ...  # softmax: the keys the logits hooks and the op see

  def bias_terms(self, q) -> list:
    ...  # softmax: the path's terms of the logits bias

  def softmax(self, q, keys, bias):
    ...

  def key_features(self, k, projection) -> KeyFeatures:
    ...

  def linear(self, num, den, keys: KeyFeatures, dtype):
    ...


@dataclasses.dataclass(frozen=True)
class Hooks:
  """A layer's schemes grouped by the hooks they list (each group in the layer's order)."""

  pre_phi: tuple = ()
  post_phi: tuple = ()
  logits: tuple = ()
  kv: tuple = ()
  output: tuple = ()

  @classmethod
  def of(cls, schemes) -> "Hooks":
    def at(hook, stage=None):
      return tuple(s for s in schemes if hook in s.hooks and stage in (None, s.feature_stage))

    return cls(
        pre_phi=at("features", "pre_phi"),
        post_phi=at("features", "post_phi"),
        logits=at("logits"),
        kv=at("kv"),
        output=at("output"),
    )

  def mix(self, ctx) -> positional.KVMix:
    """The summed ``kv`` hooks: log table and log decay (each None when no scheme gives one)."""
    mixes = [s.kv(ctx) for s in self.kv]
    return positional.KVMix(
        log_table=sum_terms([m.log_table for m in mixes]),
        log_decay=sum_terms([m.log_decay for m in mixes]),
    )

  def post_phi_features(self, fq, parts, ctx):
    """The ``post_phi`` hooks on phi(q) and the key parts: ``(num, den)``, each ``(query
    features, key parts)``; ``den`` is None when every hook keeps features nonnegative (the
    denominator then uses ``num``)."""
    num, den = (fq, tuple(parts)), None
    for s in self.post_phi:
      if s.keeps_nonnegative and den is not None:
        den = _map_parts(s, den, ctx)
      elif not s.keeps_nonnegative and den is None:
        den = num  # the denominator keeps the positive features before this hook
      num = _map_parts(s, num, ctx)
    return num, den


def _map_parts(scheme, features, ctx):
  fq, parts = features
  fq2, first = scheme.features(fq, parts[0], ctx)
  rest = tuple(None if p is None else scheme.features(fq, p, ctx)[1] for p in parts[1:])
  return fq2, (first,) + rest


def run(hooks: Hooks, path: Path, q, k, *, kernel: feature_ops.Kernel, projection: Callable):
  """The attention output ``[b, L, h, d]`` (before the output projection) of q ``[b, L, h, d]``
  and k ``[b, Lk, h, d]`` along ``path``; ``projection(dim, dtype)`` draws the random-feature
  projection (None for kernels without one)."""
  ctx = path.ctx
  for s in hooks.pre_phi:
    q, k = s.features(q, k, ctx)
  if kernel.is_softmax:
    out = _softmax(hooks, path, q, k)
  else:
    out = _linear(hooks, path, q, k, kernel, projection)
  for term in output_terms(hooks, path):
    out = out + term.astype(out.dtype)
  return out


def output_terms(hooks: Hooks, path: Path) -> list:
  """The ``output`` hooks' terms on ``path.values``, in the layer's order (``run`` adds them
  to the attention output; the chunked layer adds them chunk by chunk)."""
  ctx = path.ctx
  if path.output_term is None:
    return [s.output(path.values, ctx) for s in hooks.output]
  return [path.output_term(s, path.values, ctx) for s in hooks.output]


def _softmax(hooks: Hooks, path: Path, q, k):
  for s in hooks.post_phi:
    q, k = s.features(q, k, path.ctx)
  keys = path.keys(k)
  terms = [s.logits(q, keys, path.ctx) for s in hooks.logits]
  return path.softmax(q, keys, sum_terms(terms + path.bias_terms(q)))


def _linear(hooks: Hooks, path: Path, q, k, kernel: feature_ops.Kernel, projection: Callable):
  dim = q.shape[-1]
  state = jnp.promote_types(q.dtype, jnp.float32)  # feature maps: float32 at least
  q, k = q.astype(state), k.astype(state)
  if kernel.estimates_softmax:  # phi(q).phi(k) ~ exp(q.k / sqrt(d)), as softmax
    q, k = q * dim**-0.25, k * dim**-0.25
  if path.mask is not None:
    # Zero padded rows before phi: exp of garbage could overflow and poison gradients.
    q = jnp.where(path.mask[:, :, None, None], q, 0)
    k = jnp.where(path.mask[:, :, None, None], k, 0)
  w = projection(dim, state)
  fq = kernel.phi(q, projection=w, is_query=True, mask=path.mask)
  keys = path.key_features(k, w)
  num, den = hooks.post_phi_features(fq, keys.parts, path.ctx)
  return path.linear(num, den, keys, state)
