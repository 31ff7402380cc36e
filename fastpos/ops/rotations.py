"""Unitary position transforms ``x -> M_s x`` for relative positions in linear attention.

Qin et al., "Linearized Relative Positional Encoding" (TMLR 2023): a query at position s and a
key at position t score ``(M_s q)^H (M_t k) = q^H W_{t-s} k`` (Eq. 13-14) when
``M_s = Lambda^(s) P`` with a fixed unitary P and a unitary family Lambda^(s) (Eq. 22-24,
App. D.1). This module holds the math, shared by the ``lrpe`` and ``rope`` schemes: P
(identity, householder, interleave / random permutation, DFT), Lambda^(s) (type 1: phases,
type 2: 2x2 rotations of feature pairs, type 3: powers of a permutation) and the angle ladder.

Pure ``jax.numpy`` (static tables in numpy); no Flax. One shape convention: x
``[batch, N, heads, f]``, feature dim last; integer positions ``[N, slots]``. Complex results
are realised as ``[Re, Im]`` on the last axis (``[..., 2f]``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

P_CHOICES = ("identity", "householder", "permutation", "random_permutation", "fourier")


def is_complex(lrpe_type: int, p: str) -> bool:
  """Whether ``M_s = Lambda^(s) P`` is complex (then features are realised as [Re, Im])."""
  return lrpe_type == 1 or p == "fourier"


def num_slots(lrpe_type: int, f: int) -> int:
  """Angle / position slots: type 1 one per feature, type 2 one per pair, type 3 features."""
  return f // 2 if lrpe_type == 2 else f


def group_sizes(n: int, two_d: bool) -> tuple[int, ...]:
  """Slots per axis: (n,) in 1D; (ceil(n/2) rows, floor(n/2) columns) in 2D."""
  return (n - n // 2, n // 2) if two_d else (n,)


def check_feature_dim(lrpe_type: int, f: int, two_d: bool, scheme: str) -> None:
  """Each axis needs a slot that can move, else it carries no position: an angle (type 1:
  one feature; type 2: a pair) or a permutation of >= 2 features (type 3). Needs f >= 1 / 2
  (type 1, 1D / 2D), f >= 2 / 4 (types 2, 3)."""
  per_axis = 1 if lrpe_type == 1 else 2
  need = per_axis * (2 if two_d else 1)
  if f < need:
    where = "2D (rows and columns each need their own features)" if two_d else "1D"
    raise ValueError(
        f"{scheme}: type {lrpe_type} needs a feature dim >= {need} in {where}; "
        f"got feature dim {f}."
    )


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
  return np.concatenate(
      [float(base) ** (-2.0 * np.arange(g) / (width * g)) for g in group_sizes(n, two_d)]
  )


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
    v = v / jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True))  # v / |v|: Eq. 73
    v = v[None, None]  # [1, 1, h|1, f]
    return x - 2.0 * jnp.sum(x * v, axis=-1, keepdims=True) * v, None
  if p in ("permutation", "random_permutation"):
    idx = jnp.broadcast_to(jnp.asarray(p_index)[None, None], x.shape)
    return jnp.take_along_axis(x, idx, axis=-1), None
  if p == "fourier":
    hi = jax.lax.Precision.HIGHEST  # a basis change: no TF32 / bf16 passes on GPU / TPU
    re = jnp.einsum("bnhj,kj->bnhk", x, jnp.asarray(dft[0], x.dtype), precision=hi)
    im = jnp.einsum("bnhj,kj->bnhk", x, jnp.asarray(dft[1], x.dtype), precision=hi)
    return re, im
  raise ValueError(f"unknown p {p!r}; valid choices: {', '.join(P_CHOICES)}.")


def rotate_pairs(x, angles):
  """Type 2's ``Lambda^(s)`` (Eq. 23): rotates (x_{2k}, x_{2k+1}) by ``angles_k``.

  x ``[batch, N, heads, f]``, angles ``[N, heads or 1, floor(f/2)]``; an odd f leaves the last
  feature as it is (the identity block)."""
  b, n, h, f = x.shape
  npairs = angles.shape[-1]
  pairs = x[..., : 2 * npairs].reshape(b, n, h, npairs, 2)
  x0, x1 = pairs[..., 0], pairs[..., 1]
  cos, sin = jnp.cos(angles)[None], jnp.sin(angles)[None]  # [1, N, h|1, npairs]
  y = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
  y = y.reshape(b, n, h, 2 * npairs)
  if 2 * npairs < f:
    y = jnp.concatenate([y, x[..., 2 * npairs :]], axis=-1)
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
  s = jnp.asarray(slot_pos)[:, None, :]  # [N, 1, f]
  where = start[None] + (offset[None] + s) % length[None]  # [N, h|1, f]
  idx = jnp.take_along_axis(jnp.broadcast_to(flat[None], where.shape), where, axis=-1)
  idx = jnp.broadcast_to(idx[None], x.shape)
  return jnp.take_along_axis(x, idx, axis=-1)


def lrpe_apply(
    x,
    slot_pos,
    *,
    lrpe_type: int,
    p: str,
    theta=None,
    householder_v=None,
    p_index=None,
    dft=None,
    cycles=None,
):
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
  re, im = apply_p(x.astype(compute), p, householder_v=householder_v, p_index=p_index, dft=dft)
  if lrpe_type in (1, 2):
    pos = jnp.asarray(slot_pos).astype(compute)[:, None, :]  # [N, 1, n]
    angles = pos * theta.astype(compute)[None]  # [N, h|1, n]
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


def transform_qk(q, k, pos_q, pos_k, *, lrpe_type: int, p: str, two_d: bool, **arrays):
  """``(M_{pos_q} q, M_{pos_k} k)``: q ``[b, Lq, h, f]``, k ``[b, Lk, h, f]``, integer positions
  ``pos_q [Lq, c]``, ``pos_k [Lk, c]`` (c = 1: sequence; c = 2: (row, column)); ``arrays`` as
  ``lrpe_apply``."""
  axes = slot_axes(num_slots(lrpe_type, q.shape[-1]), two_d)
  run = functools.partial(lrpe_apply, lrpe_type=lrpe_type, p=p, **arrays)
  return run(q, pos_q[:, axes]), run(k, pos_k[:, axes])
