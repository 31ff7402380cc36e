"""``lrpe``: Linearized Relative Positional Encoding, a unitary transform per position (features).

Qin et al., "Linearized Relative Positional Encoding" (TMLR 2023). A query at position s and
a key at position t score

    f_rel(q_s, k_t) = q_s^H W_{t-s} k_t = (M_s q_s)^H (M_t k_t),   M_s = Lambda^(s) P   (Eq. 13, 75)

with a fixed unitary P (option ``p``: identity, householder (Eq. 73), permutation (Eq. 74),
random_permutation, fourier) and a unitary family Lambda^(s) (option ``type``): 1 phases
``exp(i s alpha_k)`` (Eq. 22, complex), 2 rotations of feature pairs by ``s alpha_k`` (Eq. 23),
3 the s-th power of a fixed random permutation (Eq. 24). The math is ``fastpos.ops.rotations``.
Complex transforms are realised as real features ``[Re, Im]`` (last dim 2f): their dot product
is ``Re(q^H W_{t-s} k)``, still relative. The angles start at RoPE's ``base^(-2k/f)`` and are
learned by default; ``type=2, p="identity"`` with fixed angles is ``rope``.

Shapes: q ``[batch, Lq, heads, f]``, k ``[batch, Lk, heads, f]`` (f = head_dim for softmax, the
feature size m for linear kernels: post_phi) -> the same, or last dim 2f (complex). Queries
sit at M..M+Lq-1 after M memory keys. 2D (axial, not in the paper): the first half of the
angle slots follows the row, the rest the column. Causal, 1D and 2D, every kernel
(``keeps_nonnegative = False``: the denominator keeps the untransformed features). Options:
``LRPE.option_spec``.
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
def fixed_arrays(
    lrpe_type: int, p: str, f: int, heads: int, seed: int, two_d: bool, fixed_householder: bool
) -> dict[str, Any]:
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


def _has_angles(options) -> bool:
  return options["type"] in (1, 2)


def _draws(options) -> bool:
  """Whether ``seed`` draws anything: type 3's pi, a random P or a fixed householder v."""
  fixed_v = options["p"] == "householder" and not _resolve(options["learnable_p"], True)
  return options["type"] == 3 or options["p"] == "random_permutation" or fixed_v


def _differs_per_head(options) -> bool:
  """Whether ``per_head`` can make heads differ: something learned or drawn per head (fixed
  angles with a fixed, head-independent P are the same for every head)."""
  learned_angles = _has_angles(options) and _resolve(options["learnable_theta"], True)
  return learned_angles or options["p"] == "householder" or _draws(options)


# ---------------------------------------------------------------------------------------------
# The scheme
# ---------------------------------------------------------------------------------------------
class LRPE(Scheme):
  """Options: ``option_spec``."""

  option_spec = {
      "type": Option(
          DEFAULT_TYPE,
          "Lambda^(s): 1 phases (Eq. 22), 2 rotations (Eq. 23), 3 " "permutation powers (Eq. 24)",
          type="int",
          choices=TYPES,
      ),
      "p": Option(DEFAULT_P, "the fixed unitary P (App. D.1)", type="str", choices=P_CHOICES),
      "learnable_theta": Option(
          None,
          "learn the angles (None: yes for types 1 and 2)",
          type="bool",
          none_ok=True,
          used_when=lambda o, two_d: _has_angles(o),
          used_doc="with type 1 or 2 only (type 3 has no angles)",
      ),
      "learnable_p": Option(
          None,
          "learn householder's v (None: yes)",
          type="bool",
          none_ok=True,
          used_when=lambda o, two_d: o["p"] == "householder",
          used_doc="with p='householder' only (the only P with parameters)",
      ),
      "per_head": Option(
          False,
          "one parameter set per head (else one per layer)",
          type="bool",
          used_when=lambda o, two_d: _differs_per_head(o),
          used_doc="where heads can differ: learned angles, type 3, p='householder' or "
          "p='random_permutation'",
      ),
      "base": Option(
          10000.0,
          "the angles' init ladder base^(-2k/f)",
          type="number",
          low=0,
          low_open=True,
          note="RoPE: 10000",
          used_when=lambda o, two_d: _has_angles(o),
          used_doc="with type 1 or 2 only (type 3 has no angles)",
      ),
      "seed": Option(
          0,
          "draws the fixed permutations / householder vector",
          type="int",
          low=0,
          used_when=lambda o, two_d: _draws(o),
          used_doc="where something fixed is drawn: type 3, p='random_permutation' or "
          "p='householder' with learnable_p=False",
      ),
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
      raise ValueError(
          "lrpe: learnable_theta=True needs type 1 or 2; type 3 (permutation) has "
          "no angles (leave learnable_theta at None)."
      )
    if options["learnable_p"] and options["p"] != "householder":
      raise ValueError(
          f"lrpe: learnable_p=True needs p='householder' (the only P with "
          f"parameters); got p={options['p']!r}."
      )

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
      self.householder_v = self.param(
          "householder_v", nn.initializers.normal(stddev=1.0), (heads, f)
      )

  def _arrays(self) -> dict[str, Any]:
    f, two_d = self.dims.feature_dim, self.dims.grid is not None
    heads = self.dims.num_heads if self.per_head else 1
    learned_v = self.p == "householder" and _resolve(self.learnable_p, True)
    arrays = dict(
        fixed_arrays(
            self.type, self.p, f, heads, self.seed, two_d, self.p == "householder" and not learned_v
        )
    )
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
        raise ValueError(
            f"lrpe: {name} must be [batch, length, {h}, {f}] (heads, "
            f"dims.feature_dim); got {x.shape}."
        )
    two_d = self.dims.grid is not None
    pos_q, pos_k = query_key_positions(q, k, ctx, two_d=two_d, scheme="lrpe")
    return transform_qk(
        q, k, pos_q, pos_k, lrpe_type=self.type, p=self.p, two_d=two_d, **self._arrays()
    )


SCHEMES = {"lrpe": LRPE}
