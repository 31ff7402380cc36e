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
from fastpos.ops.linear_attn import dispatch
from fastpos.ops.linear_attn.common import _guard  # noqa: F401  (re-exported)
from fastpos.ops.linear_attn.recurrent import (  # noqa: F401  (re-exported)
    CAUSAL_PLAIN_CHUNK,
    _causal_chunked,
    _causal_plain,
    _causal_running_max,
    _causal_scan,
    _chunk_ids,
    _running_max_segments,
    _segment_step,
)
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


# How softmax attention runs, per backend, when ``implementation="auto"``. Each entry names the
# run that measured it:
# * cpu: "einsum", the faster of the two side by side fwd+bwd on the 2-core CPU (batch 1, 8
#   heads, d = 64, float32; `python -m benchmarks gpu --softmax-impls 1024,2048,4096`,
#   benchmarks/softmax_impls.md): "jax" took 1.05-1.08x its time plain, 0.96-1.05x causal
#   with a bias (medians of 5 interleaved runs at load 20, whose spread is larger: a small
#   lead, not a large one).
# * every other backend: "jax", ``jax.nn.dot_product_attention``, which reaches cuDNN's fused
#   kernel on GPUs for bf16 / fp16 inputs (not measured here).
SOFTMAX_IMPLEMENTATIONS = ("auto", "einsum", "jax", "cudnn")
_SOFTMAX_AUTO = {"cpu": "einsum"}


def _softmax_implementation(implementation: str, dtype, backend: str | None = None) -> str:
  """The implementation that runs: ``implementation`` itself, or for "auto" the backend's
  entry of ``_SOFTMAX_AUTO`` ("jax" where it has none). float64 always runs "einsum"
  (``jax.nn.dot_product_attention`` takes its softmax in float32)."""
  if implementation not in SOFTMAX_IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be one of {SOFTMAX_IMPLEMENTATIONS}; got {implementation!r}."
    )
  backend = jax.default_backend() if backend is None else backend
  if implementation == "cudnn" and backend != "gpu":
    raise ValueError(
        f"implementation='cudnn' needs a GPU; JAX runs on {backend!r}. Use 'auto', 'einsum' or "
        "'jax'."
    )
  if dtype == jnp.float64 and implementation != "cudnn":
    return "einsum"
  if implementation == "auto":
    return _SOFTMAX_AUTO.get(backend, "jax")
  return implementation


def _softmax_einsum(q, k, v, bias, allowed, scale):
  """``jax.nn.dot_product_attention``'s XLA computation written with two einsums: logits in
  float32 at least, the softmax in float32 (float64 for float64), probabilities cast to v's
  dtype, masked logits set to the dtype's lowest value (a row with no visible key averages
  every value, as there)."""
  wide = jnp.promote_types(q.dtype, jnp.float32)
  logits = jnp.einsum("bihd,bjhd->bhij", q, k, preferred_element_type=wide) * scale
  if bias is not None:
    logits = logits + bias.astype(wide)
  if allowed is not None:
    logits = jnp.where(allowed, logits, jnp.finfo(wide).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  return jnp.einsum("bhij,bjhd->bihd", probs, v)


def softmax_attention(
    q,
    k,
    v,
    *,
    bias=None,
    mask=None,
    causal: bool = False,
    scale: float | None = None,
    implementation: str = "auto",
):
  """Exact softmax attention ``softmax(q k^T * scale + bias) v`` (padded keys excluded).

  Args:
    q: ``[batch, Lq, heads, dim]``; k: ``[batch, Lk, heads, dim]``; v: ``[batch, Lk, heads,
      dim_v]``, with Lk >= Lq (the first M = Lk - Lq keys are memory preceding the queries;
      usually Lk == Lq).
    bias: additive logits bias ``[heads, Lq, Lk]`` or ``[batch|1, heads|1, Lq, Lk]``.
    mask: ``[batch, Lk]`` bool, True for real keys (any other dtype or shape: ValueError).
    causal: key j visible to query i iff j <= M + i.
    scale: defaults to ``1/sqrt(dim)``.
    implementation: which computation runs (the result is the same up to rounding):
      "einsum" (two einsums and a softmax, ``_softmax_einsum``), "jax"
      (``jax.nn.dot_product_attention``, which picks cuDNN's fused kernel on GPUs where dtype
      and shapes allow), "cudnn" (that function forced onto cuDNN: GPU only, bf16 / fp16), or
      "auto": per backend from ``_SOFTMAX_AUTO`` (measured: "einsum" on CPU; "jax"
      elsewhere). float64 inputs always run "einsum" (the other takes its softmax in float32;
      exactness tests run in float64), and so does "auto" when v's dim differs from q's (a
      features scheme such as SPE gives q, k ``num_realizations`` dims; the other two need one
      dim, and refuse it). Any other value: ValueError.

  Returns:
    ``[batch, Lq, heads, dim]`` in the promoted dtype of q, k, v.
  """
  bias, allowed = _softmax_inputs(q, k, v, bias, mask, causal)
  dtype = jnp.result_type(q, k, v)
  chosen = _softmax_implementation(implementation, dtype)
  if chosen != "einsum" and q.shape[-1] != v.shape[-1]:
    # jax.nn.dot_product_attention needs one dim for q, k and v; a features scheme (SPE)
    # gives q, k num_realizations dims.
    if implementation != "auto":
      raise ValueError(
          f"implementation={implementation!r} needs q, k and v of one dim; got q "
          f"{q.shape[-1]} and v {v.shape[-1]}. Use 'auto' or 'einsum'."
      )
    chosen = "einsum"
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  if chosen == "einsum":
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    return _softmax_einsum(q, k, v, bias, allowed, scale)
  if bias is not None:
    bias = bias.astype(dtype)
  return jax.nn.dot_product_attention(
      q,
      k,
      v,
      bias=bias,
      mask=allowed,
      scale=scale,
      implementation="cudnn" if chosen == "cudnn" else None,
  )


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
    mode: str = "auto",
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
      (``CAUSAL_PLAIN_CHUNK``) in the recurrent mode without decay, segments, key scales or
      den_features, else from the shape (``causal_chunk_size``).
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
    mode: the algorithm of the causal path without rpe (``fastpos.ops.linear_attn``), checked
      before any compute (another value: ValueError naming the choices):

      * ``"recurrent"``: a serial ``lax.scan`` over chunks (``linear_attn.recurrent``): one
        carried state ``[b, h, m, d]``, N / chunk steps in a row; the plain cell runs
        token-major chunks of ``CAUSAL_PLAIN_CHUNK`` with a written-out backward.
      * ``"chunk"``: chunkwise-parallel (``linear_attn.chunk``): every chunk's products at once,
        the chunk states' exclusive prefix by an associative scan (decay, segment resets and
        the running-maximum key stabiliser combined so every exponent stays <= 0). No serial
        loop (its compiled fwd+bwd has no while loop longer than 16 trips at N = 16K); holds
        every chunk's state ``[N / chunk, b, h, m, d]`` at once.
      * ``"fused"``: ``linear_attn.fused.causal``, one kernel for the causal product, where it
        is built; a cell it does not run (its ``supports``) and bidirectional attention raise
        ValueError naming the reason and the modes that run it.
      * ``"auto"``: the backend's entry of ``linear_attn.auto.TABLE`` (measured by
        ``python -m benchmarks modes``).

      All modes compute the same function (to rounding). Bidirectional attention, rpe and the
      dense reference take the same path in every mode but "fused".

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
  per-token ``[N, m, d]`` cumulative sum; the FFT rpe path holds one step's channels at a time
  (on CPU one head's group of features, on GPU / TPU every head and feature within a stated
  budget: ``_rpe_group``) and keeps only its inputs for the backward pass (``_rpe_mix``).
  """
  algo = dispatch.resolve(
      mode,
      causal=causal,
      segments=segment_ids is not None,
      key_scales=key_log_scale is not None,
      den_features=den_features is not None,
      rpe=rpe is not None,
  )
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
        mode=algo,
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
        mode=algo,
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
        mode=algo,
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
      mode=algo,
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
    mode: str = "recurrent",
):
  """``linear_attention`` with keys ``phi_k * exp(log_scale) + key_eps`` (see there); causal
  by the resolved ``mode`` ("chunk" or "recurrent", ``dispatch.running_max``)."""
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
    num, den, ref = dispatch.running_max(q, k, vals, s, k_eps, chunk, segment_ids, mode=mode)
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
    mode: str = "recurrent",
):
  """The body of ``linear_attention`` after its checks, shared with its context-parallel form.

  ``length`` is the whole sequence's (the rpe table's) length. ``split`` is None on one
  device, or the device-axis operations of ``fastpos.ops.context_parallel`` (``toeplitz``,
  ``varying``, ``causal``, ``psum``) when the inputs are this device's block of the sequence.
  ``mode``: the resolved causal algorithm ("recurrent", "chunk" or "fused";
  ``dispatch.resolve``); unused with ``split`` or ``rpe``.
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
      product = functools.partial(_product_1d, causal=causal, group_bytes=_rpe_fft_bytes())
    else:
      product = functools.partial(
          _product_2d, grid=tuple(grid), causal=causal, group_bytes=_rpe_fft_bytes()
      )
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
        num, den = dispatch.causal(fq, fk, vals, chunk, log_decay, mode=mode)
    else:
      kv = total(jnp.einsum("bhjm,bhjd->bhmd", fk, vals))
      k_sum = total(jnp.sum(fk, axis=2))  # [b, h, m]
      num = jnp.einsum("bhim,bhmd->bhid", fq, kv)
      den = jnp.einsum("bhim,bhm->bhi", fq, k_sum)
    return _head_major(num), jnp.transpose(den, (0, 2, 1))

  # The plain causal cell: the serial scan's token-major form with a written-out backward; the
  # other modes take the general path below (``contract``), head-major.
  if (
      mode == "recurrent"
      and causal
      and rpe is None
      and decay is None
      and den_features is None
      and split is None
  ):
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


def _product_1d(w, x, *, causal, group_bytes=None):
  return toeplitz.toeplitz_matmul(w, x, causal=causal, group_bytes=group_bytes)


def _product_2d(w, x, *, grid, causal, group_bytes=None):
  return toeplitz.toeplitz_matmul_2d(w, x, grid, causal=causal, group_bytes=group_bytes)


# The dense-or-FFT switch of kernelized RPE, per backend: up to these lengths it runs densely
# (``_rpe_dense``: the [N, N] scores cost N^2 (m + d) flops per head in large matmuls, against
# the FFT path's m (d + 1) FFTs of length ~2N, six passes of them fwd+bwd, at a fraction of the
# matmul rate; its memory is that of dense softmax with a bias). Each number names the run
# that measured it (fwd+bwd, m = 32, d = 64, 8 heads, batch 1):
# * CPU (and every backend but GPU): 2-core CPU, `python -m benchmarks ops_lean` (dense over
#   FFT 0.34x at N = 512, 0.49x at 1024, 0.85x at 2048, 1.30x at 4096; benchmarks/ops_lean.md).
#   The CPU's FFT path has not changed since (the same compiled program).
# * GPU: H200, `bash scripts/gpu_check.sh` (benchmarks/gpu/gpu.md, kRPE section): dense beat the
#   FFT path at every N = 1K-16K (28.5 vs 68.8 ms at 16384), but that FFT path ran in serial
#   steps; the check's "kRPE dense" and "kRPE FFT, one batch" rows re-measure the crossover
#   against the one batched transform the GPU takes now.
_RPE_DENSE_UP_TO = 2048
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


# The FFT path mixes m*d + m channels per head (Luo et al. Eq. 11-13): the outer products
# phi(k_j) v_j^T and phi(k_j), ``[batch, heads, N, m (d + 1)]``. The op runs in steps, each
# over some heads and a group of features per head (``_rpe_group``), the channels sliced
# from the inputs' own [b, n, h, .] layout and the results accumulated into outputs of that
# layout; the forward keeps nothing but the inputs for the backward (a custom VJP), which
# rebuilds each step's channels. How big a step is depends on the backend:
# * CPU: one head and at most _RPE_GROUP_BYTES of channels per step. XLA:CPU allocates an
#   executable's temporaries afresh per call (a page fault per fresh page), and all channels
#   at once hold 1.5 GiB of temporaries fwd+bwd at N = 4096 (B=1, 8 heads, m=32, d=64; 18 MiB
#   in steps); one batch took 1.25x / 1.28x the steps' time at N = 2048 / 4096 on the 2-core
#   CPU, side by side (`python -m benchmarks gpu --rpe-steps 2048,4096`,
#   benchmarks/rpe_steps.md).
# * GPU / TPU: every head and feature in one step (one batched FFT over all channels: a loop
#   of small steps was launch-bound, 37-60x the Toeplitz product of the same channel count
#   on an H200, benchmarks/gpu/summary.md), unless the channels exceed
#   _RPE_GROUP_BYTES_ACCELERATOR; then as many whole heads as fit, or one head's features.
#   A step's temporaries fwd+bwd are about 6-7x its channels (their spectra and cotangents;
#   XLA:CPU's memory_analysis at N = 4096), so up to ~14 GiB at the budget.
_RPE_GROUP_BYTES = 2 * 2**20
_RPE_GROUP_BYTES_ACCELERATOR = 2 * 2**30


def _rpe_fft_bytes(backend: str | None = None) -> int | None:
  """The spectrum bytes of one FFT group inside a step (``toeplitz_matmul(group_bytes=)``):
  the Toeplitz module's CPU default on "cpu"; elsewhere room for a whole step's spectrum
  (complex pairs of its channels at FFT length ~2N: about twice the channels' bytes), so
  that a step is one batched transform."""
  backend = jax.default_backend() if backend is None else backend
  return None if backend == "cpu" else 4 * _RPE_GROUP_BYTES_ACCELERATOR


def _largest_divisor(n: int, at_most: int) -> int:
  return max(g for g in range(1, n + 1) if n % g == 0 and g <= max(1, at_most))


def _rpe_group(
    b: int, n: int, h: int, m: int, d: int, itemsize: int, backend: str | None = None
) -> tuple[int, int]:
  """(heads, features per head) of one step of the FFT path (``_rpe_mix``): its channels are
  ``[b, heads, n, features (d + 1)]`` of ``itemsize`` bytes. On "cpu" one head and the largest
  divisor of m whose channels fit ``_RPE_GROUP_BYTES``; on every other backend (``backend``
  is ``jax.default_backend()`` at trace time when None) all ``(h, m)`` when they fit
  ``_RPE_GROUP_BYTES_ACCELERATOR``, else the largest divisor of h whose whole heads fit, else
  one head's largest fitting divisor of m. At least (1, 1); divisors, so steps are slices."""
  backend = jax.default_backend() if backend is None else backend
  one_channel = b * n * itemsize  # bytes of one channel of one head
  if backend == "cpu":
    return 1, _largest_divisor(m, _RPE_GROUP_BYTES // (one_channel * (d + 1)))
  budget = _RPE_GROUP_BYTES_ACCELERATOR // one_channel  # channels in one step
  if budget >= m * (d + 1):
    return _largest_divisor(h, budget // (m * (d + 1))), m
  return 1, _largest_divisor(m, budget // (d + 1))


def _rpe_mix(phi_q, phi_k, v, rpe, product, zeros=None):
  """Luo et al. Eq. 11-13 by FFT: Toeplitz-mix vec(phi_k v^T) (m*d channels) and phi_k (m).

  ``phi_q, phi_k [b, n, h, m]``, ``v [b, n, h, d]``, ``rpe [h, ...]``; returns num
  ``[b, n, h, d]``, den ``[b, n, h]``. ``product(w, x)`` maps channels ``x [b, k, n, C]`` to
  their relative (Toeplitz) product under k heads' tables ``w [k, ...]``; ``zeros``, when
  given, types the loops' zero carries (the context-parallel caller marks them varying over
  its device axis).

  One step per (block of heads, group of features) (``_rpe_group``; one step in all on
  accelerators where memory allows). Backward, per step: the channels ``X`` are rebuilt, and
  one ``jax.vjp`` of the product gives ``Y = T X`` (for the gradient of phi_q), ``T^T G`` and
  the table's gradient, for the cotangent channels ``G = phi_q (x) [g_num, g_den]``.
  Residuals: the inputs alone.
  """
  b, n, h, m = phi_k.shape
  d = v.shape[-1]
  heads, group = _rpe_group(b, n, h, m, d, jnp.dtype(v.dtype).itemsize)
  per_head = m // group
  steps = (h // heads) * per_head
  mark = (lambda t: t) if zeros is None else zeros
  phi_q, phi_k, v = mark((phi_q, phi_k, v))  # den_features' ones column: same on every device

  def start(s):  # the step's first head and first feature
    return (s // per_head) * heads, (s % per_head) * group

  def take(a, s, size=None):  # [b, n, h, e] -> [b, heads, n, size] (one head: a reshape)
    hh, ff = start(s)
    ff, size = (0, a.shape[-1]) if size is None else (ff, size)
    a = jax.lax.dynamic_slice(a, (0, 0, hh, ff), (b, n, heads, size))
    return a.reshape(b, 1, n, size) if heads == 1 else jnp.swapaxes(a, 1, 2)

  def token_major(x):  # [b, heads, n, ...] -> [b, n, heads, ...]
    return x.reshape((b, n, 1) + x.shape[3:]) if heads == 1 else jnp.swapaxes(x, 1, 2)

  def add(acc, s, x):  # acc[:, :, heads of s] += x, x [b, heads, n, e] (or [b, heads, n])
    x = token_major(x)
    at = (0, 0, start(s)[0]) + (0,) * (x.ndim - 3)
    return jax.lax.dynamic_update_slice(acc, jax.lax.dynamic_slice(acc, at, x.shape) + x, at)

  def unpack(s, fq_all, fk_all, vals_all, table):
    fq, fk = (take(a, s, group) for a in (fq_all, fk_all))
    w = jax.lax.dynamic_slice_in_dim(table, start(s)[0], heads, axis=0)  # [heads, ...]
    return fq, fk, take(vals_all, s), w

  def channels(fk, vals):  # [b, k, n, g], [b, k, n, d] -> [b, k, n, g d + g]
    kv = (fk[..., :, None] * vals[..., None, :]).reshape(b, heads, n, group * d)
    return jnp.concatenate([kv, fk], axis=-1)

  def split(y):  # [b, k, n, g d + g] -> [b, k, n, g, d], [b, k, n, g]
    return y[..., : group * d].reshape(b, heads, n, group, d), y[..., group * d :]

  def loop(body, init):  # one step: no loop (XLA folds the full-size slices and updates)
    return body(0, init) if steps == 1 else jax.lax.fori_loop(0, steps, body, init)

  def forward(*args):
    def body(s, carry):
      fq, fk, vals, w = unpack(s, *args)
      y_kv, y_k = split(product(w, channels(fk, vals)))
      return (
          add(carry[0], s, jnp.einsum("bhig,bhigd->bhid", fq, y_kv)),
          add(carry[1], s, jnp.einsum("bhig,bhig->bhi", fq, y_k)),
      )

    init = mark((jnp.zeros((b, n, h, d), v.dtype), jnp.zeros((b, n, h), v.dtype)))
    return loop(body, init)

  @jax.custom_vjp
  def mix(*args):
    return forward(*args)

  def mix_fwd(*args):
    return forward(*args), args

  def mix_bwd(res, ct):
    def body(s, carry):
      g_q, g_k, g_v, g_t = carry
      fq, fk, vals, w = unpack(s, *res)
      g_num, g_den = take(ct[0], s), take(ct[1][..., None], s)[..., 0]
      cot = jnp.concatenate(
          [
              (fq[..., :, None] * g_num[..., None, :]).reshape(b, heads, n, -1),
              fq * g_den[..., None],
          ],
          axis=-1,
      )
      y, vjp = jax.vjp(product, w, channels(fk, vals))
      g_w, g_x = vjp(cot)
      (y_kv, y_k), (gx_kv, gx_k) = split(y), split(g_x)
      gq = jnp.einsum("bhid,bhigd->bhig", g_num, y_kv) + g_den[..., None] * y_k
      gk = jnp.einsum("bhigd,bhid->bhig", gx_kv, vals) + gx_k
      hh, ff = start(s)
      put = lambda acc, x: jax.lax.dynamic_update_slice(acc, token_major(x), (0, 0, hh, ff))
      return (
          put(g_q, gq),
          put(g_k, gk),
          add(g_v, s, jnp.einsum("bhig,bhigd->bhid", fk, gx_kv)),
          jax.lax.dynamic_update_slice_in_dim(
              g_t, jax.lax.dynamic_slice_in_dim(g_t, hh, heads, axis=0) + g_w, hh, axis=0
          ),
      )

    init = tuple(jnp.zeros_like(a) for a in res)  # zeros_like keeps each input's device type
    return loop(body, init)

  mix.defvjp(mix_fwd, mix_bwd)
  return mix(phi_q, phi_k, v, rpe)


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
    mode: str = "auto",
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
  bidirectional ``key_log_scale``. ``mode`` as in ``linear_attention`` (causal only; the
  bidirectional scans are the serial ones whatever the mode).
  """
  algo = dispatch.resolve(
      mode,
      causal=causal,
      segments=True,
      key_scales=key_log_scale is not None,
      den_features=den_features is not None,
      rpe=rpe is not None,
  )
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
        mode=algo,
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
      num, den = dispatch.causal(fq, fk, vals, chunk, log_decay, ids, mode=algo)
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
