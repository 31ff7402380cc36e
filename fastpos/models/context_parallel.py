"""Context parallelism in the model: a sequence split over the mesh axis ``seq``.

When the mesh in context (``jax.set_mesh``, which the trainer enters when
``config.mesh.seq > 1``) has an axis ``seq`` of size P > 1, every ``[b, N, ...]`` activation
is split over it in P blocks of N / P positions. The model code is unchanged: it runs in
the global view and the compiler (GSPMD) partitions what acts per token or reduces over the
sequence (projections, feature maps, whose key stabiliser becomes a max over all blocks,
positional features by absolute position, norms, MLP; a masked mean pools by summing local
sums and counts over devices, CLS pooling reads the token on the first block). The layer's
sequence mixers run in ``shard_map`` over ``seq`` with the algorithms of
``fastpos.ops.context_parallel`` (state psum, state scan, ring Toeplitz product).

What can run split is decided per hook by the plan
(``fastpos.positional.compatibility.split_problem``): linear kernels
only (softmax would need ring attention); ``embed`` and post-phi ``features`` hooks (per
position); ``kv`` tables and decays in 1D; an ``output`` hook whose scheme gives its Toeplitz
table (``output_table``). Not split: the softmax kernel, ``logits`` hooks (t5_bias,
transformer_xl), pre-phi features (spe: its noise processes span the sequence), 2D grids.
A sequence not divisible by P (e.g. a CLS token prepended) is zero-padded inside the mixers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fastpos.ops import context_parallel as cp_ops

SEQ = "seq"


def seq_size() -> int:
  """P, the size of the mesh axis ``seq`` in context (1 without one)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or SEQ not in mesh.axis_names:
    return 1
  return int(mesh.shape[SEQ])


def _pad_seq(x, pad: int, value=0):
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _pad_table(w, pad: int, value):
  """A ``[..., 2N-1]`` offset table for N + pad positions: the new offsets (which only meet
  padded positions) get ``value``."""
  if not pad:
    return w
  return jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(pad, pad)], constant_values=value)


def _split(fn, args: dict, specs: dict, out_spec):
  return jax.shard_map(fn, in_specs=(specs,), out_specs=out_spec, axis_names={SEQ})(args)


def linear_attention(
    phi_q,
    phi_k,
    v,
    *,
    mask=None,
    causal=False,
    rpe=None,
    grid=None,
    decay=None,
    den_features=None,
    chunk_size=None,
    eps,
):
  """``fastpos.ops.attention.linear_attention`` over the sequence split on ``seq`` (global
  view in and out; ``fastpos.ops.context_parallel.linear_attention`` on each block)."""
  if grid is not None:
    raise ValueError("a 2D grid cannot run on a split sequence (mesh.seq > 1).")
  num = seq_size()
  n = v.shape[1]
  pad = -n % num
  seq = P(None, SEQ)
  args = {"q": _pad_seq(phi_q, pad), "k": _pad_seq(phi_k, pad), "v": _pad_seq(v, pad)}
  specs = {"q": seq, "k": seq, "v": seq}
  if mask is not None or pad:
    args["mask"] = _pad_seq(jnp.ones(v.shape[:2], bool) if mask is None else mask, pad, False)
    specs["mask"] = seq
  if den_features is not None:
    args["den_q"], args["den_k"] = (_pad_seq(a, pad) for a in den_features)
    specs.update(den_q=seq, den_k=seq)
  if rpe is not None:
    args["rpe"], specs["rpe"] = _pad_table(rpe, pad, 1), P()
  if decay is not None:
    args["decay"], specs["decay"] = decay, P()

  def block(a):
    den = (a["den_q"], a["den_k"]) if "den_q" in a else None
    return cp_ops.linear_attention(
        a["q"],
        a["k"],
        a["v"],
        axis_name=SEQ,
        mask=a.get("mask"),
        causal=causal,
        rpe=a.get("rpe"),
        decay=a.get("decay"),
        den_features=den,
        chunk_size=chunk_size,
        eps=eps,
    )

  return _split(block, args, specs, seq)[:, :n]


def output(scheme, v, ctx):
  """A scheme's ``output`` hook on the split sequence: ``W v`` by the ring Toeplitz product
  of the scheme's table (``scheme.output_table(ctx)``, ``[h|1, 2N-1]``); v ``[b, N, h, d]``."""
  table = scheme.output_table(ctx)
  num = seq_size()
  n = v.shape[1]
  pad = -n % num

  def block(a):  # v [b, n, h, d] as it is: the ring reads each head's channels in place
    y = cp_ops.toeplitz_matmul(a["w"], a["v"], axis_name=SEQ, causal=ctx.causal, seq_axis=1)
    return y.astype(a["v"].dtype)

  args = {"v": _pad_seq(v, pad), "w": _pad_table(table, pad, 0)}
  return _split(block, args, {"v": P(None, SEQ), "w": P()}, P(None, SEQ))[:, :n]


__all__ = ["SEQ", "linear_attention", "output", "seq_size"]
