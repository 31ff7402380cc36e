"""Causal linear attention, chunkwise-parallel (the "chunk" mode).

The arithmetic of the serial scan (``fastpos.ops.linear_attn.recurrent``), reordered so that
nothing runs chunk after chunk:

1. every chunk's own state (the sums ``phi_k^T v`` ``[g, b, h, m, d]`` and ``phi_k``
   ``[g, b, h, m]`` over its keys, as the chunk would leave them from a zero carry) in one
   batched pass over all ``g`` chunks;
2. the state entering each chunk, the exclusive prefix of those states, by
   ``jax.lax.associative_scan`` (``jnp.cumsum`` when plain): O(log g) batched levels;
3. every chunk's outputs at once: the masked in-chunk scores ``phi_q phi_k^T``
   ``[g, b, h, chunk, chunk]`` times v, plus each query against its chunk's entering state.

Steps 1 and 3 run the serial path's own chunk step (``recurrent.chunk_step``,
``recurrent.running_max_step``) mapped over the chunk axis (``jax.vmap``), so decay, segment
resets and the running-maximum key stabiliser mean here exactly what they mean there. Step 2
combines chunk summaries with an associative operator:

* plain / decay / segments: a chunk passes the entering state on as ``a * S_in + S_own``,
  with ``a = r^chunk`` (the decay, 1 without) times 0 where the chunk's last segment begins
  inside it (a reset). Pairs combine as ``(a1, S1) . (a2, S2) = (a1 a2, a2 S1 + S2)``; every
  factor is in (0, 1], no ``r^-i`` ever appears.
* key stabiliser (``key_log_scale``): states are held relative to ``exp(M)``, M the running
  maximum of the key scales (>= 0); pairs combine as flash attention's online softmax,
  ``(M1, S1) . (M2, S2) = (M, S1 exp(M1 - M) + S2 exp(M2 - M))`` with ``M = max(M1, M2)``
  (only ``S2`` and ``M2`` after a reset): every exponent is <= 0, nothing is divided by a
  large exponent, and each query's reference is the maximum over the keys up to it (its own
  segment's), so no query's scale depends on a later key.

No loop runs N / chunk steps: compiled forward and backward have no while loop longer than
O(1) (tests check the optimized HLO at N = 16K). Memory: unlike the serial scan (one carried
state), this form holds every chunk's state ``[g, b, h, m, d]`` (N m d / chunk numbers per
(batch, head), plus the associative scan's levels) and the in-chunk scores
``[g, b, h, chunk, chunk]`` at once, fwd and bwd.

Head-major in and out, the contract of ``recurrent._causal_chunked`` /
``recurrent._causal_running_max``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fastpos.ops.linear_attn import recurrent


def _exclusive(incl, zero):
  """The inclusive prefix ``[g, ...]`` shifted one chunk later, ``zero`` entering chunk 0."""
  return jnp.concatenate([jnp.broadcast_to(zero, (1,) + incl.shape[1:]), incl[:-1]], axis=0)


def _segment_flow(segment_ids, g: int, chunk: int):
  """The chunks' ids ``[g, b, chunk]``, the segment of the carry entering each chunk ``[g, b]``
  (the previous chunk's last token's, -1 for the first) and whether the carry survives the
  chunk ``[g, b]`` (the chunk's last segment is the entering one)."""
  ids = recurrent._chunk_ids(segment_ids, g, chunk)
  last = ids[:, :, -1]
  seg_in = _exclusive(last, jnp.full((), -1, jnp.int32))
  return ids, seg_in, seg_in == last


def causal_chunked(phi_q, phi_k, v, chunk: int, log_decay=None, segment_ids=None):
  """Causal (num, den), chunkwise-parallel; the contract of ``recurrent._causal_chunked``.

  Args:
    phi_q, phi_k: ``[b, h, n, m]`` features (padded keys already zeroed), float32/float64.
    v: ``[b, h, n, d]``.
    chunk: the chunk length (n need not be a multiple: the tail is zero-padded).
    log_decay: optional ``[h]`` log r <= 0: key j weighs ``r^(i-j)`` for query i.
    segment_ids: optional ``[b, n]`` int (contiguous segments): the state resets at a
      segment start.

  Returns:
    num ``[b, h, n, d]`` and den ``[b, h, n]``, unnormalised.
  """
  b, h, n, m = phi_k.shape
  d = v.shape[-1]
  dtype = phi_q.dtype
  g = -(-n // chunk)
  segments = segment_ids is not None
  body = jax.vmap(recurrent.chunk_step(chunk, dtype, log_decay, segments=segments))
  xs = tuple(recurrent.split_chunks(a, chunk) for a in (phi_q, phi_k, v))
  zeros = (jnp.zeros((g, b, h, m, d), dtype), jnp.zeros((g, b, h, m), dtype))
  seg = ()
  factor = None  # a [g, b, h] (None: 1)
  if log_decay is not None:
    factor = jnp.broadcast_to(jnp.exp(log_decay * chunk)[None, None], (g, b, h))
  if segments:
    ids, seg_in, keep = _segment_flow(segment_ids, g, chunk)
    xs, seg = xs + (ids,), (seg_in,)
    kept = jnp.broadcast_to(keep[..., None], (g, b, h)).astype(dtype)
    factor = kept if factor is None else factor * kept
  own = body(zeros + seg, xs)[0][:2]  # each chunk's keys alone: [g, b, h, m, d], [g, b, h, m]
  if factor is None:
    incl = tuple(jnp.cumsum(s, axis=0) for s in own)
  else:

    def combine(x, y):
      (a1, kv1, ks1), (a2, kv2, ks2) = x, y
      return a1 * a2, a2[..., None, None] * kv1 + kv2, a2[..., None] * ks1 + ks2

    incl = jax.lax.associative_scan(combine, (factor,) + own, axis=0)[1:]
  carry = tuple(_exclusive(s, jnp.zeros((), dtype)) for s in incl)
  num, den = body(carry + seg, xs)[1]
  return recurrent.merge_chunks(num, n), recurrent.merge_chunks(den, n)


def causal_running_max(q, k, v, s, k_eps, chunk: int, segment_ids=None):
  """Causal linear attention with keys ``k exp(s) + k_eps`` against a running-maximum
  reference, chunkwise-parallel; the contract of ``recurrent._causal_running_max``.

  Args:
    q, k: ``[b, h, n, m]``; v: ``[b, h, n, d]``; s, k_eps: ``[b, h, n]`` (s = -inf and
      k_eps = 0 for padded keys).
    chunk: the chunk length.
    segment_ids: optional ``[b, n]`` int (contiguous segments): states and reference restart.

  Returns:
    num ``[b, h, n, d]``, den ``[b, h, n]`` (both relative to ``exp(ref)``) and ref
    ``[b, h, n]``, each query's reference ``max(0, s_j)`` over the keys j <= i it sees.
  """
  b, h, n, m = k.shape
  d = v.shape[-1]
  dtype = q.dtype
  g = -(-n // chunk)
  segments = segment_ids is not None
  body = jax.vmap(recurrent.running_max_step(chunk, dtype, segments=segments))
  split = recurrent.split_chunks
  xs = tuple(split(a, chunk) for a in (q, k, v)) + (split(s, chunk, -jnp.inf), split(k_eps, chunk))
  zeros = (
      jnp.zeros((g, b, h, m, d), dtype),
      jnp.zeros((g, b, h, m), dtype),
      jnp.zeros((g, b, h, d), dtype),
      jnp.zeros((g, b, h), dtype),
      jnp.zeros((g, b, h), dtype),
  )
  seg = ()
  keep = jnp.ones((g, b, h), bool)
  if segments:
    ids, seg_in, kept = _segment_flow(segment_ids, g, chunk)
    xs, seg = xs + (ids,), (seg_in,)
    keep = jnp.broadcast_to(kept[..., None], (g, b, h))
  # Each chunk alone (entering carry zero, reference 0): its states relative to exp(M), M its
  # keys' maximum (>= 0; the chunk's last segment's with segments), and its eps sums.
  kv, ks, ev, es, top = body(zeros + seg, xs)[0][:5]

  def combine(x, y):
    (k1, m1, kv1, ks1, ev1, es1), (k2, m2, kv2, ks2, ev2, es2) = x, y
    top = jax.lax.stop_gradient(jnp.where(k2, jnp.maximum(m1, m2), m2))
    w1 = jnp.where(k2, jnp.exp(jnp.minimum(m1 - top, 0)), 0)  # the earlier part, if it survives
    w2 = jnp.exp(jnp.minimum(m2 - top, 0))
    k2f = k2.astype(dtype)
    return (
        k1 & k2,
        top,
        w1[..., None, None] * kv1 + w2[..., None, None] * kv2,
        w1[..., None] * ks1 + w2[..., None] * ks2,
        k2f[..., None] * ev1 + ev2,
        k2f * es1 + es2,
    )

  _, top, kv, ks, ev, es = jax.lax.associative_scan(combine, (keep, top, kv, ks, ev, es), axis=0)
  carry = tuple(_exclusive(a, jnp.zeros((), dtype)) for a in (kv, ks, ev, es, top))
  num, den, ref = body(carry + seg, xs)[1]
  return tuple(recurrent.merge_chunks(a, n) for a in (num, den, ref))
