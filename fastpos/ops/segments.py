"""Packed rows: several sequences in one row, kept apart by segment ids.

A packed batch carries, beside ``inputs`` / ``mask``, ``segment_ids`` int32 ``[b, N]`` (1, 2,
... per sequence in the row, 0 on padding) and ``positions`` int32 ``[b, N]`` (each token's
position inside its own sequence). The model (``DecoderLM``) enters ``packed(segment_ids,
positions)`` around its tower; inside it the attention layer (``fastpos.models.attention``)
adds a block-diagonal bias (a query sees the keys of its own segment only) and the absolute
scheme embeds in-segment positions, so each sequence's outputs are those it has alone, to
float rounding.

Which cells pack (the plan decides, ``fastpos.positional.compatibility.packing_problem``, from
each scheme's declared ``packs``):

* the softmax kernel, whose attention is a sum over allowed pairs, with schemes whose terms
  depend on in-row offsets j - i only (equal to the in-segment offsets inside a block) or on
  in-segment positions: none, absolute (1D), t5_bias, rope, kernelized_rpe;
* every linear kernel with none, absolute or rope: the op takes
  the segment ids (``fastpos.ops.attention.segmented_linear_attention``: the causal state, its
  normaliser and running maximum restart at each segment start; bidirectional queries read
  their own segment's sums), and the stabilised maps (``STABILISED_KEYS``) take each
  segment's own key stabiliser (``segment_key_features``), so even favor's eps weighs as it
  does alone.

Everything else is refused with a message (bucket instead): FastRPB's ``W V`` and a linear
kernel's kernelized RPE (``exp(b)`` weights) are Toeplitz products (FFT) over the whole row;
t5_bias is a logits bias (softmax only); lrpe, permuteformer and spe are not checked for
packing; grids, a Transformer-XL memory and a sequence split over devices have no packed form.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp

from fastpos.ops import features

# Feature maps whose key features subtract one stabiliser per (row, head): packed, each
# segment takes its own (``segment_key_features``).
STABILISED_KEYS = ("sikf", "favor", "orf")
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


def segment_bias(ids, dtype) -> jnp.ndarray:
  """``ids [b, N]`` -> ``[b, 1, N, N]`` additive logits bias: 0 where query and key share a
  segment, a large negative value elsewhere. Padding queries (segment 0) see every key, so no
  row is empty (their outputs are padding, never read)."""
  same = (ids[:, :, None] == ids[:, None, :]) | (ids[:, :, None] == 0)
  return jnp.where(same, jnp.zeros((), dtype), jnp.asarray(_NEG, dtype))[:, None]


def _runs(ids):
  """``[b, N]`` ids -> ``[b * N]`` int32: the index of each token's run of equal ids
  (contiguous segments), counted over the flattened batch (a row starts a new run)."""
  b, n = ids.shape
  start = jnp.ones((b, n), bool).at[:, 1:].set(ids[:, 1:] != ids[:, :-1])
  return jnp.cumsum(start.reshape(-1)) - 1


def segment_reference(log_scale, ids, mask, *, causal: bool):
  """Each token's segment's key stabiliser, taken from ``log_scale`` ``[b, N, h]``: the value
  at the segment's first real key (causal: what every query of the segment sees) or the
  maximum over the segment's real keys (bidirectional); 0 for a segment with no real key.
  Behind stop_gradient. ``[b, N, h]``."""
  b, n, h = log_scale.shape
  runs = _runs(ids)
  real = jnp.ones((b, n), bool) if mask is None else mask
  flat = log_scale.reshape(b * n, h)
  if causal:
    at = jnp.where(real.reshape(-1), jnp.arange(b * n), b * n)
    first = jax.ops.segment_min(at, runs, num_segments=b * n)[runs]  # [b * N]
    ref = jnp.where((first < b * n)[:, None], flat[jnp.minimum(first, b * n - 1)], 0.0)
  else:
    top = jnp.where(real.reshape(-1, 1), flat, -jnp.inf)
    ref = jax.ops.segment_max(top, runs, num_segments=b * n)[runs]
    ref = jnp.where(jnp.isfinite(ref), ref, 0.0)
  return jax.lax.stop_gradient(ref.reshape(b, n, h))


def segment_key_parts(name: str, k, ids, *, projection=None, mask=None, causal: bool):
  """A stabilised map's key features (``STABILISED_KEYS``) split as in
  ``features.causal_key_parts`` but with each segment's own stabiliser: ``(e [b, N, h, m],
  log_scale [b, N, h], key_eps)`` with ``e exp(log_scale) + key_eps`` the features the
  segment's keys have alone (``causal``: its first real key's stabiliser; else the maximum
  over its real keys)."""
  e, log_scale, key_eps = features.causal_key_parts(name, k, projection=projection, mask=mask)
  return e, log_scale - segment_reference(log_scale, ids, mask, causal=causal), key_eps


def segment_key_features(name: str, k, ids, *, projection=None, mask=None, causal: bool):
  """``phi(k)`` ``[b, N, h, m]`` of a stabilised map with each segment's own stabiliser (what
  the map gives each segment alone, ``segment_key_parts``)."""
  e, log_scale, key_eps = segment_key_parts(
      name, k, ids, projection=projection, mask=mask, causal=causal
  )
  return e * jnp.exp(log_scale)[..., None] + key_eps
