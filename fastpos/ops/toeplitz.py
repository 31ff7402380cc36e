"""Toeplitz products by FFT, 1D and 2D, causal or not, with their dense references.

Convention (FastRPB Eq. 12, Luo et al. Eq. 12): a relative table is indexed by the offset
``j - i`` (key position minus query position). A 1D table ``w`` has length ``2N-1`` and
``w[(j - i) + N - 1]`` is the weight of the pair (query i, key j), i.e. the matrix is
``W[i, j] = w_{j-i}``; the first row is ``w_0, w_1, ..., w_{N-1}``.

Why FFT works: ``out[i] = sum_j w_{j-i} x[j]`` is a linear convolution of ``x`` with the
kernel ``a[m] = w_{-m}`` (m = i - j in [-(N-1), N-1]). Embedding ``a`` in a circular kernel of
length ``L >= 2N-1`` (non-negative m at the front, negative m wrapped to the back) makes the
circular convolution equal the linear one on the first N outputs, so
``out = irfft(rfft(a, L) * rfft(x, L))[:N]`` in O(N log N) time and O(L) memory per channel.
Causal (``j <= i``, i.e. m >= 0) keeps only the front half of the kernel; nothing from the
future can wrap around because ``L >= 2N-1``.

FFTs run in float32 (complex64) for float32 / bfloat16 / float16 inputs and in float64 for
float64 inputs; the result is cast back to the promoted input dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


# ---------------------------------------------------------------------------------------------
# FFT sizes
# ---------------------------------------------------------------------------------------------
def fft_size(n: int) -> int:
  """Smallest 5-smooth integer (2^a 3^b 5^c) that is >= ``n``.

  Every FFT backend (ducc on CPU, cuFFT, the TPU FFT) has fast radix-2/3/5 kernels, and the
  next 5-smooth size is at most a few percent above ``n`` where the next power of two can be
  almost 2x above it: ``2N-1`` for N = 1000 gives 2000 rather than 2048, for N = 4097 8192
  rather than 16384. The benchmark script compares this choice with powers of two.
  """
  if n <= 1:
    return 1
  best = 1 << (n - 1).bit_length()  # the next power of two is always a candidate
  p5 = 1
  while p5 < best:
    p35 = p5
    while p35 < best:
      p = p35
      while p < n:
        p *= 2
      best = min(best, p)
      p35 *= 3
    p5 *= 5
  return best


def _conv_fft_size(n: int) -> int:
  return fft_size(n)


# ---------------------------------------------------------------------------------------------
# Validation helpers (run on static shapes, before any compute)
# ---------------------------------------------------------------------------------------------
def _check_rank(name: str, a, min_rank: int, what: str) -> None:
  if jnp.ndim(a) < min_rank:
    raise ValueError(f"{name} must have rank >= {min_rank} ({what}); got shape {jnp.shape(a)}.")


def _broadcast_batch(name_w: str, w_batch: tuple, x_batch: tuple) -> tuple:
  try:
    return tuple(np.broadcast_shapes(w_batch, x_batch))
  except ValueError:
    raise ValueError(
        f"The leading dims of {name_w} {w_batch} do not broadcast against the leading dims "
        f"of x {x_batch} (e.g. one table per head: w [heads, 2N-1], x [batch, heads, N, C])."
    ) from None


def _compute_dtype(*arrays):
  """float64 stays float64; everything else is computed in float32."""
  out = jnp.result_type(*arrays)
  return out, (jnp.float64 if out == jnp.float64 else jnp.float32)


def _expand_to(a, batch_rank: int, tail_rank: int):
  """Prepends unit dims so that ``a``'s leading dims have rank ``batch_rank`` (no implicit
  rank promotion)."""
  missing = batch_rank - (a.ndim - tail_rank)
  return a.reshape((1,) * missing + a.shape)


def _circular_kernel(w, n: int, fft_len: int, axis: int, causal: bool):
  """Turns a relative table along ``axis`` (length 2n-1, offset j-i) into the circular
  convolution kernel of length ``fft_len``: ``a[m mod fft_len] = w_{-m}``.

  The reversed table ``r = w[::-1]`` holds ``r[t] = w_{n-1-t}``: its back half
  ``r[n-1:]`` is ``a[0..n-1]`` (m >= 0, the past and the diagonal) and its front half
  ``r[:n-1]`` is ``a[-(n-1)..-1]`` (m < 0, the future), which goes to the end of the kernel.
  """
  r = jnp.flip(w, axis=axis)
  past = jnp.take(r, jnp.arange(n - 1, 2 * n - 1), axis=axis)
  future = jnp.take(r, jnp.arange(0, n - 1), axis=axis)
  if causal:
    future = jnp.zeros_like(future)
  pad_shape = list(w.shape)
  pad_shape[axis] = fft_len - (2 * n - 1)
  return jnp.concatenate([past, jnp.zeros(pad_shape, w.dtype), future], axis=axis)


# ---------------------------------------------------------------------------------------------
# 1D
# ---------------------------------------------------------------------------------------------
def toeplitz_matmul(
    w, x, *, causal: bool = False, remat: bool = True, group_bytes: int | None = None
):
  """Toeplitz product ``out[i] = sum_j w[j - i + N - 1] x[j]`` by FFT (FastRPB Eq. 12).

  Args:
    w: ``[..., 2N-1]`` relative table indexed by offset ``j - i``; its leading dims broadcast
      against those of ``x`` (e.g. ``[heads, 2N-1]`` with ``x [batch, heads, N, C]``).
    x: ``[..., N, C]``.
    causal: keep only ``j <= i`` (lower-triangular W).
    remat: recompute each group's FFTs in the backward pass instead of keeping them (see
      ``_map_over_batch``); False when the caller already rematerialises around this call.
    group_bytes: the spectrum bytes of one group of the batch (``_map_over_batch``); None:
      ``_GROUP_BYTES``, measured on CPU. A caller on an accelerator passes more (one group:
      one batched transform instead of a serial loop).

  Returns:
    ``[broadcast(...), N, C]`` in the promoted dtype of ``w`` and ``x``. Cost O(N log N) per
    channel, extra memory O(N) per channel.
  """
  _check_rank("x", x, 2, "[..., N, C]")
  _check_rank("w", w, 1, "[..., 2N-1]")
  n = x.shape[-2]
  if w.shape[-1] != 2 * n - 1:
    raise ValueError(
        f"w has {w.shape[-1]} entries along its last axis; a sequence of N={n} needs "
        f"2N-1={2 * n - 1} (offsets j-i from -(N-1) to N-1)."
    )
  batch = _broadcast_batch("w", w.shape[:-1], x.shape[:-2])
  out_dtype, dtype = _compute_dtype(w, x)
  fft_len = _conv_fft_size(2 * n - 1)

  w = _expand_to(w.astype(dtype), len(batch), 1)
  x = _expand_to(x.astype(dtype), len(batch), 2)
  if causal and n <= _DENSE_BELOW:
    t = jnp.where(causal_mask(n), dense_toeplitz(w), jnp.zeros((), dtype))
    return _dense_product(t, x).astype(out_dtype)
  kernel_f = jnp.fft.fft(_to_complex(_circular_kernel(w, n, fft_len, -1, causal)), axis=-1)

  def product(kf, xb):  # kf [G, L] complex, xb [G, N, C] -> [G, N, C]
    # Channel pairs to the front so every FFT runs over the trailing (contiguous) axis.
    z = jnp.swapaxes(_pack_pairs(xb), -1, -2)  # [G, C/2, N] complex
    z = jnp.fft.ifft(jnp.fft.fft(z, n=fft_len, axis=-1) * kf[:, None, :], axis=-1)
    return _unpack_pairs(jnp.swapaxes(z[..., :n], -1, -2), xb.shape[-1])

  item = -(-x.shape[-1] // 2) * fft_len
  y = _map_over_batch(product, kernel_f, x, batch, item, remat, group_bytes)
  if causal:
    y = _refine_causal_head(
        y,
        lambda k: toeplitz_matmul(
            w[..., n - k : n + k - 1],
            x[..., :k, :],
            causal=True,
            remat=remat,
            group_bytes=group_bytes,
        ),
        n // _REFINE_FACTOR,
    )
  return y.astype(out_dtype)


# Two real channels share one complex FFT: z = x_a + i x_b. The kernel is real, so the
# circular convolution of z is conv(x_a) + i conv(x_b), read back from the real and imaginary
# parts. One complex FFT of length L costs about what two real ones (rfft / irfft) of length L
# cost in flops, and the product needs no Hermitian bookkeeping.
#
# The products run over the batch (every leading dim, flattened) in groups of about
# _GROUP_BYTES of spectrum, one group after the other (lax.map), each group's body
# rematerialised in the backward pass (jax.checkpoint). A group's padded input, spectra and
# transposes then stay in cache, and the executable's temporary memory is one group's instead
# of the whole batch's: measured on the 2-core CPU box (benchmarks/README.md), N = 4096 and
# 16384 run 1.3-1.5x faster than the same code over the whole batch at once, mostly because
# XLA:CPU allocates an executable's temporaries afresh per call and every fresh page costs a
# fault.
_GROUP_BYTES = 4 * 2**20


def _map_over_batch(
    product, kernel_f, x, batch: tuple, item_elems: int, remat: bool, group_bytes=None
):
  """``product(kf [G, ...], x [G, N, C]) -> [G, N, C]`` over the flattened ``batch``.

  ``kernel_f`` ``[wb..., ...]`` and ``x`` ``[xb..., N, C]`` have leading dims of rank
  ``len(batch)`` that broadcast to ``batch``; ``item_elems`` is the number of complex
  elements of one batch entry's spectrum, which with ``group_bytes`` (None:
  ``_GROUP_BYTES``) sets the group size. Returns ``[batch..., N, C]``.
  """
  tail = kernel_f.shape[len(batch) :]
  size = int(np.prod(batch, dtype=np.int64))
  itemsize = jnp.dtype(kernel_f.dtype).itemsize
  group_bytes = _GROUP_BYTES if group_bytes is None else group_bytes
  group = int(max(1, min(size, group_bytes // max(item_elems * itemsize, 1))))
  steps = -(-size // group)
  group = -(-size // steps)
  # Which table each batch entry uses (static): tables are gathered per group, not broadcast.
  w_size = int(np.prod(kernel_f.shape[: len(batch)], dtype=np.int64))
  table = np.broadcast_to(np.arange(w_size).reshape(kernel_f.shape[: len(batch)]), batch)
  table = np.concatenate([table.reshape(-1), np.zeros(steps * group - size, np.int64)])
  kf = kernel_f.reshape((w_size,) + tail)
  xs = jnp.broadcast_to(x, batch + x.shape[-2:]).reshape((size,) + x.shape[-2:])
  body = lambda idx, xg: product(kf[idx], xg)
  if remat:
    body = jax.checkpoint(body)
  if steps == 1:
    y = body(jnp.asarray(table), xs)
  else:
    xs = jnp.pad(xs, ((0, steps * group - size), (0, 0), (0, 0)))
    y = jax.lax.map(
        lambda args: body(*args),
        (
            jnp.asarray(table.reshape(steps, group).astype(np.int32)),
            xs.reshape((steps, group) + xs.shape[1:]),
        ),
    )
    y = y.reshape((steps * group,) + y.shape[2:])[:size]
  return y.reshape(batch + y.shape[1:])


def _to_complex(a):
  return jax.lax.complex(a, jnp.zeros_like(a))


def _pack_pairs(x):
  """``[..., C]`` real -> ``[..., ceil(C/2)]`` complex: channels 2j and 2j+1 as the real and
  imaginary part of channel j (an odd C gets a zero channel)."""
  if x.shape[-1] % 2:
    x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (1,), x.dtype)], axis=-1)
  return jax.lax.complex(x[..., 0::2], x[..., 1::2])


def _unpack_pairs(z, c: int):
  """Inverse of ``_pack_pairs``: ``[..., P]`` complex -> ``[..., c]`` real."""
  y = jnp.stack([jnp.real(z), jnp.imag(z)], axis=-1)
  return y.reshape(z.shape[:-1] + (2 * z.shape[-1],))[..., :c]


# Causal FFT products lose relative precision at the first positions: the FFT's round-off is
# of the order eps * (size of the largest outputs), while output i sums only i+1 terms. The
# first N/_REFINE_FACTOR outputs depend only on the first N/_REFINE_FACTOR inputs, so they are
# recomputed by a smaller causal product (recursively; dense below _DENSE_BELOW positions).
# Every output then carries round-off of at most about _REFINE_FACTOR * eps relative to its
# own scale, for about 1/(_REFINE_FACTOR - 1) extra work (float32 causal RPE at N = 4096:
# 3e-3 -> 1e-6 relative error).
_REFINE_FACTOR = 8
_DENSE_BELOW = 64


def _refine_causal_head(y, head_fn, k: int):
  """Replaces the first ``k`` positions of ``y [..., N, C]`` by ``head_fn(k)``."""
  if k < 1:
    return y
  return jnp.concatenate([head_fn(k), y[..., k:, :]], axis=-2)


def _dense_product(t, x):
  return jnp.einsum("...ij,...jc->...ic", t, x)


def dense_toeplitz(w):
  """The O(N^2) matrix ``T[..., i, j] = w[..., j - i + N - 1]`` of a ``[..., 2N-1]`` table."""
  _check_rank("w", w, 1, "[..., 2N-1]")
  w = jnp.asarray(w)
  if w.shape[-1] % 2 != 1:
    raise ValueError(f"w must have odd length 2N-1 along its last axis; got {w.shape[-1]}.")
  n = (w.shape[-1] + 1) // 2
  # Without a gather (whose gradient is a scatter-add, slow on CPU): w with one zero
  # appended (2n entries), tiled n times and cut into rows of 2n-1, starts each row one entry
  # further back, so T[i, j] = w[j - i + n - 1] sits at column j + n - 1 of row i. The
  # gradient is then a reshape and a sum.
  u = jnp.concatenate([w, jnp.zeros(w.shape[:-1] + (1,), w.dtype)], axis=-1)
  tiled = jnp.tile(u, (1,) * (w.ndim - 1) + (n,))[..., : n * (2 * n - 1)]
  return tiled.reshape(w.shape[:-1] + (n, 2 * n - 1))[..., n - 1 : 2 * n - 1]


def causal_mask(n: int):
  """``[N, N]`` boolean, True where key j <= query i."""
  return jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]


# ---------------------------------------------------------------------------------------------
# 2D
# ---------------------------------------------------------------------------------------------
def _check_grid(grid: Sequence[int], n: int) -> tuple[int, int]:
  try:
    h, wd = (int(g) for g in grid)
  except (TypeError, ValueError):
    raise ValueError(f"grid must be a pair (H, W); got {grid!r}.") from None
  if h < 1 or wd < 1 or h * wd != n:
    raise ValueError(
        f"grid {tuple(grid)} does not match the sequence: H*W={h * wd} but N={n} "
        f"(x is the image flattened row-major, N = H*W)."
    )
  return h, wd


def raster_causal_mask_2d(grid: Sequence[int]):
  """``[2H-1, 2W-1]`` boolean over offsets ``(r'-r, c'-c)``: True where the key pixel comes
  at or before the query pixel in row-major (raster) order, i.e. ``dr < 0`` or
  ``dr == 0 and dc <= 0``. The condition depends on the offset only, so a masked 2D table
  stays a 2D convolution."""
  h, wd = grid
  dr = jnp.arange(-(h - 1), h)[:, None]
  dc = jnp.arange(-(wd - 1), wd)[None, :]
  return (dr < 0) | ((dr == 0) & (dc <= 0))


def toeplitz_matmul_2d(
    w,
    x,
    grid: Sequence[int],
    *,
    causal: bool = False,
    remat: bool = True,
    group_bytes: int | None = None,
):
  """2D relative product ``out[(r,c)] = sum_{r',c'} w[r'-r+H-1, c'-c+W-1] x[(r',c')]``.

  Args:
    w: ``[..., 2H-1, 2W-1]`` the full 2D relative table indexed by ``(r'-r, c'-c)``; leading
      dims broadcast against those of ``x``.
    x: ``[..., H*W, C]``, the image flattened row-major (pixel (r, c) at ``r*W + c``).
    grid: ``(H, W)``; square or not.
    causal: raster order: pixel ``(r, c)`` sees ``(r', c')`` iff ``r'*W + c' <= r*W + c``.
      Implemented by zeroing the offsets that point forward (``raster_causal_mask_2d``).
    remat, group_bytes: as in ``toeplitz_matmul``.

  Returns:
    ``[broadcast(...), H*W, C]``, by a 2D FFT of size >= (2H-1, 2W-1): O(N log N).
  """
  _check_rank("x", x, 2, "[..., H*W, C]")
  _check_rank("w", w, 2, "[..., 2H-1, 2W-1]")
  h, wd = _check_grid(grid, x.shape[-2])
  if w.shape[-2:] != (2 * h - 1, 2 * wd - 1):
    raise ValueError(
        f"w has trailing shape {w.shape[-2:]}; grid (H, W)=({h}, {wd}) needs "
        f"(2H-1, 2W-1)=({2 * h - 1}, {2 * wd - 1})."
    )
  batch = _broadcast_batch("w", w.shape[:-2], x.shape[:-2])
  out_dtype, dtype = _compute_dtype(w, x)
  lh, lw = _conv_fft_size(2 * h - 1), _conv_fft_size(2 * wd - 1)

  w = _expand_to(w.astype(dtype), len(batch), 2)
  x = _expand_to(x.astype(dtype), len(batch), 2)
  if causal:
    w = jnp.where(raster_causal_mask_2d((h, wd)), w, jnp.zeros((), dtype))
    if h * wd <= _DENSE_BELOW:
      return _dense_product(dense_toeplitz_2d(w, (h, wd)), x).astype(out_dtype)
  kernel = _circular_kernel(w, h, lh, -2, causal=False)
  kernel = _circular_kernel(kernel, wd, lw, -1, causal=False)
  kernel_f = jnp.fft.fft2(_to_complex(kernel), axes=(-2, -1))  # [..., lh, lw]

  def product(kf, xb):  # kf [G, lh, lw] complex, xb [G, H*W, C] -> [G, H*W, C]
    z = _pack_pairs(xb)  # [G, H*W, P] complex (see _pack_pairs)
    p = z.shape[-1]
    z = jnp.swapaxes(z, -1, -2).reshape(z.shape[:-2] + (p, h, wd))  # [G, P, H, W]
    z = jnp.fft.fft2(z, s=(lh, lw), axes=(-2, -1))
    z = jnp.fft.ifft2(z * kf[:, None, :, :], axes=(-2, -1))
    z = z[..., :h, :wd].reshape(z.shape[:-2] + (h * wd,))
    return _unpack_pairs(jnp.swapaxes(z, -1, -2), xb.shape[-1])

  item = -(-x.shape[-1] // 2) * lh * lw
  y = _map_over_batch(product, kernel_f, x, batch, item, remat, group_bytes)
  if causal:
    # Raster order: the first rows depend only on themselves (see _REFINE_FACTOR). With fewer
    # than _REFINE_FACTOR rows, the first row alone is a 1D causal product along the columns.
    hk = h // _REFINE_FACTOR
    if hk >= 1:
      head = lambda k: toeplitz_matmul_2d(
          w[..., h - hk : h + hk - 1, :],
          x[..., :k, :],
          (hk, wd),
          causal=True,
          remat=remat,
          group_bytes=group_bytes,
      )
    else:
      head = lambda k: toeplitz_matmul(
          w[..., h - 1, :], x[..., :k, :], causal=True, remat=remat, group_bytes=group_bytes
      )
    y = _refine_causal_head(y, head, max(hk, 1) * wd)
  return y.astype(out_dtype)


def dense_toeplitz_2d(w, grid: Sequence[int]):
  """The O(N^2) matrix ``T[..., r*W+c, r'*W+c'] = w[..., r'-r+H-1, c'-c+W-1]``."""
  _check_rank("w", w, 2, "[..., 2H-1, 2W-1]")
  w = jnp.asarray(w)
  h, wd = (int(g) for g in grid)
  if w.shape[-2:] != (2 * h - 1, 2 * wd - 1):
    raise ValueError(
        f"w has trailing shape {w.shape[-2:]}; grid ({h}, {wd}) needs ({2 * h - 1}, {2 * wd - 1})."
    )
  r = jnp.repeat(jnp.arange(h), wd)
  c = jnp.tile(jnp.arange(wd), h)
  dr = r[None, :] - r[:, None] + (h - 1)
  dc = c[None, :] - c[:, None] + (wd - 1)
  return w[..., dr, dc]


def fastrpb_2d_matmul(w_rows, w_cols, x, grid: Sequence[int]):
  """FastRPB 2D bias ``W2d V`` with ``W2d = X + Y`` (FastRPB Sec. 3.2.2, Appendix B.3).

  The weight of a pixel pair is the sum of a vertical-offset and a horizontal-offset weight:
  ``W2d[(r,c), (r',c')] = w_rows[r'-r+H-1] + w_cols[c'-c+W-1]``. This equals
  ``toeplitz_matmul_2d`` with ``w[a, b] = w_rows[a] + w_cols[b]`` (tested), but the reduction of
  Appendix B.3 needs only two 1D Toeplitz products:

      out[(r,c)] = sum_r' w_rows[r'-r] (sum_c' x[r',c'])  +  sum_c' w_cols[c'-c] (sum_r' x[r',c'])

  i.e. sum each image over one axis, apply the 1D Toeplitz product along the other, and
  broadcast back. The paper's one-shared-table option is ``w_rows is w_cols`` (H == W).
  Not causal: raster-order causality does not factor into rows + columns; use
  ``toeplitz_matmul_2d(w_rows[:, None] + w_cols[None, :], x, grid, causal=True)``.

  Args:
    w_rows: ``[..., 2H-1]`` weights of vertical offsets ``r' - r``.
    w_cols: ``[..., 2W-1]`` weights of horizontal offsets ``c' - c``.
    x: ``[..., H*W, C]`` flattened row-major.
    grid: ``(H, W)``.

  Returns:
    ``[broadcast(...), H*W, C]``; O(H log H + W log W) per channel after the O(N) sums,
    O(N) memory.
  """
  _check_rank("x", x, 2, "[..., H*W, C]")
  _check_rank("w_rows", w_rows, 1, "[..., 2H-1]")
  _check_rank("w_cols", w_cols, 1, "[..., 2W-1]")
  h, wd = _check_grid(grid, x.shape[-2])
  if w_rows.shape[-1] != 2 * h - 1:
    raise ValueError(f"w_rows has length {w_rows.shape[-1]}; H={h} needs 2H-1={2 * h - 1}.")
  if w_cols.shape[-1] != 2 * wd - 1:
    raise ValueError(f"w_cols has length {w_cols.shape[-1]}; W={wd} needs 2W-1={2 * wd - 1}.")
  img = x.reshape(x.shape[:-2] + (h, wd, x.shape[-1]))
  rows = toeplitz_matmul(w_rows, jnp.sum(img, axis=-2))  # [..., H, C]
  cols = toeplitz_matmul(w_cols, jnp.sum(img, axis=-3))  # [..., W, C]
  batch = np.broadcast_shapes(rows.shape[:-2], cols.shape[:-2])
  rows = _expand_to(rows, len(batch), 2)
  cols = _expand_to(cols, len(batch), 2)
  out = rows[..., :, None, :] + cols[..., None, :, :]
  return out.reshape(out.shape[:-3] + (h * wd, out.shape[-1]))
