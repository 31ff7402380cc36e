"""The attention layer's token-wise part over chunks of the sequence (``model.attn_chunk``).

A linear-attention layer is token-wise except for two sums over the keys:
``S = sum_j phi(k_j) v_j^T`` and ``z = sum_j phi(k_j)`` (causal: over the keys j <= i).
``attend`` computes the layer in two passes over chunks of C tokens, each a ``lax.scan``
whose body is rematerialised:

1. keys and values of the chunk (projections, masks, phi(k)) -> S and z accumulated; v kept
   (the ``output`` hooks, e.g. FastRPB's ``W V``, mix values over the whole sequence);
2. the ``output`` hooks' terms on the whole ``v``, then queries of the chunk (projection, phi(q))
   against S and z, plus the terms, through the output projection.

Causal layers carry the state instead: pass 2 starts each device block from the sums of the
blocks before it (an exclusive prefix of pass 1's block totals, summed forward: nothing is
undone by subtraction), and each chunk's queries read the state of the chunks before
them plus, within the chunk, ``tril(phi(q) phi(k)^T)`` in pieces of the op's causal chunk
(``model.chunk_size``, else 32), before the chunk's keys join the state. On one device
without output hooks pass 1 is skipped (no block comes before).

The backward pass holds one chunk's projections and features at a time instead of the whole
sequence's (about ten width-D arrays per token in the train step of the LRA Text model),
and keeps the inputs, v, the terms and the small states (causal: the state entering each
chunk). The same function as the unchunked layer: the same parameters, masks and key
stabiliser (sikf's, favor's and orf's max over all real keys, or the first real key's when
causal, found by a forward-only pass over the chunks), summed in another order (round-off
only). One bound differs: on one device the unchunked causal layer keeps the exponential
maps' keys (sikf, favor, orf, prf) relative to a running maximum (``fastpos.ops.attention``
``key_log_scale``); chunked, as unchunked over a split sequence, a key whose exponent
exceeds the first real key's by more than ~88 (float32) overflows (a NaN loss, not a wrong
output). prf has no stabiliser; its exponent is bounded by its projection.

With the sequence split over the mesh axis ``seq`` (P devices, the global view of
``fastpos.models.context_parallel``) every device chunks its own block: the scans run over
chunk index k holding ``[b, P, C, .]``; the states are summed over P after the first pass
(one all-reduce), or for causal layers taken as the prefix over the blocks before each.

What is built (``fastpos.positional.compatibility.chunk_problem`` says why not otherwise):
causal and bidirectional 1D layers with linear kernels whose key features act on each key
alone (elu1, relu, dpfp, prf, trf, nprf) or share one stabilising max (sikf, favor, orf);
schemes at the ``output`` hook only (FastRPB; ``embed`` schemes run in the model's Tower).
Not built: 2D grids, schemes at the ``features``, ``logits`` or ``kv`` hooks, packed batches.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from fastpos.ops import attention as attn_ops


def check_chunk(value) -> int:
  """``attn_chunk`` checked: an int >= 0 (0: the layer runs on the whole sequence at once)."""
  if not isinstance(value, int) or isinstance(value, bool) or value < 0:
    raise ValueError(
        f"attn_chunk must be an int >= 0 (0: the attention layer runs on the whole sequence at "
        f"once); got {value!r}."
    )
  return value


def _split(a, parts: int, chunk: int):
  """``[b, N, ...]`` -> ``[count, b, P, C, ...]``: P blocks of ceil(N / P) positions, each in
  chunks of C (zero-padded)."""
  b, n = a.shape[:2]
  block = -(-n // parts)
  count = -(-block // chunk)
  tail = ((0, 0),) * (a.ndim - 2)
  a = jnp.pad(a, ((0, 0), (0, parts * block - n)) + tail)
  a = a.reshape((b, parts, block) + a.shape[2:])
  a = jnp.pad(a, ((0, 0), (0, 0), (0, count * chunk - block)) + tail)
  return jnp.moveaxis(a.reshape((b, parts, count, chunk) + a.shape[3:]), 2, 0)


def _merge(a, n: int):
  """Stacked chunks ``[count, b, P, C, ...]`` -> ``[b, N, ...]``."""
  count, b, parts, chunk = a.shape[:4]
  block = -(-n // parts)
  a = jnp.moveaxis(a, 0, 2).reshape((b, parts, count * chunk) + a.shape[4:])[:, :, :block]
  return a.reshape((b, parts * block) + a.shape[3:])[:, :n]


def _flat(a):
  """``[b, P, C, ...]`` -> ``[b, P * C, ...]`` (what the feature maps take)."""
  return a.reshape((a.shape[0], a.shape[1] * a.shape[2]) + a.shape[3:])


def _guard(den, eps: float):
  """The op's denominator guard (``fastpos.ops.attention``): |den| < eps becomes +-eps."""
  return jnp.where(jnp.abs(den) < eps, jnp.where(den < 0, -eps, eps), den)


class _Layer:
  """The layer's token-wise math on chunks ``[b, P, C, ...]`` of the sequence, from its
  parameters (``query``, ``key``, ``value``, ``out``, as the unchunked layer's
  ``nn.DenseGeneral``) and as its hooks compute it (``fastpos.models.hooks._linear``).
  ``stab``: sikf's key stabiliser ``[b, h]`` (``_key_stabiliser``), else None."""

  def __init__(self, cfg, params, *, dtype, projection, width: int):
    self.cfg, self.kernel, self.dtype, self.projection = cfg, cfg.kernel, dtype, projection
    self.state = jnp.promote_types(dtype, jnp.float32)  # feature maps and sums: float32 at least
    # Promoted once, outside the chunk loops: a float64 model sums its float32 parameters'
    # gradients over the chunks in float64, as the whole-sequence dot does.
    p = jax.tree.map(lambda a: a.astype(jnp.promote_types(a.dtype, dtype)), params)

    def dense(name, features, axis=-1):
      module = nn.DenseGeneral(features, axis=axis, dtype=dtype, parent=None)
      return functools.partial(module.apply, {"params": p[name]})

    heads = (cfg.num_heads, cfg.head_dim)
    self.query, self.key, self.value = (
        dense("query", heads),
        dense("key", heads),
        dense("value", heads),
    )
    self.out_proj = dense("out", width, axis=(-2, -1))
    self.stab = None

  def prepared(self, t, m):  # q or k: float32+, scaled, padded zero
    t = t.astype(self.state)
    if self.kernel.estimates_softmax:
      t = t * self.cfg.head_dim**-0.25
    return jnp.where(m[..., None, None], t, jnp.zeros((), self.state))

  def values(self, xc, m):  # [b, P, C, h, d], padded zero
    v = self.value(xc)
    return jnp.where(m[..., None, None], v, jnp.zeros((), v.dtype))

  def exponent(self, xc, m):  # a stabilised map's exponent z of the keys, [b, P, C, h, m]
    k = self.prepared(self.key(xc), m)
    z = self.kernel.map.exp_form.exponent(_flat(k), self.projection)
    return z.reshape(k.shape[:3] + z.shape[2:])

  def key_features(self, xc, m):  # [b, P, C, h, m], padded keys zero
    if self.stab is None:
      k = self.prepared(self.key(xc), m)
      fk = self.kernel.phi(_flat(k), projection=self.projection, is_query=False).reshape(
          k.shape[:3] + (self.cfg.num_heads, -1)
      )
    else:  # the map's own formula, exp(z - c) (/ sqrt(m)) (+ eps), with c from all chunks
      form = self.kernel.map.exp_form
      fk = jnp.exp(self.exponent(xc, m) - self.stab[:, None, None, :, None])
      if form.normalised:
        fk = fk / math.sqrt(fk.shape[-1])
      if form.eps:
        fk = fk + form.eps
    return jnp.where(m[..., None, None], fk.astype(self.state), jnp.zeros((), self.state))

  def query_features(self, xc, m):  # [b, P, C, h, m]
    q = self.prepared(self.query(xc), m)
    fq = self.kernel.phi(_flat(q), projection=self.projection, is_query=True, mask=_flat(m))
    return fq.astype(self.state).reshape(q.shape[:3] + (self.cfg.num_heads, -1))

  def output(self, num, den, ts):  # num / guard(den) plus the hook terms, projected
    out = (num / _guard(den, self.kernel.eps)[..., None]).astype(self.dtype)
    for t in ts:
      out = out + t.astype(out.dtype)
    return self.out_proj(out.astype(self.dtype))


@dataclasses.dataclass(frozen=True)
class LayerParts:
  """What ``attend`` reads of an attention layer planned to run by chunks
  (``fastpos.models.attention.Attention.chunked_layer`` builds it).

  Attributes:
    cfg: the layer's ``AttentionConfig`` (planned to run by chunks of ``cfg.attn_chunk``).
    params: the layer's parameters (``query``, ``key``, ``value``, ``out``, as the unchunked
      layer's ``nn.DenseGeneral``).
    dtype: the layer's activation dtype.
    terms: ``v [b, N, h, d] -> [terms [b, N, h, d]]``, the ``output`` hooks on the masked
      values, or None when the layer has none.
    projection: the kernel's random projection, or None.
    parts: P, the devices the sequence is split over.
  """

  cfg: Any
  params: Any
  dtype: Any
  terms: Callable | None
  projection: Any
  parts: int


def attend(x, mask, layer_parts: LayerParts, *, tail: Callable | None = None):
  """The layer's output ``[b, N, D]`` (in ``layer_parts.dtype``) of ``x [b, N, D]`` by chunks
  of ``layer_parts.cfg.attn_chunk`` tokens, or with ``tail`` the tail's output ``[b, N, D']``.

  mask: ``[b, N]`` bool or None. tail: None, or a token-wise ``fn(pos, x_chunk, y_chunk) ->
  [b, P, C, D']`` run on each chunk of the layer's output y in the second pass (what follows
  the layer in its block, passed by the block that owns both: neither y nor a second chunk
  loop is stored); ``pos`` int32 ``[1, P, C, 1]``: the tokens' positions (>= N: padding), as
  ``fastpos.models.tokenwise.map_chunks`` gives them."""
  cfg, terms, parts = layer_parts.cfg, layer_parts.terms, layer_parts.parts
  chunk = cfg.attn_chunk
  b, n, width = x.shape
  layer = _Layer(
      cfg,
      layer_parts.params,
      dtype=layer_parts.dtype,
      projection=layer_parts.projection,
      width=width,
  )
  real = jnp.ones((b, n), bool) if mask is None else mask
  xs = (_split(x, parts, chunk), _split(real, parts, chunk))  # padding: mask False
  if cfg.kernel.stabilised:  # sikf, favor, orf: one max shared by the keys
    layer.stab = _key_stabiliser(xs, layer, causal=cfg.causal)
  m_dim = cfg.kernel.feature_dim(cfg.head_dim)
  init = (
      jnp.zeros((b, parts, cfg.num_heads, m_dim, cfg.head_dim), layer.state),
      jnp.zeros((b, parts, cfg.num_heads, m_dim), layer.state),
  )
  # Causal on one device: no block before this one, so pass 1 is for the hooks' v only.
  sums = not cfg.causal or parts > 1
  if sums or terms is not None:
    totals, v = _first_pass(layer, xs, init if sums else None)
  extra = () if terms is None else tuple(_split(t, parts, chunk) for t in terms(_merge(v, n)))
  starts = jnp.arange(parts, dtype=jnp.int32)[None, :, None, None] * -(-n // parts)
  offsets = jnp.arange(chunk, dtype=jnp.int32)[None, None, :, None]

  def finish(index, xc, num, den, ts):
    y = layer.output(num, den, ts)
    return y if tail is None else tail(starts + index * chunk + offsets, xc, y)

  if cfg.causal:
    init = init if parts == 1 else tuple(_before(t) for t in totals)
    body = _causal_step(layer, finish, min(cfg.chunk_size or attn_ops.CAUSAL_PLAIN_CHUNK, chunk))
  else:
    init, body = None, _query_step(layer, finish, *(jnp.sum(t, axis=1) for t in totals))
  steps = jnp.arange(xs[0].shape[0], dtype=jnp.int32)
  _, y = jax.lax.scan(body, init, (steps,) + xs + extra)
  return _merge(y, n)


def _first_pass(layer, xs, init):
  """Pass 1 over the chunks: ``v`` ``[count, b, P, C, h, d]`` and, unless ``init`` is None,
  each device block's key sums ``(sum phi(k) v^T [b, P, h, m, d], sum phi(k) [b, P, h, m])``
  added to ``init`` (else None)."""

  @jax.checkpoint
  def sums(carry, xs_c):
    xc, m = xs_c
    v = layer.values(xc, m)
    if carry is None:
      return carry, v
    fk = layer.key_features(xc, m)
    kv = carry[0] + jnp.einsum("bpchm,bpchd->bphmd", fk, v.astype(layer.state))
    return (kv, carry[1] + jnp.sum(fk, axis=2)), v

  return jax.lax.scan(sums, init, xs)


def _query_step(layer, finish, kv, ks):
  """The bidirectional pass's body ``(None, (index, x, mask, *terms)) -> (None, y)``: one
  chunk's queries against the key sums of the whole sequence (``kv [b, h, m, d]``,
  ``ks [b, h, m]``), rematerialised."""

  @jax.checkpoint
  def outputs(index, xc, m, *ts):
    fq = layer.query_features(xc, m)
    num = jnp.einsum("bpchm,bhmd->bpchd", fq, kv)
    den = jnp.einsum("bpchm,bhm->bpch", fq, ks)
    return finish(index, xc, num, den, ts)

  return lambda carry, inputs: (carry, outputs(*inputs))


def _before(total):
  """The state entering each device block, ``[b, P, ...]``: the sum of the blocks before it
  (an exclusive prefix over P, summed forward; no state is rebuilt by subtraction)."""
  ahead = jnp.cumsum(total[:, :-1], axis=1)
  return jnp.concatenate([jnp.zeros_like(total[:, :1]), ahead], axis=1)


def _causal_step(layer, finish, inner: int):
  """The causal pass's rematerialised body ``(state, (index, x, mask, *terms)) -> (state,
  y)`` on one chunk of each block: its queries read the carried state and, within the
  chunk, the keys up to them (``_causal_chunk``); the chunk's keys then join the state."""

  @jax.checkpoint
  def body(carry, inputs):
    index, xc, m, *ts = inputs
    fq, fk = layer.query_features(xc, m), layer.key_features(xc, m)
    v = layer.values(xc, m).astype(layer.state)
    num, den, carry = _causal_chunk(fq, fk, v, carry, inner)
    return carry, finish(index, xc, num, den, ts)

  return body


def _causal_chunk(fq, fk, v, carry, inner: int):
  """Causal linear attention on one chunk ``fq, fk [b, P, C, h, m]``, ``v [b, P, C, h, d]``
  from the state ``carry = (S [b, P, h, m, d], s [b, P, h, m])`` of the keys before it, in
  pieces of ``inner`` tokens (the op's ``_causal_scan``): ``num = fq S + tril(fq fk^T) v``,
  ``den = fq s + tril(fq fk^T) 1``. Returns ``num [b, P, C, h, d]``, ``den [b, P, C, h]``
  and the state after the chunk."""
  c = fq.shape[2]
  g = -(-c // inner)

  def split(a):  # [b, P, C, h, .] -> [g, b, P, inner, h, .], zero-padded
    a = jnp.pad(a, ((0, 0), (0, 0), (0, g * inner - c), (0, 0), (0, 0)))
    return jnp.moveaxis(a.reshape(a.shape[:2] + (g, inner) + a.shape[3:]), 2, 0)

  def merge(a):  # [g, b, P, inner, ...] -> [b, P, C, ...]
    a = jnp.moveaxis(a, 0, 2)
    return a.reshape(a.shape[:2] + (g * inner,) + a.shape[4:])[:, :, :c]

  tri = jnp.tril(jnp.ones((inner, inner), bool))

  def piece(state, xs):
    kv, ks = state
    q, k, vals = xs
    a = jnp.where(tri, jnp.einsum("bpihm,bpjhm->bphij", q, k), jnp.zeros((), q.dtype))
    num = jnp.einsum("bpihm,bphmd->bpihd", q, kv) + jnp.einsum("bphij,bpjhd->bpihd", a, vals)
    den = jnp.einsum("bpihm,bphm->bpih", q, ks) + jnp.swapaxes(jnp.sum(a, axis=-1), 2, 3)
    kv = kv + jnp.einsum("bpjhm,bpjhd->bphmd", k, vals)
    return (kv, ks + jnp.sum(k, axis=2)), (num, den)

  carry, (num, den) = jax.lax.scan(piece, carry, (split(fq), split(fk), split(v)))
  return merge(num), merge(den), carry


def _key_stabiliser(xs, layer, *, causal: bool):
  """The key stabiliser ``[b, h]`` of sikf, favor and orf as ``fastpos.ops.features`` takes it
  (``_stabilizer``) on their exponent: the max over the real keys and their features, or with
  ``causal`` the first real key's max over its features (first in the sequence: over the
  chunks, then the devices' blocks in order); 0 where a row has no real key. A forward-only
  pass over the chunks (a constant for autodiff, as there)."""

  def top(carry, xs_c):
    xc, m = xs_c
    k = jnp.max(jnp.where(m[..., None, None], layer.exponent(xc, m), -jnp.inf), axis=4)
    if not causal:
      return carry, jnp.max(k, axis=2)  # [b, P, h]
    found, first = carry  # [b, P]: a real key seen; [b, P, h]: the first one's max
    here = jnp.take_along_axis(k, jnp.argmax(m, axis=2)[:, :, None, None], axis=2)[:, :, 0]
    return (found | jnp.any(m, axis=2), jnp.where(found[..., None], first, here)), None

  b, parts = xs[1].shape[1:3]
  heads = layer.cfg.num_heads
  init = (jnp.zeros((b, parts), bool), jnp.zeros((b, parts, heads), layer.state))
  carry, tops = jax.lax.scan(top, init if causal else None, xs)
  if causal:
    found, first = carry
    block = jnp.argmax(found, axis=1)[:, None, None]  # the first block with a real key
    m = jnp.where(jnp.any(found, axis=1)[:, None], jnp.take_along_axis(first, block, 1)[:, 0], 0)
  else:
    m = jnp.max(tops, axis=(0, 2))
  return jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m)))
