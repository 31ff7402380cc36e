"""Transformer-XL relative attention terms (b) and (d) by the left shift of Appendix B.

Convention (Transformer-XL Appendix B): a segment of ``L`` queries follows ``M`` memory
positions. Query ``i`` (0 <= i < L) sits at absolute position ``M + i``; key ``j``
(0 <= j < M + L) sits at absolute position ``j`` (memory first, then the current segment). The
relative distance of the pair is ``(M + i) - j``, which is >= 0 for every visible key.

The relative-key table is given in the paper's reversed order,
``rel_k[t] = W_{k,R} R_{M+L-1-t}`` (the paper's matrix **Q**), so ``t = M + L - 1`` is distance
0 and the pair (i, j) needs ``t = (M + L - 1) - (M + i - j) = j + L - 1 - i``.

Terms (b) and (d) of the relative logit are ``q_i . W_{k,R} R_{i-j}`` and
``v . W_{k,R} R_{i-j}``; both use the same table, so they are computed together as
``(q_i + v) . rel_k[j + L - 1 - i]``: one ``[L, M+L]`` product ``(q + v) rel_k^T`` per head
(the paper's **B-tilde** plus **d-tilde**) followed by a per-row left shift (``rel_shift``).

Two-sided (bidirectional) extension, ``two_sided=True``: a non-causal encoder also sees the
keys after query i, at distances down to ``-(L-1)``. The table then runs over distances
``M+L-1, ..., 1, 0, -1, ..., -(L-1)``: ``rel_k[t] = W_{k,R} R_{M+L-1-t}`` for
``0 <= t <= M+2L-2`` (``M+2L-1`` rows). The pair (i, j) still needs ``t = j + L - 1 - i``
(the same formula), now valid for every key, and the same left shift extracts it: row i of
the ``[L, M+2L-1]`` product is shifted left by ``L - 1 - i`` and its first ``M+L`` columns
kept (no future keys to zero).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


# ---------------------------------------------------------------------------------------------
# Validation (static shapes, before any compute)
# ---------------------------------------------------------------------------------------------
def _check_inputs(q, rel_k, pos_bias, two_sided: bool = False) -> tuple[int, int]:
  """Validates shapes; returns (L, M)."""
  if jnp.ndim(q) != 4:
    raise ValueError(f"q must have rank 4 [batch, L, heads, dim]; got shape {jnp.shape(q)}.")
  if jnp.ndim(rel_k) != 3:
    raise ValueError(f"rel_k must have rank 3 [M+L, heads, dim]; got shape {jnp.shape(rel_k)}.")
  _, length, heads, dim = jnp.shape(q)
  # One-sided: distances M+L-1..0 (M+L rows); two-sided: M+L-1..-(L-1) (M+2L-1 rows).
  extra = length - 1 if two_sided else 0
  if jnp.shape(rel_k)[0] < length + extra:
    rows = "M + 2L - 1" if two_sided else "M + L"
    raise ValueError(
        f"rel_k must have at least {length + extra} rows ({rows} with memory M >= 0, "
        f"two_sided={two_sided}); got shape {jnp.shape(rel_k)} for q of shape {jnp.shape(q)}."
    )
  if tuple(jnp.shape(rel_k)[1:]) != (heads, dim):
    raise ValueError(
        f"rel_k must have shape [M+L, heads, dim] = [M+L, {heads}, {dim}] to match q "
        f"{jnp.shape(q)}; got shape {jnp.shape(rel_k)}."
    )
  if pos_bias is not None:
    if jnp.ndim(pos_bias) != 2:
      raise ValueError(f"pos_bias must have rank 2 [heads, dim]; got shape {jnp.shape(pos_bias)}.")
    if tuple(jnp.shape(pos_bias)) != (heads, dim):
      raise ValueError(
          f"pos_bias must have shape [heads, dim] = [{heads}, {dim}] to match q "
          f"{jnp.shape(q)}; got shape {jnp.shape(pos_bias)}."
      )
  return length, jnp.shape(rel_k)[0] - length - extra


def _biased_queries(q, rel_k, pos_bias):
  """Casts to the promoted dtype; returns (q + v, rel_k), v = 0 when pos_bias is None."""
  arrays = (q, rel_k) if pos_bias is None else (q, rel_k, pos_bias)
  dtype = jnp.result_type(*arrays)
  q = jnp.asarray(q, dtype)
  rel_k = jnp.asarray(rel_k, dtype)
  if pos_bias is not None:
    # Term (d) rides along with term (b): (q + v) . Q_t, v broadcast over batch and position.
    q = q + jnp.asarray(pos_bias, dtype)[None, None]
  return q, rel_k


def _visible(shape, memory: int):
  """Boolean mask of ``shape [..., L, M+L]``: True where key j <= M + i (past or present)."""
  rank = len(shape)
  i = jax.lax.broadcasted_iota(jnp.int32, shape, rank - 2)
  j = jax.lax.broadcasted_iota(jnp.int32, shape, rank - 1)
  return j <= i + memory


# ---------------------------------------------------------------------------------------------
# The left shift
# ---------------------------------------------------------------------------------------------
def rel_shift(x, *, two_sided: bool = False):
  """Left-shifts row i of ``x`` by ``L - 1 - i`` (Transformer-XL Appendix B).

  Args:
    x: one-sided ``[..., L, M+L]`` or two-sided ``[..., L, M+2L-1]``; row i holds the
      unshifted products ``q_i . rel_k[t]`` over t (the paper's **B-tilde**).
    two_sided: x has the ``L - 1`` extra columns of negative distances (non-causal).

  Returns:
    ``[..., L, M+L]`` with ``out[..., i, j] = x[..., i, j + L - 1 - i]``: for every j when
    ``two_sided``; one-sided, for ``j <= M + i`` (the paper's **B**) and exactly 0 for
    ``j > M + i`` (future keys).

  Index algebra (T = number of columns of x). Pad one zero column in front: ``p[i, 0] = 0``
  and ``p[i, c] = x[i, c - 1]``, shape ``[L, T+1]``, flat index ``f = i (T+1) + c``. Reshape to
  ``[T+1, L]`` and drop the first row, i.e. the first L flat entries; reshape the remaining
  ``L T`` entries to ``[L, T]``. Entry (i, j) has flat index ``g = i T + j`` there, so it reads
  ``p`` at ``f = g + L = i (T+1) + (j + L - i)``. When ``0 <= j + L - i <= T`` -- i.e.
  ``j <= T - L + i``, the left bound always holds -- that is row i, column ``c = j + L - i >= 1``
  of ``p``, which is ``x[i, j + L - 1 - i]``: the wanted shift. One-sided (T = M + L) the
  condition is ``j <= M + i``; for ``j > M + i`` the read spills into row i + 1 (the zero
  column first, then entries of ``x[i + 1]``), so those entries are zeroed with a mask from
  iotas. Two-sided (T = M + 2L - 1) the condition ``j <= M + L - 1 + i`` holds for every kept
  column ``j < M + L``, so the first ``M + L`` columns are kept as they are. Only reshapes,
  one pad and one slice: no gather indices.

  Raises:
    ValueError: if ``x`` has rank < 2 or too few columns (memory M < 0).
  """
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(f"x must have rank >= 2 [..., L, M+L]; got shape {x.shape}.")
  *lead, length, cols = x.shape
  extra = length - 1 if two_sided else 0
  memory = cols - length - extra
  if memory < 0:
    want = "[..., L, M+2L-1]" if two_sided else "[..., L, M+L]"
    raise ValueError(
        f"x must be {want} with M >= 0 (two_sided={two_sided}); got shape {x.shape}, "
        f"i.e. M = {memory}."
    )
  lead = tuple(lead)
  keys = memory + length
  padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, 0), (1, 0)])  # [..., L, T+1]
  padded = padded.reshape(lead + (cols + 1, length))  # [..., T+1, L]
  shifted = padded[..., 1:, :].reshape(lead + (length, cols))  # [..., L, T]
  if two_sided:
    return shifted[..., :keys]  # [..., L, M+L]
  return jnp.where(_visible(shifted.shape, memory), shifted, jnp.zeros_like(shifted))


# ---------------------------------------------------------------------------------------------
# Terms (b) + (d): fast path and dense reference
# ---------------------------------------------------------------------------------------------
def relative_logits(q, rel_k, *, pos_bias=None, two_sided: bool = False):
  """Terms (b) + (d) of Transformer-XL relative attention by one product and a left shift.

  Transformer-XL Appendix B: ``B + D = rel_shift((q + v) Q^T)`` with ``Q = rel_k``.

  Args:
    q: ``[batch, L, heads, dim]`` queries; query i sits at absolute position M + i.
    rel_k: ``[M+L, heads, dim]``, ``rel_k[t] = W_{k,R} R_{M+L-1-t}`` (reversed order), or
      with ``two_sided`` ``[M+2L-1, heads, dim]`` (same formula; t > M+L-1 holds the
      negative distances ``-(t-M-L+1)``).
    pos_bias: ``[heads, dim]``, the global bias v of term (d), or None for term (b) only.
    two_sided: non-causal (encoder): every key is visible, distances ``M+L-1 .. -(L-1)``.

  Returns:
    ``[batch, heads, L, M+L]``,
    ``out[b, h, i, j] = (q[b, i, h] + v[h]) . rel_k[M+L-1-(M+i-j), h]`` for ``j <= M + i``
    and, one-sided, 0 for ``j > M + i`` (two-sided: the formula for every j). Unscaled (the
    caller applies 1/sqrt(dim)). Computed in the promoted dtype of the inputs;
    O(L (M+L) dim) flops but only O(L (M+L)) memory.
  """
  _check_inputs(q, rel_k, pos_bias, two_sided)
  q, rel_k = _biased_queries(q, rel_k, pos_bias)
  unshifted = jnp.einsum("bihd,thd->bhit", q, rel_k)  # [b, h, L, T]
  return rel_shift(unshifted, two_sided=two_sided)


def relative_logits_reference(q, rel_k, *, pos_bias=None, two_sided: bool = False):
  """Dense reference for ``relative_logits``: gathers W_{k,R} R_{i-j} for every pair.

  Materialises ``[L, M+L, heads, dim]`` (the quadratic cost Transformer-XL Appendix B avoids)
  and contracts it with ``q + v``. Same arguments, shapes and result as ``relative_logits``.
  """
  length, memory = _check_inputs(q, rel_k, pos_bias, two_sided)
  q, rel_k = _biased_queries(q, rel_k, pos_bias)
  keys = memory + length
  i = jnp.arange(length)[:, None]
  j = jnp.arange(keys)[None, :]
  distance = (memory + i) - j  # [L, M+L]
  visible = jnp.ones_like(distance, bool) if two_sided else distance >= 0
  t = jnp.where(visible, (keys - 1) - distance, 0)  # row of rel_k; any for future
  pair_keys = rel_k[t]  # [L, M+L, heads, dim]
  out = jnp.einsum("bihd,ijhd->bhij", q, pair_keys)
  return jnp.where(visible[None, None], out, jnp.zeros_like(out))
