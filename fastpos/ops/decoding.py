"""Attention for L new tokens against a decoding state: pure ``jax.numpy`` (the state is an
argument; ``fastpos.models.decoding`` keeps it in Flax's ``cache`` collection).

Positions are slots: the new tokens sit at ``offset .. offset+L-1`` and see every earlier real
slot (``real`` False marks padding, which contributes nothing). Three forms:

* ``softmax_step``: exact softmax over a key / value cache ``[b, T, ...]``: O(T) per token.
* ``linear_step``: causal linear attention (optionally with a decay r^(i-j)) from a recurrent
  state ``sum_j phi(k_j) v_j^T`` ``[b, h, m, d]`` and ``sum_j phi(k_j)`` ``[b, h, m]``: O(1) per
  token, nothing grows with T. It is ``_causal_chunked``'s chunk step (fastpos.ops.attention)
  with the block as the chunk.
* ``linear_cached_step``: linear attention whose weights c_{j-i} are a general relative table
  (kernelized RPE): the weight of every past key changes as the query moves, so there is no
  fixed-size state; caches phi(k_j) and v_j (not their [m, d] outer product): O(T (m + d)).

Stabilised feature maps (``Kernel.stabilised``: ``sikf``, ``favor``, ``orf``) scale every key's
features by one shared exp(-c); in a causal layer c is the first real key's max
(``features._stabilizer``), which every query sees. ``key_parts`` splits phi(k_j) = e_j
exp(s_j - c) + eps_add (s_j the token's own max), and the steps take c from the first real
key they see and keep it, so a step equals the full causal forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fastpos.ops import features as feature_ops
from fastpos.ops.attention import _guard


def key_parts(kernel: "str | feature_ops.Kernel", k, *, projection=None, nu: int = 1):
  """``(e [b, L, h, m], s [b, L, h], eps_add)`` with the layer's key features
  ``phi(k_j) = e_j exp(s_j - c) + eps_add`` for the shared stabiliser c, for kernels whose keys
  share one (``Kernel.stabilised``); for the others ``s = 0``, ``eps_add = 0`` and
  ``e = phi(k)``. ``kernel``: a name or the record."""
  kernel = feature_ops.get_kernel(kernel)
  if not kernel.stabilised:
    e = feature_ops.feature_map(kernel, k, projection=projection, is_query=False, nu=nu)
    return e, jnp.zeros(e.shape[:3], e.dtype), 0.0
  _, e, top = feature_ops.exp_parts(kernel, k, projection)
  return e, top[..., 0], kernel.map.exp_form.eps


def _pos_weights(log_decay, exponents, dtype):
  """``r^exponents`` per head: ``exponents [...]`` -> ``[h, ...]`` (ones without a decay)."""
  if log_decay is None:
    return None
  shape = (-1,) + (1,) * jnp.ndim(exponents)
  return jnp.exp(log_decay.astype(dtype).reshape(shape) * exponents[None].astype(dtype))


def _prefix_scale(s, real, prev, seen):
  """Per query i: c_i = the first real key's s (``prev`` if one was seen before this block,
  else s_j of the block's first real j <= i) ``[b, L, h]`` (0 where no key has been seen;
  every weight is then 0 anyway), and whether any was seen ``[b, L, h]``."""
  first = jnp.argmax(real, axis=1)  # [b]
  s_first = jnp.take_along_axis(s, first[:, None, None], axis=1)  # [b, 1, h]
  here = jnp.cumsum(real.astype(jnp.int32), axis=1) > 0  # [b, L]
  c = jnp.where(seen[:, None, None], prev[:, None, :], jnp.where(here[:, :, None], s_first, 0.0))
  any_ = jnp.broadcast_to((seen[:, None] | here)[:, :, None], c.shape)
  return c, any_


def linear_step(state, fq, dq, key, v, real, *, log_decay=None, eps: float = 1e-6):
  """L new tokens of causal linear attention from the recurrent state.

  Args:
    state: dict ``num_a [b, h, mq, d]``, ``num_b`` (same, or None without eps_add),
      ``den_a [b, h, md]``, ``den_b`` (or None), ``scale [b, h]`` (the c the ``_a`` sums are
      taken at), ``seen [b]`` bool (a real key has been added).
    fq: ``[b, L, h, mq]`` numerator query features (after the features hooks); dq: the
      denominator's ``[b, L, h, md]`` (``fq`` when no hook changes signs).
    key: dict ``num_a``, ``num_b`` ``[b, L, h, mq]``, ``den_a``, ``den_b`` ``[b, L, h, md]``
      (``_b`` None without eps_add): the key features split as ``a exp(s - c) + b`` (the
      hooks are linear, so they map both parts), and ``s [b, L, h]``.
    v: ``[b, L, h, d]``; real: ``[b, L]`` bool; log_decay: ``[h]`` log r or None.

  Returns ``(out [b, L, h, d], new state)``.
  """
  dtype = state["num_a"].dtype
  b, n, h, _ = fq.shape
  fq, dq, v = fq.astype(dtype), dq.astype(dtype), v.astype(dtype)
  c, any_ = _prefix_scale(key["s"].astype(dtype), real, state["scale"], state["seen"])
  i = jnp.arange(n)
  tri = (i[None, :] <= i[:, None])[None, None]  # [1, 1, L(i), L(j)]
  vis = tri & real[:, None, None, :]  # [b, 1, i, j]
  ct = jnp.transpose(c, (0, 2, 1))  # [b, h, L]
  st = jnp.transpose(key["s"].astype(dtype), (0, 2, 1))
  # Intra-block weight of key j for query i: exp(s_j - c_i) r^(i-j); old state: exp(c_old -
  # c_i) r^(i+1) (c_old = c_i once a key was seen).
  lw = st[:, :, None, :] - ct[:, :, :, None]
  w_b = jnp.where(vis, 1.0, 0.0)
  if log_decay is not None:
    log_rel = (
        log_decay.astype(dtype)[:, None, None]
        * jnp.maximum(i[:, None] - i[None, :], 0).astype(dtype)[None]
    )  # [h, i, j]
    lw = lw + log_rel[None]
    w_b = jnp.where(vis, jnp.exp(log_rel)[None], 0.0)
  w_a = jnp.where(vis, jnp.exp(jnp.where(vis, lw, 0.0)), 0.0)
  prev = jnp.where(state["seen"][:, None], state["scale"], 0.0)  # [b, h]
  old = jnp.where(state["seen"][:, None, None], jnp.exp(prev[:, :, None] - ct), 0.0)  # [b,h,L]
  step = _pos_weights(log_decay, i + 1, dtype)  # [h, L]
  if step is not None:
    old = old * step[None]

  def contract(qf, a_key, b_key, a_state, b_state, vals):
    """sum over the visible keys of phi_q . phi_k (times vals), old state included."""
    sc = w_a * jnp.einsum("bihm,bjhm->bhij", qf, a_key.astype(dtype))
    if b_key is not None:
      sc = sc + w_b * jnp.einsum("bihm,bjhm->bhij", qf, b_key.astype(dtype))
    if vals is None:
      total = jnp.sum(sc, axis=-1) + old * jnp.einsum("bihm,bhm->bhi", qf, a_state)
      if b_state is not None:
        carry = 1.0 if step is None else step[None]
        total = total + carry * jnp.einsum("bihm,bhm->bhi", qf, b_state)
      return jnp.transpose(total, (0, 2, 1))  # [b, L, h]
    total = jnp.einsum("bhij,bjhd->bhid", sc, vals) + old[..., None] * jnp.einsum(
        "bihm,bhmd->bhid", qf, a_state
    )
    if b_state is not None:
      carry = 1.0 if step is None else step[None, :, :, None]
      total = total + carry * jnp.einsum("bihm,bhmd->bhid", qf, b_state)
    return jnp.transpose(total, (0, 2, 1, 3))  # [b, L, h, d]

  num = contract(fq, key["num_a"], key["num_b"], state["num_a"], state["num_b"], v)
  den = contract(dq, key["den_a"], key["den_b"], state["den_a"], state["den_b"], None)
  out = num / _guard(den, eps)[..., None]

  # The state at the block's last position, taken at c_new = c_{L-1}.
  c_new, seen_new = c[:, -1], any_[:, -1, :].any(axis=-1) | state["seen"]
  keep = jnp.where(state["seen"][:, None], jnp.exp(prev - c_new), 0.0)  # [b, h]
  tail = _pos_weights(log_decay, n - 1 - i, dtype)  # [h, L]
  carry_all = None if log_decay is None else jnp.exp(log_decay.astype(dtype) * n)[None]
  if carry_all is not None:
    keep = keep * carry_all
  wk = jnp.where(
      real[:, :, None],
      jnp.exp(jnp.where(real[:, :, None], key["s"].astype(dtype) - c_new[:, None, :], 0.0)),
      0.0,
  )
  wb = jnp.broadcast_to(real[:, :, None].astype(dtype), (b, n, h))
  if tail is not None:
    wk, wb = wk * tail.T[None], wb * tail.T[None]
  new = dict(scale=c_new, seen=seen_new)
  for part, vals in (("num", v), ("den", None)):
    a_key, b_key = key[f"{part}_a"].astype(dtype), key[f"{part}_b"]
    spec = "bjh,bjhm,bjhd->bhmd" if vals is not None else "bjh,bjhm->bhm"
    args = (vals,) if vals is not None else ()
    lead = keep[..., None, None] if vals is not None else keep[..., None]
    new[f"{part}_a"] = lead * state[f"{part}_a"] + jnp.einsum(spec, wk, a_key, *args)
    if b_key is None:
      new[f"{part}_b"] = None
    else:
      carry = (
          1.0
          if carry_all is None
          else (carry_all[..., None, None] if vals is not None else carry_all[..., None])
      )
      new[f"{part}_b"] = carry * state[f"{part}_b"] + jnp.einsum(
          spec, wb, b_key.astype(dtype), *args
      )
  return out, new


def linear_cached_step(cache, fq, dq, *, log_rows, log_decay=None, offset=0, eps: float = 1e-6):
  """L new tokens of causal linear attention with relative weights ``exp(log_rows)`` inside
  numerator and denominator, over caches that already hold the new tokens.

  Args:
    cache: dict ``num_a``, ``num_b`` ``[b, T, h, mq]``, ``den_a``, ``den_b`` ``[b, T, h, md]``
      (``_b`` None without eps_add), ``s [b, T, h]``, ``v [b, T, h, d]``, ``real [b, T]``.
    fq, dq: ``[b, L, h, mq|md]`` query features at positions ``offset + i``.
    log_rows: ``[h, L, T]`` log c_{j - (offset+i)} (``fastpos.positional.offset_rows``).
    log_decay: ``[h]`` log r or None (r^(p - j) folded into the rows).
  """
  dtype = cache["num_a"].dtype
  b, n, h, _ = fq.shape
  t = cache["real"].shape[1]
  pos = offset + jnp.arange(n)
  j = jnp.arange(t)
  vis = (j[None, :] <= pos[:, None])[None, None] & cache["real"][:, None, None, :]  # [b,1,L,T]
  st = jnp.transpose(cache["s"].astype(dtype), (0, 2, 1))  # [b, h, T]
  first = jnp.argmax(cache["real"], axis=1)  # the first real slot
  c = jnp.take_along_axis(st, first[:, None, None], axis=-1)  # [b, h, 1]: every query
  rows = log_rows.astype(dtype)[None]
  if log_decay is not None:
    rows = rows + log_decay.astype(dtype)[None, :, None, None] * jnp.maximum(
        pos[:, None] - j[None, :], 0
    )[None, None].astype(dtype)
  w_b = jnp.where(vis, jnp.exp(jnp.where(vis, rows, 0.0)), 0.0)
  w_a = jnp.where(vis, jnp.exp(jnp.where(vis, rows + st[:, :, None, :] - c[..., None], 0.0)), 0.0)

  def contract(qf, part, vals):
    qf = qf.astype(dtype)
    sc = w_a * jnp.einsum("bihm,bjhm->bhij", qf, cache[f"{part}_a"].astype(dtype))
    if cache[f"{part}_b"] is not None:
      sc = sc + w_b * jnp.einsum("bihm,bjhm->bhij", qf, cache[f"{part}_b"].astype(dtype))
    if vals is None:
      return jnp.transpose(jnp.sum(sc, axis=-1), (0, 2, 1))
    return jnp.einsum("bhij,bjhd->bihd", sc, vals.astype(dtype))

  num = contract(fq, "num", cache["v"])
  den = contract(dq, "den", None)
  return num / _guard(den, eps)[..., None]


def softmax_step(q, k_cache, v_cache, real, *, offset, bias=None, scale: float):
  """Softmax attention of L queries at ``offset + i`` over the cache slots ``j <= offset + i``
  that are real. q ``[b, L, h, f]``, caches ``[b, T, h, f|d]``, real ``[b, T]``, bias
  ``[b|1, h, L, T]`` or None. Returns ``[b, L, h, d]``."""
  dtype = jnp.result_type(q, k_cache, v_cache)
  wide = jnp.promote_types(dtype, jnp.float32)
  n, t = q.shape[1], k_cache.shape[1]
  logits = jnp.einsum("bihf,bjhf->bhij", q.astype(wide), k_cache.astype(wide)) * scale
  if bias is not None:
    logits = logits + bias.astype(wide)
  pos = offset + jnp.arange(n)
  vis = (jnp.arange(t)[None, :] <= pos[:, None])[None, None] & real[:, None, None, :]
  logits = jnp.where(vis, logits, jnp.finfo(wide).min)
  p = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhij,bjhd->bihd", p, v_cache.astype(wide)).astype(dtype)
