"""The key of a module's fixed random draw: a seed folded with the crc32 of the module's path.

Modules that draw something once and keep it (the random-feature projection of an attention
layer, SPE's noise) key the draw by their module path: each layer gets its own draw, the same
at init, apply and decoding, with no state to store. Under ``nn.scan`` over the layers
(``model.scan_layers``) every layer runs one body with one path (``encoder/layers/...``), so
the path alone would give every layer one draw. The scanned body therefore runs inside
``scanned_layer(path, names, index)`` with its traced layer index, and ``fixed_key`` keys the
draw by the path the module has in the unrolled model (``encoder/block_{i}/...``): a static
table of the L crc32 values, read at the index. Scanned and unrolled models draw the same
numbers, and outside a scanned layer ``fixed_key`` is exactly
``fold_in(key(seed), crc32("/".join(path)))``, as it always was.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import zlib
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class _Scanned:
  path: tuple[str, ...]  # the scanned module's path, e.g. ("encoder", "layers")
  names: tuple[str, ...]  # the name of each iteration's module unrolled ("block_0", ...)
  index: Any  # the iteration being traced: an int32 scalar


_ACTIVE: contextvars.ContextVar[_Scanned | None] = contextvars.ContextVar(
    "scanned_layer", default=None
)


@contextlib.contextmanager
def scanned_layer(path: Sequence, names: Sequence[str], index) -> Iterator[None]:
  """Within this block, modules under ``path`` (the scanned module's path) key their fixed
  draws as if that module were named ``names[index]`` (``index``: the traced iteration, an
  int32 scalar; ``names``: one per iteration, e.g. ``block_0`` ... ``block_{L-1}``)."""
  if not names:
    raise ValueError("scanned_layer: names is empty; give the unrolled name of each iteration.")
  token = _ACTIVE.set(_Scanned(tuple(str(p) for p in path), tuple(names), index))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def path_fold(path: Sequence):
  """The crc32 of ``path`` joined by "/" as the unrolled model names it: a Python int outside
  a scanned layer, else the uint32 entry of the scanned iteration (traced)."""
  path = tuple(str(p) for p in path)
  scan = _ACTIVE.get()
  if scan is None or path[: len(scan.path)] != scan.path:
    return zlib.crc32("/".join(path).encode())
  head, tail = scan.path[:-1], path[len(scan.path) :]
  table = [zlib.crc32("/".join((*head, name, *tail)).encode()) for name in scan.names]
  return jnp.asarray(table, jnp.uint32)[scan.index]


def fixed_key(module, seed: int):
  """The key of ``module``'s fixed draw: ``fold_in(key(seed), path_fold(its path))``."""
  return jax.random.fold_in(jax.random.key(seed), path_fold(module.scope.path))
