"""``rope``: rotary position embedding, LRPE's identity-P type 2 with fixed angles (features).

Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021), as derived
in Qin et al., "Linearized Relative Positional Encoding" (TMLR 2023), App. D.1: the orthogonal
solution (Eq. 23) with ``P = I``, no identity block (q = 0 for even f) and the deterministic
angles ``theta_k = base^(-2k/f)``, k = 0..floor(f/2)-1, base = 10000:

    q_s -> R_s q_s,   R_s = blockdiag([[cos s theta_k, -sin s theta_k],
                                       [sin s theta_k,  cos s theta_k]]),
    (R_s q)^T (R_t k) = q^T R_{t-s} k                                     (Eq. 14)

on interleaved feature pairs (2k, 2k+1); an odd f leaves the last feature unrotated. The
computation is ``fastpos.ops.rotations``' (``transform_qk`` with type 2, P = identity and
constant angles), so ``rope`` equals ``lrpe(type=2, p="identity", learnable_theta=False)``
bit for bit.

No parameters (option ``base`` only). Acts on q, k (softmax, f = head_dim) or on phi(q),
phi(k) (linear kernels, f = m; post_phi, as RoFormer does for linear attention: the
rotation changes signs, so ``keeps_nonnegative = False`` and the layer keeps the unrotated
features for the denominator). Supports causal, 1D and 2D (axial, as ``lrpe``: the first
ceil(n/2) pairs rotate with the row, the rest with the column, each axis with its own ladder
``base^(-2k/w)``, w = twice its number of pairs; needs f >= 4). Compatible with every kernel.
"""

from __future__ import annotations

import jax.numpy as jnp

from fastpos.ops.rotations import check_feature_dim, inverse_frequencies, transform_qk
from fastpos.positional.base import Context, Option, Scheme, query_key_positions


class RoPE(Scheme):
  """Options: ``option_spec``."""

  option_spec = {
      "base": Option(
          10000.0,
          "the angle ladder base^(-2k/f)",
          type="number",
          low=0,
          low_open=True,
          note="RoPE: 10000",
      )
  }

  scheme_name = "rope"
  hooks = ("features",)
  packs = ("softmax", "linear")  # in-segment offsets inside phi(q) phi(k)
  feature_stage = "post_phi"
  keeps_nonnegative = False
  supports_2d = True

  def setup(self):
    check_feature_dim(2, self.dims.feature_dim, self.dims.grid is not None, "rope")

  def features(self, q, k, ctx: Context):
    """q ``[b, Lq, h, f]``, k ``[b, Lk, h, f]`` -> rotated, same shapes."""
    f = self.dims.feature_dim
    for name, x in (("q", q), ("k", k)):
      if x.ndim != 4 or x.shape[-1] != f:
        raise ValueError(
            f"rope: {name} must be [batch, length, heads, {f}] "
            f"(dims.feature_dim); got {x.shape}."
        )
    two_d = self.dims.grid is not None
    theta = inverse_frequencies(2, f, two_d=two_d, base=self.base)[None]  # [1, f // 2]
    pos_q, pos_k = query_key_positions(q, k, ctx, two_d=two_d, scheme="rope")
    return transform_qk(
        q, k, pos_q, pos_k, lrpe_type=2, p="identity", two_d=two_d, theta=jnp.asarray(theta)
    )


SCHEMES = {"rope": RoPE}
