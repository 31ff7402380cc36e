"""Packed rows: several sequences in one row, kept apart by segment ids.

A packed batch carries, beside ``inputs`` / ``mask``, ``segment_ids`` int32 ``[b, N]`` (1, 2,
... per sequence in the row, 0 on padding) and ``positions`` int32 ``[b, N]`` (each token's
position inside its own sequence). The model (``DecoderLM``) enters ``packed(segment_ids,
positions)`` around its tower; inside it the attention layer (``fastpos.models.attention``)
adds a block-diagonal bias (a query sees the keys of its own segment only) and the absolute
scheme embeds in-segment positions, so each sequence's outputs are those it has alone, to
float rounding.

Which cells pack (``check_packable``): the softmax kernel, whose attention is a sum over
allowed pairs, with schemes whose terms depend on in-row offsets j - i only (equal to the
in-segment offsets inside a block) or on in-segment positions: none, absolute (1D), t5_bias,
rope, kernelized_rpe. Everything else is refused with a message (bucket instead): a linear
kernel's key-value state spans the row (bidirectional) or would need a reset at each segment
start (causal; not built), FastRPB's ``W V`` is one Toeplitz product over the row, and
feature schemes other than RoPE (lrpe, permuteformer, spe) are not checked for packing.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, NamedTuple

import jax.numpy as jnp

PACKABLE_SCHEMES = ("none", "absolute", "t5_bias", "rope", "kernelized_rpe")
_NEG = -1e30  # a logit bias that exp() turns into exactly 0 in float32 / float64 / bfloat16


class Segments(NamedTuple):
  ids: object  # [b, N] int32, 0 on padding
  positions: object  # [b, N] int32, in-segment positions


_ACTIVE: contextvars.ContextVar[Segments | None] = contextvars.ContextVar("segments", default=None)


@contextlib.contextmanager
def packed(segment_ids, positions) -> Iterator[None]:
  """Within this block the model's layers keep the segments of ``segment_ids`` apart (a no-op
  when ``segment_ids`` is None)."""
  if segment_ids is None:
    yield
    return
  if positions is None:
    raise ValueError(
        "a packed batch needs 'positions' (in-segment positions) beside " "'segment_ids'."
    )
  token = _ACTIVE.set(Segments(jnp.asarray(segment_ids), jnp.asarray(positions)))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active() -> Segments | None:
  """The segments of the batch being run, or None (not packed)."""
  return _ACTIVE.get()


def packing_refusal(
    kernel: str,
    schemes: list[str],
    *,
    causal: bool,
    grid=None,
    memory_length: int = 0,
    split: bool = False,
) -> str | None:
  """Why a (kernel, schemes, causal) cell cannot pack exactly, or None when it packs."""
  if split:
    return "the sequence is split over the mesh's seq axis"
  if kernel != "softmax":
    state = (
        "its key-value state spans the whole row"
        if not causal
        else "its causal state would need a reset at each segment start (not built)"
    )
    return f"kernel {kernel!r} is linear: {state}"
  if grid is not None:
    return "2D (grid) inputs have no sequences to pack"
  if memory_length:
    return "a Transformer-XL memory carries states across rows"
  bad = [s for s in schemes if s not in PACKABLE_SCHEMES]
  if bad:
    why = {"fastrpb": "its W V is one Toeplitz product (FFT) over the row"}
    return "; ".join(f"scheme {s!r}: {why.get(s, 'not checked for packing')}" for s in bad)
  return None


def check_packable(
    kernel: str,
    schemes: list[str],
    *,
    causal: bool,
    grid=None,
    memory_length: int = 0,
    split: bool = False,
) -> None:
  """Raises ValueError naming the reason when the cell cannot pack (``packing_refusal``)."""
  reason = packing_refusal(
      kernel, schemes, causal=causal, grid=grid, memory_length=memory_length, split=split
  )
  if reason is not None:
    raise ValueError(
        f"packed batches (segment_ids) cannot run exactly on this model: "
        f"{reason}. Packing runs the softmax kernel with schemes "
        f"{', '.join(PACKABLE_SCHEMES)}; run it unpacked (classification tasks: "
        "config.data.bucket_lengths)."
    )


def segment_bias(ids, dtype) -> jnp.ndarray:
  """``ids [b, N]`` -> ``[b, 1, N, N]`` additive logits bias: 0 where query and key share a
  segment, a large negative value elsewhere. Padding queries (segment 0) see every key, so no
  row is empty (their outputs are padding, never read)."""
  same = (ids[:, :, None] == ids[:, None, :]) | (ids[:, :, None] == 0)
  return jnp.where(same, jnp.zeros((), dtype), jnp.asarray(_NEG, dtype))[:, None]
