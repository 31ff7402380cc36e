"""The table of every positional scheme's options (and which kernel reads which option),
printed by ``python -m fastpos.positional.compatibility --options``; read from each scheme's
``option_spec`` and the kernel registry, so it cannot drift from what the code accepts."""

from __future__ import annotations

from fastpos import positional
from fastpos.ops import features

HEADER = ("scheme", "option", "type", "default", "valid values", "meaning")


def _cell(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def rows() -> list[tuple[str, ...]]:
  """One row per (scheme, option): the ``HEADER`` columns, as text."""
  out = []
  for name, cls in positional.SCHEMES.items():
    for opt, spec in cls.option_spec.items():
      valid = spec.describe()
      if spec.used_doc:
        valid += f"; takes effect {spec.used_doc}"
      if spec.note:
        valid += f" ({spec.note})"
      out.append((name, opt, spec.field_annotation, repr(spec.default), valid, spec.doc))
  return out


def kernel_rows() -> list[tuple[str, str, str]]:
  """``(option, default, kernels that read it)`` for every kernel option."""
  return [
      (
          opt,
          repr(default),
          ", ".join(k for k in features.KERNELS if opt in features.get_kernel(k).options),
      )
      for opt, default in features.OPTION_DEFAULTS.items()
  ]


def markdown() -> str:
  lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
  lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows()]
  without = [n for n, cls in positional.SCHEMES.items() if not cls.option_spec]
  lines += ["", f"Schemes without options: {', '.join(without) or '(none)'}.", ""]
  lines += ["| kernel option | default | read by |", "|---|---|---|"]
  lines += ["| " + " | ".join(r) + " |" for r in kernel_rows()]
  return "\n".join(lines)
