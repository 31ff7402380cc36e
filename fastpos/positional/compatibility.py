"""Which kernel works with which positional scheme: the one place that decides.

``problem(kernel, scheme, ...)`` returns None for a compatible pair, else the reason;
``check(...)`` raises a ValueError naming the pair and the compatible choices, at
configuration time (before any parameter or compile). ``python -m
fastpos.positional.compatibility`` prints the whole kernel x scheme table; with ``--options``,
every scheme's options (type, default, valid values, meaning) instead.

Generic rules live here (a logits bias needs materialised scores, i.e. the softmax kernel;
causal / 1D / 2D support is declared by each scheme); kernel-specific rules live in each
scheme's ``compatibility`` classmethod.
"""

from __future__ import annotations

import sys
from typing import Mapping, Sequence

from fastpos import positional
from fastpos.ops import features

KERNELS = features.KERNELS


def problem(
    kernel: str | features.Kernel,
    scheme: str,
    *,
    causal: bool = False,
    two_d: bool = False,
    options: Mapping | None = None,
) -> str | None:
  """None when ``kernel`` (a name or the kernel's record) x ``scheme`` works in this setting,
  else the reason it does not; the scheme sees the record (``Scheme.compatibility``)."""
  info = features.get_kernel(kernel)
  cls = positional.get_class(scheme)
  options = dict(options or {})
  positional.check_options(scheme, options)
  unused = cls.unused_options(options, two_d=two_d)
  if unused:
    return f"{scheme!r} would ignore its option(s) {', '.join(unused)} here"
  if causal and not cls.supports_causal:
    return f"{scheme!r} has no causal form"
  if two_d and not cls.supports_2d:
    return f"{scheme!r} has no 2D form"
  if not two_d and not cls.supports_1d:
    return f"{scheme!r} has no 1D form"
  if "logits" in cls.hooks and not info.is_softmax:
    return (
        f"{scheme!r} adds a bias to the attention logits, which only the softmax kernel "
        f"materialises"
    )
  return cls.compatibility(info, causal=causal, two_d=two_d, options=options)


def compatible_kernels(scheme: str, **setting) -> list[str]:
  return [k for k in KERNELS if problem(k, scheme, **setting) is None]


def compatible_schemes(kernel: str, **setting) -> list[str]:
  return [s for s in positional.SCHEMES if problem(kernel, s, **setting) is None]


def check(
    kernel: str | features.Kernel,
    schemes: Sequence[str],
    *,
    causal: bool = False,
    two_d: bool = False,
    options: Mapping | None = None,
) -> None:
  """Raises ValueError for the first incompatible pair (``options``: per-scheme dicts)."""
  options = options or {}
  record = features.get_kernel(kernel)
  kernel = record.name
  for scheme in schemes:
    positional.get_class(scheme).check_used(options.get(scheme), two_d=two_d)
    setting = dict(causal=causal, two_d=two_d)
    why = problem(record, scheme, options=options.get(scheme), **setting)
    if why is not None:
      where = f"{'causal' if causal else 'bidirectional'} {'2D' if two_d else '1D'}"
      raise ValueError(
          f"kernel {kernel!r} x positional scheme {scheme!r} is incompatible ({where}): {why}. "
          f"Kernels that work with {scheme!r} here: "
          f"{', '.join(compatible_kernels(scheme, **setting)) or '(none)'}. Schemes that work "
          f"with {kernel!r} here: {', '.join(compatible_schemes(kernel, **setting))}."
      )
  embeds = [s for s in schemes if "embed" in positional.get_class(s).hooks]
  if len(embeds) > 1:
    raise ValueError(f"at most one embedding scheme per model; got {embeds}.")


def table(*, causal: bool, two_d: bool) -> tuple[list[str], list[list[str]], dict]:
  """(header, rows, reasons): one row per kernel, one column per scheme; a cell is "ok" or a
  note number whose reason is in ``reasons``."""
  header = ["kernel"] + list(positional.SCHEMES)
  rows, reasons, numbers = [], {}, {}
  for k in KERNELS:
    row = [k]
    for s in positional.SCHEMES:
      why = problem(k, s, causal=causal, two_d=two_d)
      if why is None:
        row.append("ok")
      else:
        if why not in numbers:
          numbers[why] = len(numbers) + 1
          reasons[numbers[why]] = why
        row.append(f"-{numbers[why]}")
    rows.append(row)
  return header, rows, reasons


def markdown(*, causal: bool, two_d: bool) -> str:
  header, rows, reasons = table(causal=causal, two_d=two_d)
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  lines += [""] + [f"-{n}: {why}" for n, why in reasons.items()]
  return "\n".join(lines)


def main(argv=None) -> int:
  if "--options" in (argv or [])[1:]:  # every scheme's options (and the kernels')
    from fastpos.positional import option_table  # pylint: disable=import-outside-toplevel

    print(option_table.markdown())
    return 0
  print(
      "Kernel x positional scheme. 'ok': supported and tested against dense references; "
      "'-n': incompatible, for reason n (a configuration error).\n"
  )
  for causal in (False, True):
    for two_d in (False, True):
      print(f"## {'causal' if causal else 'bidirectional'}, {'2D' if two_d else '1D'}\n")
      print(markdown(causal=causal, two_d=two_d))
      print()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
