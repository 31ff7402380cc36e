"""Softmax attention and kernelized (linear) attention, with their dense references.

Shapes: ``q, k, v: [batch, length, heads, dim]``; feature maps ``phi_q, phi_k:
[batch, length, heads, m]``; ``mask: [batch, length]`` boolean, True for real tokens (padding
is excluded as keys: it contributes nothing to numerators and denominators). Masks of any other
dtype (0/1 ints, floats, additive 0/-inf masks) raise ``ValueError``; see
``fastpos.ops.masks``. Outputs are ``[batch, length, heads, dim]``. Rows of padded queries are
computed but meaningless. ``linear_attention(head_major=True)`` takes and returns
``[batch, heads, length, .]`` instead (the layout of its products, so no layout copies).

Kernelized attention (FastRPB Eq. 3; Luo et al. Eq. 3 and, with RPE, Eq. 10):

    z_i = phi(q_i) . sum_j c_{j-i} phi(k_j) v_j^T  /  phi(q_i) . sum_j c_{j-i} phi(k_j)

with ``c = exp(b) > 0`` the relative table of kernelized RPE (``rpe``; absent means c = 1).
RPE sits *inside* both numerator and denominator (Luo et al.), unlike FastRPB, which adds
``W V`` outside the normalisation (see ``fastpos.ops.toeplitz``).

Precision: states (``phi_k^T v`` sums), FFTs and denominators are float32 at least (float64
for float64 inputs); the output is cast back to ``v``'s dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fastpos.ops import toeplitz
from fastpos.ops.masks import check_mask

# Denominators smaller than this in magnitude are clamped to +-DEFAULT_EPS (see _guard).
DEFAULT_EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def _check_qkv(q, k, v, names=("q", "k", "v"), *, same_length: bool = True) -> tuple[int, int, int]:
  """Validates ranks and shapes; returns (batch, query length, heads). With
  ``same_length=False`` keys may be longer than queries (memory keys first)."""
  for name, a in zip(names, (q, k, v)):
    if jnp.ndim(a) != 4:
      raise ValueError(
          f"{name} must be [batch, length, heads, dim] (rank 4); got shape {jnp.shape(a)}."
      )
  b, n, h, _ = q.shape
  nk = k.shape[1] if not same_length else n
  if k.shape[:3] != (b, nk, h) or v.shape[:3] != (b, nk, h) or (not same_length and nk < n):
    what = (
        "[batch, length, heads]"
        if same_length
        else ("batch and heads, with key length >= query length")
    )
    raise ValueError(
        f"{names[0]}, {names[1]}, {names[2]} must share {what}; got "
        f"{q.shape}, {k.shape}, {v.shape}."
    )
  if k.shape[-1] != q.shape[-1]:
    raise ValueError(
        f"{names[0]} and {names[1]} must have the same last dim; got {q.shape} and {k.shape}."
    )
  return b, n, h


def _state_dtype(*arrays):
  return jnp.float64 if jnp.result_type(*arrays) == jnp.float64 else jnp.float32


def _guard(den, eps: float):
  """Keeps denominators away from zero: |den| < eps becomes +-eps (sign kept, +eps at 0).

  Positive feature maps give den > 0 and the clamp only acts on all-padding rows; maps that
  can be negative (trf) need the sign-preserving form."""
  return jnp.where(jnp.abs(den) < eps, jnp.where(den < 0, -eps, eps), den)


# ---------------------------------------------------------------------------------------------
# Softmax attention
# ---------------------------------------------------------------------------------------------
def _softmax_inputs(q, k, v, bias, mask, causal: bool):
  """Validates and returns (bias [b|1, h|1, Lq, Lk] or None, allowed [b|1, 1, Lq, Lk] or None).

  Keys may be longer than queries (Lk = M + Lq, M memory keys first): query i then sits at
  position M + i, and causal means key j is visible iff j <= M + i."""
  b, n, _ = _check_qkv(q, k, v, same_length=False)
  nk = k.shape[1]
  mask = check_mask(mask, (b, nk), against=f"k of shape {k.shape}")
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.ndim == 3:
      bias = bias[None]
    if bias.ndim != 4 or bias.shape[-2:] != (n, nk):
      raise ValueError(
          f"bias must be [heads, Lq, Lk] or [batch, heads, Lq, Lk] (broadcastable) with "
          f"Lq={n}, Lk={nk}; got shape {bias.shape}."
      )
  allowed = None if mask is None else mask[:, None, None, :]
  if causal:
    cm = (jnp.arange(nk)[None, :] <= (nk - n) + jnp.arange(n)[:, None])[None, None]
    allowed = cm if allowed is None else (allowed & cm)
  return bias, allowed


def softmax_attention(
    q, k, v, *, bias=None, mask=None, causal: bool = False, scale: float | None = None
):
  """Exact softmax attention ``softmax(q k^T * scale + bias) v`` (padded keys excluded).

  Runs through ``jax.nn.dot_product_attention`` so that GPUs reach the fused (cuDNN) kernel
  where dtype and shapes allow. That function always takes the softmax in float32, so float64
  inputs go through the plain XLA formula instead (exactness tests run in float64), and so do
  values whose dim differs from the queries' (it needs one dim for q, k and v; a features
  scheme such as SPE gives q, k ``num_realizations`` dims).

  Args:
    q: ``[batch, Lq, heads, dim]``; k: ``[batch, Lk, heads, dim]``; v: ``[batch, Lk, heads,
      dim_v]``, with Lk >= Lq (the first M = Lk - Lq keys are memory preceding the queries;
      usually Lk == Lq).
    bias: additive logits bias ``[heads, Lq, Lk]`` or ``[batch|1, heads|1, Lq, Lk]``.
    mask: ``[batch, Lk]`` bool, True for real keys (any other dtype or shape: ValueError).
    causal: key j visible to query i iff j <= M + i.
    scale: defaults to ``1/sqrt(dim)``.
  """
  bias, allowed = _softmax_inputs(q, k, v, bias, mask, causal)
  dtype = jnp.result_type(q, k, v)
  if dtype != jnp.float64 and q.shape[-1] == v.shape[-1]:
    if bias is not None:
      bias = bias.astype(dtype)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=allowed, scale=scale)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  logits = jnp.einsum("bihd,bjhd->bhij", q, k) * scale
  if bias is not None:
    logits = logits + bias.astype(dtype)
  if allowed is not None:
    logits = jnp.where(allowed, logits, jnp.finfo(dtype).min)
  return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(logits, axis=-1), v)


def softmax_attention_reference(
    q, k, v, *, bias=None, mask=None, causal: bool = False, scale: float | None = None
):
  """Dense reference written out step by step: scores, a 0/1 visibility matrix multiplying
  ``exp(s - max)``, explicit normalisation. Computed in float64 when x64 is enabled.

  A query row that sees no key at all (causal with left padding: the padded rows before the
  first real key) is 0, not NaN, so a loss that masks such rows by a product stays finite."""
  bias, allowed = _softmax_inputs(q, k, v, bias, mask, causal)
  dtype = jnp.result_type(q, k, v)
  wide = jnp.promote_types(dtype, jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
  q, k, v = (a.astype(wide) for a in (q, k, v))
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  s = jnp.einsum("bihd,bjhd->bhij", q, k) * scale
  if bias is not None:
    s = s + bias.astype(wide)
  vis = jnp.ones_like(s) if allowed is None else jnp.broadcast_to(allowed, s.shape).astype(wide)
  top = jnp.max(jnp.where(vis > 0, s, -jnp.inf), axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)  # a row with no visible key: -inf would give NaN
  # exp of the hidden scores is never taken (it may overflow, and inf * 0 is NaN).
  e = jnp.exp(jnp.where(vis > 0, s - top, -jnp.inf)) * vis
  total = jnp.sum(e, axis=-1, keepdims=True)
  p = e / jnp.where(total > 0, total, 1.0)
  return jnp.einsum("bhij,bjhd->bihd", p, v).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Kernelized (linear) attention
# ---------------------------------------------------------------------------------------------
def _check_rpe(rpe, h: int, n: int, grid) -> None:
  if rpe is None:
    return
  if grid is None:
    expected = (h, 2 * n - 1)
    if jnp.shape(rpe) != expected:
      raise ValueError(
          f"rpe must be [heads, 2N-1]={expected} (c_(j-i) = exp(b_(j-i)) by offset j-i); "
          f"got shape {jnp.shape(rpe)}."
      )
  else:
    gh, gw = toeplitz._check_grid(grid, n)
    expected = (h, 2 * gh - 1, 2 * gw - 1)
    if jnp.shape(rpe) != expected:
      raise ValueError(
          f"rpe with grid {tuple(grid)} must be [heads, 2H-1, 2W-1]={expected}; got shape "
          f"{jnp.shape(rpe)}."
      )
  # Positivity can only be checked on concrete values; under jit the caller guarantees it
  # (the positional modules pass exp(b)).
  if not isinstance(rpe, jax.core.Tracer):
    bad = np.min(np.asarray(rpe))
    if not bad > 0:
      raise ValueError(
          f"rpe must be a table of positive weights c = exp(b) > 0; its minimum is {float(bad)}."
      )


def _apply_key_mask(phi_k, mask, dtype):
  phi_k = phi_k.astype(dtype)
  if mask is None:
    return phi_k
  # where, not a product: a padded key's features may be inf (exp of garbage), and 0 * inf
  # would be NaN. Callers should still zero padded inputs before phi to keep gradients finite.
  return jnp.where(mask[:, :, None, None], phi_k, jnp.zeros((), dtype))


def _check_decay(decay, h: int, causal: bool) -> None:
  if decay is None:
    return
  if not causal:
    raise ValueError("decay r^(i-j) is defined for causal attention only; got causal=False.")
  if jnp.shape(decay) != (h,):
    raise ValueError(
        f"decay must be [heads]=({h},) log-decays log r <= 0; got shape {jnp.shape(decay)}."
    )
  if not isinstance(decay, jax.core.Tracer):
    worst = np.max(np.asarray(decay))
    if not worst <= 0:
      raise ValueError(
          f"decay holds log r and must be <= 0 (0 < r <= 1); its maximum is {float(worst)}."
      )


def _check_den_features(den_features, phi_q, phi_k) -> None:
  if den_features is None:
    return
  if len(den_features) != 2:
    raise ValueError("den_features must be a pair (phi_q_den, phi_k_den).")
  dq, dk = den_features
  for name, a, ref in (("phi_q_den", dq, phi_q), ("phi_k_den", dk, phi_k)):
    if jnp.ndim(a) != 4 or jnp.shape(a)[:3] != jnp.shape(ref)[:3]:
      raise ValueError(
          f"{name} must be [batch, N, heads, m'] matching {jnp.shape(ref)[:3]}; got "
          f"{jnp.shape(a)}."
      )
  if jnp.shape(dq)[-1] != jnp.shape(dk)[-1]:
    raise ValueError(
        f"phi_q_den and phi_k_den must share m'; got {jnp.shape(dq)}, " f"{jnp.shape(dk)}."
    )


def causal_chunk_size(m: int, d: int) -> int:
  """The chunk of causal linear attention for ``m`` features and value size ``d``.

  Per token and head a chunk of c costs c (m + d) inside the chunk (half of it masked) and
  2 m d for the carried state: c = m d / (m + d) would balance them, but every chunk is one
  step of a serial scan. Measured fwd+bwd on a 2-core CPU (N = 4096, 8 heads, d = 64; time
  against the bidirectional path, benchmarks/README.md): chunk 64 is fastest for m <= 64
  (1.3-1.6x) and chunk 32 for m = 256 (1.3x, against 1.7x at 64)."""
  return 32 if m * d >= 48 * (m + d) else 64


def linear_attention(
    phi_q,
    phi_k,
    v,
    *,
    mask=None,
    causal: bool = False,
    rpe=None,
    grid: Sequence[int] | None = None,
    decay=None,
    den_features=None,
    chunk_size: int | None = None,
    eps: float = DEFAULT_EPS,
    key_log_scale=None,
    key_eps: float = 0.0,
    segment_ids=None,
    head_major: bool = False,
):
  """Kernelized attention (FastRPB Eq. 3; with ``rpe``, Luo et al. Eq. 10-13).

  Args:
    phi_q, phi_k: ``[batch, N, heads, m]`` features of queries and keys.
    v: ``[batch, N, heads, dim]``.
    mask: ``[batch, N]`` bool, True for real tokens; padded keys are zeroed in ``phi_k``. Any
      other dtype or shape raises ValueError.
    causal: query i sees keys j <= i (raster order with ``grid``).
    rpe: positive relative weights ``c = exp(b)``, ``[heads, 2N-1]`` by offset ``j-i``, or
      ``[heads, 2H-1, 2W-1]`` by ``(r'-r, c'-c)`` with ``grid``. Mixes keys in numerator and
      denominator alike: ``sum_j c_{j-i} phi(k_j) v_j^T`` and ``sum_j c_{j-i} phi(k_j)`` by
      the Toeplitz FFT over ``m*dim + m`` channels.
    grid: ``(H, W)`` image grid; only used with ``rpe``.
    decay: ``[heads]`` log r <= 0 of a causal decay: key j weighs ``r^(i-j)`` (PermuteFormer
      Sec. 3.3). Computed chunk by chunk so every exponent is <= 0 (no r^-i overflow). With
      ``rpe`` it is folded into the table (log c_{j-i} + (i-j) log r).
    den_features: optional ``(phi_q_den, phi_k_den)`` ``[batch, N, heads, m']`` used for the
      denominator instead of ``(phi_q, phi_k)`` (for positional transforms that may make the
      numerator's features negative, e.g. rotations: the denominator keeps the plain positive
      features). Same masks, causality, rpe and decay.
    chunk_size: chunk length of the causal path without rpe; None picks it: 32
      (``CAUSAL_PLAIN_CHUNK``) without decay, segments, key scales or den_features, else from
      the shape (``causal_chunk_size``).
    eps: denominator guard (``_guard``), applied to the denominator after the contraction
      with ``phi_q``.
    key_log_scale: optional ``[batch, N, heads]``: the keys' features are
      ``phi_k * exp(key_log_scale) + key_eps`` (``features.key_parts`` splits the stabilised
      maps so), and the op never forms ``exp(key_log_scale)``: it weighs keys by
      ``exp(s_j - R)`` against a reference ``R >= max(0, s_j)``, which cancels between
      numerator and denominator. Causal: R is the running maximum over the keys each query
      sees (inside the chunked scan), so no key, however late and large, overflows, and no
      query's scale depends on a later key. Bidirectional: the maximum over the real keys.
      ``eps`` guards the denominator in the keys' own scale (as without the split).
      Not built with ``rpe``, ``decay`` or ``den_features`` (ValueError).
    key_eps: see ``key_log_scale`` (only used with it).
    segment_ids: optional ``[batch, N]`` int, a packed row's segments (contiguous runs of one
      id): query i sees key j only when they share a segment (``segmented_linear_attention``).
    head_major: the layout of ``phi_q, phi_k, v``, ``den_features`` and the output:
      ``[batch, heads, N, .]`` (``key_log_scale`` ``[batch, heads, N]``; ``mask`` stays
      ``[batch, N]``) instead of ``[batch, N, heads, .]``. Same results; a caller whose
      projections emit head-major tensors saves the op's layout copies (bidirectional: none
      are left; other paths move to token-major views, which XLA cancels against their own
      transposes).

  Cost: O(N m d) without rpe (causal: plus O(N * chunk * (m + d)) inside chunks). With rpe: up to N
  = ``_RPE_DENSE_UP_TO`` (2048; on GPU ``_RPE_DENSE_UP_TO_GPU``, 16384) the ``[N, N]`` weights are
  materialised (``_rpe_dense``: O(N^2 (m + d)) in large matmuls, the memory of softmax with a bias),
  above it O(N log N m d) by FFT. Inside the op the products run head-major (``[b, h, n, .]``, one
  transpose per input); with ``head_major=True``, bidirectional without rpe or ``den_features``
  is two batched matmuls forward and four backward on the caller's arrays, each ``m`` or ``d``
  wide, with batch and heads folded into one axis and the normaliser as matrix-vector products
  (``_bidirectional``). Causal without rpe, decay, segments, key scales or den_features
  scans token-major chunks with a written-out backward (``_causal_scan``). Memory of the
  causal path: one carried state ``[batch, heads, m, d]`` in the forward pass and the
  per-chunk states ``[N/chunk, batch, heads, m, d]`` kept for the backward pass, never a
  per-token ``[N, m, d]`` cumulative sum; the FFT rpe path holds one (head, group of features)'
  ``[N, group*(d+1)]`` channels at a time and keeps only its inputs for the backward pass
  (``_rpe_mix``).
  """
  plain = rpe is None and den_features is None and key_log_scale is None and segment_ids is None
  if head_major and plain and not causal:
    return _bidirectional_head_major(phi_q, phi_k, v, mask, eps)
  if head_major:
    # Token-major views: the op moves to head-major inside, and XLA cancels the transpose pairs.
    swap = lambda a: None if a is None else jnp.swapaxes(a, 1, 2)
    out = linear_attention(
        *(_swap_rank4(a, "phi_q, phi_k, v") for a in (phi_q, phi_k, v)),
        mask=mask,
        causal=causal,
        rpe=rpe,
        grid=grid,
        decay=decay,
        den_features=None if den_features is None else tuple(map(swap, den_features)),
        chunk_size=chunk_size,
        eps=eps,
        key_log_scale=swap(key_log_scale),
        key_eps=key_eps,
        segment_ids=segment_ids,
    )
    return jnp.swapaxes(out, 1, 2)
  b, n, h = _check_qkv(phi_q, phi_k, v, names=("phi_q", "phi_k", "v"))
  mask = check_mask(mask, (b, n), against=f"phi_k of shape {phi_k.shape}")
  _check_rpe(rpe, h, n, grid)
  _check_decay(decay, h, causal)
  _check_den_features(den_features, phi_q, phi_k)
  if grid is not None and rpe is None:
    raise ValueError("grid is only used together with a 2D rpe table; got rpe=None.")
  if segment_ids is not None:
    return segmented_linear_attention(
        phi_q,
        phi_k,
        v,
        segment_ids,
        mask=mask,
        causal=causal,
        rpe=rpe,
        decay=decay,
        den_features=den_features,
        chunk_size=chunk_size,
        eps=eps,
        key_log_scale=key_log_scale,
        key_eps=key_eps,
    )
  if key_log_scale is not None:
    return _scaled_keys(
        phi_q,
        phi_k,
        v,
        mask,
        key_log_scale,
        key_eps,
        causal=causal,
        rpe=rpe,
        decay=decay,
        den_features=den_features,
        chunk_size=chunk_size,
        eps=eps,
    )
  return _mix(
      phi_q,
      phi_k,
      v,
      mask,
      causal=causal,
      rpe=rpe,
      grid=grid,
      decay=decay,
      den_features=den_features,
      chunk_size=chunk_size,
      eps=eps,
      length=n,
  )


def _bidirectional_head_major(phi_q, phi_k, v, mask, eps):
  """``linear_attention(head_major=True)`` without causality, rpe, den_features or key
  scales: the checks of the token-major op on transposed views (shapes only), then
  ``_bidirectional`` on the head-major arrays themselves (no layout copies)."""
  q, k, vals = (_swap_rank4(a, "phi_q, phi_k, v") for a in (phi_q, phi_k, v))
  b, n, _ = _check_qkv(q, k, vals, names=("phi_q", "phi_k", "v"))
  mask = check_mask(mask, (b, n), against=f"phi_k of shape {phi_k.shape}")
  dtype = _state_dtype(phi_q, phi_k, v)
  fk = phi_k.astype(dtype)
  if mask is not None:  # where, not a product (see _apply_key_mask)
    fk = jnp.where(mask[:, None, :, None], fk, jnp.zeros((), dtype))
  out = _bidirectional(phi_q.astype(dtype), fk, v.astype(dtype), eps)
  return out.astype(v.dtype)


def _swap_rank4(a, names: str):
  """``[b, h, n, e] -> [b, n, h, e]`` for ``head_major`` inputs (rank checked first)."""
  if jnp.ndim(a) != 4:
    raise ValueError(
        f"{names} must be [batch, heads, length, dim] (rank 4) with head_major=True; got shape "
        f"{jnp.shape(a)}."
    )
  return jnp.swapaxes(a, 1, 2)


def _scaled_keys(
    phi_q,
    phi_k,
    v,
    mask,
    log_scale,
    key_eps,
    *,
    causal,
    rpe,
    decay,
    den_features,
    chunk_size,
    eps,
    segment_ids=None,
):
  """``linear_attention`` with keys ``phi_k * exp(log_scale) + key_eps`` (see there)."""
  b, n, h = phi_q.shape[:3]
  if jnp.shape(log_scale) != (b, n, h):
    raise ValueError(
        f"key_log_scale must be [batch, N, heads]=({b}, {n}, {h}); got shape "
        f"{jnp.shape(log_scale)}."
    )
  for name, value in (("rpe", rpe), ("decay", decay), ("den_features", den_features)):
    if value is not None:
      raise ValueError(
          f"key_log_scale is not built together with {name}; pass {name}=None "
          "(or features without a separate scale)."
      )
  dtype = _state_dtype(phi_q, phi_k, v)
  q, k, vals = (_head_major(a.astype(dtype)) for a in (phi_q, phi_k, v))
  s = jnp.transpose(log_scale.astype(dtype), (0, 2, 1))  # [b, h, n]
  real = jnp.ones((b, n), bool) if mask is None else mask
  real = jnp.broadcast_to(real[:, None, :], s.shape)
  k = jnp.where(real[..., None], k, jnp.zeros((), dtype))
  s = jnp.where(real, s, -jnp.inf)  # padded keys: weight 0, and no say in the reference
  k_eps = jnp.where(real, jnp.asarray(key_eps, dtype), jnp.zeros((), dtype))
  if causal:
    chunk = min(
        causal_chunk_size(k.shape[-1], v.shape[-1]) if chunk_size is None else chunk_size, n
    )
    if chunk < 1:
      raise ValueError(f"chunk_size must be a positive int or None; got {chunk_size}.")
    num, den, ref = _causal_running_max(q, k, vals, s, k_eps, chunk, segment_ids)
  else:
    ref = jax.lax.stop_gradient(jnp.maximum(jnp.max(s, axis=2, keepdims=True), 0.0))
    w = jnp.exp(s - ref)  # [b, h, n], every exponent <= 0
    kw = k * w[..., None]
    num = jnp.einsum("bhim,bhmd->bhid", q, jnp.einsum("bhjm,bhjd->bhmd", kw, vals))
    den = jnp.einsum("bhim,bhm->bhi", q, jnp.sum(kw, axis=2))
    e = jnp.exp(-ref) * jnp.sum(q, axis=-1)  # [b, h, n]: the eps part, q . (eps 1)
    num = num + e[..., None] * jnp.einsum("bhj,bhjd->bhd", k_eps, vals)[:, :, None]
    den = den + e * jnp.sum(k_eps, axis=2, keepdims=True)
  out = num / _scaled_guard(den, eps, ref)[..., None]
  return _head_major(out).astype(v.dtype)


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
  pad = g * chunk - n

  def split(a, fill=0.0):  # [b, h, n, ...] -> [g, b, h, chunk, ...]
    widths = ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 3)
    a = jnp.pad(a, widths, constant_values=fill)
    return jnp.moveaxis(a.reshape((b, h, g, chunk) + a.shape[3:]), 2, 0)

  mask = toeplitz.causal_mask(chunk)
  tri = mask.astype(dtype)

  def body(carry, xs):
    kv, ks, ev, es, ref = carry[:5]  # [b,h,m,d], [b,h,m], [b,h,d], [b,h], [b,h]
    q_c, k_c, v_c, s_c, e_c = xs[:5]
    if segment_ids is None:
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
    tail = () if segment_ids is None else (new_seg,)
    return (kv, ks, ev, es, new) + tail, (num, den, r)

  init = (
      jnp.zeros((b, h, m, d), dtype),
      jnp.zeros((b, h, m), dtype),
      jnp.zeros((b, h, d), dtype),
      jnp.zeros((b, h), dtype),
      jnp.zeros((b, h), dtype),
  )
  xs = (split(q), split(k), split(v), split(s, -jnp.inf), split(k_eps))
  if segment_ids is not None:
    init = init + (jnp.full((b,), -1, jnp.int32),)
    xs = xs + (_chunk_ids(segment_ids, g, chunk),)
  _, (num, den, ref) = jax.lax.scan(jax.checkpoint(body), init, xs)
  num = jnp.moveaxis(num, 0, 2).reshape(b, h, g * chunk, d)[:, :, :n]
  den = jnp.moveaxis(den, 0, 2).reshape(b, h, g * chunk)[:, :, :n]
  ref = jnp.moveaxis(ref, 0, 2).reshape(b, h, g * chunk)[:, :, :n]
  return num, den, ref


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


def _scaled_guard(den, eps: float, ref):
  """``_guard`` in the keys' own scale: ``den`` is the denominator times ``exp(-ref)``, so the
  threshold is ``eps exp(-ref)`` (floored at the dtype's smallest normal, never 0)."""
  t = jnp.maximum(eps * jnp.exp(-ref), jnp.finfo(den.dtype).tiny)
  return jnp.where(jnp.abs(den) < t, jnp.where(den < 0, -t, t), den)


def _mix(
    phi_q,
    phi_k,
    v,
    mask,
    *,
    causal,
    rpe,
    grid,
    decay,
    den_features,
    chunk_size,
    eps,
    length,
    split=None,
):
  """The body of ``linear_attention`` after its checks, shared with its context-parallel form.

  ``length`` is the whole sequence's (the rpe table's) length. ``split`` is None on one
  device, or the device-axis operations of ``fastpos.ops.context_parallel`` (``toeplitz``,
  ``varying``, ``causal``, ``psum``) when the inputs are this device's block of the sequence.
  """
  if chunk_size is not None and chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int or None; got {chunk_size}.")
  out_dtype = v.dtype
  dtype = _state_dtype(phi_q, phi_k, v)
  if rpe is not None and decay is not None:
    rpe = rpe.astype(dtype) * jnp.exp(_decay_table(decay.astype(dtype), length, grid))
    decay = None
  log_decay = None if decay is None else decay.astype(dtype)
  if rpe is not None:
    rpe = rpe.astype(dtype)
    zeros = None
    if split is not None:
      product, zeros = (lambda w, x: split.toeplitz(w, causal)(x)), split.varying
    elif grid is None:
      product = functools.partial(_product_1d, causal=causal)
    else:
      product = functools.partial(_product_2d, grid=tuple(grid), causal=causal)
    dense = split is None and _rpe_dense_is_faster(phi_k.shape[1], phi_k.shape[-1], v.shape[-1])
  total = (lambda x: x) if split is None else split.psum

  def contract(fq, fk, vals):  # [b, n, h, .] in, num [b, n, h, d] and den [b, n, h] out
    fq, vals = fq.astype(dtype), vals.astype(dtype)
    fk = _apply_key_mask(fk, mask, dtype)
    if rpe is not None:
      if dense:
        return _rpe_dense(fq, fk, vals, rpe, grid, causal)
      return _rpe_mix(fq, fk, vals, rpe, product, zeros)
    # One transpose per input to head-major [b, h, n, .]: every product below is then a
    # batched matmul over contiguous [n, .] slabs (no transposes inside the products).
    fq, fk, vals = (_head_major(a) for a in (fq, fk, vals))
    if causal:
      chunk = min(chunk_size, fk.shape[2])
      if split is not None:
        num, den = split.causal(fq, fk, vals, chunk, log_decay)
      else:
        num, den = _causal_chunked(fq, fk, vals, chunk, log_decay)
    else:
      kv = total(jnp.einsum("bhjm,bhjd->bhmd", fk, vals))
      k_sum = total(jnp.sum(fk, axis=2))  # [b, h, m]
      num = jnp.einsum("bhim,bhmd->bhid", fq, kv)
      den = jnp.einsum("bhim,bhm->bhi", fq, k_sum)
    return _head_major(num), jnp.transpose(den, (0, 2, 1))

  if causal and rpe is None and decay is None and den_features is None and split is None:
    fk = _apply_key_mask(phi_k, mask, dtype)
    chunk = CAUSAL_PLAIN_CHUNK if chunk_size is None else chunk_size
    return _causal_plain(phi_q.astype(dtype), fk, v.astype(dtype), chunk, eps).astype(out_dtype)
  if chunk_size is None:
    chunk_size = causal_chunk_size(phi_k.shape[-1], v.shape[-1])
  if not causal and rpe is None and den_features is None and split is None:
    # Divided head-major, then one transpose back. Autodiff of these einsums, not the
    # written-out products (``_bidirectional``): fed token-major inputs, those need a layout
    # copy of the cotangent and of each gradient, and measured slower (ops_lean.md).
    fk = _head_major(_apply_key_mask(phi_k, mask, dtype))
    fq, vals = (_head_major(a.astype(dtype)) for a in (phi_q, v))
    num = jnp.einsum("bhim,bhmd->bhid", fq, jnp.einsum("bhjm,bhjd->bhmd", fk, vals))
    den = jnp.einsum("bhim,bhm->bhi", fq, jnp.sum(fk, axis=2))
    return _head_major(num / _guard(den, eps)[..., None]).astype(out_dtype)
  num, den = contract(phi_q, phi_k, v)
  if den_features is not None:
    ones = jnp.ones(v.shape[:-1] + (1,), dtype)
    den = contract(den_features[0], den_features[1], ones)[0][..., 0]
  return (num / _guard(den, eps)[..., None]).astype(out_dtype)


# Batched products over one leading axis z = batch * heads (``lax.dot_general`` numbers).
_ROWS_BY_STATE = (((2,), (1,)), ((0,), (0,)))  # [z, n, m] x [z, m, e] -> [z, n, e]
_ROWS_BY_STATE_T = (((2,), (2,)), ((0,), (0,)))  # [z, n, e] x [z, m, e] -> [z, n, m]
_OVER_TOKENS = (((1,), (1,)), ((0,), (0,)))  # [z, n, m] x [z, n, e] -> [z, m, e]


def _bidirectional(q, k, v, eps: float):
  """Bidirectional linear attention, head-major in and out: ``q, k [b, h, n, m]``,
  ``v [b, h, n, d]`` -> ``[b, h, n, d]``, normalised and guarded (``_guard``).

  Batch and heads fold into one leading axis (a reshape, no copy) and ``_folded`` runs six
  ``m``- and ``d``-wide batched products with a written-out backward."""
  b, h, n, _ = q.shape
  fold = lambda a: a.reshape((b * h, n, a.shape[-1]))
  return _folded(fold(q), fold(k), fold(v), eps).reshape((b, h, n, v.shape[-1]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _folded(q, k, v, eps: float):
  """``_bidirectional`` on ``q, k [z, n, m]``, ``v [z, n, d]`` (z = batch * heads).

  Forward: ``s = k^T v`` ``[z, m, d]`` and ``z_k = sum_j k_j`` ``[z, m]``; ``num = q s`` and
  ``den = q . z_k``; ``out = num / den``. Backward, written out: ``g_n = g / den`` and
  ``g_d = -(g . out) / den`` (0 where the guard clamped); ``g_q = g_n s^T + g_d z_k``,
  ``g_s = q^T g_n``, ``g_z = q^T g_d``, ``g_k = v g_s^T + g_z``, ``g_v = k g_s``. The six
  products keep the heads' own widths: a ones column riding along (``d + 1`` wide) measured
  1.4-2.4x slower on a 2-core CPU at N = 4K-16K (benchmarks/ops_lean.md); the denominator's
  terms are matrix-vector products and fuse with the elementwise work. Residuals: the inputs,
  ``s``, ``z_k``, the output and the guarded denominator."""
  return _folded_fwd(q, k, v, eps)[0]


def _folded_fwd(q, k, v, eps: float):
  s = jax.lax.dot_general(k, v, _OVER_TOKENS)
  z_k = jnp.sum(k, axis=1)
  num = jax.lax.dot_general(q, s, _ROWS_BY_STATE)
  den = jnp.einsum("znm,zm->zn", q, z_k)
  kept = jnp.abs(den) >= eps  # where the guard passes the denominator through
  den = _guard(den, eps)
  out = num / den[..., None]
  return out, (q, k, v, s, z_k, out, den, kept)


def _folded_bwd(eps: float, res, g):
  del eps
  q, k, v, s, z_k, out, den, kept = res
  g_n = g / den[..., None]
  g_d = jnp.where(kept, -jnp.sum(g * out, axis=-1), jnp.zeros((), g.dtype)) / den
  g_q = jax.lax.dot_general(g_n, s, _ROWS_BY_STATE_T) + g_d[..., None] * z_k[:, None, :]
  g_s = jax.lax.dot_general(q, g_n, _OVER_TOKENS)
  g_z = jnp.einsum("znm,zn->zm", q, g_d)
  g_k = jax.lax.dot_general(v, g_s, _ROWS_BY_STATE_T) + g_z[:, None, :]
  g_v = jax.lax.dot_general(k, g_s, _ROWS_BY_STATE)
  return g_q, g_k, g_v


_folded.defvjp(_folded_fwd, _folded_bwd)


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


def _head_major(a):
  """``[b, n, h, e] <-> [b, h, n, e]`` (head-major: the layout of the products inside the op)."""
  return jnp.transpose(a, (0, 2, 1, 3))


def _decay_table(log_decay, n: int, grid):
  """``[heads, 2N-1]`` log weights (i-j) log r for j <= i (raster offsets on a grid; the
  causal mask removes j > i). Used to fold a decay into an rpe table."""
  if grid is None:
    offsets = jnp.arange(-(n - 1), n)  # j - i
  else:
    gh, gw = grid
    offsets = jnp.arange(-(gh - 1), gh)[:, None] * gw + jnp.arange(-(gw - 1), gw)[None, :]
  dist = jnp.maximum(-offsets, 0).astype(log_decay.dtype)
  return log_decay.reshape((-1,) + (1,) * dist.ndim) * dist[None]


def _product_1d(w, x, *, causal):
  return toeplitz.toeplitz_matmul(w, x, causal=causal)


def _product_2d(w, x, *, grid, causal):
  return toeplitz.toeplitz_matmul_2d(w, x, grid, causal=causal)


# Up to this length kernelized RPE runs densely (``_rpe_dense``): the [N, N] scores cost
# N^2 (m + d) flops per head in large matmuls, against the FFT path's m (d + 1) FFTs of length
# ~2N, six passes of them fwd+bwd, at a fraction of the matmul rate. Measured fwd+bwd on a
# 2-core CPU (m = 32, d = 64, 8 heads): dense over FFT 0.34x at N = 512, 0.49x at 1024, 0.85x
# at 2048, 1.30x at 4096; its memory is that of dense softmax with a bias
# (benchmarks/ops_lean.md).
_RPE_DENSE_UP_TO = 2048
# On GPU the dense path beat the FFT path at every length measured, N = 1K-16K (H200, m = 32,
# d = 64, 8 heads, fwd+bwd; 28.5 vs 68.8 ms at 16384: benchmarks/gpu/gpu.md, kRPE section).
_RPE_DENSE_UP_TO_GPU = 16384


def _rpe_dense_is_faster(n: int, m: int, d: int, backend: str | None = None) -> bool:
  """Whether kernelized RPE runs densely at length ``n``, by the measured crossover of the
  ``backend`` (``jax.default_backend()`` at trace time when None): ``_RPE_DENSE_UP_TO_GPU``
  on "gpu", ``_RPE_DENSE_UP_TO`` (measured on CPU) on every other backend."""
  del m, d  # measured at m = 32, d = 64; the FFT side grows with m d as the dense with m + d
  backend = jax.default_backend() if backend is None else backend
  return n <= (_RPE_DENSE_UP_TO_GPU if backend == "gpu" else _RPE_DENSE_UP_TO)


def _rpe_dense(phi_q, phi_k, v, rpe, grid, causal: bool):
  """Kernelized RPE with materialised weights ``A = (phi_q phi_k^T) * C`` ``[b, h, N, N]``.
  ``[b, n, h, .]`` in and out (num ``[b, n, h, d]``, den ``[b, n, h]``)."""
  c = toeplitz.dense_toeplitz(rpe) if grid is None else toeplitz.dense_toeplitz_2d(rpe, grid)
  a = jnp.einsum("bihm,bjhm->bhij", phi_q, phi_k) * c[None]
  if causal:
    a = jnp.where(toeplitz.causal_mask(a.shape[-1]), a, jnp.zeros((), a.dtype))
  return jnp.einsum("bhij,bjhd->bihd", a, v), jnp.transpose(jnp.sum(a, axis=-1), (0, 2, 1))


# The FFT path mixes m*d + m channels per head (Luo et al. Eq. 11-13). All of them at once
# hold the [batch, heads, N, m*d] outer products phi(k_j) v_j^T and their spectra: 1.3 GiB of
# temporaries fwd+bwd at N = 4096 (B=1, 8 heads, m=32, d=64). Instead the op loops over
# (head, group of features) pairs of at most _RPE_GROUP_BYTES of channels, sliced from the
# inputs' own [b, n, h, .] layout (one head's slice is contiguous after the gather: no layout
# copies) and accumulated into outputs of that layout. The forward keeps nothing but the
# inputs for the backward (a custom VJP), which rebuilds each group's channels.
_RPE_GROUP_BYTES = 2 * 2**20


def _rpe_group(b: int, n: int, m: int, d: int, itemsize: int) -> int:
  """The features per group: the largest divisor of m whose ``g (d + 1)`` channels of one head
  fit ``_RPE_GROUP_BYTES`` (at least 1). A divisor, so groups are plain slices."""
  fit = max(1, _RPE_GROUP_BYTES // (b * n * (d + 1) * itemsize))
  return max(g for g in range(1, m + 1) if m % g == 0 and g <= fit)


def _rpe_mix(phi_q, phi_k, v, rpe, product, zeros=None):
  """Luo et al. Eq. 11-13 by FFT: Toeplitz-mix vec(phi_k v^T) (m*d channels) and phi_k (m).

  ``phi_q, phi_k [b, n, h, m]``, ``v [b, n, h, d]``, ``rpe [h, ...]``; returns num
  ``[b, n, h, d]``, den ``[b, n, h]``. ``product(w, x)`` maps channels ``x [b, 1, n, C]`` to
  their relative (Toeplitz) product under one head's table ``w [1, ...]``; ``zeros``, when
  given, types the loops' zero carries (the context-parallel caller marks them varying over
  its device axis).

  One loop step per (head, group of features) (``_rpe_group``). Backward, per step: the
  channels ``X`` are rebuilt, and one ``jax.vjp`` of the product gives ``Y = T X`` (for the
  gradient of phi_q), ``T^T G`` and the table's gradient, for the cotangent channels
  ``G = phi_q (x) [g_num, g_den]``. Residuals: the inputs alone.
  """
  b, n, h, m = phi_k.shape
  d = v.shape[-1]
  group = _rpe_group(b, n, m, d, jnp.dtype(v.dtype).itemsize)
  per_head = m // group
  mark = (lambda t: t) if zeros is None else zeros
  phi_q, phi_k, v = mark((phi_q, phi_k, v))  # den_features' ones column: same on every device

  def head(a, hh, start=0, size=None):  # [b, n, h, e] -> [b, 1, n, size] (a reshape)
    size = a.shape[-1] if size is None else size
    a = jax.lax.dynamic_slice(a, (0, 0, hh, start), (b, n, 1, size))
    return a.reshape(b, 1, n, size)

  def add(acc, hh, x):  # acc[:, :, hh] += x, x [b, 1, n, e] (or [b, 1, n])
    x = x.reshape((b, n, 1) + x.shape[3:])
    start = (0, 0, hh) + (0,) * (x.ndim - 3)
    return jax.lax.dynamic_update_slice(acc, jax.lax.dynamic_slice(acc, start, x.shape) + x, start)

  def unpack(s, fq_all, fk_all, vals_all, table):
    hh, gi = s // per_head, s % per_head
    fq, fk = (head(a, hh, gi * group, group) for a in (fq_all, fk_all))
    w = jax.lax.dynamic_index_in_dim(table, hh, axis=0)  # [1, ...]
    return hh, fq, fk, head(vals_all, hh), w

  def channels(fk, vals):  # [b, 1, n, g], [b, 1, n, d] -> [b, 1, n, g d + g]
    kv = (fk[..., :, None] * vals[..., None, :]).reshape(b, 1, n, group * d)
    return jnp.concatenate([kv, fk], axis=-1)

  def split(y):  # [b, 1, n, g d + g] -> [b, 1, n, g, d], [b, 1, n, g]
    return y[..., : group * d].reshape(b, 1, n, group, d), y[..., group * d :]

  def forward(*args):
    def body(s, carry):
      hh, fq, fk, vals, w = unpack(s, *args)
      y_kv, y_k = split(product(w, channels(fk, vals)))
      return (
          add(carry[0], hh, jnp.einsum("bhig,bhigd->bhid", fq, y_kv)),
          add(carry[1], hh, jnp.einsum("bhig,bhig->bhi", fq, y_k)),
      )

    init = mark((jnp.zeros((b, n, h, d), v.dtype), jnp.zeros((b, n, h), v.dtype)))
    return jax.lax.fori_loop(0, h * per_head, body, init)

  @jax.custom_vjp
  def mix(*args):
    return forward(*args)

  def mix_fwd(*args):
    return forward(*args), args

  def mix_bwd(res, ct):
    def body(s, carry):
      g_q, g_k, g_v, g_t = carry
      hh, fq, fk, vals, w = unpack(s, *res)
      g_num, g_den = head(ct[0], hh), head(ct[1][..., None], hh)[..., 0]
      cot = jnp.concatenate(
          [(fq[..., :, None] * g_num[..., None, :]).reshape(b, 1, n, -1), fq * g_den[..., None]],
          axis=-1,
      )
      y, vjp = jax.vjp(product, w, channels(fk, vals))
      g_w, g_x = vjp(cot)
      (y_kv, y_k), (gx_kv, gx_k) = split(y), split(g_x)
      gq = jnp.einsum("bhid,bhigd->bhig", g_num, y_kv) + g_den[..., None] * y_k
      gk = jnp.einsum("bhigd,bhid->bhig", gx_kv, vals) + gx_k
      put = lambda acc, x: jax.lax.dynamic_update_slice(
          acc, x.reshape(b, n, 1, group), (0, 0, hh, (s % per_head) * group)
      )
      return (
          put(g_q, gq),
          put(g_k, gk),
          add(g_v, hh, jnp.einsum("bhig,bhigd->bhid", fk, gx_kv)),
          jax.lax.dynamic_update_index_in_dim(
              g_t, jax.lax.dynamic_index_in_dim(g_t, hh, axis=0) + g_w, hh, axis=0
          ),
      )

    init = tuple(jnp.zeros_like(a) for a in res)  # zeros_like keeps each input's device type
    return jax.lax.fori_loop(0, h * per_head, body, init)

  mix.defvjp(mix_fwd, mix_bwd)
  return mix(phi_q, phi_k, v, rpe)


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
  pad = g * chunk - n

  def split(a):  # [b, h, n, e] -> [g, b, h, chunk, e]
    a = jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0)))
    return jnp.moveaxis(a.reshape(b, h, g, chunk, a.shape[-1]), 2, 0)

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
    seg = () if segment_ids is None else (carry[2], xs[3])
    if seg:
      scores, q_in, k_in, kv, ks, new_seg = _segment_step(*seg, scores, q_in, k_in, kv, ks)
    num = jnp.einsum("bhim,bhmd->bhid", q_in, carry[0]) + jnp.einsum("bhij,bhjd->bhid", scores, v_c)
    den = jnp.einsum("bhim,bhm->bhi", q_in, carry[1]) + jnp.sum(scores, axis=-1)
    kv = kv + jnp.einsum("bhjm,bhjd->bhmd", k_in, v_c)
    ks = ks + jnp.sum(k_in, axis=2)
    return (kv, ks) + ((new_seg,) if seg else ()), (num, den)

  if segment_ids is not None and init is not None:
    raise ValueError("_causal_chunked: segment_ids are not built with an init carry.")
  if init is None:
    init = (jnp.zeros((b, h, m, d), dtype), jnp.zeros((b, h, m), dtype))
  xs = (split(phi_q), split(phi_k), split(v))
  if segment_ids is not None:
    init = init + (jnp.full((b,), -1, jnp.int32),)  # the carry's segment: none yet
    xs = xs + (_chunk_ids(segment_ids, g, chunk),)
  _, (num, den) = jax.lax.scan(jax.checkpoint(body), init, xs)
  num = jnp.moveaxis(num, 0, 2).reshape(b, h, g * chunk, d)[:, :, :n]
  den = jnp.moveaxis(den, 0, 2).reshape(b, h, g * chunk)[:, :, :n]
  return num, den


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


# ---------------------------------------------------------------------------------------------
# Packed rows: linear attention inside segments
# ---------------------------------------------------------------------------------------------
def _check_segment_ids(segment_ids, b: int, n: int) -> None:
  if jnp.shape(segment_ids) != (b, n) or not jnp.issubdtype(
      jnp.result_type(segment_ids), jnp.integer
  ):
    raise ValueError(
        f"segment_ids must be an integer array [batch, N]=({b}, {n}); got shape "
        f"{jnp.shape(segment_ids)} of {jnp.result_type(segment_ids)}."
    )


def segmented_linear_attention(
    phi_q,
    phi_k,
    v,
    segment_ids,
    *,
    mask=None,
    causal: bool = False,
    rpe=None,
    decay=None,
    den_features=None,
    chunk_size: int | None = None,
    eps: float = DEFAULT_EPS,
    key_log_scale=None,
    key_eps: float = 0.0,
    num_segments: int | None = None,
):
  """``linear_attention`` over a packed row: query i sees key j only when
  ``segment_ids[i] == segment_ids[j]`` (and j <= i when causal), so each segment's outputs
  are those it has alone. Segments are contiguous runs of one id (a packed row); padding may
  carry any id (its keys are masked).

  Causal (with ``decay``, ``den_features`` or ``key_log_scale`` as in ``linear_attention``):
  the chunked scan's state, normaliser and running maximum restart at each segment start
  (``_causal_chunked``, ``_causal_running_max``). Bidirectional: each query reads its
  segment's total ``sum phi(k) v^T`` and ``sum phi(k)``, by default as two segment-reset
  scans (the inclusive prefix left to right plus the one right to left, minus the token's own
  term; O(N m d), no bound on the segment count), or with ``num_segments = G`` (ids in
  [0, G)) by a one-hot ``[N, G]`` matmul (O(N G m d), for a few segments per row).

  Not built (ValueError): ``rpe`` (its FFT Toeplitz product spans the row) and a
  bidirectional ``key_log_scale``.
  """
  b, n, h = _check_qkv(phi_q, phi_k, v, names=("phi_q", "phi_k", "v"))
  _check_segment_ids(segment_ids, b, n)
  mask = check_mask(mask, (b, n), against=f"phi_k of shape {phi_k.shape}")
  _check_decay(decay, h, causal)
  _check_den_features(den_features, phi_q, phi_k)
  if rpe is not None:
    raise ValueError(
        "segment_ids are not built with rpe: its Toeplitz product (FFT) spans the whole row."
    )
  if num_segments is not None and (causal or not _positive_int(num_segments)):
    raise ValueError(
        f"num_segments must be None or an int >= 1, bidirectional only; got {num_segments!r} "
        f"(causal={causal})."
    )
  if key_log_scale is not None:
    if not causal:
      raise ValueError("segment_ids with key_log_scale are built for causal=True only.")
    return _scaled_keys(
        *(phi_q, phi_k, v, mask, key_log_scale, key_eps),
        causal=True,
        rpe=None,
        decay=decay,
        den_features=den_features,
        chunk_size=chunk_size,
        eps=eps,
        segment_ids=segment_ids,
    )
  chunk = causal_chunk_size(phi_k.shape[-1], v.shape[-1]) if chunk_size is None else chunk_size
  if not _positive_int(chunk):
    raise ValueError(f"chunk_size must be a positive int or None; got {chunk_size}.")
  chunk = min(chunk, n)
  dtype = _state_dtype(phi_q, phi_k, v)
  log_decay = None if decay is None else decay.astype(dtype)
  ids = jnp.asarray(segment_ids).astype(jnp.int32)

  def contract(fq, fk, vals):  # [b, n, h, .] in, num [b, n, h, d] and den [b, n, h] out
    fk = _apply_key_mask(fk, mask, dtype)
    fq, fk, vals = (_head_major(a.astype(dtype)) for a in (fq, fk, vals))
    if causal:
      num, den = _causal_chunked(fq, fk, vals, chunk, log_decay, segment_ids=ids)
    elif num_segments is None:
      num, den = _segment_totals_by_scans(fq, fk, vals, ids, chunk)
    else:
      num, den = _segment_totals_one_hot(fq, fk, vals, ids, num_segments)
    return _head_major(num), jnp.transpose(den, (0, 2, 1))

  num, den = contract(phi_q, phi_k, v)
  if den_features is not None:
    den = contract(den_features[0], den_features[1], jnp.ones(v.shape[:-1] + (1,), dtype))[0]
    den = den[..., 0]
  return (num / _guard(den, eps)[..., None]).astype(v.dtype)


def _positive_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1


def _segment_totals_by_scans(fq, fk, vals, ids, chunk: int):
  """Bidirectional segment sums, head-major (``fq, fk [b, h, n, m]``, ``vals [b, h, n, d]``,
  ``ids [b, n]``): the segment-reset causal scan left to right (keys j <= i of i's segment)
  plus the one right to left (j >= i), minus query i's own key counted twice."""
  fwd = _causal_chunked(fq, fk, vals, chunk, segment_ids=ids)
  flip = lambda a: jnp.flip(a, axis=2)
  bwd = _causal_chunked(flip(fq), flip(fk), flip(vals), chunk, segment_ids=jnp.flip(ids, 1))
  own = jnp.sum(fq * fk, axis=-1)  # [b, h, n]
  num = fwd[0] + flip(bwd[0]) - own[..., None] * vals
  den = fwd[1] + jnp.flip(bwd[1], axis=2) - own
  return num, den


def _segment_totals_one_hot(fq, fk, vals, ids, num_segments: int):
  """Bidirectional segment sums by a one-hot ``[b, n, G]`` of the ids (ids outside [0, G)
  see nothing), as two plain matmuls: the states ``fk^T (one_hot x [v, 1])`` ``[b, h, m,
  G (d + 1)]`` of every segment at once, then ``fq`` against them, each query keeping its own
  segment's ``d + 1`` columns. O(N m G d)."""
  b, h, n, _ = fk.shape
  d = vals.shape[-1]
  one_hot = (ids[..., None] == jnp.arange(num_segments)[None, None]).astype(fq.dtype)[:, None]
  vals1 = jnp.concatenate([vals, jnp.ones(vals.shape[:-1] + (1,), vals.dtype)], axis=-1)
  spread = one_hot[..., None] * vals1[:, :, :, None, :]  # [b, h, n, G, d + 1]
  spread = spread.reshape(b, h, n, num_segments * (d + 1))
  states = jnp.einsum("bhjm,bhje->bhme", fk, spread)  # [b, h, m, G (d + 1)]
  read = jnp.einsum("bhim,bhme->bhie", fq, states).reshape(b, h, n, num_segments, d + 1)
  mine = jnp.einsum("bhige,bxig->bhie", read, one_hot)  # [b, h, n, d + 1]
  return mine[..., :d], mine[..., d]


def linear_attention_reference(
    phi_q,
    phi_k,
    v,
    *,
    mask=None,
    causal: bool = False,
    rpe=None,
    grid: Sequence[int] | None = None,
    decay=None,
    den_features=None,
    eps: float = DEFAULT_EPS,
    segment_ids=None,
):
  """Dense reference: materialises ``A = (phi_q phi_k^T) * C * R * masks`` of [b, h, N, N]
  (C the rpe Toeplitz matrix, R_ij = r^(i-j) the decay, masks: padding, causal, and with
  ``segment_ids`` [b, N] same segment) and normalises by the row sums of the same matrix built
  from ``den_features`` when given."""
  b, n, h = _check_qkv(phi_q, phi_k, v, names=("phi_q", "phi_k", "v"))
  mask = check_mask(mask, (b, n), against=f"phi_k of shape {phi_k.shape}")
  _check_rpe(rpe, h, n, grid)
  _check_decay(decay, h, causal)
  _check_den_features(den_features, phi_q, phi_k)
  dtype = _state_dtype(phi_q, phi_k, v)

  def scores(fq, fk):
    fk = _apply_key_mask(fk, mask, dtype)
    a = jnp.einsum("bihm,bjhm->bhij", fq.astype(dtype), fk)
    if rpe is not None:
      c = toeplitz.dense_toeplitz(rpe) if grid is None else toeplitz.dense_toeplitz_2d(rpe, grid)
      a = a * c[None].astype(dtype)
    if decay is not None:
      dist = jnp.maximum(jnp.arange(n)[:, None] - jnp.arange(n)[None, :], 0).astype(dtype)
      a = a * jnp.exp(decay.astype(dtype)[:, None, None] * dist[None])[None]
    if causal:
      a = jnp.where(toeplitz.causal_mask(n)[None, None], a, 0)
    if segment_ids is not None:
      a = jnp.where((segment_ids[:, :, None] == segment_ids[:, None, :])[:, None], a, 0)
    return a

  a = scores(phi_q, phi_k)
  num = jnp.einsum("bhij,bjhd->bihd", a, v.astype(dtype))
  a_den = a if den_features is None else scores(*den_features)
  den = jnp.transpose(jnp.sum(a_den, axis=-1), (0, 2, 1))
  return (num / _guard(den, eps)[..., None]).astype(v.dtype)
