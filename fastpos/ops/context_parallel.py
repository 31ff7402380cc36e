"""Context parallelism: linear attention and Toeplitz products over a sequence split on devices.

Every function here runs inside ``shard_map`` on one device's block of the sequence: a
sequence of N = n * P positions is split over the P devices of the mesh axis ``axis_name``,
device p holding positions ``[p n, (p + 1) n)``. Each one equals its unsplit op on the
concatenated blocks (``fastpos.ops.attention``, ``fastpos.ops.toeplitz``; tests hold them
together in float64) and never gathers the sequence on one device:

* bidirectional linear attention: the states ``sum phi(k) v^T`` and ``sum phi(k)`` summed
  over devices (one ``psum`` of ``[b, h, m, d]``);
* causal linear attention (with a decay r): the chunked path on the block, plus the state of
  all earlier blocks from an exclusive scan over devices (``exclusive_scan``: ceil(log2 P) + 1
  ``ppermute`` of ``[b, h, m, d]``, each hop scaled by r^(hop length));
* Toeplitz products (FastRPB's ``W V``, kernelized RPE's ``sum_j c_{j-i} phi(k_j) v_j^T``):
  a ring of block products (``toeplitz_matmul``, below); with ``rpe`` the attention runs its
  feature groups through that ring.

Relative tables keep their global layout ``[..., 2N-1]`` (offset j - i at index j - i + N - 1)
and are replicated; queries, keys, values and masks are the device's block ``[b, n, ...]``.
1D only: 2D grids (raster blocks of a 2D convolution) are not split.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fastpos.ops import attention as attn
from fastpos.ops import toeplitz
from fastpos.ops.masks import check_mask


def _axis(axis_name) -> tuple[int, jax.Array]:
  """(P, p): the axis size (static) and this device's index along it (traced)."""
  return jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)


# ---------------------------------------------------------------------------------------------
# Toeplitz product over a split sequence: a ring of block products
# ---------------------------------------------------------------------------------------------
def toeplitz_matmul(w, x, *, axis_name, causal: bool = False, seq_axis: int = -2):
  """``out[i] = sum_j w[j - i + N - 1] x[j]`` for this device's block of queries i, over the
  keys j of every block, without gathering the sequence (the unsplit op is
  ``fastpos.ops.toeplitz.toeplitz_matmul``).

  Algorithm (block Toeplitz): with N = n P, output block p is ``sum_q T_{q-p} x_q`` where
  ``T_s`` is the n x n Toeplitz block of offsets ``s n - (n-1) .. s n + (n-1)``, i.e. the 2n-1
  table entries starting at ``(s + P - 1) n``. The blocks x_q travel around a ring: at step t
  device p holds ``x_{(p+t) mod P}`` (received from device p+1, ``ppermute``), multiplies it
  by its ``T_s`` (an FFT product of size fft_size(2n-1)) and accumulates. Causal: the
  diagonal block is a causal product, blocks from later devices (s > 0) add nothing.

  The backward pass (a custom VJP, so that no device keeps the P blocks it saw) is written
  out, not differentiated: ``T_s^T dy`` is the same FFT product with the conjugate kernel
  spectrum (the flipped table), and the gradient of the table entries of ``T_s`` is the
  correlation of dy with ``x_q``, summed over channels in the frequency domain (one inverse
  FFT of the table's size). Each block goes around the ring once more with its gradient.

  Every product runs over groups of about 4 MiB of spectrum (items of the batch, or channels
  of one item; the group size of ``fastpos.ops.toeplitz``), one after the other, adding in
  place into the output (or gradient) block: the temporary memory is one group's FFT
  buffers, and the carries are the travelling block, the output block and, in the backward
  pass, the travelling gradient and the table gradient, initialised by the first block
  product (no zero-filled block-sized accumulators).

  Cost per device: P Toeplitz products of length n (FFT size about 2n), i.e. O(P n log n) =
  O(N log n) work per device where the unsplit op does O(N log N) on one device; memory
  O(n C) (one block in flight at a time). Communication: P - 1 ``ppermute`` of an ``[n, C]``
  block forward; backward, P - 1 ``ppermute`` of two ``[n, C]`` blocks (the block and its
  gradient), one more of the gradient (home), and one ``psum`` of the table gradient.

  Args:
    w: ``[..., 2N-1]`` the global relative table (replicated), N = n P.
    x: this device's block, the sequence (n positions) on axis ``seq_axis`` and channels on
      the last axis, e.g. ``[..., n, C]`` (the default) or ``[b, n, h, d]`` with
      ``seq_axis=1``; its other axes (in order) broadcast against the leading dims of w
      (e.g. one table per head: w ``[h, 2N-1]``).
    axis_name: the mesh axis the sequence is split over.
    causal: keep only ``j <= i``.
    seq_axis: the sequence axis of x (not the last).

  Returns:
    x's layout, its other axes broadcast with w's leading dims (new ones in front), in the
    promoted dtype of w and x.
  """
  num, _ = _axis(axis_name)
  if jnp.ndim(x) < 2 or jnp.ndim(w) < 1:
    raise ValueError(
        f"w must be [..., 2N-1] and x [..., n, C]; got {jnp.shape(w)}, {jnp.shape(x)}."
    )
  if not -x.ndim <= seq_axis < x.ndim - 1:
    raise ValueError(
        f"seq_axis={seq_axis} is not an axis of x {x.shape} other than the last (channels); "
        f"valid: {-x.ndim} .. {x.ndim - 2}."
    )
  seq = seq_axis - x.ndim if seq_axis >= 0 else seq_axis  # negative: stays put as dims prepend
  n = x.shape[seq]
  if w.shape[-1] != 2 * n * num - 1:
    raise ValueError(
        f"w has {w.shape[-1]} entries along its last axis; a sequence of N = {n} x {num} "
        f"devices = {n * num} needs 2N-1 = {2 * n * num - 1} (the global table, offsets j-i "
        f"from -(N-1) to N-1)."
    )
  before, after = x.shape[: x.ndim + seq], x.shape[x.ndim + seq + 1 : -1]
  batch = toeplitz._broadcast_batch("w", w.shape[:-1], before + after)
  before = batch[: len(batch) - len(after)]
  shape = before + (n,) + after + (x.shape[-1],)
  # x broadcast to the output's batch up front, and typed as varying over the axis (a block
  # the same on every device, e.g. ones, too): autodiff sums its gradient back.
  x = jnp.broadcast_to(x.reshape((1,) * (len(shape) - x.ndim) + x.shape), shape)
  x = _varying(x, axis_name)
  items, heads = int(np.prod(before, dtype=np.int64)), int(np.prod(after, dtype=np.int64))
  rows = np.broadcast_to(np.arange(int(np.prod(w.shape[:-1]))).reshape(w.shape[:-1]), batch)
  ring = _Ring(axis_name, causal, tuple(map(tuple, rows.reshape(items, heads).tolist())))
  y = _ring_toeplitz(w.reshape(-1, w.shape[-1]), x.reshape(items, n, heads, -1), ring)
  return y.reshape(shape)


@dataclasses.dataclass(frozen=True)
class _Ring:
  """The static side of a ring product: the mesh axis, causality and the table row of each
  (item, head) of the block ``[items, n, heads, C]``."""

  axis_name: str
  causal: bool
  rows: tuple  # [items][heads] of ints


@dataclasses.dataclass(frozen=True)
class _Groups:
  """The block ``[items, n, heads, C]`` in groups of ``size`` items x ``chunk`` channels of
  one head; group g is (item group, head, channel chunk) in row-major order."""

  size: int
  chunk: int
  shape: tuple

  @staticmethod
  def plan(shape, fft_len: int, itemsize: int) -> _Groups:
    items, _, _, c = shape
    pairs = max(1, toeplitz._GROUP_BYTES // (fft_len * 2 * itemsize))  # complex rows
    if -(-c // 2) <= pairs:
      return _Groups(_largest_divisor(items, pairs // -(-c // 2)), c, shape)
    return _Groups(1, _largest_divisor(c, 2 * pairs), shape)

  @property
  def count(self) -> int:
    items, _, heads, c = self.shape
    return items // self.size * heads * (c // self.chunk)

  def _corner(self, g):
    items, _, heads, c = self.shape
    chunks = c // self.chunk
    return (g // (chunks * heads)) * self.size, (g // chunks) % heads, (g % chunks) * self.chunk

  def take(self, a, g):
    """Group g of ``a [items, n, heads, C]``: ``[size, n, chunk]``."""
    i, h, c = self._corner(g)
    part = jax.lax.dynamic_slice(a, (i, 0, h, c), (self.size, a.shape[1], 1, self.chunk))
    return part[:, :, 0, :]

  def put(self, a, part, g):
    i, h, c = self._corner(g)
    return jax.lax.dynamic_update_slice(a, part[:, :, None, :].astype(a.dtype), (i, 0, h, c))

  def rows(self, ring: _Ring, g):
    """The table row of each item of group g: int32 ``[size]``."""
    i, h, _ = self._corner(g)
    table = jnp.asarray(np.asarray(ring.rows, np.int32))
    return jax.lax.dynamic_slice(table, (i, h), (self.size, 1))[:, 0]


def _largest_divisor(n: int, at_most: int) -> int:
  return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


def _block_table(w, s, n: int, num: int):
  """The 2n-1 entries of ``w`` for the block pair at block offset s = q - p (may be traced)."""
  return jax.lax.dynamic_slice_in_dim(w, (s + num - 1) * n, 2 * n - 1, axis=-1)


def _varying(tree, axis_name):
  """``tree``'s arrays typed as varying over ``axis_name`` (shard_map's check_vma types): a
  loop's carry must have its body's type, where the ring's backward pass wants each device's
  own table gradient, summed once at the end."""

  def one(x):
    if axis_name in _varying_axes(x):
      return x
    return jax.lax.pcast(x, axis_name, to="varying")

  return jax.tree.map(one, tree)


def _varying_axes(x) -> frozenset:
  """The mesh axes x varies over (its type's ``vma``; ``manual_axis_type.varying`` in the JAX
  versions that name it so)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  return manual.varying if manual is not None else getattr(aval, "vma", frozenset())


def _ring_perm(num: int):
  """Each device sends to the previous one: device p then holds block p + t at step t."""
  return [(i, (i - 1) % num) for i in range(num)]


def _spectrum(xg, fft_len: int):
  """``[G, n, c]`` real -> ``[G, ceil(c/2), L]``: channel pairs as one complex signal (as in
  ``fastpos.ops.toeplitz``), zero-padded to L and transformed along the sequence."""
  return jnp.fft.fft(jnp.swapaxes(toeplitz._pack_pairs(xg), -1, -2), n=fft_len, axis=-1)


def _signal(zf, n: int, c: int):
  """Inverse of ``_spectrum``, the first n positions: ``[G, ceil(c/2), L]`` -> ``[G, n, c]``."""
  z = jnp.fft.ifft(zf, axis=-1)[..., :n]
  return toeplitz._unpack_pairs(jnp.swapaxes(z, -1, -2), c)


def _kernels(w, s, n: int, num: int, fft_len: int, causal_diagonal: bool):
  """(block table ``[R, 2n-1]``, its circular kernel's spectrum ``[R, L]``) of ``T_s``; the
  table's future half zero for the causal diagonal block."""
  b = _block_table(w, s, n, num)
  kernel = toeplitz._circular_kernel(b, n, fft_len, -1, causal_diagonal)
  return b, jnp.fft.fft(toeplitz._to_complex(kernel), axis=-1)


def _refined_head(b, xg, k: int):
  """The first k outputs of the causal product of the block table ``b [G, 2n-1]`` and
  ``xg [G, >= k, c]``, by a smaller causal product (float32 FFT round-off is relative to the
  largest outputs; as ``toeplitz.toeplitz_matmul`` does)."""
  n = (b.shape[-1] + 1) // 2
  return toeplitz.toeplitz_matmul(b[:, n - k : n + k - 1], xg[:, :k], causal=True, remat=False)


def _sweep_plan(w, xq, s, ring: _Ring, diagonal: bool):
  """What both sweeps over the groups need: (n, FFT length, groups, the kernels ``b`` and
  their spectra ``kf`` at block offset s, the rows refined directly: 0 but for a causal
  ring's diagonal block)."""
  num, _ = _axis(ring.axis_name)
  n = xq.shape[1]
  fft_len = toeplitz.fft_size(2 * n - 1)
  groups = _Groups.plan(xq.shape, fft_len, jnp.dtype(w.dtype).itemsize)
  causal_diagonal = diagonal and ring.causal
  b, kf = _kernels(w, s, n, num, fft_len, causal_diagonal)
  refine = n // toeplitz._REFINE_FACTOR if causal_diagonal else 0
  return n, fft_len, groups, b, kf, refine


def _sweep_forward(y, w, xq, s, ring: _Ring, *, diagonal: bool, init: bool):
  """``y + T_s xq`` (``T_0 xq`` written over y when ``init``), group by group, in place."""
  n, fft_len, groups, b, kf, refine = _sweep_plan(w, xq, s, ring, diagonal)

  def body(g, y):
    rows, xg = groups.rows(ring, g), groups.take(xq, g).astype(w.dtype)
    yg = _signal(_spectrum(xg, fft_len) * kf[rows][:, None, :], n, groups.chunk)
    if refine:
      yg = jnp.concatenate([_refined_head(b[rows], xg, refine), yg[:, refine:]], axis=1)
    return groups.put(y, yg if init else groups.take(y, g) + yg, g)

  return jax.lax.fori_loop(0, _count(groups, ring, s, diagonal), body, y)


def _sweep_backward(dx, w, xq, dy, s, ring: _Ring, *, diagonal: bool, init: bool):
  """(``dx + T_s^T dy``, the gradient ``[R, 2n-1]`` of ``T_s``'s table entries), group by
  group; ``T_s^T dy`` written over dx when ``init``."""
  n, fft_len, groups, b, kf, refine = _sweep_plan(w, xq, s, ring, diagonal)
  causal_diagonal = diagonal and ring.causal
  keep = jnp.arange(2 * n - 1) <= n - 1  # the causal diagonal block's past and diagonal

  def body(g, carry):
    dx, db = carry
    rows = groups.rows(ring, g)
    dyf = _spectrum(groups.take(dy, g).astype(w.dtype), fft_len)
    # T^T is the product with the reversed kernel: the conjugate spectrum (a real kernel).
    dxg = _signal(dyf * jnp.conj(kf[rows])[:, None, :], n, groups.chunk)
    if refine:  # the last outputs of the anti-causal T^T: T^T = R T R on the reversed tail
      tail = _refined_head(b[rows], jnp.flip(groups.take(dy, g)[:, n - refine :], 1), refine)
      dxg = jnp.concatenate([dxg[:, : n - refine], jnp.flip(tail, 1).astype(dxg.dtype)], 1)
    dx = groups.put(dx, dxg if init else groups.take(dx, g) + dxg, g)
    # db[k] = sum_i <dy[i], x[i + k - (n-1)]>: the circular correlation, channels summed
    # before its inverse FFT.
    xf = _spectrum(groups.take(xq, g).astype(w.dtype), fft_len)
    corr = jnp.real(jnp.fft.ifft(jnp.sum(jnp.conj(dyf) * xf, axis=1), axis=-1))
    dbg = jnp.concatenate([corr[:, fft_len - (n - 1) :], corr[:, :n]], axis=-1)
    if causal_diagonal:
      dbg = jnp.where(keep, dbg, jnp.zeros((), dbg.dtype))
    return dx, db.at[rows].add(dbg)

  db = _varying(jnp.zeros((w.shape[0], 2 * n - 1), w.dtype), ring.axis_name)
  return jax.lax.fori_loop(0, _count(groups, ring, s, diagonal), body, (dx, db))


def _count(groups: _Groups, ring: _Ring, s, diagonal: bool):
  """The groups to run at block offset s: all, or (traced) none for a causal ring's later
  blocks (s > 0), which add nothing."""
  if diagonal or not ring.causal:
    return groups.count
  return jnp.where(s < 0, groups.count, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ring_toeplitz(w, x, ring: _Ring):
  """``[R, 2N-1]`` tables and the block ``[items, n, heads, C]`` -> the product, x's shape."""
  num, p = _axis(ring.axis_name)
  dtype = jnp.result_type(w, x)
  w = w.astype(jnp.float64 if dtype == jnp.float64 else jnp.float32)
  # The home block first: its product initialises the carry (x's buffer, overwritten).
  y = _sweep_forward(x.astype(dtype), w, x, 0, ring, diagonal=True, init=True)

  def step(t, carry):
    xq, y = carry
    xq = jax.lax.ppermute(xq, ring.axis_name, _ring_perm(num))
    s = (p + t) % num - p
    return xq, _sweep_forward(y, w, xq, s, ring, diagonal=False, init=False)

  return jax.lax.fori_loop(1, num, step, (x, y))[1]


def _ring_toeplitz_fwd(w, x, ring):
  return _ring_toeplitz(w, x, ring), (w, x)


def _ring_toeplitz_bwd(ring, res, dy):
  # The blocks go around the ring again, each carrying the gradient of its own block: device p
  # adds T_{q-p}^T dy_p to block q's gradient and the table gradient of offsets s; after P
  # hops every block (and its gradient) is home.
  w_in, x = res
  num, p = _axis(ring.axis_name)
  n = x.shape[1]
  w = w_in.astype(jnp.float64 if dy.dtype == jnp.float64 else jnp.float32)

  def window(dw, db, s):  # dw's entries of T_s += db
    start = (s + num - 1) * n
    part = jax.lax.dynamic_slice_in_dim(dw, start, 2 * n - 1, axis=-1)
    return jax.lax.dynamic_update_slice_in_dim(dw, part + db, start, axis=-1)

  dx, db = _sweep_backward(dy, w, x, dy, 0, ring, diagonal=True, init=True)
  dw = window(_varying(jnp.zeros(w.shape, w.dtype), ring.axis_name), db, 0)

  def step(t, carry):
    xq, dx, dw = carry
    xq, dx = jax.lax.ppermute((xq, dx), ring.axis_name, _ring_perm(num))
    s = (p + t) % num - p
    dx, db = _sweep_backward(dx, w, xq, dy, s, ring, diagonal=False, init=False)
    return xq, dx, window(dw, db, s)

  _, dx, dw = jax.lax.fori_loop(1, num, step, (x, dx, dw))
  dx = jax.lax.ppermute(dx, ring.axis_name, _ring_perm(num))
  return jax.lax.psum(dw, ring.axis_name).astype(w_in.dtype), dx.astype(x.dtype)


_ring_toeplitz.defvjp(_ring_toeplitz_fwd, _ring_toeplitz_bwd)


# ---------------------------------------------------------------------------------------------
# Exclusive scan of states over devices
# ---------------------------------------------------------------------------------------------
def exclusive_scan(x, *, axis_name, log_decay=None, block: int = 1):
  """``sum_{q < p} r^((p - 1 - q) block) x_q`` on device p (zeros on device 0).

  Hillis-Steele over ``ppermute``: one hop shifts the states by one device, then rounds of
  hop length 1, 2, 4, ... add the partial sum of the device that far back, scaled by
  ``r^(hop length * block)`` (every exponent <= 0): ceil(log2 P) + 1 ``ppermute`` of ``x``.

  Args:
    x: ``[b, h, ...]`` this device's state (e.g. ``sum_j r^(n-1-j) phi(k_j) v_j^T``).
    axis_name: the mesh axis.
    log_decay: ``[h]`` log r <= 0, or None (r = 1).
    block: positions per device (the decay's exponent per hop).
  """
  num, _ = _axis(axis_name)

  def shift(a, hop):
    return jax.lax.ppermute(a, axis_name, [(i, i + hop) for i in range(num - hop)])

  def scale(a, hop):
    if log_decay is None:
      return a
    f = jnp.exp(log_decay.astype(a.dtype) * (hop * block))
    return a * f.reshape((1, -1) + (1,) * (a.ndim - 2))

  y = shift(x, 1)
  hop = 1
  while hop < num:
    y = y + scale(shift(y, hop), hop)
    hop *= 2
  return y


# ---------------------------------------------------------------------------------------------
# Linear attention over a split sequence
# ---------------------------------------------------------------------------------------------
def linear_attention(
    phi_q,
    phi_k,
    v,
    *,
    axis_name,
    mask=None,
    causal: bool = False,
    rpe=None,
    decay=None,
    den_features=None,
    chunk_size: int | None = None,
    eps: float = attn.DEFAULT_EPS,
):
  """``fastpos.ops.attention.linear_attention`` on this device's block of a split sequence.

  Same arguments and result as the unsplit op, restricted to the block: ``phi_q, phi_k``
  ``[b, n, h, m]``, ``v`` ``[b, n, h, d]``, ``mask`` ``[b, n]``, ``den_features`` blocks;
  ``rpe`` is the global ``[h, 2N-1]`` table (N = n P) and ``decay`` ``[h]`` log r. 1D only.

  * no rpe, bidirectional: the states ``sum phi(k) v^T`` ``[b, h, m, d]`` and ``sum phi(k)``
    summed over devices (``psum``);
  * no rpe, causal: the block's own chunked causal attention (``chunk_size``), plus the state
    of the earlier blocks (``exclusive_scan`` of each block's state, keys weighted
    ``r^(n-1-j)`` toward the block's end; query i then weighs it by ``r^(i+1)``);
  * rpe (decay folded into the table as in the unsplit op): the feature groups of the
    unsplit op, each mixing its ``m d + m`` channels by the ring Toeplitz product
    (``toeplitz_matmul``).
  """
  b, n, h = attn._check_qkv(phi_q, phi_k, v, names=("phi_q", "phi_k", "v"))
  num, _ = _axis(axis_name)
  total = n * num
  mask = check_mask(mask, (b, n), against=f"phi_k of shape {phi_k.shape}")
  attn._check_rpe(rpe, h, total, None)
  attn._check_decay(decay, h, causal)
  attn._check_den_features(den_features, phi_q, phi_k)
  return attn._mix(
      phi_q,
      phi_k,
      v,
      mask,
      causal=causal,
      rpe=rpe,
      grid=None,
      decay=decay,
      den_features=den_features,
      chunk_size=chunk_size,
      eps=eps,
      length=total,
      split=_Split(axis_name),
  )


@dataclasses.dataclass(frozen=True)
class _Split:
  """The device-axis operations ``fastpos.ops.attention._mix`` uses on a split sequence."""

  axis_name: str

  def toeplitz(self, rpe, causal: bool):  # the ring product in place of the FFT one
    return functools.partial(toeplitz_matmul, rpe, axis_name=self.axis_name, causal=causal)

  def varying(self, tree):
    return _varying(tree, self.axis_name)

  def causal(self, fq, fk, vals, chunk: int, log_decay):
    return _causal(fq, fk, vals, chunk, log_decay, self.axis_name)

  def psum(self, x):
    return jax.lax.psum(x, self.axis_name)


def _causal(fq, fk, vals, chunk: int, log_decay, axis_name):
  """Causal (num, den) of the block, head-major as ``attn._causal_chunked``: the chunked path
  entered with the state of the earlier blocks' keys. Block q's state weighs its key j by
  r^(n - j) (toward the next block's start); the exclusive scan over devices then gives the
  state at this block's start, weighted r^(p n - J) for a key at global position J, the carry
  the chunked path expects."""
  n = fk.shape[2]  # head-major [b, h, n, .]
  k_w = fk
  if log_decay is not None:
    dist = (n - jnp.arange(n, dtype=fk.dtype))[None, :]
    k_w = fk * jnp.exp(log_decay[:, None] * dist)[None, :, :, None]
  scan = functools.partial(exclusive_scan, axis_name=axis_name, log_decay=log_decay, block=n)
  init = (scan(jnp.einsum("bhjm,bhjd->bhmd", k_w, vals)), scan(jnp.sum(k_w, axis=2)))
  return attn._causal_chunked(fq, fk, vals, chunk, log_decay, init=init)
