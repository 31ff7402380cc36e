"""Linear attention as fused Pallas kernels per (batch, head), forward and backward.

``causal(phi_q, phi_k, v)`` returns the unnormalised numerator and denominator

  num_i = sum_{j <= i} (phi_q_i . phi_k_j) r^(i-j) v_j      ``[b, h, n, d]``
  den_i = sum_{j <= i} (phi_q_i . phi_k_j) r^(i-j)          ``[b, h, n]``

(r = 1 without ``log_decay``), before any eps guard or division: the caller normalises.
``bidirectional(phi_q, phi_k, v)`` returns the same sums over every j (no decay, no mask): one
loop over the chunks sums the state, a second applies it.

Causal layout (as flash-linear-attention's chunk kernel): the sequence is walked chunk by chunk
carrying the state ``S = sum_j phi_k_j v_j^T`` ``[m, d]`` and ``z = sum_j phi_k_j`` ``[1, m]``.
Per chunk of ``c`` tokens (``_fwd_step``): the masked ``(Q K^T) V`` product inside the chunk
plus ``Q S`` for the earlier chunks, then ``S += K^T V``. Two layouts run the same step
functions: on GPU (Triton) and in interpret mode, one program per (batch, head) loops over the
chunks (``lax.fori_loop``) with the state in registers (``_loop_kernel``); on TPU (Mosaic) the
grid is (batch x head, chunk), the chunk axis sequential ("arbitrary"), each program one chunk,
and the state in VMEM scratch between programs (``_grid_kernel``), so VMEM holds a chunk, not
the sequence. States and accumulation are float32 (float64 for float64 inputs); bf16 inputs
enter the ``Q K^T`` and ``K^T V`` matmuls as bf16 with float32 accumulation (bf16 products are
exact in float32). Float32 matmuls run at full precision (``Precision.HIGHEST``: IEEE on GPU,
not TF32), so float32 results hold 1e-4 against float64.

Decay: key j weighs ``r^(i-j)`` for query i, split per chunk as ``r^(i - start)`` (query side)
times ``r^(start - j)`` (the carried state, decayed by ``r^c`` per chunk), so every exponent is
<= 0 and nothing overflows. ``log_decay`` is a constant of the model (a config value in fastpos):
no gradient flows to it.

Backward (``jax.custom_vjp``, Pallas kernels in the same layouts): a forward pass over the chunks
recomputes ``S`` and ``z`` and writes ``d phi_q`` (``_dq_step``); a reverse pass carries
``dS = sum_{i later} phi_q_i dnum_i^T`` and ``dz`` and writes ``d phi_k`` and ``dv``
(``_dkv_step``). No prefix state is ever rebuilt by subtraction (that drifts in float32); the
residuals are the inputs only.

Padding: n is zero-padded to a multiple of ``chunk`` (zero keys add nothing; padded queries are
cut off), and m, d to the next power of two >= 16 (Triton's block and matmul minimum; zero
features and value columns are exact). m and d up to 128 (one full block each).

Platforms: ``interpret=None`` runs Pallas interpret mode when ``jax.default_backend()`` is
``"cpu"`` (how the tests run both layouts) and compiles otherwise. On a CPU-only jaxlib both
lowerings can be produced (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``, and
``"tpu"``), and the tests check that forward and backward lower. What a GPU / TPU must still
confirm: that Triton / Mosaic compile the lowered kernels (Mosaic's own layout passes run only
on a TPU; the transposed-operand matmuls ``K^T V`` and ``dA^T Q`` are the likeliest to need
care there), their values against the interpret-mode results, and their speed. The bidirectional
kernel has the loop layout on every platform: on TPU a program holds its (batch, head)'s whole
sequence in VMEM, which bounds n there.

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


def block_for(x: int) -> int:
  """The kernel's block for a size ``x >= 1``: the next power of two, at least ``MIN_BLOCK``."""
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
    return (row >= col).astype(acc), None, None, None
  g = lr_ref[...].astype(acc)  # [1, 1]
  dist = jnp.maximum(row - col, 0).astype(acc)
  intra = jnp.where(row >= col, jnp.exp(g * dist), jnp.zeros((), acc))
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


def _zeros(m: int, d: int, acc):
  return jnp.zeros((m, d), acc), jnp.zeros((1, m), acc)


def _rows(i, chunk: int):
  return pl.ds(pl.multiple_of(i * chunk, chunk), chunk)


# One chunk of each causal pass: (the chunk's input blocks, the carried state, the weights) ->
# (the chunk's output blocks, the state leaving the chunk). Both layouts (``_loop_kernel``,
# ``_grid_kernel``) run these, so the two share every line of the arithmetic.


def _fwd_step(q, k, v, s, z, *, w, acc):
  """num ``[c, d]``, den ``[c, 1]``; the state ``S [m, d]``, ``z [1, m]`` moves forward."""
  intra, q_w, k_w, step = w
  a = _mm(q, k, (1, 1), acc) * intra  # [c, c]
  if step is not None:
    q, k = q * q_w, k * k_w
  num = _mm(q, s, (1, 0), acc) + _mm(a, v, (1, 0), acc)
  den = jnp.sum(q.astype(acc) * z, axis=1, keepdims=True) + jnp.sum(a, axis=1, keepdims=True)
  return (num, den), _advance(s, z, k, v, step, acc)


def _dq_step(k, v, dnum, dden, s, z, *, w, acc):
  """d phi_q ``[c, m]``, recomputing the forward state ``S``, ``z`` (moving forward)."""
  intra, q_w, k_w, step = w
  da = (_mm(dnum, v, (1, 1), acc) + dden) * intra  # [c, c]
  dq = _mm(dnum, s, (1, 1), acc) + dden * z  # [c, m]
  if step is not None:
    dq = dq * q_w
  dq = dq + _mm(da, k, (1, 0), acc)
  return (dq,), _advance(s, z, k if step is None else k * k_w, v, step, acc)


def _dkv_step(q, k, v, dnum, dden, ds, dz, *, w, acc):
  """d phi_k ``[c, m]`` and dv ``[c, d]``; carries (moving backward) the cotangents ``dS``,
  ``dz`` of the state leaving the chunk and returns those of the state entering it."""
  intra, q_w, k_w, step = w
  a = _mm(q, k, (1, 1), acc) * intra
  da = (_mm(dnum, v, (1, 1), acc) + dden) * intra
  dk = _mm(da, q, (0, 0), acc)
  dk_state = _mm(v, ds, (1, 1), acc) + dz  # [c, m]
  if step is not None:
    q, k, dk_state = q * q_w, k * k_w, dk_state * k_w
  dv = _mm(a, dnum, (0, 0), acc) + _mm(k, ds, (1, 0), acc)
  # The state entering the chunk reaches the next one decayed by r^c, and this chunk's queries.
  return (dk + dk_state, dv), _advance(ds, dz, q, dnum, step, acc, weights=dden)


def _split_refs(refs, decay: bool, n_in: int):
  lr_ref, refs = (refs[0], refs[1:]) if decay else (None, refs)
  return lr_ref, refs[:n_in], refs[n_in:]


def _loop_kernel(*refs, step, n_in, state, acc, chunk, num_chunks, decay, reverse):
  """GPU layout: a program sees its (batch, head)'s whole sequence and loops over the chunks,
  the state in registers."""
  lr_ref, in_refs, out_refs = _split_refs(refs, decay, n_in)
  w = _weights(lr_ref, chunk, acc)

  def body(i, carry):
    rows = _rows(num_chunks - 1 - i if reverse else i, chunk)
    outs, carry = step(*(r[rows, :] for r in in_refs), *carry, w=w, acc=acc)
    for r, o in zip(out_refs, outs):
      r[rows, :] = o.astype(r.dtype)
    return carry

  lax.fori_loop(0, num_chunks, body, _zeros(*state, acc))


def _grid_kernel(*refs, step, n_in, state, acc, chunk, num_chunks, decay, reverse):
  """TPU layout: the grid's second axis walks the chunks in order ("arbitrary"), a program sees
  one chunk, and the state lives in VMEM scratch between programs."""
  del num_chunks, reverse  # in the grid and its index maps
  lr_ref, in_refs, refs = _split_refs(refs, decay, n_in)
  out_refs, (s_ref, z_ref) = refs[:-2], refs[-2:]

  @pl.when(pl.program_id(1) == 0)
  def _():
    s_ref[...], z_ref[...] = _zeros(*state, acc)

  w = _weights(lr_ref, chunk, acc)
  outs, (s, z) = step(*(r[...] for r in in_refs), s_ref[...], z_ref[...], w=w, acc=acc)
  s_ref[...], z_ref[...] = s, z
  for r, o in zip(out_refs, outs):
    r[...] = o.astype(r.dtype)


def _bi_fwd_kernel(q_ref, k_ref, v_ref, num_ref, den_ref, *, chunk: int, num_chunks: int):
  """Bidirectional forward (whole-sequence layout): S, z summed over the chunks, then applied."""
  acc = num_ref.dtype
  m, d = q_ref.shape[-1], v_ref.shape[-1]

  rows = functools.partial(_rows, chunk=chunk)

  def total(i, carry):  # S = sum_j phi_k_j v_j^T, z = sum_j phi_k_j over the whole sequence
    return _advance(*carry, k_ref[rows(i), :], v_ref[rows(i), :], None, acc)

  zeros = _zeros(m, d, acc)
  s, z = lax.fori_loop(0, num_chunks, total, zeros)

  def out(i, carry):
    q = q_ref[rows(i), :]
    num_ref[rows(i), :] = _mm(q, s, (1, 0), acc)
    den_ref[rows(i), :] = jnp.sum(q.astype(acc) * z, axis=1, keepdims=True)
    return carry

  lax.fori_loop(0, num_chunks, out, 0)


def _bi_bwd_kernel(*refs, chunk: int, num_chunks: int):
  """Bidirectional backward: S, z and their cotangents dS, dz summed in one pass, applied in a
  second."""
  q_ref, k_ref, v_ref, dnum_ref, dden_ref, dq_ref, dk_ref, dv_ref = refs
  acc = dnum_ref.dtype
  m, d = q_ref.shape[-1], v_ref.shape[-1]

  rows = functools.partial(_rows, chunk=chunk)

  def totals(i, carry):  # the states S, z and their cotangents dS = sum_i phi_q_i dnum_i^T, dz
    s, z, ds, dz = carry
    s, z = _advance(s, z, k_ref[rows(i), :], v_ref[rows(i), :], None, acc)
    q, dden = q_ref[rows(i), :], dden_ref[rows(i), :]
    ds, dz = _advance(ds, dz, q, dnum_ref[rows(i), :], None, acc, weights=dden)
    return s, z, ds, dz

  zeros = _zeros(m, d, acc)
  s, z, ds, dz = lax.fori_loop(0, num_chunks, totals, zeros + zeros)

  def out(i, carry):
    r = rows(i)
    dq = _mm(dnum_ref[r, :], s, (1, 1), acc) + dden_ref[r, :] * z
    dq_ref[r, :] = dq.astype(dq_ref.dtype)
    dk_ref[r, :] = (_mm(v_ref[r, :], ds, (1, 1), acc) + dz).astype(dk_ref.dtype)
    dv_ref[r, :] = _mm(k_ref[r, :], ds, (1, 0), acc).astype(dv_ref.dtype)
    return carry

  lax.fori_loop(0, num_chunks, out, 0)


def _whole(kernel, args, outs, *, interpret: bool, platform: str, name: str):
  """One program per row of the flattened [b h] axis; each sees its row's whole sequence."""
  spec = lambda a: pl.BlockSpec((None,) + tuple(a.shape[1:]), lambda i: (i, 0, 0))
  if interpret:
    params = None
  elif platform == "tpu":
    params = pltpu.CompilerParams(dimension_semantics=("parallel",))
  else:
    params = pltriton.CompilerParams(num_warps=4, num_stages=2)
  return pl.pallas_call(
      kernel,
      out_shape=outs,
      grid=(args[0].shape[0],),
      in_specs=[spec(a) for a in args],
      out_specs=[spec(o) for o in outs],
      interpret=interpret,
      compiler_params=params,
      name=name,
  )(*args)


def _chunked(step, inputs, outs, lr, *, state, reverse, chunk, interpret, platform):
  """Runs ``step`` over the chunks of every (batch, head), forward or in ``reverse``, carrying
  a state of shape ``state`` = (m, d): by ``_loop_kernel`` (GPU, interpret mode) or by
  ``_grid_kernel`` (TPU). inputs ``[bh, n, .]`` (n a multiple of chunk), lr ``[bh, 1, 1]`` or
  None; outs: the ``[bh, n, .]`` outputs' shapes and dtypes."""
  bh, n = inputs[0].shape[:2]
  g = n // chunk
  decay = lr is not None
  args = ([lr] if decay else []) + list(inputs)
  acc = _acc_dtype(*inputs)
  kw = dict(step=step, n_in=len(inputs), state=state, acc=acc, chunk=chunk, num_chunks=g)
  kw.update(decay=decay, reverse=reverse)
  name = step.__name__.strip("_")
  if platform != "tpu":
    return _whole(
        functools.partial(_loop_kernel, **kw),
        args,
        outs,
        interpret=interpret,
        platform=platform,
        name=name,
    )
  at = (lambda i, j: (i, g - 1 - j, 0)) if reverse else (lambda i, j: (i, j, 0))
  spec = lambda a: pl.BlockSpec((None, chunk, a.shape[-1]), at)
  lr_spec = [pl.BlockSpec((None, 1, 1), lambda i, j: (i, 0, 0))] if decay else []
  params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
  return pl.pallas_call(
      functools.partial(_grid_kernel, **kw),
      out_shape=outs,
      grid=(bh, g),
      in_specs=lr_spec + [spec(a) for a in inputs],
      out_specs=[spec(o) for o in outs],
      scratch_shapes=[pltpu.VMEM(state, acc), pltpu.VMEM((1, state[0]), acc)],
      interpret=interpret,
      compiler_params=None if interpret else params,
      name=name,
  )(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused(q, k, v, lr, kind, chunk, interpret, platform):
  """Padded, flattened: q, k ``[bh, n, m]``, v ``[bh, n, d]``, lr ``[bh, 1, 1]`` or None ->
  num ``[bh, n, d]``, den ``[bh, n, 1]`` (accumulation dtype)."""
  return _fused_fwd(q, k, v, lr, kind, chunk, interpret, platform)[0]


def _fused_fwd(q, k, v, lr, kind, chunk, interpret, platform):
  acc = _acc_dtype(q, k, v)
  (bh, n, m), d = q.shape, v.shape[-1]
  outs = [jax.ShapeDtypeStruct((bh, n, d), acc), jax.ShapeDtypeStruct((bh, n, 1), acc)]
  if kind == "bidirectional":
    kernel = functools.partial(_bi_fwd_kernel, chunk=chunk, num_chunks=n // chunk)
    num, den = _whole(kernel, [q, k, v], outs, interpret=interpret, platform=platform, name=kind)
  else:
    run = functools.partial(
        _chunked, state=(m, d), chunk=chunk, interpret=interpret, platform=platform
    )
    num, den = run(_fwd_step, [q, k, v], outs, lr, reverse=False)
  return (num, den), (q, k, v, lr)


def _fused_bwd(kind, chunk, interpret, platform, res, ct):
  q, k, v, lr = res
  dnum, dden = ct
  (_, n, m), d = q.shape, v.shape[-1]
  like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  if kind == "bidirectional":
    kernel = functools.partial(_bi_bwd_kernel, chunk=chunk, num_chunks=n // chunk)
    args = [q, k, v, dnum, dden]
    dq, dk, dv = _whole(
        kernel,
        args,
        [like(q), like(k), like(v)],
        interpret=interpret,
        platform=platform,
        name=kind + "_bwd",
    )
  else:
    run = functools.partial(
        _chunked, state=(m, d), chunk=chunk, interpret=interpret, platform=platform
    )
    (dq,) = run(_dq_step, [k, v, dnum, dden], [like(q)], lr, reverse=False)
    dk, dv = run(_dkv_step, [q, k, v, dnum, dden], [like(k), like(v)], lr, reverse=True)
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
  mb, db = block_for(m), block_for(d)
  q, k, vals = flat(phi_q, mb), flat(phi_k, mb), flat(v, db)
  num, den = _fused(q, k, vals, lr, kind, chunk, interpret, platform)
  num = num.reshape(b, h, n + pad_n, db)[:, :, :n, :d]
  den = den.reshape(b, h, n + pad_n)[:, :, :n]
  return num, den
