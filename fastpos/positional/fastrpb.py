"""``fastrpb``: FastRPB, a learned relative bias added to the attention output (output hook).

FastRPB (Zubkov et al., ICLR 2022 submission), Eq. 10-12:

    Y = AttentionVariant(Q, K, V) + W V,     W_{i,j} = w_{j-i},  w in R^{2N-1}

``W`` is Toeplitz, so ``W V`` costs O(N log N d) by FFT (``fastpos.ops.toeplitz``). The bias
sits *outside* the attention's normalisation (not inside it as in Luo et al.'s kernelized
RPE), so FastRPB is independent of the kernel: it works with softmax and every feature map.

* 1D: ``w`` ``[2*max_length-1]`` (or ``[heads, ...]`` with ``per_head``), sliced to the
  batch's length, so shorter batches use the offsets -(N-1)..(N-1) of the same table (the
  reference code padded by max_len-1 and was only right at N == max_len).
* causal 1D: ``W`` lower triangular (``w_{j-i}`` for j <= i only) by the causal FFT path.
* 2D (Sec. 3.2.2): ``mode_2d="axial"`` (the paper): ``W2d = X + Y``, a vertical table
  ``[2H-1]`` plus a horizontal table ``[2W-1]`` (``shared_axes=True`` uses one table for both,
  which needs H == W, as the paper does); ``mode_2d="full"``: one weight per 2D offset
  ``[2H-1, 2W-1]`` by the 2D FFT (``toeplitz_matmul_2d``), which also supports causal
  (raster order). Axial is not causal (raster causality does not split into rows + columns).

Parameters: one table per layer, or one per head (``per_head=True``); initialised to zero so
training starts from the plain attention. Compatible with every kernel; causal in 1D and 2D
full; not shareable across layers (one table per layer, as in the paper).
With ``ctx.reference`` the product is the dense matrix ``W`` times ``V``.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from fastpos.ops import toeplitz
from fastpos.positional.base import (
    Context,
    KernelInfo,
    Option,
    Scheme,
    center_slice,
    center_slice_2d,
    offset_rows,
)

MODES_2D = ("axial", "full")


class FastRPB(Scheme):
  """Options: ``option_spec``."""

  option_spec = {
      "per_head": Option(False, "one table per head (else one shared by the heads)", type="bool"),
      "mode_2d": Option(
          "axial",
          "2D: the paper's row + column tables, or one full 2D table",
          type="str",
          choices=MODES_2D,
          used_when=lambda o, two_d: two_d,
          used_doc="on a 2D grid only",
      ),
      "shared_axes": Option(
          False,
          "axial 2D: one table for rows and columns (square grids)",
          type="bool",
          used_when=lambda o, two_d: two_d and o["mode_2d"] == "axial",
          used_doc="on a 2D grid with mode_2d='axial' only",
      ),
  }

  scheme_name = "fastrpb"
  hooks = ("output",)
  supports_2d = True
  packing_note = "its W V is one Toeplitz product (FFT) over the row"

  @classmethod
  def compatibility(
      cls, kernel: KernelInfo, *, causal: bool, two_d: bool, options: dict
  ) -> str | None:
    if two_d and causal and options["mode_2d"] == "axial":
      return (
          "the paper's axial 2D bias (vertical + horizontal tables) is not causal in "
          "raster order; use positional_options.fastrpb.mode_2d='full'"
      )
    return None

  def setup(self):
    lead = (self.dims.num_heads,) if self.per_head else ()
    zeros = nn.initializers.zeros
    if self.dims.grid is None:
      self.w = self.param("w", zeros, lead + (2 * self.dims.max_length - 1,))
      return
    h, w = self.dims.grid
    if self.mode_2d == "full":
      self.w = self.param("w", zeros, lead + (2 * h - 1, 2 * w - 1))
    else:  # axial
      if self.shared_axes:
        if h != w:
          raise ValueError(f"fastrpb: shared_axes needs a square grid; got {self.dims.grid}.")
        self.w = self.param("w", zeros, lead + (2 * h - 1,))
      else:
        self.w_rows = self.param("w_rows", zeros, lead + (2 * h - 1,))
        self.w_cols = self.param("w_cols", zeros, lead + (2 * w - 1,))

  def _tables(self, n: int, grid):
    """The batch's tables, each ``[h|1, ...]`` so they broadcast over ``[b, h, N, d]``."""

    def lead(t):
      return t if self.per_head else t[None]

    if grid is None:
      if self.dims.grid is not None:
        raise ValueError("fastrpb: built for a 2D grid but called without one.")
      return (lead(center_slice(self.w, n, self.dims.max_length)),)
    if self.dims.grid is None:
      raise ValueError("fastrpb: called with a grid but built for 1D (dims.grid is None).")
    gh, gw = grid
    mh, mw = self.dims.grid
    if self.mode_2d == "full":
      return (lead(center_slice_2d(self.w, grid, self.dims.grid)),)
    w_rows = self.w if self.shared_axes else self.w_rows
    w_cols = self.w if self.shared_axes else self.w_cols
    return (lead(center_slice(w_rows, gh, mh)), lead(center_slice(w_cols, gw, mw)))

  def output_table(self, ctx: Context):
    """The 1D output hook as a Toeplitz table: ``output(v) = W v`` with ``W[i, j] =
    w[j - i + N - 1]`` (j <= i when causal), ``[h|1, 2N-1]`` for N = ``ctx.length``. A layer
    whose sequence is split over devices computes ``W v`` from it block by block
    (``fastpos.models.context_parallel``)."""
    (w,) = self._tables(ctx.length, None)
    return w

  def output(self, v, ctx: Context):
    """``W V``: ``v [b, N, h, d] -> [b, N, h, d]`` (padded rows of v must be zero)."""
    if ctx.offset is not None:
      return self._output_at(v, ctx)
    b, n, h, d = v.shape
    x = jnp.transpose(v, (0, 2, 1, 3))  # [b, h, N, d]
    tables = self._tables(n, ctx.grid)
    if ctx.grid is None:
      (w,) = tables
      if ctx.reference:
        t = toeplitz.dense_toeplitz(w)
        if ctx.causal:
          t = jnp.where(toeplitz.causal_mask(n), t, 0)
        y = jnp.einsum("hij,bhjd->bhid", t, x.astype(t.dtype))
      else:
        y = toeplitz.toeplitz_matmul(w, x, causal=ctx.causal)
    elif self.mode_2d == "full":
      (w,) = tables
      if ctx.reference:
        t = toeplitz.dense_toeplitz_2d(w, ctx.grid)
        if ctx.causal:
          t = jnp.where(toeplitz.causal_mask(n), t, 0)  # raster order = index order
        y = jnp.einsum("hij,bhjd->bhid", t, x.astype(t.dtype))
      else:
        y = toeplitz.toeplitz_matmul_2d(w, x, ctx.grid, causal=ctx.causal)
    else:
      w_rows, w_cols = tables
      if ctx.reference:
        t = toeplitz.dense_toeplitz_2d(w_rows[..., :, None] + w_cols[..., None, :], ctx.grid)
        y = jnp.einsum("hij,bhjd->bhid", t, x.astype(t.dtype))
      else:
        y = toeplitz.fastrpb_2d_matmul(w_rows, w_cols, x, ctx.grid)
    return jnp.transpose(y, (0, 2, 1, 3)).astype(v.dtype)

  def _output_at(self, v, ctx: Context):
    """Decoding: ``sum_{j <= p} w_{j-p} v_j`` for the ``ctx.length`` queries at
    ``p = ctx.offset + i`` over the value cache ``v [b, T, h, d]`` (slot = position; zero at
    padding): O(T d) per query. A general table has no fixed-size recurrent form."""
    if ctx.grid is not None or self.dims.grid is not None:
      raise ValueError("fastrpb: decoding is 1D only.")
    t, lq = v.shape[1], ctx.length
    (w,) = self._tables(t, None)  # [h|1, 2T-1]
    rows = offset_rows(w, ctx.offset, lq)  # [h|1, Lq, T]
    pos = ctx.offset + jnp.arange(lq)
    seen = (jnp.arange(t)[None, :] <= pos[:, None])[None]
    rows = jnp.where(seen, rows, jnp.zeros((), rows.dtype))
    return jnp.einsum("hij,bjhd->bihd", rows, v.astype(rows.dtype)).astype(v.dtype)


SCHEMES = {"fastrpb": FastRPB}
