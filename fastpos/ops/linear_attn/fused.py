"""Linear attention as fused Pallas kernels, one program per (batch, head), forward and backward.

``causal(phi_q, phi_k, v)`` returns the unnormalised numerator and denominator

  num_i = sum_{j <= i} (phi_q_i . phi_k_j) r^(i-j) v_j      ``[b, h, n, d]``
  den_i = sum_{j <= i} (phi_q_i . phi_k_j) r^(i-j)          ``[b, h, n]``

(r = 1 without ``log_decay``), before any eps guard or division: the caller normalises.
``bidirectional(phi_q, phi_k, v)`` returns the same sums over every j (no decay, no mask), by a
kernel of the same layout: one pass sums the state over the chunks, a second applies it.

Layout (as flash-linear-attention's chunk kernel): the grid runs one program per (batch, head);
each program walks the sequence chunk by chunk in a ``lax.fori_loop`` carrying the state
``S = sum_j phi_k_j v_j^T`` ``[m, d]`` and ``z = sum_j phi_k_j`` ``[1, m]`` in registers (GPU)
or VMEM (TPU). Per chunk of ``c`` tokens: the masked ``(Q K^T) V`` product inside the chunk plus
``Q S`` for the earlier chunks, then ``S += K^T V``. States and accumulation are float32 (float64
for float64 inputs); bf16 inputs enter the ``Q K^T`` and ``K^T V`` matmuls as bf16 with float32
accumulation (bf16 products are exact in float32). Float32 matmuls run at full precision
(``Precision.HIGHEST``: IEEE on GPU, not TF32), so float32 results hold 1e-4 against float64.

Decay: key j weighs ``r^(i-j)`` for query i, split per chunk as ``r^(i - start)`` (query side)
times ``r^(start - j)`` (the carried state, decayed by ``r^c`` per chunk), so every exponent is
<= 0 and nothing overflows. ``log_decay`` is a constant of the model (a config value in fastpos):
no gradient flows to it.

Backward (``jax.custom_vjp``, also a Pallas kernel, one program per (batch, head)): a forward
pass over the chunks recomputes ``S`` and ``z`` and writes ``d phi_q``; a reverse pass carries
``dS = sum_{i later} phi_q_i dnum_i^T`` and ``dz`` and writes ``d phi_k`` and ``dv``. No prefix
state is ever rebuilt by subtraction (that drifts in float32); the residuals are the inputs only.

Padding: n is zero-padded to a multiple of ``chunk`` (zero keys add nothing; padded queries are
cut off), and m, d to the next power of two >= 16 (Triton's block and matmul minimum; zero
features and value columns are exact). m and d up to 128 (one full block each).

Platforms: ``interpret=None`` runs Pallas interpret mode when ``jax.default_backend()`` is
``"cpu"`` (how the tests run it) and compiles otherwise, through Triton on GPU and Mosaic on TPU.
On a CPU-only jaxlib both lowerings can be produced (``jax.jit(f).trace(...).lower(
lowering_platforms=("cuda",))``, and ``"tpu"``), and the tests check that forward and backward
lower; what a GPU / TPU must still confirm: that Triton / Mosaic compile the lowered kernels,
their values against the interpret-mode results, and their speed. On TPU each program holds its
(batch, head)'s whole sequence in VMEM (n (2m + 2d) words, double-buffered), which bounds n; a
grid over chunks with a VMEM-scratch state would lift that bound.

Not built in (``supports`` names them): segment ids, per-key log scales, separate denominator
features, kernelized RPE. Separate denominator features can be served by calling ``causal``
twice (num from phi, den from the denominator features); the kernel itself does not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

MAX_FEATURES = 128  # m and d: one full block each
MIN_BLOCK = 16  # Triton's smallest matmul operand side
_HIGHEST = lax.Precision.HIGHEST


def supports(*, segments: bool, key_scales: bool, den_features: bool, rpe: bool) -> str | None:
  """None when ``causal`` computes the cell, else a one-line reason it does not."""
  if segments:
    return "segment ids are not built into the fused kernel"
  if key_scales:
    return "per-key log scales (running max) are not built into the fused kernel"
  if den_features:
    return "separate denominator features are not built into the fused kernel"
  if rpe:
    return "kernelized RPE (Toeplitz kv mixing) is not built into the fused kernel"
  return None


def _next_block(x: int) -> int:
  return max(MIN_BLOCK, 1 << (x - 1).bit_length())


def _check(phi_q, phi_k, v, chunk, log_decay) -> None:
  for name, a in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
    if jnp.ndim(a) != 4:
      raise ValueError(f"{name} must be rank 4 [b, h, n, .]; got shape {jnp.shape(a)}.")
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating (float32, bf16, float64); got {a.dtype}.")
  if phi_q.shape != phi_k.shape:
    raise ValueError(f"phi_q {phi_q.shape} and phi_k {phi_k.shape} must have the same shape.")
  if v.shape[:3] != phi_k.shape[:3]:
    raise ValueError(f"v {v.shape} must share [b, h, n] with phi_k {phi_k.shape}.")
  m, d = phi_k.shape[-1], v.shape[-1]
  if not (1 <= m <= MAX_FEATURES and 1 <= d <= MAX_FEATURES):
    raise ValueError(
        f"feature size m={m} and value size d={d} must lie in [1, {MAX_FEATURES}] "
        "(one full block each in the fused kernel)."
    )
  if not isinstance(chunk, (int, np.integer)) or chunk < MIN_BLOCK or chunk & (chunk - 1):
    raise ValueError(f"chunk must be a power of two >= {MIN_BLOCK}; got {chunk!r}.")
  if log_decay is None:
    return
  if jnp.shape(log_decay) != (phi_k.shape[1],):
    raise ValueError(
        f"log_decay must be [heads]=({phi_k.shape[1]},) log r <= 0; got shape "
        f"{jnp.shape(log_decay)}."
    )
  if not isinstance(log_decay, jax.core.Tracer):
    worst = float(np.max(np.asarray(log_decay)))
    if not worst <= 0:
      raise ValueError(f"log_decay holds log r and must be <= 0; its maximum is {worst}.")


def _acc_dtype(*arrays):
  """States and sums: float64 for float64 inputs, else float32."""
  return jnp.float64 if jnp.result_type(*arrays) == jnp.float64 else jnp.float32


def _mm(a, b, contract, acc):
  """``a`` contracted with ``b`` over ``contract`` = (axis of a, axis of b), accumulated in
  ``acc``; operands of different dtypes (bf16 input against a float32 state) meet in ``acc``."""
  if a.dtype != b.dtype:
    a, b = a.astype(acc), b.astype(acc)
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return lax.dot_general(a, b, dims, precision=_HIGHEST, preferred_element_type=acc)


def _weights(lr_ref, chunk: int, acc):
  """The chunk's causal weights: ``intra [c, c]`` (r^(i-j) for j <= i, else 0), and with a decay
  ``q_w [c, 1]`` = r^t, ``k_w [c, 1]`` = r^(c - t), ``step [1, 1]`` = r^c (None without)."""
  row = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
  col = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
  if lr_ref is None:
    return jnp.where(row >= col, 1.0, 0.0).astype(acc), None, None, None
  g = lr_ref[...].astype(acc)  # [1, 1]
  dist = jnp.maximum(row - col, 0).astype(acc)
  intra = jnp.where(row >= col, jnp.exp(g * dist), 0.0).astype(acc)
  t = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0).astype(acc)
  return intra, jnp.exp(g * t), jnp.exp(g * (chunk - t)), jnp.exp(g * chunk)


def _advance(s, z, k, v, step, acc, weights=None):
  """The state leaving a chunk: ``step * s + k^T v`` ``[m, d]`` and ``step * z + weights^T k``
  ``[1, m]`` (weights ``[c, 1]``, ones when None; step None: no decay)."""
  if step is not None:
    s, z = s * step, z * step
  k_acc = k.astype(acc)
  z = z + jnp.sum(k_acc if weights is None else k_acc * weights, axis=0, keepdims=True)
  return s + _mm(k, v, (0, 0), acc), z


def _fwd_kernel(*refs, chunk: int, num_chunks: int, decay: bool):
  lr_ref, refs = (refs[0], refs[1:]) if decay else (None, refs)
  q_ref, k_ref, v_ref, num_ref, den_ref = refs
  acc = num_ref.dtype
  intra, q_w, k_w, step = _weights(lr_ref, chunk, acc)

  def body(i, carry):
    s, z = carry  # [m, d], [1, m]
    rows = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
    q, k, v = q_ref[rows, :], k_ref[rows, :], v_ref[rows, :]
    a = _mm(q, k, (1, 1), acc) * intra  # [c, c]
    if decay:
      q, k = q * q_w, k * k_w
    num_ref[rows, :] = _mm(q, s, (1, 0), acc) + _mm(a, v, (1, 0), acc)
    den_ref[rows, :] = jnp.sum(q * z, axis=1, keepdims=True) + jnp.sum(a, axis=1, keepdims=True)
    return _advance(s, z, k, v, step, acc)

  m, d = q_ref.shape[-1], v_ref.shape[-1]
  lax.fori_loop(
      np.int32(0), np.int32(num_chunks), body, (jnp.zeros((m, d), acc), jnp.zeros((1, m), acc))
  )


def _bwd_kernel(*refs, chunk: int, num_chunks: int, decay: bool):
  lr_ref, refs = (refs[0], refs[1:]) if decay else (None, refs)
  q_ref, k_ref, v_ref, dnum_ref, dden_ref, dq_ref, dk_ref, dv_ref = refs
  acc = dnum_ref.dtype
  intra, q_w, k_w, step = _weights(lr_ref, chunk, acc)
  m, d = q_ref.shape[-1], v_ref.shape[-1]

  def load(i):
    rows = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
    return (
        rows,
        q_ref[rows, :],
        k_ref[rows, :],
        v_ref[rows, :],
        dnum_ref[rows, :],
        dden_ref[rows, :],
    )

  def forward(i, carry):  # d phi_q, recomputing the state entering each chunk
    s, z = carry
    rows, _, k, v, dnum, dden = load(i)
    da = (_mm(dnum, v, (1, 1), acc) + dden) * intra  # [c, c]
    dq = _mm(dnum, s, (1, 1), acc) + dden * z  # [c, m]
    if decay:
      dq = dq * q_w
    dq_ref[rows, :] = (dq + _mm(da, k, (1, 0), acc)).astype(dq_ref.dtype)
    return _advance(s, z, k * k_w if decay else k, v, step, acc)

  def reverse(i, carry):  # d phi_k and dv; carries dS, dz of the state leaving the chunk
    ds, dz = carry  # [m, d], [1, m]
    rows, q, k, v, dnum, dden = load(num_chunks - 1 - i)
    a = _mm(q, k, (1, 1), acc) * intra
    da = (_mm(dnum, v, (1, 1), acc) + dden) * intra
    dk = _mm(v, ds, (1, 1), acc) + dz  # [c, m]
    if decay:
      q, k, dk = q * q_w, k * k_w, dk * k_w
    dk_ref[rows, :] = (dk + _mm(da, q_ref[rows, :], (0, 0), acc)).astype(dk_ref.dtype)
    dv_ref[rows, :] = (_mm(a, dnum, (0, 0), acc) + _mm(k, ds, (1, 0), acc)).astype(dv_ref.dtype)
    # The state entering the chunk reaches the next one decayed by r^c, and this chunk's queries.
    return _advance(ds, dz, q, dnum, step, acc, weights=dden)

  lax.fori_loop(
      np.int32(0), np.int32(num_chunks), forward, (jnp.zeros((m, d), acc), jnp.zeros((1, m), acc))
  )
  lax.fori_loop(
      np.int32(0), np.int32(num_chunks), reverse, (jnp.zeros((m, d), acc), jnp.zeros((1, m), acc))
  )


def _bi_fwd_kernel(q_ref, k_ref, v_ref, num_ref, den_ref, *, chunk: int, num_chunks: int, decay):
  del decay  # bidirectional: none
  acc = num_ref.dtype
  m, d = q_ref.shape[-1], v_ref.shape[-1]

  def rows(i):
    return pl.ds(pl.multiple_of(i * chunk, chunk), chunk)

  def total(i, carry):  # S = sum_j phi_k_j v_j^T, z = sum_j phi_k_j over the whole sequence
    return _advance(*carry, k_ref[rows(i), :], v_ref[rows(i), :], None, acc)

  zeros = (jnp.zeros((m, d), acc), jnp.zeros((1, m), acc))
  s, z = lax.fori_loop(0, num_chunks, total, zeros)

  def out(i, carry):
    q = q_ref[rows(i), :]
    num_ref[rows(i), :] = _mm(q, s, (1, 0), acc)
    den_ref[rows(i), :] = jnp.sum(q.astype(acc) * z, axis=1, keepdims=True)
    return carry

  lax.fori_loop(0, num_chunks, out, 0)


def _bi_bwd_kernel(*refs, chunk: int, num_chunks: int, decay):
  del decay
  q_ref, k_ref, v_ref, dnum_ref, dden_ref, dq_ref, dk_ref, dv_ref = refs
  acc = dnum_ref.dtype
  m, d = q_ref.shape[-1], v_ref.shape[-1]

  def rows(i):
    return pl.ds(pl.multiple_of(i * chunk, chunk), chunk)

  def totals(i, carry):  # the states S, z and their cotangents dS = sum_i phi_q_i dnum_i^T, dz
    s, z, ds, dz = carry
    s, z = _advance(s, z, k_ref[rows(i), :], v_ref[rows(i), :], None, acc)
    q, dden = q_ref[rows(i), :], dden_ref[rows(i), :]
    ds, dz = _advance(ds, dz, q, dnum_ref[rows(i), :], None, acc, weights=dden)
    return s, z, ds, dz

  zeros = (jnp.zeros((m, d), acc), jnp.zeros((1, m), acc))
  s, z, ds, dz = lax.fori_loop(0, num_chunks, totals, zeros + zeros)

  def out(i, carry):
    r = rows(i)
    dq = _mm(dnum_ref[r, :], s, (1, 1), acc) + dden_ref[r, :] * z
    dq_ref[r, :] = dq.astype(dq_ref.dtype)
    dk_ref[r, :] = (_mm(v_ref[r, :], ds, (1, 1), acc) + dz).astype(dk_ref.dtype)
    dv_ref[r, :] = _mm(k_ref[r, :], ds, (1, 0), acc).astype(dv_ref.dtype)
    return carry

  lax.fori_loop(0, num_chunks, out, 0)


_KERNELS = {"causal": (_fwd_kernel, _bwd_kernel), "bidirectional": (_bi_fwd_kernel, _bi_bwd_kernel)}


def _compiler_params(platform: str):
  if platform == "tpu":
    return pltpu.CompilerParams(dimension_semantics=("parallel",))
  if platform in ("cuda", "rocm", "gpu"):
    return pltriton.CompilerParams(num_warps=4, num_stages=2)
  return None


def _call(kernel, inputs, outs, lr, *, chunk, interpret, platform):
  """One program per row of the flattened [b h] axis; each sees its row's whole sequence."""
  bh, n = inputs[0].shape[:2]
  decay = lr is not None
  row = lambda i: (i, 0, 0)
  spec = lambda a: pl.BlockSpec((None,) + tuple(a.shape[1:]), row)
  args = ([lr] if decay else []) + list(inputs)
  return pl.pallas_call(
      functools.partial(kernel, chunk=chunk, num_chunks=n // chunk, decay=decay),
      out_shape=outs,
      grid=(bh,),
      in_specs=[spec(a) for a in args],
      out_specs=[spec(o) for o in outs],
      interpret=interpret,
      compiler_params=None if interpret else _compiler_params(platform),
      name=kernel.__name__.strip("_"),
  )(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused(q, k, v, lr, kind, chunk, interpret, platform):
  """Padded, flattened: q, k ``[bh, n, m]``, v ``[bh, n, d]``, lr ``[bh, 1, 1]`` or None ->
  num ``[bh, n, d]``, den ``[bh, n, 1]`` (accumulation dtype)."""
  return _fused_fwd(q, k, v, lr, kind, chunk, interpret, platform)[0]


def _fused_fwd(q, k, v, lr, kind, chunk, interpret, platform):
  acc = _acc_dtype(q, k, v)
  bh, n, _ = q.shape
  outs = [jax.ShapeDtypeStruct((bh, n, v.shape[-1]), acc), jax.ShapeDtypeStruct((bh, n, 1), acc)]
  num, den = _call(
      _KERNELS[kind][0], [q, k, v], outs, lr, chunk=chunk, interpret=interpret, platform=platform
  )
  return (num, den), (q, k, v, lr)


def _fused_bwd(kind, chunk, interpret, platform, res, ct):
  q, k, v, lr = res
  dnum, dden = ct
  outs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v)]
  dq, dk, dv = _call(
      _KERNELS[kind][1],
      [q, k, v, dnum, dden],
      outs,
      lr,
      chunk=chunk,
      interpret=interpret,
      platform=platform,
  )
  return dq, dk, dv, None if lr is None else jnp.zeros_like(lr)


_fused.defvjp(_fused_fwd, _fused_bwd)


def causal(phi_q, phi_k, v, *, chunk: int = 64, log_decay=None, interpret: bool | None = None):
  """Causal linear attention, unnormalised, by the fused Pallas kernel.

  Args:
    phi_q, phi_k: ``[b, h, n, m]`` features (float32, bf16 or float64), m <= 128.
    v: ``[b, h, n, d]`` values, d <= 128.
    chunk: tokens per chunk, a power of two >= 16; n need not be a multiple.
    log_decay: ``[h]`` log r <= 0, a causal decay r^(i-j); None for none. A constant: no
      gradient flows to it.
    interpret: Pallas interpret mode; None: on when ``jax.default_backend() == "cpu"``.

  Returns:
    num ``[b, h, n, d]`` and den ``[b, h, n]``, float32 (float64 for float64 inputs):
    ``num_i = sum_{j<=i} (phi_q_i . phi_k_j) r^(i-j) v_j`` and the same sum without ``v_j``.
  """
  return _entry("causal", phi_q, phi_k, v, chunk, log_decay, interpret)


def bidirectional(phi_q, phi_k, v, *, chunk: int = 64, interpret: bool | None = None):
  """Bidirectional linear attention, unnormalised, by a fused Pallas kernel: one pass over the
  chunks sums ``S = phi_k^T v`` ``[m, d]`` and ``z = sum_j phi_k_j``, a second writes
  ``num = phi_q S`` ``[b, h, n, d]`` and ``den = phi_q z`` ``[b, h, n]`` (float32; float64 for
  float64 inputs). Arguments as ``causal``'s (no decay: it is causal only)."""
  return _entry("bidirectional", phi_q, phi_k, v, chunk, None, interpret)


def _entry(kind, phi_q, phi_k, v, chunk, log_decay, interpret):
  _check(phi_q, phi_k, v, chunk, log_decay)
  backend = jax.default_backend()
  if interpret is False and backend == "cpu":
    raise ValueError(
        "interpret=False compiles the kernel for a GPU (Triton) or TPU (Mosaic); the backend "
        "is cpu: pass interpret=True or None."
    )
  interpret = backend == "cpu" if interpret is None else interpret
  return _apply(phi_q, phi_k, v, log_decay, kind, chunk, interpret, backend)


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7))
def _apply(phi_q, phi_k, v, log_decay, kind: str, chunk: int, interpret: bool, platform: str):
  """``causal`` or ``bidirectional`` (``kind``) after the checks, for a given platform ("cpu",
  "gpu", "cuda", "tpu"): the tests lower it for a platform this machine does not have."""
  b, h, n, m = phi_k.shape
  d = v.shape[-1]
  acc = _acc_dtype(phi_q, phi_k, v)
  pad_n = -(-n // chunk) * chunk - n

  def flat(a, size):  # [b, h, n, e] -> [b h, n + pad, size], zeros appended
    a = jnp.pad(a, ((0, 0), (0, 0), (0, pad_n), (0, size - a.shape[-1])))
    return a.reshape(b * h, n + pad_n, size)

  lr = None
  if log_decay is not None:
    lr = lax.stop_gradient(jnp.asarray(log_decay, acc))
    lr = jnp.broadcast_to(lr[None, :], (b, h)).reshape(b * h, 1, 1)
  mb, db = _next_block(m), _next_block(d)
  q, k, vals = flat(phi_q, mb), flat(phi_k, mb), flat(v, db)
  num, den = _fused(q, k, vals, lr, kind, chunk, interpret, platform)
  num = num.reshape(b, h, n + pad_n, db)[:, :, :n, :d]
  den = den.reshape(b, h, n + pad_n)[:, :, :n]
  return num, den
