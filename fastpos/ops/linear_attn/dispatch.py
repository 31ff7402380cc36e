"""Which algorithm computes a causal linear attention: ``mode`` -> the module that runs it.

``resolve`` checks a mode and the cell it is asked to run (before any compute) and turns
"auto" into the backend's choice (``fastpos.ops.linear_attn.auto``); ``causal`` and
``running_max`` run the resolved mode on head-major arrays (the contracts of
``recurrent._causal_chunked`` and ``recurrent._causal_running_max``).
"""

from __future__ import annotations

import importlib

from fastpos.ops.linear_attn import auto, chunk, recurrent
from fastpos.ops.linear_attn.common import MODES, check_mode

__all__ = ["MODES", "causal", "resolve", "running_max"]


def _fused():
  # Imported only when asked for: the fused kernel's module may need what other modes do not.
  return importlib.import_module("fastpos.ops.linear_attn.fused")


def resolve(
    mode: str,
    *,
    causal: bool,
    segments: bool = False,
    key_scales: bool = False,
    den_features: bool = False,
    rpe: bool = False,
) -> str:
  """The algorithm ("chunk", "recurrent" or "fused") that runs ``mode`` on this cell.

  Raises ValueError for a mode outside ``MODES`` (naming them), and for "fused" on a cell the
  fused kernel does not run (bidirectional, or what its ``supports`` refuses), naming the
  reason and the modes that run it."""
  check_mode(mode)
  if mode == "auto":
    return auto.pick()
  if mode == "fused":
    if not causal:
      raise ValueError(
          "mode='fused' is built for causal attention only (the fused kernel has no "
          "bidirectional form); bidirectional attention runs with mode='auto', 'chunk' or "
          "'recurrent' (all take the same bidirectional path)."
      )
    why = _fused().supports(
        segments=segments, key_scales=key_scales, den_features=den_features, rpe=rpe
    )
    if why is not None:
      raise ValueError(
          f"mode='fused' does not run this cell: {why}. Modes 'chunk' and 'recurrent' (and "
          "'auto') run every cell."
      )
  return mode


def causal(fq, fk, vals, chunk_size: int, log_decay=None, segment_ids=None, *, mode: str):
  """Causal (num ``[b, h, n, d]``, den ``[b, h, n]``) by the resolved ``mode``; head-major
  ``fq, fk [b, h, n, m]``, ``vals [b, h, n, d]`` (padded keys zeroed)."""
  if mode == "chunk":
    return chunk.causal_chunked(fq, fk, vals, chunk_size, log_decay, segment_ids)
  if mode == "fused":
    if segment_ids is not None:  # resolve() asked supports(); this is a caller's mistake
      raise ValueError("the fused kernel takes no segment_ids.")
    # The kernel's chunk is a power of two >= 16 (its block): the layer's chunk (clipped to a
    # short sequence, or any size asked for) rounds up to one; the kernel pads the sequence.
    fused = _fused()
    return fused.causal(fq, fk, vals, chunk=fused.block_for(chunk_size), log_decay=log_decay)
  return recurrent._causal_chunked(fq, fk, vals, chunk_size, log_decay, segment_ids=segment_ids)


def running_max(q, k, v, s, k_eps, chunk_size: int, segment_ids=None, *, mode: str):
  """``recurrent._causal_running_max``'s (num, den, ref) by the resolved ``mode`` ("chunk"
  or "recurrent"; the fused kernel takes no key scales)."""
  if mode == "chunk":
    return chunk.causal_running_max(q, k, v, s, k_eps, chunk_size, segment_ids)
  if mode == "fused":
    raise ValueError("the fused kernel takes no key_log_scale.")
  return recurrent._causal_running_max(q, k, v, s, k_eps, chunk_size, segment_ids)
