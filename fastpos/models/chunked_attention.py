"""The attention layer's token-wise part over chunks of the sequence (``model.attn_chunk``).

A bidirectional linear-attention layer is token-wise except for two sums over the keys:
``S = sum_j phi(k_j) v_j^T`` and ``z = sum_j phi(k_j)``. ``attend`` computes the layer in two
passes over chunks of C tokens, each a ``lax.scan`` whose body is rematerialised:

1. keys and values of the chunk (projections, masks, phi(k)) -> S and z accumulated; v kept
   (the ``output`` hooks, e.g. FastRPB's ``W V``, mix values over the whole sequence);
2. the ``output`` hooks' terms on the whole ``v``, then queries of the chunk (projection, phi(q))
   against S and z, plus the terms, through the output projection.

The backward pass holds one chunk's projections and features at a time instead of the whole
sequence's (about ten width-D arrays per token in the train step of the LRA Text model),
and keeps the inputs, v, the terms and the small states. The same function as the unchunked
layer: the same parameters, masks and key stabiliser (sikf's max over all real keys, found by
a forward-only pass over the chunks), summed in another order (round-off only).

With the sequence split over the mesh axis ``seq`` (P devices, the global view of
``fastpos.models.context_parallel``) every device chunks its own block: the scans run over
chunk index k holding ``[b, P, C, .]``, and the states are summed over P after the first pass
(one all-reduce).

What is built (``problem`` says why not otherwise): linear kernels whose key features act on
each key alone, and sikf; bidirectional 1D layers whose schemes act at the ``output`` hook
only (FastRPB; ``embed`` schemes run in the model's Tower). Not built: causal layers (their
prefix state would have to cross the chunks and devices in order), 2D grids, feature maps
whose key stabiliser spans the sequence other than sikf's (favor, orf), schemes at the
``features``, ``logits`` or ``kv`` hooks, packed batches.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

# The hooks a chunked layer runs (``embed`` schemes never reach the layer).
CHUNKED_HOOKS = ("output", "embed")
# Key feature maps whose arguments do not tie a key to others (``FeatureMap.reads``).
_PER_TOKEN_READS = frozenset({"projection", "nu"})


def check_chunk(value) -> int:
  """``attn_chunk`` checked: an int >= 0 (0: the layer runs on the whole sequence at once)."""
  if not isinstance(value, int) or isinstance(value, bool) or value < 0:
    raise ValueError(
        f"attn_chunk must be an int >= 0 (0: the attention layer runs on the whole sequence at "
        f"once); got {value!r}."
    )
  return value


def problem(kernel, scheme_classes, *, causal: bool, two_d: bool) -> str | None:
  """None when a layer with ``kernel`` (a ``fastpos.ops.features.Kernel``) and the scheme
  classes ``scheme_classes`` runs by chunks, else why not (one phrase)."""
  if kernel.is_softmax:
    return "kernel 'softmax' materialises the N x N scores (chunking is for linear kernels)"
  if causal:
    return "causal layers are not built by chunks (their prefix state would cross the chunks)"
  if two_d:
    return "2D grids are not built by chunks (set model.use_grid=False for a raster sequence)"
  if kernel.name != "sikf" and not set(kernel.map.reads) <= _PER_TOKEN_READS:
    return (
        f"kernel {kernel.name!r} stabilises its key features over the whole sequence, which "
        "is built by chunks for sikf only (and for maps acting on each key alone)"
    )
  for cls in scheme_classes:
    other = [hk for hk in cls.hooks if hk not in CHUNKED_HOOKS]
    if other:
      return (
          f"positional scheme {cls.scheme_name!r} acts at the {other[0]!r} hook (chunked layers "
          f"run schemes at the output hook only)"
      )
  return None


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


def attend(
    x,
    mask,
    *,
    cfg,
    params,
    dtype: Any,
    terms: Callable,
    projection,
    chunk: int,
    parts: int,
    tail: Callable | None = None,
):
  """The layer's output ``[b, N, D]`` of ``x [b, N, D]`` by chunks of ``chunk`` tokens.

  mask: ``[b, N]`` bool or None. cfg: the layer's ``AttentionConfig`` (``problem`` None).
  params: the layer's parameters (``query``, ``key``, ``value``, ``out``, as the unchunked
  layer's ``nn.DenseGeneral``). terms: ``v [b, N, h, d] -> [terms [b, N, h, d]]``, the
  ``output`` hooks on the masked values. projection: the kernel's random projection or None.
  parts: P, the devices the sequence is split over. tail: None, or a token-wise
  ``fn(pos, x_chunk, y_chunk) -> [b, P, C, D']`` run on each chunk of the layer's output y in
  the second pass (the block's token-wise part: then the result is its output, and neither
  y nor a second chunk loop is stored); ``pos`` int32 ``[1, P, C, 1]``: the tokens'
  positions (>= N: padding), as ``fastpos.models.tokenwise.map_chunks`` gives them."""
  b, n, width = x.shape
  kernel, eps = cfg.kernel, cfg.kernel.eps
  state = jnp.promote_types(dtype, jnp.float32)  # feature maps and sums: float32 at least
  # Promoted once, outside the chunk loops: a float64 model sums its float32 parameters'
  # gradients over the chunks in float64, as the whole-sequence dot does.
  p = jax.tree.map(lambda a: a.astype(jnp.promote_types(a.dtype, dtype)), params)

  def dense(name, features, axis=-1):
    module = nn.DenseGeneral(features, axis=axis, dtype=dtype, parent=None)
    return functools.partial(module.apply, {"params": p[name]})

  heads = (cfg.num_heads, cfg.head_dim)
  query, key, value = dense("query", heads), dense("key", heads), dense("value", heads)
  out_proj = dense("out", width, axis=(-2, -1))
  real = jnp.ones((b, n), bool) if mask is None else mask
  xs = (_split(x, parts, chunk), _split(real, parts, chunk))  # padding: mask False

  def prepared(t, m):  # hooks._linear's preparation of q and k: float32+, scaled, padded zero
    t = t.astype(state)
    if kernel.estimates_softmax:
      t = t * cfg.head_dim**-0.25
    return jnp.where(m[..., None, None], t, jnp.zeros((), state))

  stab = _key_stabiliser(xs, key, prepared) if kernel.name == "sikf" else None

  def key_features(k, m):  # [b, P, C, h, d] -> [b, P, C, h, m], padded keys zero
    if stab is None:
      fk = kernel.phi(_flat(k), projection=projection, is_query=False).reshape(
          k.shape[:3] + (cfg.num_heads, -1)
      )
    else:
      fk = jnp.exp(k - stab[:, None, None, :, None])
    return jnp.where(m[..., None, None], fk.astype(state), jnp.zeros((), state))

  @jax.checkpoint
  def sums(carry, xs_c):
    xc, m = xs_c
    v = value(xc)
    v = jnp.where(m[..., None, None], v, jnp.zeros((), v.dtype))
    fk = key_features(prepared(key(xc), m), m)
    kv = carry[0] + jnp.einsum("bpchm,bpchd->bphmd", fk, v.astype(state))
    return (kv, carry[1] + jnp.sum(fk, axis=2)), v

  m_dim = kernel.feature_dim(cfg.head_dim)
  init = (
      jnp.zeros((b, parts, cfg.num_heads, m_dim, cfg.head_dim), state),
      jnp.zeros((b, parts, cfg.num_heads, m_dim), state),
  )
  (kv, ks), v = jax.lax.scan(sums, init, xs)
  kv, ks = jnp.sum(kv, axis=1), jnp.sum(ks, axis=1)  # over the devices' blocks
  extra = tuple(_split(t, parts, chunk) for t in terms(_merge(v, n)))

  starts = jnp.arange(parts, dtype=jnp.int32)[None, :, None, None] * -(-n // parts)
  offsets = jnp.arange(chunk, dtype=jnp.int32)[None, None, :, None]

  @jax.checkpoint
  def outputs(index, xc, m, *ts):
    q = prepared(query(xc), m)
    fq = kernel.phi(_flat(q), projection=projection, is_query=True, mask=_flat(m))
    fq = fq.astype(state).reshape(q.shape[:3] + (cfg.num_heads, -1))
    num = jnp.einsum("bpchm,bhmd->bpchd", fq, kv)
    den = jnp.einsum("bpchm,bhm->bpch", fq, ks)
    out = (num / _guard(den, eps)[..., None]).astype(dtype)
    for t in ts:
      out = out + t.astype(out.dtype)
    y = out_proj(out.astype(dtype))
    return y if tail is None else tail(starts + index * chunk + offsets, xc, y)

  steps = jnp.arange(xs[0].shape[0], dtype=jnp.int32)
  _, y = jax.lax.scan(lambda c, a: (c, outputs(*a)), None, (steps,) + xs + extra)
  return _merge(y, n)


def _key_stabiliser(xs, key, prepared):
  """sikf's key stabiliser ``[b, h]``: the max over the real keys and their features (0 where
  a row has none), as ``fastpos.ops.features.sikf`` takes it; a forward-only pass over the
  chunks (a constant for autodiff, as there)."""

  def top(_, xs_c):
    xc, m = xs_c
    k = prepared(key(xc), m)
    k = jnp.where(m[..., None, None], k, -jnp.inf)
    return None, jnp.max(k, axis=(2, 4))  # [b, P, h]

  _, tops = jax.lax.scan(top, None, xs)
  m = jnp.max(tops, axis=(0, 2))
  return jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m)))
