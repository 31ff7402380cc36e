"""What every linear-attention algorithm shares: the denominator guard and the mode names."""

from __future__ import annotations

import jax.numpy as jnp

# The algorithms of causal linear attention (``fastpos.ops.linear_attn``): "chunk"
# (chunkwise-parallel), "recurrent" (serial scan over chunks), "fused" (one kernel), "auto"
# (per backend, ``fastpos.ops.linear_attn.auto``).
MODES = ("auto", "chunk", "recurrent", "fused")


def check_mode(mode) -> str:
  """Returns ``mode`` when it is one of ``MODES``, else raises ValueError naming the choices."""
  if not isinstance(mode, str) or mode not in MODES:
    raise ValueError(f"mode must be one of {', '.join(repr(m) for m in MODES)}; got {mode!r}.")
  return mode


def _guard(den, eps: float):
  """Keeps denominators away from zero: |den| < eps becomes +-eps (sign kept, +eps at 0).

  Positive feature maps give den > 0 and the clamp only acts on all-padding rows; maps that
  can be negative (trf) need the sign-preserving form."""
  return jnp.where(jnp.abs(den) < eps, jnp.where(den < 0, -eps, eps), den)
