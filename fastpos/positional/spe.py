"""``spe``: Stochastic Positional Encoding, sineSPE and convSPE, gated (features, pre_phi).

Liutkus et al., "Relative Positional Encoding for Transformers with Linear Complexity" (ICML
2021); FastRPB Eq. (8) and Table 1 use it as a
baseline. The formulation below is derived here
and pinned by tests (``tests/positional/test_spe.py``).

**Target.** Relative attention with one stationary kernel per feature dimension d:

    A_mn = sum_d q_md k_nd P_d(m - n)                    (FastRPB Eq. (8), before 1/sqrt(D))

**Construction.** For each head h and dimension d, two zero-mean Gaussian processes
``Qbar_d(m)``, ``Kbar_d(n)`` with cross-covariance ``E[Qbar_d(m) Kbar_d(n)] = P_d(m - n)``,
independent across d, are drawn R times (R = ``num_realizations``). With

    qhat_m = R^(-1/2) sum_d q_md Qbar_d(m, :)    [R],   khat_n = R^(-1/2) sum_d k_nd Kbar_d(n, :)

``E[qhat_m . khat_n] = sum_d q_md k_nd P_d(m - n)`` exactly (the cross terms d != d' vanish by
independence), and the estimate's variance falls as 1/R. The features hook returns
``qhat [b, Lq, h, R]`` and ``khat [b, Lk, h, R]``: the last dim becomes R
(``feature_out_dim``). The layer then applies its kernel (softmax with scale 1/sqrt(head_dim),
or a feature map phi) to qhat, khat. The authors' code scales Qbar, Kbar by (R D)^(-1/4), i.e.
puts the 1/sqrt(D) inside SPE; here the layer's softmax scale supplies it. (The layer scales
q, k by ``dim ** -0.25`` before the random-feature maps with dim the size it sees, which after
SPE is R, not D.)

* **sineSPE** (``kind="sine"``): K = ``num_sines`` sinusoids per (h, d),

      P_d(delta) = sum_k lambda_kd^2 cos(2 pi f_kd delta + theta_kd).

  With noise ``Z_d [2K, R]`` ~ N(0, 1) and ``Omega(m, theta) = [lambda_k cos(2 pi f_k m +
  theta_k), lambda_k sin(2 pi f_k m + theta_k)]_k`` ``[2K]``: ``Qbar_d(m) = Omega(m, theta_d)
  Z_d``, ``Kbar_d(n) = Omega(n, 0) Z_d``; since cos(a + t) cos b + sin(a + t) sin b =
  cos(a - b + t) the cross-covariance is P_d(m - n). ``Qbar [Lk, h, d, R]`` is materialised
  once per call (batch-independent) and contracted with q over d. Parameters ``[h, d, K]``:
  ``frequencies`` (raw; f = sigmoid(raw) / 2 in (0, 1/2), init N(-4, 1), f ~ 0.01: slow, long-range
  sinusoids, as the authors' init), ``phases`` theta (init 0: P_d starts symmetric, positive
  definite with P_d(0) = 1; the authors draw N(0, 1)), ``gains`` (raw; lambda = softplus(raw),
  init softplus^-1(K^(-1/2)) so that sum_k lambda_k^2 = 1 and |P_d| <= 1; the authors draw
  random gains and scale the noise by (2K)^(-1/2) instead).
* **convSPE** (``kind="conv"``): white noise ``z_d(t, :)`` ~ N(0, 1) filtered by two learned
  filters of length L = ``kernel_size`` per (h, d):

      Qbar_d(m) = sum_{t<L} phi^q_d(t) z_d(m + t),    Kbar_d(n) = sum_{t<L} phi^k_d(t) z_d(n + t),
      P_d(delta) = sum_t phi^q_d(t) phi^k_d(t + delta)       (zero for |delta| >= L).

  A depthwise ``VALID`` convolution of noise of length Lk + L - 1 (no border: every output
  sees L real samples, so P is exactly stationary). Where the filter window sits (here at
  m..m+L-1; "centred" or not) only shifts both processes alike and does not change P.
  Parameters ``filter_q``, ``filter_k`` ``[h, d, L]``, init U(0, 2 / sqrt(L)) so that
  P_d(0) ~ 1 (the authors: U(0, sqrt(2 / L)), P_d(0) ~ 1/2). ``Qbar`` is materialised,
  O(Lk h d R) memory per call (as in the authors' code; batch-independent).
* **Gating** (``gated=True``, default as in the authors' code): a position-free part is
  mixed in, ``Qbar_d <- sqrt(1 - b_d) Qbar_d + sqrt(b_d) eps_d``, the same for Kbar, with
  ``eps_d [R]`` ~ N(0, 1) shared by every position, query and key, so that the kernel becomes
  ``(1 - b_d) P_d(delta) + b_d``: b_d -> 1 recovers position-free attention. ``gate [h, d]``
  (raw; b = sigmoid(raw), init 0: b = 1/2; the authors draw N(0, 1)).

**Noise.** One fixed draw: key ``fold_in(key(seed), crc32(module path))``, so evaluation is
deterministic and two layers with the same seed still get different noise (a layer shared
with ``share_across_layers`` gets one draw). The authors' PyTorch code draws fresh noise at
every forward call (training and evaluation alike); their JAX LRA code derives the key from
the sum of the queries, i.e. a new draw per batch and layer. A fixed draw turns SPE into a
deterministic (random-feature-like) map and lets the model fit that draw; this is a
simplification, not the paper's training procedure. The noise is drawn in float32 (the same
draw for float32 and float64 runs) and the codes are computed in ``promote(q.dtype,
float32)``, cast back to q's dtype; the noise covers positions ``0..max_length-1`` once, so a
shorter sequence sees a prefix of the same draw (its codes are the first rows of a longer
one's). sineSPE has no length limit; convSPE needs Lk <= ``dims.max_length``.

**Causal.** qhat_m depends on q_m alone and khat_n on k_n alone (Qbar, Kbar are data-free), so
the layer's causal mask (softmax) or prefix sums (linear) keep attention causal. For convSPE,
Qbar(m) mixes noise samples m..m+L-1 but no other position's data; noise carries no
information about the sequence, so nothing leaks. Supports causal: yes. 1D: yes. 2D: no
(sineSPE is 1D in the paper; convSPE's 2D form, a 2D filter on 2D noise, is left out).
Memory keys (Transformer-XL, ``ctx.memory_length = M``): keys at positions 0..M+Lq-1, queries
at M..M+Lq-1.

**Compatibility.** Every kernel (softmax and all feature maps): SPE acts before phi
(``feature_stage = "pre_phi"``), and phi sees ordinary (signed) vectors of size R. Options:
``kind`` ("sine" | "conv"), ``num_realizations`` R (64, the authors' LRA setting),
``num_sines`` K (10, their JAX default), ``kernel_size`` L (128, their LRA convSPE
``k128``), ``gated`` (True), ``seed`` (0), ``share_across_layers`` (False; their LRA runs
share one SPE module across layers). With ``ctx.reference`` sineSPE folds Omega into q, k
before contracting with the noise (another order of the same sums) and convSPE gathers the
noise windows instead of convolving (dense references of the fast paths). Memory: the codes
are ``[Lk, h, d, R]`` per call (0.5 GB in float32 for Lk = 4096, h = 8, d = R = 64), as in the
authors' code.

Equation numbers: the SPE paper's equation numbers
are not cited here; the formulas above are derived and each is pinned by a test.
"""

from __future__ import annotations

import math
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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
      "kind": Option("sine", "sineSPE (periodic) or convSPE (a learned filter)", type="str",
                     choices=KINDS),
      "num_realizations": Option(64, "R, the features per head (the output size)", type="int",
                                 low=1, note="the authors' LRA setting: 64"),
      "num_sines": Option(10, "sine: sinusoids per feature", type="int", low=1,
                          note="default 10"),
      "kernel_size": Option(128, "conv: the filter length", type="int", low=1,
                            note="default 128"),
      "gated": Option(True, "mix in a position-free part by a learned gate", type="bool"),
      "seed": Option(0, "the fixed noise draw (per seed and layer path)", type="int"),
      "share_across_layers": Option(False, "one set of parameters and noise for the model",
                                    type="bool"),
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
    path = "/".join(str(p) for p in self.scope.path)
    key = jax.random.fold_in(jax.random.key(self.seed), zlib.crc32(path.encode()))
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
    f = jax.nn.sigmoid(self.frequencies.astype(dtype)) / 2.0            # [h, d, K]
    lam = jax.nn.softplus(self.gains.astype(dtype))                      # [h, d, K]
    pos = jnp.asarray(positions, dtype).reshape(-1, 1, 1, 1)
    angle = 2.0 * np.pi * f[None] * pos                                  # [n, h, d, K]
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
    omega = self._omega(positions, dtype, with_phase=query)              # [n, h, d, 2K]
    u = x[..., None] * omega[None]                                       # [b, n, h, d, 2K]
    return jnp.einsum("bnhc,hcr->bnhr", u.reshape(b, n, h, -1),
                      z.reshape(h, -1, self.num_realizations), precision=_HIGHEST)

  # -------------------------------------------------------------------------------------------
  # convSPE
  # -------------------------------------------------------------------------------------------
  def _conv_codes(self, z, n: int, dtype, *, query: bool, reference: bool):
    """Qbar or Kbar ``[n, h, d, R]`` for positions 0..n-1: sum_t phi(t) z(m + t); z
    ``[R, h*d, max_length + L - 1]``."""
    h, d = self.dims.num_heads, self.dims.head_dim
    r, ks = self.num_realizations, self.kernel_size
    filt = (self.filter_q if query else self.filter_k).astype(dtype).reshape(h * d, ks)
    z = z[:, :, :n + ks - 1]                                             # [R, hd, n + L - 1]
    if reference:
      idx = np.arange(n)[:, None] + np.arange(ks)[None, :]               # [n, L]: m + t
      windows = z[:, :, idx]                                             # [R, hd, n, L]
      out = jnp.einsum("rcnt,ct->rcn", windows, filt, precision=_HIGHEST)
    else:
      out = jax.lax.conv_general_dilated(
          z, filt[:, None, :], window_strides=(1,), padding="VALID",
          dimension_numbers=("NCH", "OIH", "NCH"), feature_group_count=h * d,
          precision=_HIGHEST)                                            # [R, hd, n]
    return jnp.transpose(out.reshape(r, h, d, n), (3, 1, 2, 0))          # [n, h, d, R]

  # -------------------------------------------------------------------------------------------
  # The hook
  # -------------------------------------------------------------------------------------------
  def _encode(self, x, noise, positions, n_total: int, *, query: bool, reference: bool,
              codes=None):
    """``[b, n, h, R]``: R^-1/2 sum_d x_md Qbar_d(pos_m) (gated), for x ``[b, n, h, d]`` at
    ``positions`` (the last n of 0..n_total-1); noise from ``_noise``."""
    dtype = x.dtype
    z, eps = noise
    r = self.num_realizations
    gates = self._gate_weights(dtype)
    x_pos = x if gates is None else x * gates[0][None, None]             # sqrt(1 - b) x
    if codes is not None:  # given by a decoding step
      out = jnp.einsum("bnhd,nhdr->bnhr", x_pos, codes, precision=_HIGHEST)
    elif self.kind == "sine" and reference:
      out = self._sine_apply(x_pos, z, positions, query=query)
    else:
      if self.kind == "sine":
        codes = self._sine_codes(z, positions, dtype, query=query)
      else:
        codes = self._conv_codes(z, n_total, dtype, query=query,
                                 reference=reference)[n_total - x.shape[1]:]
      out = jnp.einsum("bnhd,nhdr->bnhr", x_pos, codes, precision=_HIGHEST)
    if gates is not None:
      out = out + jnp.einsum("bnhd,hdr->bnhr", x * gates[1][None, None],
                             eps, precision=_HIGHEST)
    return out / math.sqrt(r)

  def features(self, q, k, ctx: Context):
    """q ``[b, Lq, h, d]``, k ``[b, Lk, h, d]`` (d = ``dims.head_dim``; Lk = M + Lq) ->
    qhat ``[b, Lq, h, R]``, khat ``[b, Lk, h, R]`` with E[qhat_m . khat_n] =
    sum_d q_md k_nd P~_d(m - n), P~ = (1 - b) P + b gated (module docstring)."""
    h, d = self.dims.num_heads, self.dims.head_dim
    for name, x in (("q", q), ("k", k)):
      if x.ndim != 4 or x.shape[2] != h or x.shape[3] != d:
        raise ValueError(f"spe: {name} must be [batch, length, {h}, {d}] (heads, "
                         f"dims.head_dim; spe acts pre_phi on raw q, k); got {x.shape}.")
    if ctx.grid is not None:
      raise ValueError(f"spe: only 1D sequences are supported; got grid {ctx.grid}.")
    lq, lk = q.shape[1], k.shape[1]
    if ctx.offset is not None:
      return self._features_at(q, k, ctx)
    memory = lk - lq
    if memory != ctx.memory_length:
      raise ValueError(f"spe: keys [b, {lk}, ...] and queries [b, {lq}, ...] imply memory "
                       f"M = {memory}, but ctx.memory_length = {ctx.memory_length}.")
    if self.kind == "conv" and lk > self.dims.max_length:
      raise ValueError(f"spe: sequence length {lk} exceeds the maximum length "
                       f"{self.dims.max_length} the convSPE noise was drawn for; raise "
                       f"model.max_length.")
    dtype = jnp.promote_types(jnp.promote_types(q.dtype, k.dtype), jnp.float32)
    positions = np.arange(lk)
    noise = self._noise(dtype)
    qhat = self._encode(q.astype(dtype), noise, positions[memory:], lk, query=True,
                        reference=ctx.reference)
    khat = self._encode(k.astype(dtype), noise, positions, lk, query=False,
                        reference=ctx.reference)
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
      codes = {query: self._sine_codes(noise[0], positions, dtype, query=query)
               for query in (True, False)}
    else:  # the noise window of positions offset..offset+n-1: samples offset..offset+n+L-2
      z = jax.lax.dynamic_slice_in_dim(noise[0], ctx.offset, n + self.kernel_size - 1, axis=2)
      codes = {query: self._conv_codes(z, n, dtype, query=query, reference=False)
               for query in (True, False)}
    out = []
    for x, query in ((q, True), (k, False)):
      y = self._encode(x.astype(dtype), noise, None, n, query=query, reference=False,
                       codes=codes[query])
      out.append(y.astype(x.dtype))
    return tuple(out)

  def offset_kernel(self, n: int, dtype=jnp.float32):
    """``[h, d, 2n-1]``: the (gated) kernel E[Qbar_d(i) Kbar_d(j)] = P~_d(i - j) at index
    ``j - i + n - 1`` (the layout of ``fastpos.ops.toeplitz``), in closed form."""
    delta = -np.arange(-(n - 1), n)                                      # i - j per index
    if self.kind == "sine":
      f = jax.nn.sigmoid(self.frequencies.astype(dtype)) / 2.0
      lam2 = jax.nn.softplus(self.gains.astype(dtype)) ** 2
      angle = (2.0 * np.pi * f[..., None] * jnp.asarray(delta, dtype)[None, None, None]
               + self.phases.astype(dtype)[..., None])                   # [h, d, K, 2n-1]
      p = jnp.sum(lam2[..., None] * jnp.cos(angle), axis=2)
    else:
      ks = self.kernel_size
      fq, fk = self.filter_q.astype(dtype), self.filter_k.astype(dtype)
      fk_pad = jnp.pad(fk, ((0, 0), (0, 0), (n + ks, n + ks)))
      # P(delta) = sum_t fq(t) fk(t + delta): gather fk at t + delta (zero outside [0, L)).
      idx = np.arange(ks)[:, None] + delta[None, :] + n + ks              # [L, 2n-1]
      p = jnp.einsum("hdt,hdto->hdo", fq, fk_pad[:, :, idx], precision=_HIGHEST)
    if self.gated:
      b = jax.nn.sigmoid(self.gate.astype(dtype))[..., None]
      p = (1.0 - b) * p + b
    return p


SCHEMES = {"spe": SPE}
