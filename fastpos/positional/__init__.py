"""Positional schemes, one module each, all following ``fastpos.positional.base``.

Each module exports ``SCHEMES = {name: SchemeClass}``; this registry merges them. Build a
scheme with ``build(name, dims, options)``, which checks the option names first.
"""

from __future__ import annotations

import importlib
import re
from typing import Mapping

from fastpos.positional.base import (
    Context,
    Dims,
    KernelInfo,
    KVMix,
    Option,
    Scheme,
    center_slice,
    center_slice_2d,
    offset_rows,
    positions_2d,
)

# Modules holding schemes, in the order of the compatibility table.
SCHEME_MODULES = (
    "none",
    "absolute",
    "fastrpb",
    "kernelized_rpe",
    "rope",
    "lrpe",
    "permuteformer",
    "spe",
    "t5_bias",
    "transformer_xl",
)


def _collect() -> dict[str, type[Scheme]]:
  schemes: dict[str, type[Scheme]] = {}
  for mod in SCHEME_MODULES:
    module = importlib.import_module(f"fastpos.positional.{mod}")
    for name, cls in module.SCHEMES.items():
      if name in schemes:
        raise RuntimeError(f"positional scheme {name!r} is registered twice.")
      schemes[name] = cls
  return schemes


SCHEMES: dict[str, type[Scheme]] = _collect()


def get_class(name: str) -> type[Scheme]:
  if name not in SCHEMES:
    raise ValueError(f"unknown positional scheme {name!r}; valid choices: {', '.join(SCHEMES)}.")
  return SCHEMES[name]


def option_names(name: str) -> tuple[str, ...]:
  """The options scheme ``name`` accepts (its ``option_spec``)."""
  return tuple(get_class(name).option_spec)


def check_options(name: str, options: Mapping) -> None:
  """Raises ValueError for an option name scheme ``name`` does not have (values are checked by
  ``Scheme.resolve_options`` when the scheme is used)."""
  get_class(name).check_option_names(options)


def build(scheme: str, dims: Dims, options: Mapping | None = None, **module_kwargs) -> Scheme:
  """A scheme module; ``module_kwargs`` are linen's (``name=``, ``parent=``)."""
  options = dict(options or {})
  check_options(scheme, options)
  return get_class(scheme)(dims=dims, **options, **module_kwargs)


def parse_names(positional: str | tuple | list) -> tuple[str, ...]:
  """``"fastrpb,rope"`` / ``"absolute+fastrpb"`` or a sequence -> validated names.

  Names are separated by "," or "+" (the "+" form fits in a sweep grid, whose values are
  comma-separated); ``"none"`` / ``""`` -> ().
  """
  if isinstance(positional, str):
    names = tuple(s.strip() for s in re.split(r"[,+]", positional) if s.strip())
  else:
    names = tuple(positional)
  for n in names:
    get_class(n)
  if len(set(names)) != len(names):
    raise ValueError(f"positional scheme listed twice: {positional!r}.")
  return tuple(n for n in names if n != "none")


__all__ = [
    "Context",
    "Dims",
    "KernelInfo",
    "KVMix",
    "Option",
    "Scheme",
    "SCHEMES",
    "build",
    "center_slice",
    "center_slice_2d",
    "check_options",
    "get_class",
    "offset_rows",
    "option_names",
    "parse_names",
    "positions_2d",
]
