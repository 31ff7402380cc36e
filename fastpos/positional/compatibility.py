"""What runs: the one place that decides whether a kernel x schemes x setting runs, and how.

``plan(kernel, schemes, setting)`` returns the execution ``Plan`` of an attention layer, or
raises ValueError naming the bad value and the valid choices, before any parameter or compile.
It reads only what kernels and schemes declare: the kernel's record
(``fastpos.ops.features.Kernel``: ``is_softmax``, ``nonnegative``, ``scaled_keys``,
``stabilised``, what its map ``reads``) and the fused kernel's ``supports``; each scheme's
class attributes (``hooks``, ``feature_stage``, ``supports_causal`` / ``_1d`` / ``_2d``,
``keeps_nonnegative``, ``permutes_features``, ``packs``, ``packing_note``,
``linear_hint``, an ``output_table``), its ``kv_terms`` and its kernel-specific rule
``Scheme.compatibility``. The attention layer plans its config once at construction
(``Setting`` of the config: causal, 1D / 2D, ``attn_chunk``, ``mode``) and again, from a cache,
when a call adds what only the call knows (a packed batch, a split sequence, memory, a decoding
step); it then trusts the plan.

``python -m fastpos.positional.compatibility`` prints the tables of what runs (the kernel x
scheme table per causal / 1D / 2D, then the settings), which ``docs/compatibility.md`` holds;
with ``--options``, every scheme's options (type, default, valid values, meaning) instead.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Mapping, Sequence

from fastpos import positional
from fastpos.ops import features
from fastpos.ops.linear_attn import common as linear_attn_common

KERNELS = features.KERNELS
MODES = linear_attn_common.MODES
# The hooks a layer run by chunks of the sequence runs (``embed`` schemes act in the Tower).
CHUNKED_HOOKS = ("output", "embed")
# Key feature maps whose arguments do not tie a key to others (``FeatureMap.reads``).
_PER_TOKEN_READS = frozenset({"projection", "nu"})


@dataclasses.dataclass(frozen=True)
class Setting:
  """Where an attention layer runs.

  Attributes:
    causal: query i sees keys j <= i only.
    two_d: the input is an image grid (2D positions), else a 1D sequence.
    attn_chunk: > 0: the layer runs by chunks of this many tokens (``model.attn_chunk``).
    seq: the number of devices the sequence is split over (``mesh.seq``; 1: not split; None:
      not known yet, as when a config is built outside the mesh: the split sequence's rules
      and the fused kernel's wait for the call).
    packed: the batch packs several sequences per row (segment ids).
    memory: the keys include a Transformer-XL memory.
    decoding: a decoding step against a cache.
    mode: causal linear attention's algorithm (``fastpos.ops.linear_attn``).
  """

  causal: bool = False
  two_d: bool = False
  attn_chunk: int = 0
  seq: int | None = 1
  packed: bool = False
  memory: bool = False
  decoding: bool = False
  mode: str = "auto"

  def where(self) -> str:
    return f"{'causal' if self.causal else 'bidirectional'} {'2D' if self.two_d else '1D'}"


@dataclasses.dataclass(frozen=True)
class Plan:
  """What runs for a kernel x schemes in a setting (``plan``).

  Attributes:
    kernel: the kernel's record.
    schemes: the scheme names, in order.
    setting: the ``Setting`` planned for.
    path: ``"softmax"`` (materialised scores) or ``"linear"`` (feature maps).
    runs: ``"whole"`` (the whole sequence at once), ``"chunks"`` (``attn_chunk``), ``"split"``
      (over the ``seq`` devices), ``"decoding"`` (a step against the cache), or None where
      the setting leaves it open (``seq=None``).
    split: the sequence is split over devices (with ``"chunks"``: each device chunks its
      block).
    kv: the ``kv`` hooks' terms, a subset of ``("table", "decay")``.
    den_features: the linear path's denominator keeps its features apart (a post_phi scheme
      whose features can be negative).
    key_scales: the causal linear path keeps the keys' scale apart (a running maximum;
      ``Kernel.scaled_keys`` kernels without kv terms or a sign-changing post_phi scheme).
    algorithm: the causal linear algorithm the setting's ``mode`` asks for, None where the
      path takes none (softmax, bidirectional, chunks, split, decoding).
  """

  kernel: features.Kernel
  schemes: tuple[str, ...]
  setting: Setting
  path: str
  runs: str | None
  split: bool = False
  kv: tuple[str, ...] = ()
  den_features: bool = False
  key_scales: bool = False
  algorithm: str | None = None


def _classes(schemes) -> list[type[positional.Scheme]]:
  return [positional.get_class(s) for s in schemes]


# ---------------------------------------------------------------------------------------------
# The rules, one per part of the setting; each returns None or the reason (one phrase).
# ---------------------------------------------------------------------------------------------
def problem(
    kernel: str | features.Kernel,
    scheme: str,
    *,
    causal: bool = False,
    two_d: bool = False,
    options: Mapping | None = None,
) -> str | None:
  """None when ``kernel`` (a name or the kernel's record) x ``scheme`` works causal or not, in
  1D or 2D, else the reason it does not (the cell of the kernel x scheme table)."""
  cls = positional.get_class(scheme)
  options = dict(options or {})
  unused = cls.unused_options(options, two_d=two_d)  # validates the options first
  if unused:
    return f"{scheme!r} would ignore its option(s) {', '.join(unused)} here"
  return _pair_problem(features.get_kernel(kernel), cls, causal, two_d, options)


def _pair_problem(info: features.Kernel, cls, causal: bool, two_d: bool, options) -> str | None:
  """``problem`` for options already checked (``Scheme.check_used``)."""
  scheme = cls.scheme_name
  if causal and not cls.supports_causal:
    return f"{scheme!r} has no causal form"
  if two_d and not cls.supports_2d:
    return f"{scheme!r} has no 2D form"
  if not two_d and not cls.supports_1d:
    return f"{scheme!r} has no 1D form"
  if "logits" in cls.hooks and not info.is_softmax:
    hint = f"; use {cls.linear_hint}" if cls.linear_hint else ""
    return (
        f"{scheme!r} adds a bias to the attention logits, which only the softmax kernel "
        f"materialises{hint}"
    )
  return cls.compatibility(info, causal=causal, two_d=two_d, options=options)


def chunk_problem(kernel: features.Kernel, schemes, *, two_d: bool) -> str | None:
  """Why a layer cannot run by chunks of the sequence (``attn_chunk``), or None."""
  if kernel.is_softmax:
    return "kernel 'softmax' materialises the N x N scores (chunking is for linear kernels)"
  if two_d:
    return "2D grids are not built by chunks (set model.use_grid=False for a raster sequence)"
  if not kernel.stabilised and not set(kernel.map.reads) <= _PER_TOKEN_READS:
    return (
        f"kernel {kernel.name!r} reads other keys in its key features, which is built by "
        "chunks for the maps acting on each key alone and for a stabilising max shared by "
        "the keys (sikf, favor, orf)"
    )
  for cls in _classes(schemes):
    other = [hk for hk in cls.hooks if hk not in CHUNKED_HOOKS]
    if other:
      return (
          f"positional scheme {cls.scheme_name!r} acts at the {other[0]!r} hook (chunked layers "
          f"run schemes at the output hook only)"
      )
  return None


def _split_scheme_problem(cls) -> str | None:
  """Why scheme class ``cls`` cannot run on a split sequence (None when it can), by hook."""
  for hook in cls.hooks:
    if hook == "logits":
      return "its logits hook biases materialised softmax scores"
    if hook == "features" and cls.feature_stage == "pre_phi":
      return "its features hook acts before the feature map on processes spanning the sequence"
    if hook == "output" and not hasattr(cls, "output_table"):
      return "its output hook is not a Toeplitz product (no output_table)"
  return None


def split_problem(kernel: features.Kernel, schemes, *, two_d: bool) -> str | None:
  """Why a layer cannot run on a sequence split over devices, or None."""
  if kernel.is_softmax:
    return "kernel 'softmax' materialises the N x N scores (ring attention is not built)"
  if two_d:
    return "2D grids are not split (set model.use_grid=False to treat the image as a sequence)"
  for cls in _classes(schemes):
    why = _split_scheme_problem(cls)
    if why is not None:
      return f"positional scheme {cls.scheme_name!r}: {why}"
  return None


def packable(kernel: str | features.Kernel) -> list[str]:
  """The schemes that pack with ``kernel`` (their ``packs`` names its path)."""
  path = "softmax" if features.get_kernel(kernel).is_softmax else "linear"
  return [s for s, cls in positional.SCHEMES.items() if path in cls.packs]


def packing_problem(kernel: features.Kernel, schemes, setting: Setting) -> str | None:
  """Why a packed batch (segment ids) cannot run exactly, or None."""
  if (setting.seq or 1) > 1:
    return "the sequence is split over the mesh's seq axis"
  if setting.two_d:
    return "2D (grid) inputs have no sequences to pack"
  if setting.memory:
    return "a Transformer-XL memory carries states across rows"
  path = "softmax" if kernel.is_softmax else "linear"
  bad = [cls for cls in _classes(schemes) if path not in cls.packs]
  if not bad:
    return None
  notes = []
  for cls in bad:
    on = "with a linear kernel " if "softmax" in cls.packs else ""
    notes.append(f"scheme {cls.scheme_name!r}: {on}{cls.packing_note}")
  return "; ".join(notes)


def memory_problem(kernel: features.Kernel, schemes, options, *, causal: bool) -> str | None:
  """Why a Transformer-XL memory (keys ``[memory, current segment]``) cannot run, or None."""
  if not kernel.is_softmax:
    return f"needs the softmax kernel; got kernel {kernel.name!r}"
  kv = [s for s in schemes if kv_terms([s], options, causal=causal)]
  if kv:
    return (
        f"cannot run with positional scheme {kv[0]!r}: its kv terms are materialised over the "
        "current segment's keys only (schemes that run with memory: those without kv terms)"
    )
  return None


def kv_terms(schemes, options: Mapping, *, causal: bool) -> tuple[str, ...]:
  """The ``kv`` hooks' terms of ``schemes`` (``Scheme.kv_terms``): ``"table"`` and / or
  ``"decay"``."""
  terms = set()
  for cls in _classes(schemes):
    if "kv" in cls.hooks:
      terms |= set(cls.kv_terms(options.get(cls.scheme_name), causal=causal))
  return tuple(t for t in ("table", "decay") if t in terms)


def _linear_flags(kernel, schemes, options, setting) -> dict:
  """The whole-sequence linear path's inputs beside phi(q), phi(k), v."""
  kv = kv_terms(schemes, options, causal=setting.causal)
  post = [
      cls
      for cls in _classes(schemes)
      if "features" in cls.hooks and cls.feature_stage == "post_phi"
  ]
  den = any(not cls.keeps_nonnegative for cls in post)
  scaled = (
      setting.causal
      and kernel.scaled_keys
      and not kv
      and setting.seq == 1
      and all(cls.permutes_features for cls in post)
  )
  return dict(kv=kv, den_features=den, key_scales=scaled)


def mode_problem(setting: Setting, flags: dict) -> str | None:
  """Why ``setting.mode`` cannot run this cell (mode "fused": what the fused kernel's
  ``supports`` refuses), or None."""
  if setting.mode != "fused":
    return None
  fused = importlib.import_module("fastpos.ops.linear_attn.fused")
  return fused.supports(
      segments=setting.packed,
      key_scales=flags["key_scales"],
      den_features=flags["den_features"],
      rpe="table" in flags["kv"],
  )


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
def _schemes_that_work(kernel: features.Kernel, setting: Setting) -> list[str]:
  pair = dict(causal=setting.causal, two_d=setting.two_d)
  return [s for s in positional.SCHEMES if problem(kernel, s, **pair) is None]


class Refusal(ValueError):
  """``plan``'s error: the message (naming the bad value and the valid choices) and
  ``reason``, its short phrase (what the tables print)."""

  def __init__(self, message: str, reason: str):
    super().__init__(message)
    self.reason = reason


def _check_pairs(kernel, schemes, options, setting) -> None:
  pair = dict(causal=setting.causal, two_d=setting.two_d)
  for scheme in schemes:
    cls = positional.get_class(scheme)
    cls.check_used(options.get(scheme), two_d=setting.two_d)  # validates the options too
    why = _pair_problem(kernel, cls, setting.causal, setting.two_d, options.get(scheme, {}))
    if why is not None:
      kernels = [k for k in KERNELS if problem(k, scheme, **pair) is None]
      raise Refusal(
          f"kernel {kernel.name!r} x positional scheme {scheme!r} is incompatible "
          f"({setting.where()}): {why}. Kernels that work with {scheme!r} here: "
          f"{', '.join(kernels) or '(none)'}. Schemes that work with {kernel.name!r} here: "
          f"{', '.join(_schemes_that_work(kernel, setting))}.",
          why,
      )
  embeds = [s for s in schemes if "embed" in positional.get_class(s).hooks]
  if len(embeds) > 1:
    raise ValueError(f"at most one embedding scheme per model; got {embeds}.")


def _check_mode(setting) -> None:
  if setting.mode not in MODES:
    raise ValueError(
        f"AttentionConfig: mode must be one of {', '.join(repr(m) for m in MODES)}; got "
        f"{setting.mode!r}."
    )
  if setting.mode == "fused" and not setting.causal:
    raise Refusal(
        "AttentionConfig: mode='fused' is built for causal linear attention only; a "
        "bidirectional layer runs with mode='auto', 'chunk' or 'recurrent' (the same path).",
        "mode='fused' is built for causal linear attention only",
    )


def _cell(kernel, schemes) -> str:
  return f"kernel {kernel.name!r}, schemes {', '.join(schemes) or 'none'}"


def _check_setting(kernel, schemes, options, setting) -> None:
  """The refusals of the parts of ``setting`` beyond causal / 1D / 2D, in the order a layer
  meets them."""
  if setting.attn_chunk:
    why = chunk_problem(kernel, schemes, two_d=setting.two_d)
    if why is not None:
      raise Refusal(
          f"AttentionConfig: attn_chunk={setting.attn_chunk} runs the layer by chunks of the "
          f"sequence, which this layer cannot do: {why}. Use attn_chunk=0.",
          why,
      )
  if setting.memory:
    why = memory_problem(kernel, schemes, options, causal=setting.causal)
    if why is not None:
      raise Refusal(f"memory (Transformer-XL) {why}.", f"memory {why}")
  if setting.packed:
    why = packing_problem(kernel, schemes, setting)
    if why is not None:
      raise Refusal(
          f"packed batches (segment_ids) cannot run exactly on this model "
          f"({_cell(kernel, schemes)}): {why}. Packing runs the softmax kernel with schemes "
          f"{', '.join(packable('softmax'))} and the linear kernels with "
          f"{', '.join(packable('elu1'))}; run it unpacked (classification tasks: "
          "config.data.bucket_lengths).",
          why,
      )
    if setting.attn_chunk:
      raise Refusal(
          f"attn_chunk={setting.attn_chunk}: a packed batch (segment ids) is not run by "
          "chunks; use attn_chunk=0 with packing.",
          "a packed batch is not run by chunks",
      )
  if (setting.seq or 1) > 1:
    why = split_problem(kernel, schemes, two_d=setting.two_d)
    if why is not None:
      kernels = [k for k in KERNELS if not features.get_kernel(k).is_softmax]
      ok = [s for s, cls in positional.SCHEMES.items() if _split_scheme_problem(cls) is None]
      raise Refusal(
          f"mesh.seq={setting.seq} splits each sequence over {setting.seq} devices, which "
          f"this model ({_cell(kernel, schemes)}) cannot do: {why}. Split sequences support "
          f"the kernels {', '.join(kernels)} with the 1D schemes {', '.join(ok)}; use "
          "mesh.seq=1 otherwise.",
          why,
      )
  if setting.decoding:
    if setting.two_d:
      raise Refusal(
          "decoding is defined for 1D causal models; the layer was built 2D.",
          "decoding is defined for 1D sequences",
      )
    if not setting.causal:
      raise Refusal("decoding needs a causal (lm) model.", "decoding needs a causal (lm) model")


def plan(
    kernel: str | features.Kernel,
    schemes: Sequence[str] = (),
    setting: Setting = Setting(),
    *,
    options: Mapping | None = None,
) -> Plan:
  """The execution plan of an attention layer with ``kernel`` (a name or its record) and the
  scheme names ``schemes`` (in order; ``options``: ``{scheme: {option: value}}``) in
  ``setting``, or ValueError naming the bad kernel, scheme, option or setting and the valid
  choices (every check before any compute).

  Example::

      from fastpos.positional import compatibility as compat
      p = compat.plan("sikf", ["fastrpb"], compat.Setting(causal=True))
      p.path, p.runs, p.key_scales                  # ('linear', 'whole', True)
      compat.refusal("softmax", ["t5_bias"])        # None
      compat.refusal("elu1", ["t5_bias"]) is None   # False
  """
  kernel, schemes = features.get_kernel(kernel), tuple(schemes)
  opts = {k: dict(v or {}) for k, v in (options or {}).items()}
  for scheme in opts:
    if scheme not in schemes:
      raise ValueError(
          f"options given for positional scheme {scheme!r}, which is not among the schemes "
          f"{', '.join(schemes) or '(none)'}."
      )
  _check_mode(setting)
  _check_pairs(kernel, schemes, opts, setting)
  _check_setting(kernel, schemes, opts, setting)
  path = "softmax" if kernel.is_softmax else "linear"
  if setting.decoding:
    runs = "decoding"
  elif setting.attn_chunk:
    runs = "chunks"
  elif setting.seq is None:
    runs = None
  elif setting.seq > 1:
    runs = "split"
  else:
    runs = "whole"
  split = (setting.seq or 1) > 1
  if path == "softmax":
    return Plan(kernel, schemes, setting, path, runs, split)
  flags = _linear_flags(kernel, schemes, opts, setting)
  algorithm = None
  if runs == "whole" and setting.causal:
    why = mode_problem(setting, flags)
    if why is not None:
      raise Refusal(
          f"mode='fused' does not run this cell ({_cell(kernel, schemes)}): {why}. Modes "
          "'chunk' and 'recurrent' (and 'auto') run every cell.",
          why,
      )
    algorithm = setting.mode
  if runs != "whole":
    flags["key_scales"] = False
  return Plan(kernel, schemes, setting, path, runs, split, algorithm=algorithm, **flags)


def refusal(
    kernel: str | features.Kernel,
    schemes: Sequence[str] = (),
    setting: Setting = Setting(),
    *,
    options: Mapping | None = None,
) -> str | None:
  """None when ``plan`` plans the cell, else the reason (``Refusal.reason``) for which ``plan``
  raises."""
  try:
    plan(kernel, schemes, setting, options=options)
  except Refusal as e:
    return e.reason
  return None


# ---------------------------------------------------------------------------------------------
# The tables, printed from the plan
# ---------------------------------------------------------------------------------------------
def table(setting: Setting) -> tuple[list[str], list[list[str]], dict]:
  """(header, rows, reasons): one row per kernel, one column per scheme; a cell is "ok" or a
  note number whose reason is in ``reasons``."""
  header = ["kernel"] + list(positional.SCHEMES)
  rows, reasons, numbers = [], {}, {}
  for k in KERNELS:
    row = [k]
    for s in positional.SCHEMES:
      why = refusal(k, [s] if s != "none" else [], setting)
      if why is None:
        row.append("ok")
        continue
      if why not in numbers:
        numbers[why] = len(numbers) + 1
        reasons[numbers[why]] = why
      row.append(f"-{numbers[why]}")
    rows.append(row)
  return header, rows, reasons


def markdown(setting: Setting) -> str:
  header, rows, reasons = table(setting)
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  lines += [""] + [f"-{n}: {why}" for n, why in reasons.items()]
  return "\n".join(lines)


# The settings beyond causal / 1D / 2D the tables show, each on the setting where it applies.
SETTINGS = {
    "by chunks (attn_chunk=64), bidirectional 1D": Setting(attn_chunk=64),
    "split over 2 devices (mesh.seq=2), causal 1D": Setting(causal=True, seq=2),
    "packed (segment ids), causal 1D": Setting(causal=True, packed=True),
    "decoding, causal 1D": Setting(causal=True, decoding=True),
    "mode='fused', causal 1D": Setting(causal=True, mode="fused"),
}


def report() -> str:
  """Every table: kernel x scheme per causal / 1D / 2D, then per setting of ``SETTINGS``."""
  out = [
      "Kernel x positional scheme x setting. 'ok': runs (each kernel x scheme cell is held "
      "to dense references by tests/models/test_cells.py); '-n': refused before any compute, "
      "for reason n.\n"
  ]
  for causal in (False, True):
    for two_d in (False, True):
      setting = Setting(causal=causal, two_d=two_d)
      out += [f"## {setting.where()}\n", markdown(setting), ""]
  for title, setting in SETTINGS.items():
    out += [f"## {title}\n", markdown(setting), ""]
  return "\n".join(out)


def main(argv=None) -> int:
  if "--options" in (argv or [])[1:]:  # every scheme's options (and the kernels')
    from fastpos.positional import option_table  # pylint: disable=import-outside-toplevel

    print(option_table.markdown())
    return 0
  print(report(), end="")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
