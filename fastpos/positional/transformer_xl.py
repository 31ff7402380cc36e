"""``transformer_xl``: Transformer-XL relative attention terms (b), (c), (d) (logits hook).

Dai et al. 2019 ("Transformer-XL"), Sec. 3.3, the score of query i and key j:

    A^rel_{i,j} = q_i . k_j                       (a)  content     (the attention layer's q.k)
                + q_i . W_{k,R} R_{i-j}            (b)  content-dependent position
                + u . k_j                          (c)  global content bias
                + v . W_{k,R} R_{i-j}              (d)  global position bias

with R the sinusoids of Vaswani et al. (width ``rel_dim``), W_{k,R} a learned projection and
u, v learned vectors per head. This hook returns ``((b) + (c) + (d)) / sqrt(d)``; (b) + (d) use
the left shift of Appendix B (``fastpos.ops.transformer_xl.relative_logits``).

Shapes: ``logits(q, k, ctx)`` with q ``[batch, Lq, heads, d]``, k ``[batch, Lk, heads, d]``,
keys ``[memory (M = ctx.memory_length), segment]`` -> ``[batch, heads, Lq, Lk]``. Parameters
``w_kr [d_R, heads, d]``, ``u``, ``v`` ``[heads, d]`` (init N(0, 0.02^2), as the paper's code).
Causal (the paper) and non-causal (two-sided distances), 1D only; softmax only. Options:
``TransformerXL.option_spec``.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from fastpos.ops import transformer_xl as txl
from fastpos.positional.base import Context, Option, Scheme

INIT_STD = 0.02  # the paper's code: init_std for weights and for r_w_bias / r_r_bias


def sinusoids(distances, dim: int, dtype=jnp.float32):
  """``[len(distances), dim]``: ``R_t = [sin(t w), cos(t w)]``, ``w_k = 10000^(-2k/dim)``.

  ``distances`` may be negative (two-sided tables)."""
  inv = 10000.0 ** (-jnp.arange(0, dim, 2, dtype=dtype) / dim)  # [dim/2]
  ang = jnp.asarray(distances, dtype)[:, None] * inv[None, :]
  return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)


class TransformerXL(Scheme):
  """Options: ``option_spec``."""

  option_spec = {
      "rel_dim": Option(
          None,
          "width d_R of the sinusoids R (None: dims.embed_dim)",
          type="int",
          none_ok=True,
          even=True,
          low=2,
          valid="None (use dims.embed_dim) or a positive even integer (half "
          "sines, half cosines)",
      )
  }

  scheme_name = "transformer_xl"
  hooks = ("logits",)
  supports_2d = False

  @property
  def width(self) -> int:
    """d_R, the width of the sinusoids."""
    return self.dims.embed_dim if self.rel_dim is None else self.rel_dim

  def setup(self):
    if self.rel_dim is None and (self.dims.embed_dim < 2 or self.dims.embed_dim % 2):
      raise ValueError(
          f"transformer_xl: the sinusoid width defaults to dims.embed_dim = "
          f"{self.dims.embed_dim}, which is not a positive even integer; set "
          f"rel_dim to one."
      )
    h, d = self.dims.num_heads, self.dims.head_dim
    init = nn.initializers.normal(INIT_STD)
    self.w_kr = self.param("w_kr", init, (self.width, h, d))
    self.u = self.param("u", init, (h, d))
    self.v = self.param("v", init, (h, d))

  def rel_keys(self, length: int, memory: int, two_sided: bool, dtype):
    """``rel_k[t] = W_{k,R} R_{M+L-1-t}``: ``[M+L, h, d]``, two-sided ``[M+2L-1, h, d]``."""
    last = -length if two_sided else -1  # distances M+L-1 down to -(L-1) or 0
    distances = np.arange(memory + length - 1, last, -1)
    r = sinusoids(distances, self.width, dtype)  # [T, d_R]
    return jnp.einsum("tr,rhd->thd", r, self.w_kr.astype(dtype))

  def logits(self, q, k, ctx: Context):
    """``[b, heads, Lq, Lk]``: ``((q_i + v) . W_{k,R} R_{M+i-j} + u . k_j) / sqrt(d)``.

    q ``[b, Lq, h, d]``, k ``[b, Lk, h, d]`` with Lk = M + Lq (M = ``ctx.memory_length``).
    Causal: the (b) + (d) part is 0 on future keys j > M + i."""
    if ctx.grid is not None:
      raise ValueError(f"transformer_xl is 1D only; got grid {ctx.grid}.")
    h, d = self.dims.num_heads, self.dims.head_dim
    if q.shape[2:] != (h, d) or k.shape[2:] != (h, d):
      raise ValueError(
          f"transformer_xl: q {q.shape} and k {k.shape} must be "
          f"[batch, length, heads={h}, head_dim={d}]."
      )
    lq, lk = q.shape[1], k.shape[1]
    if ctx.offset is not None:
      return self._logits_at(q, k, ctx)
    memory = lk - lq
    if memory != ctx.memory_length:
      raise ValueError(
          f"transformer_xl: keys [b, {lk}, ...] and queries [b, {lq}, ...] imply "
          f"memory M = {memory}, but ctx.memory_length = {ctx.memory_length}."
      )
    dtype = jnp.result_type(q, k, self.w_kr)
    two_sided = not ctx.causal
    rel_k = self.rel_keys(lq, memory, two_sided, dtype)
    fn = txl.relative_logits_reference if ctx.reference else txl.relative_logits
    terms_bd = fn(q.astype(dtype), rel_k, pos_bias=self.v.astype(dtype), two_sided=two_sided)
    term_c = jnp.einsum("bjhd,hd->bhj", k.astype(dtype), self.u.astype(dtype))  # [b, h, Lk]
    return (terms_bd + term_c[:, :, None, :]) * (d**-0.5)

  def _logits_at(self, q, k, ctx: Context):
    """Decoding: queries at ``ctx.offset + i``, keys at cache slots 0..Lk-1 (distance
    ``offset + i - j``; later slots are masked by the layer). (b) + (d) as
    ``((q_i + v) W_{k,R}) . R_dist``: O(Lk d_R) per query, no [Lk, h, d] relative keys."""
    d = self.dims.head_dim
    lq, lk = q.shape[1], k.shape[1]
    dtype = jnp.result_type(q, k, self.w_kr)
    dist = (ctx.offset + jnp.arange(lq))[:, None] - jnp.arange(lk)[None, :]  # [Lq, Lk]
    r = sinusoids(dist.reshape(-1), self.width, dtype).reshape(lq, lk, self.width)
    qv = q.astype(dtype) + self.v.astype(dtype)[None, None]
    proj = jnp.einsum("bihd,rhd->bihr", qv, self.w_kr.astype(dtype))
    terms_bd = jnp.einsum("bihr,ijr->bhij", proj, r)
    term_c = jnp.einsum("bjhd,hd->bhj", k.astype(dtype), self.u.astype(dtype))
    return (terms_bd + term_c[:, :, None, :]) * (d**-0.5)


SCHEMES = {"transformer_xl": TransformerXL}
