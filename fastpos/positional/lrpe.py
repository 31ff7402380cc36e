"""``lrpe``: Linearized Relative Positional Encoding, a unitary transform per position (features).

Qin et al., "Linearized Relative Positional Encoding" (TMLR 2023). A query at position s and
a key at position t score

    f_rel(q_s, k_t) = q_s^H W_{t-s} k_t = (M_s q_s)^H (M_t k_t)                      (Eq. 13)

which stays decomposable (linear attention only needs per-position features) iff the
positional matrices satisfy ``W_{t-s} = W_s^H W_t`` (Eq. 14; W_0 = I, every W_s unitary). The
paper's solutions all have the form ``W_s = P^H Lambda^(s) P`` with a fixed unitary ``P`` and a
unitary family ``Lambda^(s)`` (Sec. 3.2.1, Eq. 22-24):

* ``type=1`` (unitary, Eq. 22): ``Lambda^(s) = diag(exp(i s alpha_1), ..., exp(i s alpha_f))``,
  complex, one angle per feature;
* ``type=2`` (orthogonal, Eq. 23): block-diagonal 2x2 rotations
  ``[[cos s a_k, -sin s a_k], [sin s a_k, cos s a_k]]`` on the feature pairs (2k, 2k+1)
  (interleaved, as the paper's pseudocode, App. D.2); an odd feature dim leaves the last
  feature unrotated (the identity block ``B^(s) = I_q`` of Eq. 23 with q = 1);
* ``type=3`` (permutation, Eq. 24): ``Lambda^(s) = (I)_{pi^s}``, the s-th power of a fixed
  random permutation pi (drawn from ``seed``; redrawn while it is the identity):
  ``(Lambda^(s) x)_j = x_{pi^s(j)}``. Powers are taken on pi's cycles, so there is no length
  limit and no ``[N, f]`` table.

``P`` (option ``p``; App. D.1 "Choice of matrices"):

* ``"identity"``;
* ``"householder"``: ``P = I - 2 v v^T / (v^T v)`` (Eq. 73), v ~ N(0, 1) per the paper. The
  paper's runs kept v fixed; here v is a learned parameter by default (``learnable_p=None`` ->
  True), ``learnable_p=False`` draws a fixed v from ``seed`` (the paper's setting);
* ``"permutation"``: the fixed interleave of Eq. 74 (0-indexed, as the paper's code):
  ``(P x)_{2k} = x_k``, ``(P x)_{2k+1} = x_{ceil(f/2)+k}`` (pairs feature k with feature
  ceil(f/2)+k, i.e. a half-split RoPE layout);
* ``"random_permutation"``: a fixed random permutation drawn from ``seed`` (an extra choice,
  not in the paper's list);
* ``"fourier"``: the unitary DFT ``P_{jk} = exp(-2 pi i jk / f) / sqrt(f)`` (the paper's code:
  ``fft(x, norm="ortho")``), applied as two real ``[f, f]`` matmuls (cos and -sin parts).

The features hook applies ``M_s = Lambda^(s) P`` (App. D.1, Eq. 75: ``W_s^H W_t = P^H
(Lambda^(s))^H Lambda^(t) P = M_s^H M_t``, so the leading ``P^H`` of ``W_s = P^H M_s`` never
changes a score and is dropped): q_s -> M_s q_s, k_t -> M_t k_t.

Complex features in real arithmetic (type 1, or the complex ``fourier`` P). For real q, k and
any unitary M_s with ``M_s^H M_t = W_{t-s}``:

    (M_s q)^H (M_t k) = q^T M_s^H M_t k = q^T W_{t-s} k,
    Re(a^H b) = Re(a) . Re(b) + Im(a) . Im(b)        for complex vectors a, b,

so with the real features ``q_hat_s = [Re(M_s q), Im(M_s q)]`` (``[..., 2f]``, real parts
first) the plain dot product the attention kernels form is

    q_hat_s . k_hat_t = Re((M_s q)^H (M_t k)) = q^T Re(W_{t-s}) k,

a real bilinear form that depends on t - s only: a relative score, computed from per-position
features, so linear attention stays linear. ``feature_out_dim`` is then 2f. Real types with a
real P (types 2, 3 with identity / householder / (random_)permutation) keep f features and
score ``q^T W_{t-s} k`` exactly. Note: with a *real* P, type 1's ``Re(W_r) = P^T diag(cos r a)
P`` is even in r (the score cannot tell a key r before from r after the query; in a causal
model only r <= 0 occurs, so nothing is lost there); the fourier P breaks that symmetry. The
softmax scale stays 1 / sqrt(head_dim).

Parameters and init (App. D.1): ``theta`` (the alphas) ``[1 or heads, n]`` with n = f (type 1)
or floor(f/2) (type 2), initialised as in RoPE (Su et al.) ``alpha_k = base^(-2k/f)``,
k = 0..n-1, base = 10000 (type 1's run down to base^-2, as in the paper's code), and learned
(``learnable_theta=None`` -> True for types 1 and 2, as the paper; False keeps them fixed:
type 2 + identity + fixed is RoPE, see ``rope.py``). Type 3 has no angles.
``householder_v`` ``[1 or heads, f]`` ~ N(0, 1) (learned householder only). One set per layer
shared by every head, as the paper's code (``per_head=True``: one per head).

Acts on whatever arrives with the feature dim last: q, k ``[batch, length, heads, f]`` with
f = head_dim for softmax and f = m (the feature map's size) for linear kernels (post_phi);
parameters are sized from ``dims.feature_dim``.

2D (axial; not in the paper): the angle slots (type 1: features, type 2: feature pairs,
type 3: features) are split in two groups, the first ceil(n/2) follow the row index and the
rest the column index: ``Lambda^(r,c) = blockdiag(Lambda_row^(r), Lambda_col^(c))``. Each block
satisfies the 1D identity, so ``W_a^H W_b = W_{b-a}`` for 2D offsets b - a. Each group's angles
start from its own ladder ``base^(-2k/w)`` (w = the group's width in features); type 3 uses a
block-diagonal permutation (one random permutation within each group). Feature dims: type 1
needs f >= 1 (1D) / 2 (2D), types 2 and 3 f >= 2 / 4 (else an axis would carry no position).

Positions are 0..N-1 (keys) and M..M+Lq-1 (queries after M memory keys,
``ctx.memory_length``); raster order on a grid. Angles are computed in float32 at least and
the result cast back to the input dtype. Supports causal (a per-position transform cannot
leak), 1D and 2D, and every kernel: post_phi with ``keeps_nonnegative = False`` (the layer
keeps the untransformed phi features for the linear-attention denominator).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from fastpos.ops.rotations import (
  P_CHOICES,
  check_feature_dim,
  dft_parts,
  group_sizes,
  interleave_index,
  inverse_frequencies,
  is_complex,
  permutation_cycles,
  transform_qk,
)
from fastpos.positional.base import Context, Option, Scheme, query_key_positions

TYPES = {1: "unitary, complex", 2: "orthogonal rotations", 3: "permutation"}
DEFAULT_TYPE = 2
DEFAULT_P = "householder"

# Sub-streams of ``seed`` (numpy SeedSequence entropy [seed, stream]).
_STREAM_HOUSEHOLDER, _STREAM_P_PERMUTATION, _STREAM_LAMBDA_PERMUTATION = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# Fixed matrices (numpy, static)
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=128)
def fixed_arrays(lrpe_type: int, p: str, f: int, heads: int, seed: int, two_d: bool,
                 fixed_householder: bool) -> dict[str, Any]:
  """The static (non-learned) arrays of a configuration, numpy, ``heads`` = 1 or h:

  ``p_index`` ``[heads, f]`` (permutation P), ``householder_v`` ``[heads, f]`` (fixed v),
  ``dft`` (Re, Im) ``[f, f]``, ``cycles`` 4 x ``[heads, f]`` (type 3's pi)."""
  out: dict[str, Any] = {}
  if p == "permutation":
    out["p_index"] = np.broadcast_to(interleave_index(f), (heads, f)).copy()
  elif p == "random_permutation":
    rng = np.random.default_rng([seed, _STREAM_P_PERMUTATION])
    out["p_index"] = np.stack([rng.permutation(f) for _ in range(heads)]).astype(np.int32)
  elif p == "householder" and fixed_householder:
    rng = np.random.default_rng([seed, _STREAM_HOUSEHOLDER])
    out["householder_v"] = rng.standard_normal((heads, f))
  elif p == "fourier":
    out["dft"] = dft_parts(f)
  if lrpe_type == 3:
    rng = np.random.default_rng([seed, _STREAM_LAMBDA_PERMUTATION])
    tables = []
    for _ in range(heads):
      # 2D: one permutation within each axis group, so the two powers commute.
      parts, lo = [], 0
      for g in group_sizes(f, two_d):
        perm = rng.permutation(g)
        while np.array_equal(perm, np.arange(g)):  # the identity would carry no position
          perm = rng.permutation(g)
        parts.append(lo + perm)
        lo += g
      tables.append(permutation_cycles(np.concatenate(parts)))
    out["cycles"] = tuple(np.stack([t[i] for t in tables]) for i in range(4))
  return out


def _resolve(learnable, default: bool) -> bool:
  return default if learnable is None else bool(learnable)


# ---------------------------------------------------------------------------------------------
# The scheme
# ---------------------------------------------------------------------------------------------
class LRPE(Scheme):
  """Options: ``option_spec``."""

  option_spec = {
      "type": Option(DEFAULT_TYPE, "Lambda^(s): 1 phases (Eq. 22), 2 rotations (Eq. 23), 3 "
                     "permutation powers (Eq. 24)", type="int", choices=TYPES),
      "p": Option(DEFAULT_P, "the fixed unitary P (App. D.1)", type="str", choices=P_CHOICES),
      "learnable_theta": Option(None, "learn the angles (None: yes for types 1 and 2)",
                                type="bool", none_ok=True),
      "learnable_p": Option(None, "learn householder's v (None: yes)", type="bool",
                            none_ok=True),
      "per_head": Option(False, "one parameter set per head (else one per layer)", type="bool"),
      "base": Option(10000.0, "the angles' init ladder base^(-2k/f)", type="number", low=0,
                     low_open=True, note="RoPE: 10000"),
      "seed": Option(0, "draws the fixed permutations / householder vector", type="int",
                     low=0),
  }

  scheme_name = "lrpe"
  hooks = ("features",)
  feature_stage = "post_phi"
  keeps_nonnegative = False
  supports_2d = True

  # compatibility: the base's (a per-position unitary map: any kernel, causal or not, 1D, 2D).

  @classmethod
  def check_relations(cls, options: dict) -> None:
    if options["learnable_theta"] and options["type"] == 3:
      raise ValueError("lrpe: learnable_theta=True needs type 1 or 2; type 3 (permutation) has "
                       "no angles (leave learnable_theta at None).")
    if options["learnable_p"] and options["p"] != "householder":
      raise ValueError(f"lrpe: learnable_p=True needs p='householder' (the only P with "
                       f"parameters); got p={options['p']!r}.")

  @classmethod
  def feature_out_dim(cls, dim: int, options: dict) -> int:
    return 2 * dim if is_complex(options["type"], options["p"]) else dim

  def setup(self):
    f, two_d = self.dims.feature_dim, self.dims.grid is not None
    check_feature_dim(self.type, f, two_d, "lrpe")
    heads = self.dims.num_heads if self.per_head else 1
    if self.type in (1, 2):
      ladder = inverse_frequencies(self.type, f, two_d=two_d, base=self.base)
      values = np.broadcast_to(ladder, (heads, len(ladder))).copy()
      if _resolve(self.learnable_theta, True):
        self.theta = self.param("theta", lambda key: jnp.asarray(values))
      else:
        self.theta = jnp.asarray(values)
    if self.p == "householder" and _resolve(self.learnable_p, True):
      self.householder_v = self.param("householder_v", nn.initializers.normal(stddev=1.0),
                                      (heads, f))

  def _arrays(self) -> dict[str, Any]:
    f, two_d = self.dims.feature_dim, self.dims.grid is not None
    heads = self.dims.num_heads if self.per_head else 1
    learned_v = self.p == "householder" and _resolve(self.learnable_p, True)
    arrays = dict(fixed_arrays(self.type, self.p, f, heads, self.seed, two_d,
                               self.p == "householder" and not learned_v))
    if learned_v:
      arrays["householder_v"] = self.householder_v
    elif "householder_v" in arrays:
      arrays["householder_v"] = jnp.asarray(arrays["householder_v"])
    if self.type in (1, 2):
      arrays["theta"] = self.theta
    return arrays

  def features(self, q, k, ctx: Context):
    """q ``[b, Lq, h, f]``, k ``[b, Lk, h, f]`` (f = ``dims.feature_dim``) ->
    ``(M_{M+i} q_i, M_j k_j)``, last dim f (real) or 2f ([Re, Im])."""
    f, h = self.dims.feature_dim, self.dims.num_heads
    for name, x in (("q", q), ("k", k)):
      if x.ndim != 4 or x.shape[-1] != f or x.shape[2] != h:
        raise ValueError(f"lrpe: {name} must be [batch, length, {h}, {f}] (heads, "
                         f"dims.feature_dim); got {x.shape}.")
    two_d = self.dims.grid is not None
    pos_q, pos_k = query_key_positions(q, k, ctx, two_d=two_d, scheme="lrpe")
    return transform_qk(q, k, pos_q, pos_k, lrpe_type=self.type, p=self.p, two_d=two_d,
                        **self._arrays())


SCHEMES = {"lrpe": LRPE}
