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

from fastpos.ops import attention as attn
from fastpos.ops import toeplitz
from fastpos.ops.masks import check_mask


def _axis(axis_name) -> tuple[int, jax.Array]:
  """(P, p): the axis size (static) and this device's index along it (traced)."""
  return jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)


# ---------------------------------------------------------------------------------------------
# Toeplitz product over a split sequence: a ring of block products
# ---------------------------------------------------------------------------------------------
def toeplitz_matmul(w, x, *, axis_name, causal: bool = False):
  """``out[i] = sum_j w[j - i + N - 1] x[j]`` for this device's block of queries i, over the
  keys j of every block, without gathering the sequence (the unsplit op is
  ``fastpos.ops.toeplitz.toeplitz_matmul``).

  Algorithm (block Toeplitz): with N = n P, output block p is ``sum_q T_{q-p} x_q`` where
  ``T_s`` is the n x n Toeplitz block of offsets ``s n - (n-1) .. s n + (n-1)``, i.e. the 2n-1
  table entries starting at ``(s + P - 1) n``. The blocks x_q travel around a ring: at step t
  device p holds ``x_{(p+t) mod P}`` (received from device p+1, ``ppermute``), multiplies it
  by its ``T_s`` (an FFT product of size fft_size(2n-1)) and accumulates. Causal: the
  diagonal block is a causal product, blocks from later devices (s > 0) add nothing.

  Cost per device: P Toeplitz products of length n (FFT size about 2n), i.e. O(P n log n) =
  O(N log n) work per device where the unsplit op does O(N log N) on one device; memory
  O(n C) (one block in flight at a time). Communication: P - 1 ``ppermute`` of an ``[n, C]``
  block forward; the backward pass (a custom VJP, so that no device keeps the P blocks it
  saw) sends each block once more around the ring with its gradient, P ``ppermute`` of two
  ``[n, C]`` blocks, and sums the table's gradient over devices (one ``psum`` of ``w``).

  Args:
    w: ``[..., 2N-1]`` the global relative table (replicated), N = n P.
    x: ``[..., n, C]`` this device's block; leading dims broadcast against those of w.
    axis_name: the mesh axis the sequence is split over.
    causal: keep only ``j <= i``.

  Returns:
    ``[broadcast(...), n, C]`` in the promoted dtype of w and x.
  """
  num, _ = _axis(axis_name)
  n = x.shape[-2]
  if jnp.ndim(x) < 2 or jnp.ndim(w) < 1:
    raise ValueError(
        f"w must be [..., 2N-1] and x [..., n, C]; got {jnp.shape(w)}, " f"{jnp.shape(x)}."
    )
  if w.shape[-1] != 2 * n * num - 1:
    raise ValueError(
        f"w has {w.shape[-1]} entries along its last axis; a sequence of N = {n} x {num} "
        f"devices = {n * num} needs 2N-1 = {2 * n * num - 1} (the global table, offsets j-i "
        f"from -(N-1) to N-1)."
    )
  return _ring_toeplitz(w, x, axis_name, causal)


def _block_table(w, s, n: int, num: int):
  """The 2n-1 entries of ``w`` for the block pair at block offset s = q - p (may be traced)."""
  return jax.lax.dynamic_slice_in_dim(w, (s + num - 1) * n, 2 * n - 1, axis=-1)


def _varying(tree, axis_name):
  """``tree``'s arrays typed as varying over ``axis_name`` (shard_map's check_vma types): a
  scan's zero carry must have its body's type, and a vjp taken inside shard_map sums the
  cotangent of an invariant (replicated) input over the axis, where the ring's backward pass
  wants each device's own table gradient, summed once at the end."""

  def one(x):
    if axis_name in getattr(jax.typeof(x), "vma", frozenset()):
      return x
    return jax.lax.pcast(x, axis_name, to="varying")

  return jax.tree.map(one, tree)


def _ring_perm(num: int):
  """Each device sends to the previous one: device p then holds block p + t at step t."""
  return [(i, (i - 1) % num) for i in range(num)]


def _block_product(w, s, xq, n: int, num: int, causal: bool):
  """``T_s x_q``: the diagonal block (s = 0) causal when ``causal``, later blocks (s > 0)
  zero when ``causal``. ``s`` is traced: the branches are chosen at run time."""

  def off_diagonal(xq):
    y = toeplitz.toeplitz_matmul(_block_table(w, s, n, num), xq, remat=False)
    return jnp.where(s < 0, y, jnp.zeros((), y.dtype)) if causal else y

  if not causal:
    return off_diagonal(xq)
  diagonal = lambda xq: toeplitz.toeplitz_matmul(
      _block_table(w, 0, n, num), xq, causal=True, remat=False
  )
  return jax.lax.cond(s == 0, diagonal, off_diagonal, xq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _ring_toeplitz(w, x, axis_name, causal):
  num, p = _axis(axis_name)
  n = x.shape[-2]

  # One loop over all P blocks (the home block at t = 0, no hop before it): unrolled, the
  # independent block products let the scheduler receive every block first and hold the
  # whole sequence on each device.
  def step(t, carry):
    xq, y = carry
    xq = jax.lax.cond(
        t > 0, lambda a: jax.lax.ppermute(a, axis_name, _ring_perm(num)), lambda a: a, xq
    )
    return xq, y + _block_product(w, (p + t) % num - p, xq, n, num, causal).astype(y.dtype)

  dtype = jnp.result_type(w, x)
  y = _varying(jnp.zeros(jnp.broadcast_shapes(w.shape[:-1] + (1, 1), x.shape), dtype), axis_name)
  return jax.lax.fori_loop(0, num, step, (x, y))[1]


def _ring_toeplitz_fwd(w, x, axis_name, causal):
  return _ring_toeplitz(w, x, axis_name, causal), (w, x)


def _ring_toeplitz_bwd(axis_name, causal, res, dy):
  # The blocks go around the ring again, each carrying the gradient of its own block: device p
  # adds T_{q-p}^T dy_p to block q's gradient and the table gradient of offsets s; after P
  # hops every block (and its gradient) is home.
  w, x = res
  w = _varying(w, axis_name)
  num, p = _axis(axis_name)
  n = x.shape[-2]

  def step(t, carry):
    xq, dx, dw = carry
    xq, dx = jax.lax.cond(
        t > 0, lambda a: jax.lax.ppermute(a, axis_name, _ring_perm(num)), lambda a: a, (xq, dx)
    )
    s = (p + t) % num - p
    _, vjp = jax.vjp(lambda a, b: _block_product(a, s, b, n, num, causal), w, xq)
    dws, dxq = vjp(dy)
    return xq, dx + dxq, dw + dws

  dx0 = jnp.zeros_like(x)  # varying, as x
  _, dx, dw = jax.lax.fori_loop(0, num, step, (x, dx0, jnp.zeros_like(w)))
  dx = jax.lax.ppermute(dx, axis_name, _ring_perm(num))
  return jax.lax.psum(dw, axis_name), dx


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
