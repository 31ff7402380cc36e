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
import jax
import jax.numpy as jnp
import numpy as np

from fastpos.positional.base import Context, KernelInfo, Scheme

TYPES = (1, 2, 3)
P_CHOICES = ("identity", "householder", "permutation", "random_permutation", "fourier")
DEFAULT_TYPE = 2
DEFAULT_P = "householder"

# Sub-streams of ``seed`` (numpy SeedSequence entropy [seed, stream]).
_STREAM_HOUSEHOLDER, _STREAM_P_PERMUTATION, _STREAM_LAMBDA_PERMUTATION = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------
def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_bool(x) -> bool:
  return isinstance(x, (bool, np.bool_))


def check_base(base, scheme: str = "lrpe") -> None:
  if _is_bool(base) or not isinstance(base, (int, float, np.integer, np.floating)) or not (
      np.isfinite(base) and base > 0):
    raise ValueError(f"{scheme}: base must be a finite number > 0 (RoPE: 10000); got {base!r}.")


def check_options(lrpe_type=DEFAULT_TYPE, p=DEFAULT_P, learnable_theta=None, learnable_p=None,
                  per_head=False, base=10000.0, seed=0) -> None:
  """Raises ValueError naming the bad option and its valid values."""
  if not _is_int(lrpe_type) or lrpe_type not in TYPES:
    raise ValueError(f"lrpe: unknown type {lrpe_type!r}; valid choices: 1 (unitary, complex), "
                     f"2 (orthogonal rotations), 3 (permutation).")
  if p not in P_CHOICES:
    raise ValueError(f"lrpe: unknown p {p!r}; valid choices: {', '.join(P_CHOICES)}.")
  if learnable_theta is not None and not _is_bool(learnable_theta):
    raise ValueError(f"lrpe: learnable_theta must be None, True or False; got "
                     f"{learnable_theta!r}.")
  if learnable_theta and lrpe_type == 3:
    raise ValueError("lrpe: learnable_theta=True needs type 1 or 2; type 3 (permutation) has no "
                     "angles (leave learnable_theta at None).")
  if learnable_p is not None and not _is_bool(learnable_p):
    raise ValueError(f"lrpe: learnable_p must be None, True or False; got {learnable_p!r}.")
  if learnable_p and p != "householder":
    raise ValueError(f"lrpe: learnable_p=True needs p='householder' (the only P with "
                     f"parameters); got p={p!r}.")
  if not _is_bool(per_head):
    raise ValueError(f"lrpe: per_head must be True or False; got {per_head!r}.")
  check_base(base)
  if not _is_int(seed) or seed < 0:
    raise ValueError(f"lrpe: seed must be an integer >= 0; got {seed!r}.")


def is_complex(lrpe_type: int, p: str) -> bool:
  """Whether ``M_s = Lambda^(s) P`` is complex (then features are realised as [Re, Im])."""
  return lrpe_type == 1 or p == "fourier"


def num_slots(lrpe_type: int, f: int) -> int:
  """Angle / position slots: type 1 one per feature, type 2 one per pair, type 3 features."""
  return f // 2 if lrpe_type == 2 else f


def group_sizes(n: int, two_d: bool) -> tuple[int, ...]:
  """Slots per axis: (n,) in 1D; (ceil(n/2) rows, floor(n/2) columns) in 2D."""
  return (n - n // 2, n // 2) if two_d else (n,)


def check_feature_dim(lrpe_type: int, f: int, two_d: bool, scheme: str = "lrpe") -> None:
  """Each axis needs a slot that can move, else it carries no position: an angle (type 1:
  one feature; type 2: a pair) or a permutation of >= 2 features (type 3). Needs f >= 1 / 2
  (type 1, 1D / 2D), f >= 2 / 4 (types 2, 3)."""
  per_axis = 1 if lrpe_type == 1 else 2
  need = per_axis * (2 if two_d else 1)
  if f < need:
    where = "2D (rows and columns each need their own features)" if two_d else "1D"
    raise ValueError(f"{scheme}: type {lrpe_type} needs a feature dim >= {need} in {where}; "
                     f"got feature dim {f}.")


def slot_axes(n: int, two_d: bool) -> np.ndarray:
  """``[n]`` which position coordinate each slot follows (0: sequence / row, 1: column)."""
  sizes = group_sizes(n, two_d)
  return np.concatenate([np.full(s, a, np.int32) for a, s in enumerate(sizes)])


def inverse_frequencies(lrpe_type: int, f: int, *, two_d: bool, base: float) -> np.ndarray:
  """``[n]`` float64 initial angles alpha (App. D.1, as RoPE).

  1D: ``base^(-2k/f)``, k = 0..n-1 (type 2: n = floor(f/2); type 1: n = f, the paper's code).
  2D: each axis group of g slots gets its own ladder ``base^(-2k/w)``, k < g, w = its width in
  features (2g for type 2, g for type 1)."""
  n = num_slots(lrpe_type, f)
  if not two_d:
    return float(base) ** (-2.0 * np.arange(n) / f)
  width = 2 if lrpe_type == 2 else 1
  return np.concatenate([float(base) ** (-2.0 * np.arange(g) / (width * g))
                         for g in group_sizes(n, two_d)])


# ---------------------------------------------------------------------------------------------
# Fixed matrices (numpy, static)
# ---------------------------------------------------------------------------------------------
def interleave_index(f: int) -> np.ndarray:
  """Eq. 74 as an index: ``(P x)_j = x_{idx[j]}``, idx[2k] = k, idx[2k+1] = ceil(f/2) + k."""
  idx = np.empty(f, np.int32)
  idx[0::2] = np.arange((f + 1) // 2)
  idx[1::2] = (f + 1) // 2 + np.arange(f // 2)
  return idx


def dft_parts(f: int) -> tuple[np.ndarray, np.ndarray]:
  """(Re, Im) of the unitary DFT ``exp(-2 pi i jk / f) / sqrt(f)``, each ``[f, f]`` float64."""
  jk = np.outer(np.arange(f), np.arange(f)) % f  # reduce first: exact angles for large f
  ang = 2.0 * np.pi * jk / f
  return np.cos(ang) / np.sqrt(f), -np.sin(ang) / np.sqrt(f)


def permutation_cycles(perm: np.ndarray) -> tuple[np.ndarray, ...]:
  """Cycle tables of a permutation ``[f]`` so that ``pi^s(j) = flat[start_j + (offset_j + s)
  mod length_j]`` for any s >= 0 (``pi(j) = perm[j]``): (flat, start, offset, length)."""
  f = len(perm)
  flat, start, offset, length = (np.zeros(f, np.int32) for _ in range(4))
  seen = np.zeros(f, bool)
  pos = 0
  for j in range(f):
    if seen[j]:
      continue
    cycle, e = [], j
    while not seen[e]:
      seen[e] = True
      cycle.append(e)
      e = int(perm[e])
    for c, e in enumerate(cycle):
      flat[pos + c], start[e], offset[e], length[e] = e, pos, c, len(cycle)
    pos += len(cycle)
  return flat, start, offset, length


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


# ---------------------------------------------------------------------------------------------
# The transform, pure jax: realise(Lambda^(s) P x)
# ---------------------------------------------------------------------------------------------
def apply_p(x, p: str, *, householder_v=None, p_index=None, dft=None):
  """``P x`` over the last axis: x ``[batch, N, heads, f]`` -> (re, im or None).

  householder_v / p_index: ``[1 or heads, f]``; dft: (Re, Im) ``[f, f]``."""
  if p == "identity":
    return x, None
  if p == "householder":
    v = householder_v.astype(x.dtype)
    v = v / jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True))   # v / |v|: Eq. 73
    v = v[None, None]                                           # [1, 1, h|1, f]
    return x - 2.0 * jnp.sum(x * v, axis=-1, keepdims=True) * v, None
  if p in ("permutation", "random_permutation"):
    idx = jnp.broadcast_to(jnp.asarray(p_index)[None, None], x.shape)
    return jnp.take_along_axis(x, idx, axis=-1), None
  if p == "fourier":
    hi = jax.lax.Precision.HIGHEST  # a basis change: no TF32 / bf16 passes on GPU / TPU
    re = jnp.einsum("bnhj,kj->bnhk", x, jnp.asarray(dft[0], x.dtype), precision=hi)
    im = jnp.einsum("bnhj,kj->bnhk", x, jnp.asarray(dft[1], x.dtype), precision=hi)
    return re, im
  raise ValueError(f"lrpe: unknown p {p!r}; valid choices: {', '.join(P_CHOICES)}.")


def rotate_pairs(x, angles):
  """Type 2's ``Lambda^(s)`` (Eq. 23): rotates (x_{2k}, x_{2k+1}) by ``angles_k``.

  x ``[batch, N, heads, f]``, angles ``[N, heads or 1, floor(f/2)]``; an odd f leaves the last
  feature as it is (the identity block)."""
  b, n, h, f = x.shape
  npairs = angles.shape[-1]
  pairs = x[..., :2 * npairs].reshape(b, n, h, npairs, 2)
  x0, x1 = pairs[..., 0], pairs[..., 1]
  cos, sin = jnp.cos(angles)[None], jnp.sin(angles)[None]    # [1, N, h|1, npairs]
  y = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
  y = y.reshape(b, n, h, 2 * npairs)
  if 2 * npairs < f:
    y = jnp.concatenate([y, x[..., 2 * npairs:]], axis=-1)
  return y


def phase(re, im, angles):
  """Type 1's ``Lambda^(s)`` (Eq. 22): z_k -> z_k exp(i angles_k) on z = re + i im (im None:
  real z). re, im ``[batch, N, heads, f]``, angles ``[N, heads or 1, f]``."""
  cos, sin = jnp.cos(angles)[None], jnp.sin(angles)[None]
  if im is None:
    return re * cos, re * sin
  return re * cos - im * sin, re * sin + im * cos


def permute_powers(x, slot_pos, cycles):
  """Type 3's ``Lambda^(s)`` (Eq. 24): ``y_j = x_{pi^(s_j)(j)}``.

  x ``[batch, N, heads, f]``, slot_pos ``[N, f]`` int (the power of each feature: its row or
  column in 2D), cycles: ``permutation_cycles`` tables ``[1 or heads, f]``."""
  flat, start, offset, length = (jnp.asarray(c) for c in cycles)
  s = jnp.asarray(slot_pos)[:, None, :]                          # [N, 1, f]
  where = start[None] + (offset[None] + s) % length[None]        # [N, h|1, f]
  idx = jnp.take_along_axis(jnp.broadcast_to(flat[None], where.shape), where, axis=-1)
  idx = jnp.broadcast_to(idx[None], x.shape)
  return jnp.take_along_axis(x, idx, axis=-1)


def lrpe_apply(x, slot_pos, *, lrpe_type: int, p: str, theta=None, householder_v=None,
               p_index=None, dft=None, cycles=None):
  """``realise(M_s x)`` with ``M_s = Lambda^(s) P`` (App. D.1, Eq. 75).

  Args:
    x: ``[batch, N, heads, f]``.
    slot_pos: ``[N, n_slots]`` integer position of each slot (``slot_axes``).
    theta: ``[1 or heads, n_slots]`` angles (types 1, 2).
    householder_v, p_index, dft, cycles: P's and type 3's arrays (see ``apply_p``,
      ``permute_powers``).

  Returns:
    ``[batch, N, heads, f]`` (real M_s) or ``[batch, N, heads, 2f]`` = [Re, Im] (complex).
  """
  dtype = x.dtype
  compute = jnp.promote_types(dtype, jnp.float32)  # angles s * alpha need float32 at least
  re, im = apply_p(x.astype(compute), p, householder_v=householder_v, p_index=p_index,
                   dft=dft)
  if lrpe_type in (1, 2):
    pos = jnp.asarray(slot_pos).astype(compute)[:, None, :]       # [N, 1, n]
    angles = pos * theta.astype(compute)[None]                     # [N, h|1, n]
    if lrpe_type == 1:
      re, im = phase(re, im, angles)
    else:
      re = rotate_pairs(re, angles)
      im = None if im is None else rotate_pairs(im, angles)
  else:
    re = permute_powers(re, slot_pos, cycles)
    im = None if im is None else permute_powers(im, slot_pos, cycles)
  out = re if im is None else jnp.concatenate([re, im], axis=-1)
  return out.astype(dtype)


def query_key_positions(q, k, ctx: Context, *, two_d: bool, scheme: str):
  """Integer positions ``([Lq, c], [Lk, c])``, c = 1 (1D: queries at M + i after M memory
  keys, keys at j) or 2 (2D raster order: (row, column)). Numpy (static), except in a decoding
  step (``ctx.offset``): jax arrays ``offset + i`` for queries and keys alike."""
  lq, lk = q.shape[1], k.shape[1]
  if ctx.offset is not None:  # decoding: the new tokens' queries and keys share positions
    if two_d or lq != lk:
      raise ValueError(f"{scheme}: a decoding step is 1D with one key per query; got queries "
                       f"{q.shape}, keys {k.shape}, grid {ctx.grid}.")
    pos = (ctx.offset + jnp.arange(lq, dtype=jnp.int32))[:, None]
    return pos, pos
  memory = lk - lq
  if memory != ctx.memory_length:
    raise ValueError(f"{scheme}: keys [b, {lk}, ...] and queries [b, {lq}, ...] imply memory "
                     f"M = {memory}, but ctx.memory_length = {ctx.memory_length}.")
  if ctx.grid is None:
    if two_d:
      raise ValueError(f"{scheme}: built for a 2D grid but called without one.")
    return (memory + np.arange(lq))[:, None], np.arange(lk)[:, None]
  if not two_d:
    raise ValueError(f"{scheme}: called with a grid but built for 1D (dims.grid is None).")
  if memory:
    raise ValueError(f"{scheme}: memory (M = {memory}) is only defined for 1D sequences; got "
                     f"grid {ctx.grid}.")
  h, w = (int(g) for g in ctx.grid)
  if h * w != lq:
    raise ValueError(f"{scheme}: grid {tuple(ctx.grid)} does not cover length {lq}.")
  idx = np.arange(lq)
  pos = np.stack([idx // w, idx % w], axis=-1)
  return pos, pos


def apply_to_qk(q, k, ctx: Context, *, lrpe_type: int, p: str, two_d: bool, scheme: str,
                **arrays):
  """The features hook shared by ``lrpe`` and ``rope``: (M_i q_i, M_j k_j) at each position."""
  n_slots = num_slots(lrpe_type, q.shape[-1])
  axes = slot_axes(n_slots, two_d)
  pos_q, pos_k = query_key_positions(q, k, ctx, two_d=two_d, scheme=scheme)
  run = functools.partial(lrpe_apply, lrpe_type=lrpe_type, p=p, **arrays)
  return run(q, pos_q[:, axes]), run(k, pos_k[:, axes])


def _resolve(learnable, default: bool) -> bool:
  return default if learnable is None else bool(learnable)


# ---------------------------------------------------------------------------------------------
# The scheme
# ---------------------------------------------------------------------------------------------
class LRPE(Scheme):
  """Options: ``type`` in ``TYPES``, ``p`` in ``P_CHOICES``, ``learnable_theta`` /
  ``learnable_p`` (None: the paper's choice for the type / P), ``per_head``, ``base`` (the
  angles' init ladder), ``seed`` (fixed random permutations / householder vector)."""

  type: int = DEFAULT_TYPE
  p: str = DEFAULT_P
  learnable_theta: bool | None = None
  learnable_p: bool | None = None
  per_head: bool = False
  base: float = 10000.0
  seed: int = 0

  scheme_name = "lrpe"
  hooks = ("features",)
  feature_stage = "post_phi"
  keeps_nonnegative = False
  supports_2d = True

  @classmethod
  def _check(cls, options: dict) -> None:
    check_options(options.get("type", DEFAULT_TYPE), options.get("p", DEFAULT_P),
                  options.get("learnable_theta"), options.get("learnable_p"),
                  options.get("per_head", False), options.get("base", 10000.0),
                  options.get("seed", 0))

  @classmethod
  def compatibility(cls, kernel: KernelInfo, *, causal: bool, two_d: bool,
                    options: dict) -> str | None:
    cls._check(options)
    return None  # a per-position unitary map: any kernel, causal or not, 1D or 2D

  @classmethod
  def feature_out_dim(cls, dim: int, options: dict) -> int:
    cls._check(options)
    complex_ = is_complex(options.get("type", DEFAULT_TYPE), options.get("p", DEFAULT_P))
    return 2 * dim if complex_ else dim

  def setup(self):
    check_options(self.type, self.p, self.learnable_theta, self.learnable_p, self.per_head,
                  self.base, self.seed)
    f, two_d = self.dims.feature_dim, self.dims.grid is not None
    check_feature_dim(self.type, f, two_d)
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
    return apply_to_qk(q, k, ctx, lrpe_type=self.type, p=self.p,
                       two_d=self.dims.grid is not None, scheme="lrpe", **self._arrays())


SCHEMES = {"lrpe": LRPE}
