"""Causal linear attention by a serial scan over chunks (the "recurrent" mode).

Exact inside a chunk, a state carried from chunk to chunk by ``lax.scan``: one step per chunk,
``N / chunk`` steps in a row. Memory is one carried state ``[b, h, m, d]`` forward (plus the
per-chunk states the backward keeps); on a CPU it is the fastest form measured, on an
accelerator the serial steps leave the device idle (``fastpos.ops.linear_attn.chunk`` is the
chunkwise-parallel form of the same arithmetic, sharing the chunk steps defined here).

* ``_causal_plain`` / ``_causal_scan``: no decay, segments, key scales or separate denominator
  features; token-major chunks, normalised, with a written-out backward.
* ``_causal_chunked``: decay, segments (state reset), an entering carry; returns (num, den).
* ``_causal_running_max``: keys ``phi_k exp(s) + eps`` with a running-maximum reference.

Shapes as in ``fastpos.ops.attention`` (head-major ``[b, h, n, .]`` inside unless said).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fastpos.ops import toeplitz
from fastpos.ops.linear_attn.common import _guard


def _causal_chunked(phi_q, phi_k, v, chunk: int, log_decay=None, init=None, segment_ids=None):
  """Causal linear attention by chunks: exact inside a chunk, carried state between chunks.

  Head-major in and out: ``phi_q, phi_k [b, h, n, m]``, ``v [b, h, n, d]`` -> num
  ``[b, h, n, d]``, den ``[b, h, n]``. The sequence is zero-padded to ``g`` chunks (zero keys
  add nothing), moved chunk-major ``[g, b, h, chunk, .]`` once, and scanned chunk by chunk
  (``lax.scan``). The carry entering chunk g is the sum over earlier chunks of ``phi_k^T v``
  ``[b, h, m, d]`` and of ``phi_k`` ``[b, h, m]``; inside a chunk the scores
  ``phi_q phi_k^T`` ``[b, h, chunk, chunk]`` are masked to j <= i. Every product in the body
  is a batched matmul over contiguous ``[chunk, .]`` slabs, and the body is rematerialised in
  the backward pass (``jax.checkpoint``): the residuals are the carries, never a per-token
  ``[n, m, d]`` cumulative sum. (Measured on a 2-core CPU, the serial scan beat the fully
  parallel chunk form, all chunks' products batched plus a scan of states: the states
  ``[g, m, d]`` then travel through memory four times.)

  With ``log_decay`` (``[heads]``, g = log r <= 0) key j weighs r^(i-j) for query i, split as
  r^(i - start) (query side, inside its chunk) times r^(start - j) (the carried state, decayed
  by r^chunk per chunk): every exponent is <= 0, so nothing overflows. ``init``: the carry
  entering the first chunk (keys before the sequence, weighted r^(-j) for a key at j < 0),
  ``([b, h, m, d], [b, h, m])``; zeros when None.

  With ``segment_ids`` (``[b, n]`` int, contiguous segments; not with ``init``) the state
  resets at each segment start (``_segment_step``): inside a chunk the causal products are
  also masked to one segment; a query reads the carry only when its segment is the carry's
  (the segment of the previous chunk's last token); the carry leaving a chunk holds the keys
  of the chunk's last segment only (plus the old carry when that segment began earlier).
  """
  b, h, n, m = phi_k.shape
  d = v.shape[-1]
  dtype = phi_q.dtype
  g = -(-n // chunk)
  body = chunk_step(chunk, dtype, log_decay, segments=segment_ids is not None)
  if segment_ids is not None and init is not None:
    raise ValueError("_causal_chunked: segment_ids are not built with an init carry.")
  if init is None:
    init = (jnp.zeros((b, h, m, d), dtype), jnp.zeros((b, h, m), dtype))
  xs = tuple(split_chunks(a, chunk) for a in (phi_q, phi_k, v))
  if segment_ids is not None:
    init = init + (jnp.full((b,), -1, jnp.int32),)  # the carry's segment: none yet
    xs = xs + (_chunk_ids(segment_ids, g, chunk),)
  _, (num, den) = jax.lax.scan(jax.checkpoint(body), init, xs)
  return merge_chunks(num, n), merge_chunks(den, n)


def split_chunks(a, chunk: int, fill=0.0):
  """``[b, h, n, ...] -> [g, b, h, chunk, ...]``: zero-padded (``fill``) to ``g`` chunks and
  moved chunk-major."""
  b, h, n = a.shape[:3]
  g = -(-n // chunk)
  widths = ((0, 0), (0, 0), (0, g * chunk - n)) + ((0, 0),) * (a.ndim - 3)
  a = jnp.pad(a, widths, constant_values=fill)
  return jnp.moveaxis(a.reshape((b, h, g, chunk) + a.shape[3:]), 2, 0)


def merge_chunks(a, n: int):
  """``[g, b, h, chunk, ...] -> [b, h, n, ...]``, the inverse of ``split_chunks``."""
  g, b, h, chunk = a.shape[:4]
  return jnp.moveaxis(a, 0, 2).reshape((b, h, g * chunk) + a.shape[4:])[:, :, :n]


def chunk_step(chunk: int, dtype, log_decay=None, *, segments: bool = False):
  """The step of ``_causal_chunked``: ``body(carry, xs) -> (carry leaving the chunk, (num,
  den))`` on one chunk, ``carry = (kv [b, h, m, d], ks [b, h, m])`` (plus the carry's segment
  ``[b]`` int32 with ``segments``), ``xs = (q, k, v)`` ``[b, h, chunk, .]`` (plus the chunk's
  ids ``[b, chunk]``). The serial scan runs it chunk after chunk; the chunkwise-parallel form
  (``fastpos.ops.linear_attn.chunk``) maps it over all chunks at once, given every chunk's
  entering carry. The carry leaving is ``a * carry + (the chunk's own keys)``, with ``a`` the
  decay ``r^chunk`` times 0 where the chunk's last segment begins inside it."""
  mask = toeplitz.causal_mask(chunk)
  if log_decay is not None:
    t = jnp.arange(chunk, dtype=dtype)
    dist = jnp.maximum(t[:, None] - t[None, :], 0)
    intra = jnp.where(
        mask[None], jnp.exp(log_decay[:, None, None] * dist[None]), jnp.zeros((), dtype)
    )[
        None
    ]  # [1, h, chunk, chunk]
    # Keys weighted by r^(chunk - t) toward the end of their chunk; queries by r^t.
    k_w = jnp.exp(log_decay[:, None] * (chunk - t)[None, :])[None, :, :, None]
    q_w = jnp.exp(log_decay[:, None] * t[None, :])[None, :, :, None]
    step = jnp.exp(log_decay * chunk)[None, :, None]  # r^chunk per chunk, [1, h, 1]

  def body(carry, xs):
    kv, ks = carry[:2]  # [b, h, m, d], [b, h, m]
    q_c, k_c, v_c = xs[:3]  # [b, h, chunk, .]
    scores = jnp.einsum("bhim,bhjm->bhij", q_c, k_c)
    if log_decay is None:
      scores = jnp.where(mask, scores, jnp.zeros((), dtype))
      q_in, k_in = q_c, k_c
    else:
      scores = scores * intra
      q_in, k_in = q_c * q_w, k_c * k_w
      kv, ks = kv * step[..., None], ks * step
    seg = (carry[2], xs[3]) if segments else ()
    if seg:
      scores, q_in, k_in, kv, ks, new_seg = _segment_step(*seg, scores, q_in, k_in, kv, ks)
    num = jnp.einsum("bhim,bhmd->bhid", q_in, carry[0]) + jnp.einsum("bhij,bhjd->bhid", scores, v_c)
    den = jnp.einsum("bhim,bhm->bhi", q_in, carry[1]) + jnp.sum(scores, axis=-1)
    kv = kv + jnp.einsum("bhjm,bhjd->bhmd", k_in, v_c)
    ks = ks + jnp.sum(k_in, axis=2)
    return (kv, ks) + ((new_seg,) if seg else ()), (num, den)

  return body


def _chunk_ids(segment_ids, g: int, chunk: int):
  """``[b, n]`` segment ids -> ``[g, b, chunk]`` int32, the chunk padding as segment -1."""
  b, n = segment_ids.shape
  ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, g * chunk - n)), constant_values=-1)
  return jnp.moveaxis(ids.reshape(b, g, chunk), 1, 0)


def _segment_step(seg, ids, scores, q_in, k_in, kv, ks):
  """One chunk of the segment reset (``_causal_chunked``): ``seg [b]`` the carry's segment,
  ``ids [b, chunk]``. Returns the scores masked to one segment, the queries that read the
  carry (others zeroed), the keys of the chunk's last segment (others zeroed), the carry kept
  only when that segment began before the chunk, and the new carry's segment."""
  zero = jnp.zeros((), scores.dtype)
  last = ids[:, -1]  # [b]: the segment the carry leaving this chunk belongs to
  same = (ids[:, :, None] == ids[:, None, :])[:, None]  # [b, 1, chunk, chunk]
  scores = jnp.where(same, scores, zero)
  q_in = jnp.where((ids == seg[:, None])[:, None, :, None], q_in, zero)
  k_in = jnp.where((ids == last[:, None])[:, None, :, None], k_in, zero)
  keep = (seg == last)[:, None, None]
  return scores, q_in, k_in, jnp.where(keep[..., None], kv, zero), jnp.where(keep, ks, zero), last


def _causal_running_max(q, k, v, s, k_eps, chunk: int, segment_ids=None):
  """Causal linear attention with keys ``k_j exp(s_j) + k_eps_j``, head-major (``q, k
  [b, h, n, m]``, ``v [b, h, n, d]``, ``s, k_eps [b, h, n]``; s = -inf for padded keys).

  Query i weighs key j <= i by ``exp(s_j - R_i)`` with ``R_i = max(0, s_1..s_i)``, the running
  maximum (and the eps part by ``exp(-R_i)``): every exponent is <= 0. The carry holds the
  state relative to the reference at the chunk's start and is rescaled by
  ``exp(R_old - R_new) <= 1`` when the reference grows; inside a chunk the reference of each
  query is the cumulative maximum up to it (``lax.cummax``), so a later key changes nothing
  before it. The references are constants for autodiff (they cancel).

  With ``segment_ids`` ``[b, n]`` (contiguous segments) everything restarts at a segment start,
  the reference too: ``R_i`` is the running maximum over the keys of i's own segment, so a
  large key of one segment never shrinks the weights of the next (``_running_max_segments``)."""
  b, h, n, m = k.shape
  d = v.shape[-1]
  dtype = q.dtype
  g = -(-n // chunk)
  body = running_max_step(chunk, dtype, segments=segment_ids is not None)
  init = (
      jnp.zeros((b, h, m, d), dtype),
      jnp.zeros((b, h, m), dtype),
      jnp.zeros((b, h, d), dtype),
      jnp.zeros((b, h), dtype),
      jnp.zeros((b, h), dtype),
  )
  xs = tuple(split_chunks(a, chunk) for a in (q, k, v))
  xs = xs + (split_chunks(s, chunk, -jnp.inf), split_chunks(k_eps, chunk))
  if segment_ids is not None:
    init = init + (jnp.full((b,), -1, jnp.int32),)
    xs = xs + (_chunk_ids(segment_ids, g, chunk),)
  _, (num, den, ref) = jax.lax.scan(jax.checkpoint(body), init, xs)
  return merge_chunks(num, n), merge_chunks(den, n), merge_chunks(ref, n)


def running_max_step(chunk: int, dtype, *, segments: bool = False):
  """The step of ``_causal_running_max``: ``body(carry, xs) -> (carry leaving the chunk,
  (num, den, r))`` with ``carry = (kv [b, h, m, d], ks [b, h, m], ev [b, h, d], es [b, h],
  ref [b, h])`` (the keys' states relative to ``exp(ref)``, the eps parts' sums, the
  reference; plus the carry's segment ``[b]`` with ``segments``) and ``xs = (q, k, v, s,
  k_eps)`` of one chunk (plus its ids ``[b, chunk]``). Scanned by the serial path, mapped over
  all chunks at once by the chunkwise-parallel one (``fastpos.ops.linear_attn.chunk``)."""
  mask = toeplitz.causal_mask(chunk)
  tri = mask.astype(dtype)

  def body(carry, xs):
    kv, ks, ev, es, ref = carry[:5]  # [b,h,m,d], [b,h,m], [b,h,d], [b,h], [b,h]
    q_c, k_c, v_c, s_c, e_c = xs[:5]
    if not segments:
      r = jax.lax.stop_gradient(jnp.maximum(ref[..., None], jax.lax.cummax(s_c, axis=2)))
      seen, sees, mine = mask, None, None
    else:
      r, seen, sees, mine, new_seg = _running_max_segments(carry[5], xs[5], s_c, ref, mask)
    # The future's exponents can be large: masked before exp, so no inf meets a zero gradient.
    w = jnp.exp(jnp.where(seen, s_c[..., None, :] - r[..., :, None], -jnp.inf))
    scores = jnp.einsum("bhim,bhjm->bhij", q_c, k_c) * w
    # [b, h, chunk]: the carry's scale for each query (0 for a query outside its segment).
    lift = ref[..., None] - r
    old = jnp.exp(lift) if sees is None else jnp.where(sees, jnp.exp(jnp.minimum(lift, 0)), 0)
    eps_w = jnp.exp(-r) * jnp.sum(q_c, axis=-1)  # the eps part's scale times q . 1
    if sees is None:
      e_in = jnp.einsum("ij,bhj->bhi", tri, e_c)  # sum of eps over keys j <= i in the chunk
      e_v = jnp.einsum("ij,bhj,bhjd->bhid", tri, e_c, v_c)
      ev_in, es_in = ev[:, :, None], es[..., None]
    else:  # the same over the visible keys of i's segment; the carry's only if i reads it
      e_seen = jnp.where(seen, e_c[..., None, :], 0)  # [b, h, chunk, chunk]
      e_in, e_v = jnp.sum(e_seen, axis=-1), jnp.einsum("bhij,bhjd->bhid", e_seen, v_c)
      ev_in = jnp.where(sees[..., None], ev[:, :, None], 0)
      es_in = jnp.where(sees, es[..., None], 0)
    num = (
        old[..., None] * jnp.einsum("bhim,bhmd->bhid", q_c, kv)
        + jnp.einsum("bhij,bhjd->bhid", scores, v_c)
        + eps_w[..., None] * (ev_in + e_v)
    )
    den = (
        old * jnp.einsum("bhim,bhm->bhi", q_c, ks)
        + jnp.sum(scores, axis=-1)
        + eps_w * (es_in + e_in)
    )
    new = r[..., -1]
    if mine is None:
      k_w = k_c * jnp.exp(s_c - new[..., None])[..., None]
      shrink = jnp.exp(ref - new)
      e_w = e_c
    else:  # only the chunk's last segment travels on; the old carry only if it is that one
      k_w = k_c * jnp.exp(jnp.where(mine, s_c - new[..., None], -jnp.inf))[..., None]
      keep = (carry[5] == new_seg)[:, None]
      shrink = jnp.where(keep, jnp.exp(jnp.minimum(ref - new, 0)), 0)
      ev, es = ev * keep[..., None], es * keep
      e_w = jnp.where(mine, e_c, 0)
    kv = kv * shrink[..., None, None] + jnp.einsum("bhjm,bhjd->bhmd", k_w, v_c)
    ks = ks * shrink[..., None] + jnp.sum(k_w, axis=2)
    ev = ev + jnp.einsum("bhj,bhjd->bhd", e_w, v_c)
    es = es + jnp.sum(e_w, axis=-1)
    tail = (new_seg,) if segments else ()
    return (kv, ks, ev, es, new) + tail, (num, den, r)

  return body


def _running_max_segments(seg, ids, s_c, ref, mask):
  """The segment reset of ``_causal_running_max`` in one chunk: ``seg [b]`` the carry's
  segment, ``ids [b, chunk]``, ``s_c [b, h, chunk]``, ``ref [b, h]`` the carry's reference.
  Returns ``r [b, h, chunk]`` (each query's reference: max(0, its segment's keys so far)),
  ``seen [b, 1, chunk, chunk]`` (j <= i in i's segment), ``sees [b, 1, chunk]`` (the query
  reads the carry), ``mine [b, 1, chunk]`` (the key is in the chunk's last segment) and that
  segment."""
  seen = mask[None, None] & (ids[:, :, None] == ids[:, None, :])[:, None]
  sees = (ids == seg[:, None])[:, None]
  inside = jnp.max(jnp.where(seen, s_c[..., None, :], -jnp.inf), axis=-1)  # [b, h, chunk]
  base = jnp.where(sees, ref[..., None], 0.0)
  r = jax.lax.stop_gradient(jnp.maximum(base, jnp.maximum(inside, 0.0)))
  last = ids[:, -1]
  return r, seen, sees, (ids == last[:, None])[:, None], last


# The chunk of the plain causal path (``_causal_plain``) when none is given: fwd+bwd on a
# shared 2-core CPU (m = d = 64, 8 heads; chunks side by side in one run per N, not recorded)
# took 0.53x / 0.85x / 0.74x the Performer scan's time at chunk 32 / 16 / 64 (N = 4K), 0.59x /
# 1.05x at 32 / 64 (8K). The op at 32 is recorded in benchmarks/ops_lean.md.
CAUSAL_PLAIN_CHUNK = 32


def _causal_plain(phi_q, phi_k, v, chunk: int, eps: float):
  """Causal linear attention without rpe, decay, segments or separate denominator features,
  normalised and guarded: ``phi_q, phi_k [b, n, h, m]``, ``v [b, n, h, d]`` (token-major, as
  the layers pass them; padded keys already zeroed) -> ``[b, n, h, d]``.

  The sequence is zero-padded to ``g`` chunks and viewed chunk-major ``[g, b, chunk, h, .]``
  (a reshape, and for batch 1 no copy at all); ``_causal_scan`` runs over the chunks, its
  backward written out (``_causal_scan_bwd``)."""
  b, n, h, _ = phi_k.shape
  chunk = min(chunk, n)
  g = -(-n // chunk)

  def split(a):  # [b, n, h, e] -> [g, b, chunk, h, e]
    a = jnp.pad(a, ((0, 0), (0, g * chunk - n), (0, 0), (0, 0)))
    return jnp.swapaxes(a.reshape((b, g, chunk) + a.shape[2:]), 0, 1)

  out = _causal_scan(split(phi_q), split(phi_k), split(v), eps)
  return jnp.swapaxes(out, 0, 1).reshape((b, g * chunk) + out.shape[3:])[:, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _causal_scan(q, k, v, eps: float):
  """The chunked causal scan, chunk-major token-major: ``q, k [g, b, c, h, m]``,
  ``v [g, b, c, h, d]`` -> ``[g, b, c, h, d]``, normalised and guarded (``_guard``).

  Chunk t's queries read the carried state ``S = sum over earlier chunks of k^T v``
  ``[b, h, m, d]`` and ``s = sum of k`` ``[b, h, m]``, plus their own chunk's keys through the
  masked scores ``A = tril(q k^T)`` ``[b, h, c, c]``: ``num = q S + A v``,
  ``den = q s + A 1``, ``out = num / den``. Each chunk's products are small enough to stay in
  cache, and the body's layout copies stay inside it. The forward emits the states entering
  each chunk (residuals ``[g, b, h, m, d]``: N m d / c numbers, no recomputation); the
  backward (``_causal_scan_bwd``) is a reverse scan of nine such products per chunk."""
  return _causal_scan_fwd(q, k, v, eps)[0]


def _causal_scan_fwd(q, k, v, eps: float):
  mask = toeplitz.causal_mask(q.shape[2])

  def body(carry, xs):
    s_kv, s_k = carry  # [b, h, m, d], [b, h, m]
    q_c, k_c, v_c = xs  # [b, c, h, .]
    a = jnp.where(mask, jnp.einsum("bihm,bjhm->bhij", q_c, k_c), jnp.zeros((), q.dtype))
    num = jnp.einsum("bihm,bhmd->bihd", q_c, s_kv) + jnp.einsum("bhij,bjhd->bihd", a, v_c)
    den = jnp.einsum("bihm,bhm->bih", q_c, s_k) + jnp.swapaxes(jnp.sum(a, axis=-1), 1, 2)
    kept = jnp.abs(den) >= eps  # where the guard passes the denominator through
    den = _guard(den, eps)
    s_kv_next = s_kv + jnp.einsum("bjhm,bjhd->bhmd", k_c, v_c)
    ys = (num / den[..., None], den, kept, s_kv, s_k)
    return (s_kv_next, s_k + jnp.sum(k_c, axis=1)), ys

  b, _, h, m = q.shape[1:]
  init = (jnp.zeros((b, h, m, v.shape[-1]), q.dtype), jnp.zeros((b, h, m), q.dtype))
  _, (out, den, kept, s_kv, s_k) = jax.lax.scan(body, init, (q, k, v))
  return out, (q, k, v, out, den, kept, s_kv, s_k)


def _causal_scan_bwd(eps: float, res, g):
  """Chunks in reverse, carrying ``R = sum over later chunks of q^T g_num`` ``[b, h, m, d]``
  and ``r = q^T g_den`` ``[b, h, m]``. With ``g_num = g / den``, ``g_den = -(g . out) / den``
  (0 where the guard clamped) and ``B = tril(g_num v^T + g_den 1^T)``:
  ``g_q = g_num S^T + g_den s^T + B k``, ``g_k = B^T q + v R^T + r``,
  ``g_v = A^T g_num + k R``. No state is rebuilt by subtraction."""
  del eps
  mask = toeplitz.causal_mask(res[0].shape[2])
  zero = jnp.zeros((), g.dtype)

  def body(carry, xs):
    r_kv, r_k = carry
    q_c, k_c, v_c, out_c, den_c, kept_c, s_kv, s_k, g_c = xs
    g_num = g_c / den_c[..., None]
    g_den = jnp.where(kept_c, -jnp.sum(g_c * out_c, axis=-1), zero) / den_c  # [b, c, h]
    a = jnp.where(mask, jnp.einsum("bihm,bjhm->bhij", q_c, k_c), zero)
    bb = jnp.einsum("bihd,bjhd->bhij", g_num, v_c) + jnp.swapaxes(g_den, 1, 2)[..., None]
    bb = jnp.where(mask, bb, zero)
    g_q = (
        jnp.einsum("bihd,bhmd->bihm", g_num, s_kv)
        + g_den[..., None] * s_k[:, None]
        + jnp.einsum("bhij,bjhm->bihm", bb, k_c)
    )
    g_k = (
        jnp.einsum("bhij,bihm->bjhm", bb, q_c)
        + jnp.einsum("bjhd,bhmd->bjhm", v_c, r_kv)
        + r_k[:, None]
    )
    g_v = jnp.einsum("bhij,bihd->bjhd", a, g_num) + jnp.einsum("bjhm,bhmd->bjhd", k_c, r_kv)
    r_kv = r_kv + jnp.einsum("bihm,bihd->bhmd", q_c, g_num)
    return (r_kv, r_k + jnp.einsum("bihm,bih->bhm", q_c, g_den)), (g_q, g_k, g_v)

  s_kv, s_k = res[-2:]
  init = (jnp.zeros_like(s_kv[0]), jnp.zeros_like(s_k[0]))
  _, grads = jax.lax.scan(body, init, res + (g,), reverse=True)
  return grads


_causal_scan.defvjp(_causal_scan_fwd, _causal_scan_bwd)
