"""Softmax attention and kernelized (linear) attention, with their dense references.

Shapes: ``q, k, v: [batch, length, heads, dim]``; feature maps ``phi_q, phi_k:
[batch, length, heads, m]``; ``mask: [batch, length]`` boolean, True for real tokens (padding
is excluded as keys: it contributes nothing to numerators and denominators). Masks of any other
dtype (0/1 ints, floats, additive 0/-inf masks) raise ``ValueError``; see
``fastpos.ops.masks``. Outputs are ``[batch, length, heads, dim]``. Rows of padded queries are
computed but meaningless.

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
def _check_qkv(q, k, v, names=("q", "k", "v"), *, same_length: bool = True
               ) -> tuple[int, int, int]:
  """Validates ranks and shapes; returns (batch, query length, heads). With
  ``same_length=False`` keys may be longer than queries (memory keys first)."""
  for name, a in zip(names, (q, k, v)):
    if jnp.ndim(a) != 4:
      raise ValueError(
          f"{name} must be [batch, length, heads, dim] (rank 4); got shape {jnp.shape(a)}.")
  b, n, h, _ = q.shape
  nk = k.shape[1] if not same_length else n
  if (k.shape[:3] != (b, nk, h) or v.shape[:3] != (b, nk, h)
      or (not same_length and nk < n)):
    what = "[batch, length, heads]" if same_length else (
        "batch and heads, with key length >= query length")
    raise ValueError(
        f"{names[0]}, {names[1]}, {names[2]} must share {what}; got "
        f"{q.shape}, {k.shape}, {v.shape}.")
  if k.shape[-1] != q.shape[-1]:
    raise ValueError(
        f"{names[0]} and {names[1]} must have the same last dim; got {q.shape} and {k.shape}.")
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
          f"Lq={n}, Lk={nk}; got shape {bias.shape}.")
  allowed = None if mask is None else mask[:, None, None, :]
  if causal:
    cm = (jnp.arange(nk)[None, :] <= (nk - n) + jnp.arange(n)[:, None])[None, None]
    allowed = cm if allowed is None else (allowed & cm)
  return bias, allowed


def softmax_attention(q, k, v, *, bias=None, mask=None, causal: bool = False,
                      scale: float | None = None):
  """Exact softmax attention ``softmax(q k^T * scale + bias) v`` (padded keys excluded).

  Runs through ``jax.nn.dot_product_attention`` so that GPUs reach the fused (cuDNN) kernel
  where dtype and shapes allow. That function always takes the softmax in float32, so float64
  inputs go through the plain XLA formula instead (exactness tests run in float64).

  Args:
    q: ``[batch, Lq, heads, dim]``; k, v: ``[batch, Lk, heads, dim]`` with Lk >= Lq (the
      first M = Lk - Lq keys are memory preceding the queries; usually Lk == Lq).
    bias: additive logits bias ``[heads, Lq, Lk]`` or ``[batch|1, heads|1, Lq, Lk]``.
    mask: ``[batch, Lk]`` bool, True for real keys (any other dtype or shape: ValueError).
    causal: key j visible to query i iff j <= M + i.
    scale: defaults to ``1/sqrt(dim)``.
  """
  bias, allowed = _softmax_inputs(q, k, v, bias, mask, causal)
  dtype = jnp.result_type(q, k, v)
  if dtype != jnp.float64:
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


def softmax_attention_reference(q, k, v, *, bias=None, mask=None, causal: bool = False,
                                scale: float | None = None):
  """Dense reference written out step by step: scores, a 0/1 visibility matrix multiplying
  ``exp(s - max)``, explicit normalisation. Computed in float64 when x64 is enabled."""
  bias, allowed = _softmax_inputs(q, k, v, bias, mask, causal)
  dtype = jnp.result_type(q, k, v)
  wide = jnp.promote_types(dtype, jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
  q, k, v = (a.astype(wide) for a in (q, k, v))
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  s = jnp.einsum("bihd,bjhd->bhij", q, k) * scale
  if bias is not None:
    s = s + bias.astype(wide)
  vis = jnp.ones_like(s) if allowed is None else jnp.broadcast_to(allowed, s.shape).astype(wide)
  e = jnp.exp(s - jnp.max(jnp.where(vis > 0, s, -jnp.inf), axis=-1, keepdims=True)) * vis
  p = e / jnp.sum(e, axis=-1, keepdims=True)
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
          f"got shape {jnp.shape(rpe)}.")
  else:
    gh, gw = toeplitz._check_grid(grid, n)
    expected = (h, 2 * gh - 1, 2 * gw - 1)
    if jnp.shape(rpe) != expected:
      raise ValueError(
          f"rpe with grid {tuple(grid)} must be [heads, 2H-1, 2W-1]={expected}; got shape "
          f"{jnp.shape(rpe)}.")
  # Positivity can only be checked on concrete values; under jit the caller guarantees it
  # (the positional modules pass exp(b)).
  if not isinstance(rpe, jax.core.Tracer):
    bad = np.min(np.asarray(rpe))
    if not bad > 0:
      raise ValueError(
          f"rpe must be a table of positive weights c = exp(b) > 0; its minimum is {float(bad)}.")


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
        f"decay must be [heads]=({h},) log-decays log r <= 0; got shape {jnp.shape(decay)}.")
  if not isinstance(decay, jax.core.Tracer):
    worst = np.max(np.asarray(decay))
    if not worst <= 0:
      raise ValueError(
          f"decay holds log r and must be <= 0 (0 < r <= 1); its maximum is {float(worst)}.")


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
          f"{jnp.shape(a)}.")
  if jnp.shape(dq)[-1] != jnp.shape(dk)[-1]:
    raise ValueError(f"phi_q_den and phi_k_den must share m'; got {jnp.shape(dq)}, "
                     f"{jnp.shape(dk)}.")


def causal_chunk_size(m: int, d: int) -> int:
  """The chunk of causal linear attention for ``m`` features and value size ``d``.

  Per token and head a chunk of c costs c (m + d) inside the chunk (half of it masked) and
  2 m d for the carried state: c = m d / (m + d) would balance them, but every chunk is one
  step of a serial scan. Measured fwd+bwd on a 2-core CPU (N = 4096, 8 heads, d = 64; time
  against the bidirectional path, benchmarks/README.md): chunk 64 is fastest for m <= 64
  (1.3-1.6x) and chunk 32 for m = 256 (1.3x, against 1.7x at 64)."""
  return 32 if m * d >= 48 * (m + d) else 64


def linear_attention(phi_q, phi_k, v, *, mask=None, causal: bool = False, rpe=None,
                     grid: Sequence[int] | None = None, decay=None, den_features=None,
                     chunk_size: int | None = None, eps: float = DEFAULT_EPS):
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
    chunk_size: chunk length of the causal path without rpe; None picks it from the shape
      (``causal_chunk_size``).
    eps: denominator guard (``_guard``), applied to the denominator after the contraction
      with ``phi_q``.

  Cost: O(N m d) without rpe (causal: plus O(N * chunk * (m + d)) inside chunks), O(N log N
  m d) with rpe. Memory of the causal path: one carried state ``[batch, heads, m, d]`` in the
  forward pass and the per-chunk states ``[N/chunk, batch, heads, m, d]`` kept for the
  backward pass, never a per-token ``[N, m, d]`` cumulative sum; the rpe path holds one group
  of features' ``[N, group*d]`` channels at a time (``_rpe_mix``).
  """
  b, n, h = _check_qkv(phi_q, phi_k, v, names=("phi_q", "phi_k", "v"))
  mask = check_mask(mask, (b, n), against=f"phi_k of shape {phi_k.shape}")
  _check_rpe(rpe, h, n, grid)
  _check_decay(decay, h, causal)
  _check_den_features(den_features, phi_q, phi_k)
  if grid is not None and rpe is None:
    raise ValueError("grid is only used together with a 2D rpe table; got rpe=None.")
  return _mix(phi_q, phi_k, v, mask, causal=causal, rpe=rpe, grid=grid, decay=decay,
              den_features=den_features, chunk_size=chunk_size, eps=eps, length=n)


def _mix(phi_q, phi_k, v, mask, *, causal, rpe, grid, decay, den_features, chunk_size, eps,
         length, split=None):
  """The body of ``linear_attention`` after its checks, shared with its context-parallel form.

  ``length`` is the whole sequence's (the rpe table's) length. ``split`` is None on one
  device, or the device-axis operations of ``fastpos.ops.context_parallel`` (``toeplitz``,
  ``varying``, ``causal``, ``psum``) when the inputs are this device's block of the sequence.
  """
  if chunk_size is None:
    chunk_size = causal_chunk_size(phi_k.shape[-1], v.shape[-1])
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int or None; got {chunk_size}.")
  out_dtype = v.dtype
  dtype = _state_dtype(phi_q, phi_k, v)
  if rpe is not None and decay is not None:
    rpe = rpe.astype(dtype) * jnp.exp(_decay_table(decay.astype(dtype), length, grid))
    decay = None
  log_decay = None if decay is None else decay.astype(dtype)
  if rpe is not None:
    rpe = rpe.astype(dtype)
    if split is not None:
      product, zeros = split.toeplitz(rpe, causal), split.varying
    elif grid is None:
      product = functools.partial(toeplitz.toeplitz_matmul, rpe, causal=causal, remat=False)
      zeros = None
    else:
      product = lambda x: toeplitz.toeplitz_matmul_2d(rpe, x, grid, causal=causal, remat=False)
      zeros = None
  total = (lambda x: x) if split is None else split.psum

  def contract(fq, fk, vals):
    fq = fq.astype(dtype)
    fk = _apply_key_mask(fk, mask, dtype)
    vals = vals.astype(dtype)
    if rpe is not None:
      return _rpe_mix(fq, fk, vals, product, zeros)
    if causal:
      chunk = min(chunk_size, fk.shape[1])
      if split is not None:
        return split.causal(fq, fk, vals, chunk, log_decay)
      return _causal_chunked(fq, fk, vals, chunk, log_decay)
    kv = total(jnp.einsum("bjhm,bjhd->bhmd", fk, vals))
    k_sum = total(jnp.sum(fk, axis=1))  # [b, h, m]
    return (jnp.einsum("bihm,bhmd->bihd", fq, kv),
            jnp.einsum("bihm,bhm->bih", fq, k_sum))

  num, den = contract(phi_q, phi_k, v)
  if den_features is not None:
    ones = jnp.ones(v.shape[:-1] + (1,), dtype)
    den = contract(den_features[0], den_features[1], ones)[0][..., 0]
  return (num / _guard(den, eps)[..., None]).astype(out_dtype)


def _decay_table(log_decay, n: int, grid):
  """``[heads, 2N-1]`` log weights (i-j) log r for j <= i (raster offsets on a grid; the
  causal mask removes j > i). Used to fold a decay into an rpe table."""
  if grid is None:
    offsets = jnp.arange(-(n - 1), n)  # j - i
  else:
    gh, gw = grid
    offsets = (jnp.arange(-(gh - 1), gh)[:, None] * gw + jnp.arange(-(gw - 1), gw)[None, :])
  dist = jnp.maximum(-offsets, 0).astype(log_decay.dtype)
  return log_decay.reshape((-1,) + (1,) * dist.ndim) * dist[None]


# The rpe product mixes m*d + m channels per head (Luo et al. Eq. 11-13). All of them at once
# hold the [batch, heads, N, m*d] outer products phi(k_j) v_j^T and their spectra: 1.3 GiB of
# temporaries fwd+bwd at N = 4096 (B=1, 8 heads, m=32, d=64). Instead the features run in
# groups of about _RPE_GROUP_BYTES of channels, one after the other (lax.scan), each group's
# body rematerialised in the backward pass: the outer products and spectra exist one group at
# a time and the numerator and denominator are accumulated over groups. The price: the
# backward pass recomputes each group's Toeplitz product (the gradient of phi_q needs it), three
# FFT passes instead of two (benchmarks/README.md, "Long sequences on one device").
_RPE_GROUP_BYTES = 8 * 2 ** 20


def _rpe_mix(phi_q, phi_k, v, product, zeros=None):
  """Luo et al. Eq. 11-13: Toeplitz-mix vec(phi_k v^T) (m*d channels) and phi_k (m).

  ``product`` maps channels ``[b, h, n, C]`` to their relative (Toeplitz) product, the same
  shape; ``zeros``, when given, types the scan's zero carry (the context-parallel caller marks
  it varying over its device axis)."""
  b, n, h, m = phi_k.shape
  d = v.shape[-1]
  per_feature = b * h * n * (d + 1) * jnp.dtype(v.dtype).itemsize
  group = int(max(1, min(m, _RPE_GROUP_BYTES // per_feature)))
  steps = -(-m // group)
  group = -(-m // steps)
  pad = steps * group - m  # zero features add nothing to numerator or denominator

  def split(phi):  # [b, n, h, m] -> [steps, b, h, n, group]
    phi = jnp.pad(phi, ((0, 0), (0, 0), (0, 0), (0, pad)))
    return jnp.moveaxis(phi.reshape(b, n, h, steps, group), (3, 2), (0, 2))

  vals = jnp.transpose(v, (0, 2, 1, 3))  # [b, h, n, d]

  @jax.checkpoint
  def mix(fq, fk):  # [b, h, n, group] each -> num [b, h, n, d], den [b, h, n]
    kv = (fk[..., :, None] * vals[..., None, :]).reshape(b, h, n, group * d)
    mixed = product(jnp.concatenate([kv, fk], axis=-1))
    num = jnp.einsum("bhig,bhigd->bhid", fq, mixed[..., : group * d].reshape(b, h, n, group, d))
    den = jnp.einsum("bhig,bhig->bhi", fq, mixed[..., group * d:])
    return num, den

  def step(carry, fqk):
    num, den = mix(*fqk)
    return (carry[0] + num, carry[1] + den), None

  init = (jnp.zeros((b, h, n, d), v.dtype), jnp.zeros((b, h, n), v.dtype))
  if zeros is not None:
    init = zeros(init)
  (num, den), _ = jax.lax.scan(step, init, (split(phi_q), split(phi_k)))
  return jnp.transpose(num, (0, 2, 1, 3)), jnp.transpose(den, (0, 2, 1))


def _causal_chunked(phi_q, phi_k, v, chunk: int, log_decay=None, init=None):
  """Causal linear attention by chunks: exact inside a chunk, carried state between chunks.

  The sequence is zero-padded to a multiple of ``chunk`` (zero keys add nothing) and scanned
  chunk by chunk (``lax.scan``). The carry entering chunk g is the sum over earlier chunks of
  ``phi_k^T v`` ``[b, h, m, d]`` and of ``phi_k`` ``[b, h, m]``; inside a chunk the scores
  ``phi_q phi_k^T`` ``[b, h, chunk, chunk]`` are masked to j <= i. Each step works on one
  chunk ``[b, chunk, h, .]`` sliced from the inputs' own layout, so the head-major transposes
  stay in cache (no O(N) transpose, no O(N/chunk) cumulative sum in memory), and the body is
  rematerialised in the backward pass (``jax.checkpoint``): the residuals are the carries.
  With ``log_decay`` (``[heads]``, g = log r <= 0) key j weighs r^(i-j) for query i, split as
  r^(i - start) (query side, inside its chunk) times r^(start - j) (the carried state, decayed
  by r^chunk per chunk): every exponent is <= 0, so nothing overflows. ``init``: the carry
  entering the first chunk (keys before the sequence, weighted r^(-j) for a key at j < 0);
  zeros when None.
  """
  b, n, h, m = phi_k.shape
  d = v.shape[-1]
  dtype = phi_q.dtype
  g = -(-n // chunk)
  pad = g * chunk - n

  def split(a):  # [b, n, h, e] -> [g, b, chunk, h, e] (a reshape for b = 1)
    a = jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return jnp.moveaxis(a.reshape(b, g, chunk, h, a.shape[-1]), 1, 0)

  t = jnp.arange(chunk, dtype=dtype)
  mask = toeplitz.causal_mask(chunk)
  if log_decay is not None:
    dist = jnp.maximum(t[:, None] - t[None, :], 0)
    intra = jnp.where(mask[None], jnp.exp(log_decay[:, None, None] * dist[None]),
                      jnp.zeros((), dtype))[None]  # [1, h, chunk, chunk]
    # Keys weighted by r^(chunk - t) toward the end of their chunk; queries by r^t.
    k_w = jnp.exp(log_decay[:, None] * (chunk - t)[None, :])[None, :, :, None]
    q_w = jnp.exp(log_decay[:, None] * t[None, :])[None, :, :, None]
    step = jnp.exp(log_decay * chunk)[None, :, None]  # r^chunk per chunk, [1, h, 1]

  def body(carry, xs):
    kv, ks = carry  # [b, h, m, d], [b, h, m]
    q_c, k_c, v_c = (jnp.transpose(a, (0, 2, 1, 3)) for a in xs)  # [b, h, chunk, .]
    scores = jnp.einsum("bhim,bhjm->bhij", q_c, k_c)
    if log_decay is None:
      scores = jnp.where(mask, scores, jnp.zeros((), dtype))
      q_in, k_in = q_c, k_c
    else:
      scores = scores * intra
      q_in, k_in = q_c * q_w, k_c * k_w
      kv, ks = kv * step[..., None], ks * step
    num = (jnp.einsum("bhim,bhmd->bhid", q_in, carry[0])
           + jnp.einsum("bhij,bhjd->bhid", scores, v_c))
    den = jnp.einsum("bhim,bhm->bhi", q_in, carry[1]) + jnp.sum(scores, axis=-1)
    kv = kv + jnp.einsum("bhjm,bhjd->bhmd", k_in, v_c)
    ks = ks + jnp.sum(k_in, axis=2)
    return (kv, ks), (jnp.transpose(num, (0, 2, 1, 3)), jnp.transpose(den, (0, 2, 1)))

  if init is None:
    init = (jnp.zeros((b, h, m, d), dtype), jnp.zeros((b, h, m), dtype))
  _, (num, den) = jax.lax.scan(jax.checkpoint(body), init,
                               (split(phi_q), split(phi_k), split(v)))
  num = jnp.moveaxis(num, 0, 1).reshape(b, g * chunk, h, d)[:, :n]
  den = jnp.moveaxis(den, 0, 1).reshape(b, g * chunk, h)[:, :n]
  return num, den


def linear_attention_reference(phi_q, phi_k, v, *, mask=None, causal: bool = False, rpe=None,
                               grid: Sequence[int] | None = None, decay=None,
                               den_features=None, eps: float = DEFAULT_EPS):
  """Dense reference: materialises ``A = (phi_q phi_k^T) * C * R * masks`` of [b, h, N, N]
  (C the rpe Toeplitz matrix, R_ij = r^(i-j) the decay) and normalises by the row sums of the
  same matrix built from ``den_features`` when given."""
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
    return a

  a = scores(phi_q, phi_k)
  num = jnp.einsum("bhij,bjhd->bihd", a, v.astype(dtype))
  a_den = a if den_features is None else scores(*den_features)
  den = jnp.transpose(jnp.sum(a_den, axis=-1), (0, 2, 1))
  return (num / _guard(den, eps)[..., None]).astype(v.dtype)
