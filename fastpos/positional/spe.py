"""``spe``: Stochastic Positional Encoding, sineSPE and convSPE, gated (features, pre_phi).

Liutkus et al., "Relative Positional Encoding for Transformers with Linear Complexity" (ICML
2021); the target is FastRPB Eq. (8), one stationary kernel P_d per feature dimension d:

    A_mn = sum_d q_md k_nd P_d(m - n)

Two zero-mean Gaussian processes with ``E[Qbar_d(m) Kbar_d(n)] = P_d(m - n)``, drawn R times,
give per-position features whose dot product estimates it (variance ~ 1/R):

    qhat_m = R^(-1/2) sum_d q_md Qbar_d(m, :),    khat_n = R^(-1/2) sum_d k_nd Kbar_d(n, :)

* ``kind="sine"``: ``P_d(delta) = sum_k lambda_kd^2 cos(2 pi f_kd delta + theta_kd)``, K =
  ``num_sines`` learned sinusoids per (head, d).
* ``kind="conv"``: ``Qbar``, ``Kbar`` are white noise filtered by two learned filters of length
  ``kernel_size``: ``P_d(delta) = sum_t phi^q_d(t) phi^k_d(t + delta)``.
* ``gated``: ``(1 - b_d) P_d(delta) + b_d`` with a learned gate b_d (position-free part).

The noise is one fixed draw per ``seed`` and layer path (the authors redraw it per call).

Shapes: q ``[batch, Lq, heads, d]``, k ``[batch, Lk, heads, d]`` -> qhat, khat ``[batch, L,
heads, R]`` (R = ``num_realizations``, ``feature_out_dim``); acts before phi (pre_phi), so
every kernel works. Causal (features are per position), 1D only; convSPE needs Lk <=
``dims.max_length``. Options: ``SPE.option_spec``.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fastpos.positional import path_keys
from fastpos.positional.base import Context, Option, Scheme

KINDS = ("sine", "conv")
_HIGHEST = jax.lax.Precision.HIGHEST


def _const_init(value: float):
  def init(key, shape, dtype=jnp.float32):
    del key
    return jnp.full(shape, value, dtype)

  return init


# Initialisers draw flat and reshape (the partitionable threefry compiles rank-3 draws slowly).
def _normal_init(mean: float, std: float):
  def init(key, shape, dtype=jnp.float32):
    return mean + std * jax.random.normal(key, (math.prod(shape),), dtype).reshape(shape)

  return init


def _uniform_init(high: float):
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, (math.prod(shape),), dtype, 0.0, high).reshape(shape)

  return init


class SPE(Scheme):
  """Options: ``option_spec`` (see the module docstring)."""

  option_spec = {
      "kind": Option(
          "sine", "sineSPE (periodic) or convSPE (a learned filter)", type="str", choices=KINDS
      ),
      "num_realizations": Option(
          64,
          "R, the features per head (the output size)",
          type="int",
          low=1,
          note="the authors' LRA setting: 64",
      ),
      "num_sines": Option(
          10,
          "sine: sinusoids per feature",
          type="int",
          low=1,
          note="default 10",
          used_when=lambda o, two_d: o["kind"] == "sine",
          used_doc="with kind='sine' only",
      ),
      "kernel_size": Option(
          128,
          "conv: the filter length",
          type="int",
          low=1,
          note="default 128",
          used_when=lambda o, two_d: o["kind"] == "conv",
          used_doc="with kind='conv' only",
      ),
      "gated": Option(True, "mix in a position-free part by a learned gate", type="bool"),
      "seed": Option(0, "the fixed noise draw (per seed and layer path)", type="int"),
      "share_across_layers": Option(
          False, "one set of parameters and noise for the model", type="bool"
      ),
  }

  scheme_name = "spe"
  hooks = ("features",)
  feature_stage = "pre_phi"
  supports_causal = True
  supports_1d = True
  supports_2d = False

  @classmethod
  def feature_out_dim(cls, dim: int, options: dict) -> int:
    """R = ``num_realizations``: qhat, khat are ``[b, L, h, R]`` whatever the input size."""
    return int(options["num_realizations"])

  def setup(self):
    h, d = self.dims.num_heads, self.dims.head_dim
    if self.kind == "sine":
      k = self.num_sines
      self.frequencies = self.param("frequencies", _normal_init(-4.0, 1.0), (h, d, k))
      self.phases = self.param("phases", nn.initializers.zeros, (h, d, k))
      # softplus^-1(K^-1/2): sum_k lambda_k^2 = 1 at init.
      lam = 1.0 / math.sqrt(k)
      self.gains = self.param("gains", _const_init(math.log(math.expm1(lam))), (h, d, k))
    else:
      high = 2.0 / math.sqrt(self.kernel_size)
      self.filter_q = self.param("filter_q", _uniform_init(high), (h, d, self.kernel_size))
      self.filter_k = self.param("filter_k", _uniform_init(high), (h, d, self.kernel_size))
    if self.gated:
      self.gate = self.param("gate", nn.initializers.zeros, (h, d))

  # -------------------------------------------------------------------------------------------
  # Noise (one fixed draw per seed and module path)
  # -------------------------------------------------------------------------------------------
  def _noise(self, dtype):
    """(positional noise, gating noise eps ``[h, d, R]``); positional: sine ``[h, d, 2K, R]``,
    conv ``[R, h*d, max_length + L - 1]`` (the convolution's layout).

    One flat float32 draw, sliced and reshaped: the same draw whatever the compute dtype and
    whether or not ``gated`` (eps is always drawn), and a flat draw compiles in a fraction of
    the time a rank-4 one takes with the partitionable threefry on CPU."""
    h, d, r = self.dims.num_heads, self.dims.head_dim, self.num_realizations
    if self.kind == "sine":
      shape = (h, d, 2 * self.num_sines, r)
    else:
      shape = (r, h * d, self.dims.max_length + self.kernel_size - 1)
    size = math.prod(shape)
    key = path_keys.fixed_key(self, self.seed)  # by the layer's unrolled path, also scanned
    flat = jax.random.normal(key, (size + h * d * r,), jnp.float32).astype(dtype)
    return flat[:size].reshape(shape), flat[size:].reshape(h, d, r)

  def _gate_weights(self, dtype):
    """(sqrt(1 - b), sqrt(b)) ``[h, d]`` each, or None without gating."""
    if not self.gated:
      return None
    b = jax.nn.sigmoid(self.gate.astype(dtype))
    return jnp.sqrt(1.0 - b), jnp.sqrt(b)

  # -------------------------------------------------------------------------------------------
  # sineSPE
  # -------------------------------------------------------------------------------------------
  def _omega(self, positions, dtype, *, with_phase: bool):
    """``[n, h, d, 2K]``: [lambda cos(2 pi f m + theta), lambda sin(2 pi f m + theta)]."""
    f = jax.nn.sigmoid(self.frequencies.astype(dtype)) / 2.0  # [h, d, K]
    lam = jax.nn.softplus(self.gains.astype(dtype))  # [h, d, K]
    pos = jnp.asarray(positions, dtype).reshape(-1, 1, 1, 1)
    angle = 2.0 * np.pi * f[None] * pos  # [n, h, d, K]
    if with_phase:
      angle = angle + self.phases.astype(dtype)[None]
    lam = lam[None]
    return jnp.concatenate([lam * jnp.cos(angle), lam * jnp.sin(angle)], axis=-1)

  def _sine_codes(self, z, positions, dtype, *, query: bool):
    """Qbar or Kbar ``[n, h, d, R]`` = Omega(m) Z_d; z ``[h, d, 2K, R]``. Batch-independent, so
    materialising it (n h d 2K R multiply-adds) and then contracting d against x costs far
    less than folding Omega into x first (b n h d 2K R), which the reference path does."""
    omega = self._omega(positions, dtype, with_phase=query)
    return jnp.einsum("nhdj,hdjr->nhdr", omega, z, precision=_HIGHEST)

  def _sine_apply(self, x, z, positions, *, query: bool):
    """``[b, n, h, R]`` = sum_d x_d Qbar_d (unscaled) without forming Qbar: x Omega, then one
    contraction over (d, 2K) against the noise z ``[h, d, 2K, R]`` (the reference path)."""
    b, n, h, d = x.shape
    dtype = x.dtype
    omega = self._omega(positions, dtype, with_phase=query)  # [n, h, d, 2K]
    u = x[..., None] * omega[None]  # [b, n, h, d, 2K]
    return jnp.einsum(
        "bnhc,hcr->bnhr",
        u.reshape(b, n, h, -1),
        z.reshape(h, -1, self.num_realizations),
        precision=_HIGHEST,
    )

  # -------------------------------------------------------------------------------------------
  # convSPE
  # -------------------------------------------------------------------------------------------
  def _conv_codes(self, z, n: int, dtype, *, query: bool, reference: bool):
    """Qbar or Kbar ``[n, h, d, R]`` for positions 0..n-1: sum_t phi(t) z(m + t); z
    ``[R, h*d, max_length + L - 1]``."""
    h, d = self.dims.num_heads, self.dims.head_dim
    r, ks = self.num_realizations, self.kernel_size
    filt = (self.filter_q if query else self.filter_k).astype(dtype).reshape(h * d, ks)
    z = z[:, :, : n + ks - 1]  # [R, hd, n + L - 1]
    if reference:
      idx = np.arange(n)[:, None] + np.arange(ks)[None, :]  # [n, L]: m + t
      windows = z[:, :, idx]  # [R, hd, n, L]
      out = jnp.einsum("rcnt,ct->rcn", windows, filt, precision=_HIGHEST)
    else:
      out = jax.lax.conv_general_dilated(
          z,
          filt[:, None, :],
          window_strides=(1,),
          padding="VALID",
          dimension_numbers=("NCH", "OIH", "NCH"),
          feature_group_count=h * d,
          precision=_HIGHEST,
      )  # [R, hd, n]
    return jnp.transpose(out.reshape(r, h, d, n), (3, 1, 2, 0))  # [n, h, d, R]

  # -------------------------------------------------------------------------------------------
  # The hook
  # -------------------------------------------------------------------------------------------
  def _encode(self, x, noise, positions, n_total: int, *, query: bool, reference: bool, codes=None):
    """``[b, n, h, R]``: R^-1/2 sum_d x_md Qbar_d(pos_m) (gated), for x ``[b, n, h, d]`` at
    ``positions`` (the last n of 0..n_total-1); noise from ``_noise``."""
    dtype = x.dtype
    z, eps = noise
    r = self.num_realizations
    gates = self._gate_weights(dtype)
    x_pos = x if gates is None else x * gates[0][None, None]  # sqrt(1 - b) x
    if codes is not None:  # given by a decoding step
      out = jnp.einsum("bnhd,nhdr->bnhr", x_pos, codes, precision=_HIGHEST)
    elif self.kind == "sine" and reference:
      out = self._sine_apply(x_pos, z, positions, query=query)
    else:
      if self.kind == "sine":
        codes = self._sine_codes(z, positions, dtype, query=query)
      else:
        codes = self._conv_codes(z, n_total, dtype, query=query, reference=reference)[
            n_total - x.shape[1] :
        ]
      out = jnp.einsum("bnhd,nhdr->bnhr", x_pos, codes, precision=_HIGHEST)
    if gates is not None:
      out = out + jnp.einsum("bnhd,hdr->bnhr", x * gates[1][None, None], eps, precision=_HIGHEST)
    return out / math.sqrt(r)

  def features(self, q, k, ctx: Context):
    """q ``[b, Lq, h, d]``, k ``[b, Lk, h, d]`` (d = ``dims.head_dim``; Lk = M + Lq) ->
    qhat ``[b, Lq, h, R]``, khat ``[b, Lk, h, R]`` with E[qhat_m . khat_n] =
    sum_d q_md k_nd P~_d(m - n), P~ = (1 - b) P + b gated (module docstring)."""
    h, d = self.dims.num_heads, self.dims.head_dim
    for name, x in (("q", q), ("k", k)):
      if x.ndim != 4 or x.shape[2] != h or x.shape[3] != d:
        raise ValueError(
            f"spe: {name} must be [batch, length, {h}, {d}] (heads, "
            f"dims.head_dim; spe acts pre_phi on raw q, k); got {x.shape}."
        )
    if ctx.grid is not None:
      raise ValueError(f"spe: only 1D sequences are supported; got grid {ctx.grid}.")
    lq, lk = q.shape[1], k.shape[1]
    if ctx.offset is not None:
      return self._features_at(q, k, ctx)
    memory = lk - lq
    if memory != ctx.memory_length:
      raise ValueError(
          f"spe: keys [b, {lk}, ...] and queries [b, {lq}, ...] imply memory "
          f"M = {memory}, but ctx.memory_length = {ctx.memory_length}."
      )
    if self.kind == "conv" and lk > self.dims.max_length:
      raise ValueError(
          f"spe: sequence length {lk} exceeds the maximum length "
          f"{self.dims.max_length} the convSPE noise was drawn for; raise "
          f"model.max_length."
      )
    dtype = jnp.promote_types(jnp.promote_types(q.dtype, k.dtype), jnp.float32)
    positions = np.arange(lk)
    noise = self._noise(dtype)
    qhat = self._encode(
        q.astype(dtype), noise, positions[memory:], lk, query=True, reference=ctx.reference
    )
    khat = self._encode(k.astype(dtype), noise, positions, lk, query=False, reference=ctx.reference)
    return qhat.astype(q.dtype), khat.astype(k.dtype)

  def _features_at(self, q, k, ctx: Context):
    """Decoding: q, k ``[b, L, h, d]`` of the new tokens at positions ``ctx.offset + i``."""
    if q.shape[1] != k.shape[1]:
      raise ValueError(f"spe: a decoding step has one key per query; got {q.shape}, {k.shape}.")
    n = q.shape[1]
    dtype = jnp.promote_types(jnp.promote_types(q.dtype, k.dtype), jnp.float32)
    noise = self._noise(dtype)
    positions = ctx.offset + jnp.arange(n)
    if self.kind == "sine":
      codes = {
          query: self._sine_codes(noise[0], positions, dtype, query=query)
          for query in (True, False)
      }
    else:  # the noise window of positions offset..offset+n-1: samples offset..offset+n+L-2
      z = jax.lax.dynamic_slice_in_dim(noise[0], ctx.offset, n + self.kernel_size - 1, axis=2)
      codes = {
          query: self._conv_codes(z, n, dtype, query=query, reference=False)
          for query in (True, False)
      }
    out = []
    for x, query in ((q, True), (k, False)):
      y = self._encode(
          x.astype(dtype), noise, None, n, query=query, reference=False, codes=codes[query]
      )
      out.append(y.astype(x.dtype))
    return tuple(out)

  def offset_kernel(self, n: int, dtype=jnp.float32):
    """``[h, d, 2n-1]``: the (gated) kernel E[Qbar_d(i) Kbar_d(j)] = P~_d(i - j) at index
    ``j - i + n - 1`` (the layout of ``fastpos.ops.toeplitz``), in closed form."""
    delta = -np.arange(-(n - 1), n)  # i - j per index
    if self.kind == "sine":
      f = jax.nn.sigmoid(self.frequencies.astype(dtype)) / 2.0
      lam2 = jax.nn.softplus(self.gains.astype(dtype)) ** 2
      angle = (
          2.0 * np.pi * f[..., None] * jnp.asarray(delta, dtype)[None, None, None]
          + self.phases.astype(dtype)[..., None]
      )  # [h, d, K, 2n-1]
      p = jnp.sum(lam2[..., None] * jnp.cos(angle), axis=2)
    else:
      ks = self.kernel_size
      fq, fk = self.filter_q.astype(dtype), self.filter_k.astype(dtype)
      fk_pad = jnp.pad(fk, ((0, 0), (0, 0), (n + ks, n + ks)))
      # P(delta) = sum_t fq(t) fk(t + delta): gather fk at t + delta (zero outside [0, L)).
      idx = np.arange(ks)[:, None] + delta[None, :] + n + ks  # [L, 2n-1]
      p = jnp.einsum("hdt,hdto->hdo", fq, fk_pad[:, :, idx], precision=_HIGHEST)
    if self.gated:
      b = jax.nn.sigmoid(self.gate.astype(dtype))[..., None]
      p = (1.0 - b) * p + b
    return p


SCHEMES = {"spe": SPE}
