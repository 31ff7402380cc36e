"""``t5_bias``: a learned per-head scalar added to the logits by relative offset (logits hook).

Raffel et al. 2020 (T5), Sec. 2.1:

    logits_{h,i,j} = q_i . k_j / sqrt(d) + b_{h, bucket(j - i)}

``bucket`` is T5's ``_relative_position_bucket`` (``relative_position_bucket`` below): exact
buckets for small offsets, log-spaced ones up to ``max_distance``, split by sign unless
causal. ``bucketed=False``: one scalar per offset instead (lengths up to ``dims.max_length``).
2D (raster order): per 2D offset, or a joint table of (row bucket, column bucket).

Shapes: ``logits(q, k, ctx)`` returns ``[1, heads, Lq, Lk]`` added to the scaled logits;
parameters ``[heads, num_buckets]`` (T5), ``[heads, 2N-1]`` or ``[heads, 2H-1, 2W-1]`` (per
offset), init normal with variance 1 / (entries per head), as T5X. With M memory keys the
queries sit at M..M+Lq-1. Causal, 1D and 2D; softmax only (with a linear kernel use
``kernelized_rpe``). Options: ``T5Bias.option_spec`` (``share_across_layers``: one table for
the model, as T5).
"""

from __future__ import annotations

import math

import flax.linen as nn
import numpy as np

from fastpos.ops import toeplitz
from fastpos.positional.base import (
    Context,
    Option,
    Scheme,
    center_slice,
    center_slice_2d,
    offset_rows,
)


def relative_position_bucket(
    offset, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> np.ndarray:
  """T5's bucket of each relative offset ``j - i`` (key minus query position).

  Args:
    offset: integer array (any shape) of offsets ``j - i``.
    bidirectional: split the buckets by sign (encoder); otherwise all buckets serve keys at or
      before the query and later keys map to bucket 0 (decoder).
    num_buckets: B, even, >= 4. max_distance: distances >= it share the last bucket of a side.

  Returns:
    int32 array like ``offset`` with values in ``[0, num_buckets)`` (see the module docstring
    for the formula). Pure numpy: offsets are static.
  """
  n = -np.asarray(offset, np.int64)  # i - j: >= 0 for past keys
  ret = np.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    ret = ret + (n < 0) * num_buckets  # keys after the query: upper half
    n = np.abs(n)
  else:
    n = np.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  ratio = np.maximum(n, max_exact).astype(np.float64) / max_exact  # >= 1: log defined
  large = max_exact + (
      np.log(ratio) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
  ).astype(np.int64)
  large = np.minimum(large, num_buckets - 1)
  return (ret + np.where(is_small, n, large)).astype(np.int32)


def _t5_init(key, shape, dtype=None):
  """Normal with variance 1 / (entries per head): T5X's ``default_embed_init`` on a
  ``[heads, buckets]`` table, extended to the other tables."""
  init = nn.initializers.variance_scaling(
      1.0, "fan_in", "normal", in_axis=tuple(range(1, len(shape))), out_axis=0
  )
  return init(key, shape) if dtype is None else init(key, shape, dtype)


class T5Bias(Scheme):
  """Options: ``option_spec``."""

  option_spec = {
      "bucketed": Option(True, "T5's log buckets (else one scalar per offset)", type="bool"),
      "num_buckets": Option(
          32,
          "bucketed: B, split by sign when bidirectional",
          type="int",
          low=4,
          even=True,
          note="T5: 32",
          used_when=lambda o, two_d: o["bucketed"],
          used_doc="with bucketed=True only",
      ),
      "max_distance": Option(
          128,
          "bucketed: distances >= it share the last bucket",
          type="int",
          low=1,
          note="T5: 128",
          used_when=lambda o, two_d: o["bucketed"],
          used_doc="with bucketed=True only",
      ),
      "share_across_layers": Option(False, "one table for the whole model", type="bool"),
  }

  scheme_name = "t5_bias"
  hooks = ("logits",)
  supports_2d = True
  packs = ("softmax",)  # in-row offsets j - i are the in-segment offsets inside a segment
  packing_note = "a logits bias (softmax only)"
  linear_hint = (
      "kernelized_rpe, its linear-attention counterpart (exp(b_(j-i)) inside the kernel sums "
      "by FFT)"
  )

  @classmethod
  def check_relations(cls, options: dict) -> None:
    if options["bucketed"] and options["max_distance"] <= options["num_buckets"] // 2:
      raise ValueError(
          f"t5_bias: max_distance must be an integer > num_buckets // 2 = "
          f"{options['num_buckets'] // 2} (T5: 128), the end of the exact buckets; "
          f"got {options['max_distance']!r}."
      )

  def setup(self):
    h, grid = self.dims.num_heads, self.dims.grid
    if self.bucketed:
      shape = (h, self.num_buckets) if grid is None else (h, self.num_buckets, self.num_buckets)
    elif grid is None:
      shape = (h, 2 * self.dims.max_length - 1)
    else:
      shape = (h, 2 * grid[0] - 1, 2 * grid[1] - 1)
    self.rel_bias = self.param("rel_bias", _t5_init, shape)

  def _buckets(self, n: int, bidirectional: bool) -> np.ndarray:
    """``[2n-1]`` buckets of the offsets -(n-1)..(n-1)."""
    return relative_position_bucket(
        np.arange(-(n - 1), n),
        bidirectional=bidirectional,
        num_buckets=self.num_buckets,
        max_distance=self.max_distance,
    )

  def offset_table(self, n: int, causal: bool):
    """``[heads, 2n-1]``: the bias of offset ``j - i`` at index ``j - i + n - 1`` (1D)."""
    if self.dims.grid is not None:
      raise ValueError("t5_bias: built for a 2D grid but called without one.")
    if self.bucketed:
      return self.rel_bias[:, self._buckets(n, not causal)]
    return center_slice(self.rel_bias, n, self.dims.max_length)

  def offset_table_2d(self, grid, causal: bool):
    """``[heads, 2H-1, 2W-1]`` by (row offset + H - 1, column offset + W - 1)."""
    if self.dims.grid is None:
      raise ValueError("t5_bias: called with a grid but built for 1D (dims.grid is None).")
    if not self.bucketed:
      return center_slice_2d(self.rel_bias, grid, self.dims.grid)
    rows = self._buckets(grid[0], not causal)  # raster causal: earlier rows only
    cols = self._buckets(grid[1], True)  # ... but any column in an earlier row
    return self.rel_bias[:, rows[:, None], cols[None, :]]

  def logits(self, q, k, ctx: Context):
    """``[1, heads, Lq, Lk]``: ``b_{h, bucket(j - (M + i))}``; q ``[b, Lq, h, d]``,
    k ``[b, Lk, h, d]`` with Lk = M + Lq (M = ``ctx.memory_length``)."""
    lq, lk = q.shape[1], k.shape[1]
    if ctx.offset is not None:  # decoding: queries at offset + i, keys at cache slots 0..Lk-1
      return offset_rows(self.offset_table(lk, ctx.causal), ctx.offset, lq)[None]
    memory = lk - lq
    if memory != ctx.memory_length:
      raise ValueError(
          f"t5_bias: keys [b, {lk}, ...] and queries [b, {lq}, ...] imply memory "
          f"M = {memory}, but ctx.memory_length = {ctx.memory_length}."
      )
    if ctx.grid is None:
      t = toeplitz.dense_toeplitz(self.offset_table(lk, ctx.causal))  # [h, Lk, Lk]
      return t[None, :, memory:, :]  # queries at M + i
    if memory:
      raise ValueError(
          f"t5_bias: memory (M = {memory}) is only defined for 1D sequences; "
          f"got grid {ctx.grid}."
      )
    grid = tuple(int(g) for g in ctx.grid)
    return toeplitz.dense_toeplitz_2d(self.offset_table_2d(grid, ctx.causal), grid)[None]


SCHEMES = {"t5_bias": T5Bias}
