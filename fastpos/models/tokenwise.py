"""A block's token-wise part over chunks of the sequence (``model.mlp_chunk``).

After its attention, a block acts on each token alone: dropout, residual, LayerNorm, the MLP
(``[C, mlp_dim]`` hidden) and again. ``map_chunks`` runs such a function over chunks of
``chunk`` tokens in a ``lax.scan`` whose body is rematerialised, so that the backward pass
holds one chunk's hidden activations and dropout bits instead of the whole sequence's (at
width 256 and MLP 1024, about 25 KiB per token). With the sequence split over the mesh axis
``seq`` (P devices, the global view of ``fastpos.models.context_parallel``), every device
chunks its own block of positions: the scan runs over chunk index k, each step holding
``[b, P, C, .]``, P split over the devices.

The dropout masks are the unchunked ones, drawn by slice: ``bernoulli_at`` gives the entries
of ``jax.random.bernoulli(key, p, shape)`` at given indices without drawing the rest
(threefry in its partitionable form keys each entry by its flat index), so a chunked block
computes the same function as the unchunked one, masks included.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

_U32 = jnp.uint32


def _add_2x32(hi, lo, v):
  """``(hi, lo) + v`` in 64-bit arithmetic on uint32 halves (``v`` uint32)."""
  s = lo + v
  return hi + (s < lo).astype(_U32), s


def mul_add_2x32(a, m: int, c):
  """``a * m + c`` as 64-bit ``(hi, lo)`` uint32 halves: ``a``, ``c`` uint32 arrays
  (broadcastable), ``m`` a static int in [0, 2**32). 16-bit partial products, so that no
  uint64 (absent without ``jax_enable_x64``) is needed."""
  if not 0 <= m < 2**32:
    raise ValueError(f"mul_add_2x32: m must be in [0, 2**32); got {m}.")
  a = jnp.asarray(a, _U32)
  m1, m0 = _U32(m >> 16), _U32(m & 0xFFFF)
  a1, a0 = a >> 16, a & 0xFFFF
  mid1, mid2 = a0 * m1, a1 * m0
  hi, lo = _add_2x32(a1 * m1 + (mid1 >> 16), a0 * m0, mid1 << 16)
  hi, lo = _add_2x32(hi + (mid2 >> 16), lo, mid2 << 16)
  return _add_2x32(hi, lo, jnp.asarray(c, _U32))


def _key_words(key):
  """The two uint32 words of a threefry key (typed or raw); other generators raise."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    impl = str(jax.random.key_impl(key))
    data = jax.random.key_data(key)
  else:
    impl, data = jax.config.jax_default_prng_impl, key
  if "threefry2x32" not in impl or not jax.config.jax_threefry_partitionable:
    raise ValueError(
        f"dropout masks drawn by slice (model.mlp_chunk > 0 with dropout) need the threefry2x32 "
        f"generator in its partitionable form (jax_threefry_partitionable=True); got {impl!r} "
        f"with jax_threefry_partitionable={jax.config.jax_threefry_partitionable}: set "
        "model.mlp_chunk=0 or use that generator."
    )
  return data[0], data[1]


def _uniform_from_words(b1, b2, dtype):
  """``jax.random.uniform``'s floats in [0, 1) from threefry's two output words."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float64:
    bits = (b1.astype(jnp.uint64) << 32) | b2.astype(jnp.uint64)
    one = np.array(1.0, np.float64).view(np.uint64)
    shift = 64 - 52
  elif dtype == jnp.float32:
    bits = b1 ^ b2
    one = np.array(1.0, np.float32).view(np.uint32)
    shift = 32 - 23
  else:
    raise ValueError(f"bernoulli_at: probability dtype {dtype} is not float32 or float64.")
  floats = jax.lax.bitcast_convert_type((bits >> shift) | one, dtype) - jnp.array(1.0, dtype)
  return jnp.maximum(jnp.array(0.0, dtype), floats)


def bernoulli_at(key, p: float, shape: Sequence[int], index: Sequence) -> jax.Array:
  """``jax.random.bernoulli(key, p, shape)[index]`` without drawing the other entries.

  ``index``: one integer array per axis of ``shape`` (broadcastable together; entries in
  range); the result has their broadcast shape. Exact (the same bits) for the threefry2x32
  generator with ``jax_threefry_partitionable`` (JAX's default), which draws entry i from
  threefry(key, i) with i its row-major flat index; any other generator raises ValueError.
  ``p`` a Python float, as ``nn.Dropout`` passes it."""
  if len(index) != len(shape):
    raise ValueError(f"bernoulli_at: {len(index)} index arrays for a {len(shape)}-d shape.")
  if math.prod(shape) >= 2**64:
    raise ValueError(f"bernoulli_at: shape {tuple(shape)} has 2**64 entries or more.")
  k1, k2 = _key_words(key)
  # Flat index = (..(i0 * s1 + i1) * s2 + ..): the leading axes as one uint32 row, then 64-bit.
  lead = math.prod(shape[:-1])
  if lead >= 2**32 or shape[-1] >= 2**32:
    raise ValueError(f"bernoulli_at: shape {tuple(shape)} has 2**32 rows or columns or more.")
  row = jnp.zeros((), _U32)
  for i, n in zip(index[:-1], shape[:-1]):
    row = row * _U32(n) + jnp.asarray(i).astype(_U32)
  hi, lo = mul_add_2x32(row, shape[-1], jnp.asarray(index[-1]).astype(_U32))
  hi, lo = jnp.broadcast_arrays(hi, lo)
  b1, b2 = threefry2x32_p.bind(k1, k2, hi, lo)
  dtype = jax.dtypes.canonicalize_dtype(jnp.float64)  # what bernoulli makes of a Python float
  return _uniform_from_words(b1, b2, dtype) < jnp.asarray(p, dtype)


def check_chunk(value) -> int:
  """``model.mlp_chunk`` checked: an int >= 0 (0: no chunking); raises ValueError."""
  if not isinstance(value, int) or isinstance(value, bool) or value < 0:
    raise ValueError(
        f"model.mlp_chunk must be an int >= 0 (0: the block's token-wise part runs on the whole "
        f"sequence at once); got {value!r}."
    )
  return value


def map_chunks(fn: Callable, arrays: Sequence, chunk: int, parts: int = 1):
  """``fn`` applied to chunks of ``chunk`` tokens of ``arrays``, each rematerialised.

  arrays: ``[b, N, d_i]``, acted on token by token by ``fn(pos, *chunks) -> [b, P, C, d]``
  where ``chunks`` are ``[b, P, C, d_i]`` and ``pos`` int32 ``[1, P, C, 1]`` holds the tokens'
  positions in [0, N) (positions >= N are padding, and their outputs are dropped). ``parts``:
  P, the devices the sequence is split over; each runs its own block of ceil(N / P)
  positions in chunks (padded up to a multiple of ``chunk``). Returns ``[b, N, d]``. The
  backward pass keeps the inputs only and recomputes ``fn`` chunk by chunk."""
  b, n = arrays[0].shape[:2]
  block = -(-n // parts)
  count = -(-block // chunk)

  def split(a):
    a = jnp.pad(a, ((0, 0), (0, parts * block - n), (0, 0)))
    a = a.reshape(b, parts, block, a.shape[-1])
    a = jnp.pad(a, ((0, 0), (0, 0), (0, count * chunk - block), (0, 0)))
    return jnp.moveaxis(a.reshape(b, parts, count, chunk, a.shape[-1]), 2, 0)

  starts = jnp.arange(parts, dtype=jnp.int32)[None, :, None, None] * block
  offsets = jnp.arange(chunk, dtype=jnp.int32)[None, None, :, None]

  @jax.checkpoint
  def body(k, chunks):
    return fn(starts + k * chunk + offsets, *chunks)

  _, out = jax.lax.scan(
      lambda c, xs: (c, body(xs[0], xs[1:])),
      None,
      (jnp.arange(count, dtype=jnp.int32), *map(split, arrays)),
  )
  out = jnp.moveaxis(out, 0, 2).reshape(b, parts, count * chunk, out.shape[-1])[:, :, :block]
  return out.reshape(b, parts * block, out.shape[-1])[:, :n]
