"""``kernelized_rpe``: relative positional encoding inside kernelized attention (kv hook).

Luo et al., "Stable, Fast and Accurate: Kernelized Attention with Relative Positional
Encoding" (NeurIPS 2021), Eq. 10-13: with a learned table ``b_{j-i}`` and ``c = exp(b)``,

    z_i = phi(q_i) . sum_j c_{j-i} phi(k_j) v_j^T  /  phi(q_i) . sum_j c_{j-i} phi(k_j)

``c`` sits *inside* numerator and denominator (unlike FastRPB's W V outside). The sums over
keys are Toeplitz products over ``m*d + m`` channels, done by FFT in O(N log N)
(``fastpos.ops.attention.linear_attention(rpe=...)``). With the softmax kernel the same table
is an exact T5-style logits bias: ``exp(q.k + b_{j-i})`` = ``exp(b_{j-i}) exp(q.k)``, so one
learned ``b`` serves both paths (README, Design). The attention layer does the kernel-specific part;
this module only owns ``b``.

Parameters: ``b`` ``[heads, 2*max_length-1]`` (1D) or ``[heads, 2H-1, 2W-1]`` (2D, by row and
column offset, Luo et al. Sec. 3.2's 2D RPE), initialised to zero (c = 1: plain linear
attention at the start). ``share_across_layers=True`` makes the model build one table for all
layers, as in the paper's experiments.

Supports 1D, 2D and causal (the causal FFT path; raster order in 2D). Compatible with softmax
and every feature map, except that the causal path needs phi >= 0 (``trf`` is signed: its
denominators can cross zero when prefix sums are reweighted by c).
"""

from __future__ import annotations

import flax.linen as nn

from fastpos.positional.base import (
    Context,
    KernelInfo,
    KVMix,
    Option,
    Scheme,
    center_slice,
    center_slice_2d,
)


class KernelizedRPE(Scheme):
  """Options: ``option_spec``."""

  option_spec = {"share_across_layers": Option(False, "one table for the whole model", type="bool")}

  scheme_name = "kernelized_rpe"
  hooks = ("kv",)
  supports_2d = True
  packs = ("softmax",)  # softmax: a logits bias b_{j-i}
  packing_note = "its exp(b) weights are one Toeplitz product (FFT) over the row"

  @classmethod
  def compatibility(
      cls, kernel: KernelInfo, *, causal: bool, two_d: bool, options: dict
  ) -> str | None:
    if causal and not kernel.nonnegative:
      return (
          f"causal kernelized RPE needs non-negative features; {kernel.name!r} features "
          f"can be negative, so the reweighted prefix denominators can vanish"
      )
    return None

  def setup(self):
    h = self.dims.num_heads
    shape = (
        (h, 2 * self.dims.max_length - 1)
        if self.dims.grid is None
        else (h, 2 * self.dims.grid[0] - 1, 2 * self.dims.grid[1] - 1)
    )
    self.b = self.param("b", nn.initializers.zeros, shape)

  def kv(self, ctx: Context) -> KVMix:
    if ctx.grid is None:
      if self.dims.grid is not None:
        raise ValueError("kernelized_rpe: built for a 2D grid but called without one.")
      return KVMix(log_table=center_slice(self.b, ctx.length, self.dims.max_length))
    if self.dims.grid is None:
      raise ValueError("kernelized_rpe: called with a grid but built for 1D.")
    return KVMix(log_table=center_slice_2d(self.b, ctx.grid, self.dims.grid))


SCHEMES = {"kernelized_rpe": KernelizedRPE}
