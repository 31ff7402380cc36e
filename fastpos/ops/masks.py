"""The one check every op, layer and model runs on an attention mask.

Policy: a mask is a **boolean** array, True for a real token (a key that may be attended to)
and False for padding. Nothing else is accepted, and nothing is converted: a float or integer
mask raises ``ValueError``. Its dtype does not tell what it means (a 0/1 mask keeps the 1s, an
additive 0/-inf mask keeps the 0s), and under ``jax.jit`` its values cannot be looked at, so
any conversion could silently invert it. Convert at the source: ``mask.astype(bool)`` for a
0/1 mask, ``mask == 0`` for an additive one.

The check reads static dtypes and shapes only, so under ``jax.jit`` it runs once at trace time
and costs nothing per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np


def check_mask(
    mask,
    shape: Sequence[int | None] | None,
    *,
    name: str = "mask",
    layout: str = "[batch, length]",
    against: str = "",
):
  """Validates a boolean mask; returns it (array-likes such as nested lists as a jax array).

  Args:
    mask: the mask, or None (no padding; returned as is).
    shape: the expected shape; a None entry matches any size; None skips the shape check.
    name: how the caller's argument is called in messages (e.g. ``"memory_mask"``).
    layout: the meaning of the axes, for messages.
    against: what the expected shape comes from (e.g. ``"k of shape (2, 5, 3, 4)"``).

  Raises:
    ValueError: the mask is not boolean, or its shape is not ``shape``; the message names the
      argument, what was received and what is accepted.
  """
  if mask is None:
    return None
  if not hasattr(mask, "dtype") or not hasattr(mask, "shape"):
    mask = jnp.asarray(mask)
  if mask.dtype != np.bool_:
    raise ValueError(
        f"{name} must be a boolean array {layout} (True = real token); got {mask.dtype}. "
        f"Convert a 0/1 mask with {name}.astype(bool); an additive 0/-inf mask with "
        f"{name} == 0."
    )
  got = tuple(mask.shape)
  if shape is not None:
    shape = tuple(shape)
    if len(got) != len(shape) or any(e is not None and e != g for e, g in zip(shape, got)):
      sizes = ", ".join("*" if e is None else str(e) for e in shape)
      expected = f"({sizes},)" if len(shape) == 1 else f"({sizes})"
      source = f" to match {against}" if against else ""
      raise ValueError(
          f"{name} must be {layout}={expected} with True for real tokens{source}; got shape "
          f"{got}."
      )
  return mask
