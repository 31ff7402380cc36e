"""The contract every positional scheme follows: its hooks, what it sees, how it is built.

A scheme is a Flax linen module that acts at one or more of five places (README,
"Design"). The attention layer and the models call each hook
at its place and never look at a scheme's name:

| hook       | method                              | returns                                      |
|------------|-------------------------------------|----------------------------------------------|
| ``embed``    | ``embed(x, ctx)``  x ``[b, N, D]``    | new embeddings ``[b, N, D]``                   |
| ``features`` | ``features(q, k, ctx)``             | new ``(q, k)``, q ``[b, Lq, h, f]``, k ``[b, Lk, h, f]`` |
| ``logits``   | ``logits(q, k, ctx)``          | ``[b|1, h|1, Lq, Lk]`` added to the *scaled* logits (softmax only) |
| ``kv``       | ``kv(ctx)``                     | a ``KVMix``: log weights ``b_{j-i}`` and/or a causal decay |
| ``output``   | ``output(v, ctx)``  v ``[b, N, h, d]`` | ``[b, N, h, d]`` added to the attention output |

``features`` schemes say at which stage they act (``feature_stage``): ``"pre_phi"`` on the raw
q, k (before the feature map of a linear kernel), or ``"post_phi"`` on phi(q), phi(k) (for the
softmax kernel both stages act on q, k). A post-phi scheme whose output can be negative
(``keeps_nonnegative = False``, e.g. rotations) only transforms the numerator's features; the
linear-attention denominator then uses the features without it, so it stays positive.

Parameters are created in ``setup()`` from ``dims`` (static sizes: heads, head dim, feature
dim, the longest length and the largest grid), so one set of parameters serves every
sequence length up to ``dims.max_length``; tables indexed by offset are sliced to the batch's
length with ``center_slice`` / ``center_slice_2d``.
"""  # noqa: E501 (the hook table's rows are wider than a line)

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Callable, ClassVar, Mapping, Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from fastpos.ops.features import Kernel
from fastpos.ops.masks import check_mask

HOOKS = ("embed", "features", "logits", "kv", "output")
FEATURE_STAGES = ("pre_phi", "post_phi")


# What a scheme may know of the kernel it is paired with: the kernel's one record (name,
# options and facts such as ``is_softmax`` and ``nonnegative``), under the name schemes use.
KernelInfo = Kernel


@dataclasses.dataclass(frozen=True)
class Dims:
  """Static sizes a scheme is built for.

  Attributes:
    num_heads: h.
    head_dim: d, the size of q, k, v per head.
    feature_dim: f, the size the post-phi ``features`` hook sees: d for softmax, m (the feature
      map's output size) for linear kernels.
    embed_dim: D, the model width (the ``embed`` hook's input size).
    max_length: the longest sequence N the parameters must serve (1D offset tables have
      2 * max_length - 1 entries).
    grid: the largest image grid (H, W) for 2D tasks, None for 1D tasks.
    causal: whether the model is causal (a decoder).
    kernel: the kernel the layer uses (its record, ``fastpos.ops.features.Kernel``).
  """

  num_heads: int
  head_dim: int
  feature_dim: int
  embed_dim: int
  max_length: int
  grid: tuple[int, int] | None = None
  causal: bool = False
  kernel: Kernel = Kernel("softmax")


@dataclasses.dataclass(frozen=True)
class Context:
  """What a hook sees at call time.

  Attributes:
    mask: ``[batch, Lk]`` bool, True for real tokens, or None (no padding). Boolean only (any
      other dtype raises ValueError, ``fastpos.ops.masks``); with ``length`` set its last axis
      must be ``memory_length + length``.
    grid: the (H, W) grid of this batch (H * W == N), or None for 1D inputs.
    causal: query i sees keys j <= i only (raster order on a grid).
    reference: compute with dense O(N^2) references instead of fast paths (tests hold the
      two together).
    deterministic: no dropout / no feature redraw.
    length: Lq, the number of queries (sequence length) of this batch.
    memory_length: M, the number of memory keys that precede the Lq queries (Transformer-XL
      decoder); keys are ``[memory, current segment]`` and Lk = M + Lq.
    offset: None, or a decoding step (``fastpos.models.decoding``): the absolute position of
      the first of the Lq new tokens (an int32 scalar, traced under jit). ``embed`` and
      ``features`` then see the new tokens only (queries and keys both at ``offset + i``);
      ``logits`` and ``output`` see the whole cache as keys / values at slots 0..Lk-1 (slot =
      position; slots after a query's position are masked by the layer).
  """

  mask: Any = None
  grid: tuple[int, int] | None = None
  causal: bool = False
  reference: bool = False
  deterministic: bool = True
  length: int = 0
  memory_length: int = 0
  offset: Any = None

  def __post_init__(self):
    # Static dtype and shape only: free under jit, and hooks may then trust the mask.
    keys = self.memory_length + self.length if self.length else None
    check_mask(self.mask, (None, keys), name="Context.mask", layout="[batch, Lk]")


@dataclasses.dataclass(frozen=True)
class KVMix:
  """A scheme's weights on the key sum ``sum_j c_{j-i} phi(k_j) v_j^T`` (and denominator).

  Attributes:
    log_table: ``b`` with ``c = exp(b)``: ``[heads, 2N-1]`` by offset j-i (index j-i+N-1), or
      ``[heads, 2H-1, 2W-1]`` by (row offset, col offset) on a grid. With the softmax kernel
      it is added to the logits (a T5-style bias; exact).
    log_decay: ``[heads]`` log r <= 0 of a causal decay ``r^(i-j)`` (j <= i), or None.
  """

  log_table: Any = None
  log_decay: Any = None


# ---------------------------------------------------------------------------------------------
# Options: one declarative spec per scheme, one validator.
# ---------------------------------------------------------------------------------------------
OPTION_TYPES = ("bool", "int", "number", "str", "any")
_ANNOTATIONS = {"bool": "bool", "int": "int", "number": "float", "str": "str", "any": "Any"}
# A value's Python type by option type ("number": numbers.Real, so an int stays an int).
_VALUE_TYPES = {"bool": bool, "int": int, "number": numbers.Real, "str": str, "any": object}


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x) -> bool:
  return (
      isinstance(x, (int, float, np.integer, np.floating))
      and not isinstance(x, (bool, np.bool_))
      and math.isfinite(x)
  )


_TYPE_CHECKS = {
    "bool": lambda x: isinstance(x, (bool, np.bool_)),
    "int": _is_int,
    "number": _is_number,
    "str": lambda x: isinstance(x, str),
    "any": lambda x: True,
}


@dataclasses.dataclass(frozen=True)
class Option:
  """One option of a scheme: its type, default, valid values and meaning.

  Attributes:
    default: the value when the option is not given.
    doc: what the option does (one line).
    type: one of ``OPTION_TYPES`` ("number": a finite int or float; "any": only ``check``).
    choices: the valid values, or a mapping value -> short description.
    low, high: a range (inclusive unless ``low_open`` / ``high_open``).
    even: the integer must be even.
    none_ok: None is valid too (it means the documented default behaviour).
    check: a predicate for values a type and range cannot say (e.g. a number or a sequence).
    valid: the valid values in words, where the generated description does not say enough.
    note: appended to the error in parentheses (e.g. the paper's value).
    annotation: the field's type annotation (derived from ``type`` unless given).
    used_when: a predicate ``(options, two_d) -> bool`` (all options, defaults filled in):
      whether the option takes effect; a value other than the default where it does not is
      refused (``Scheme.check_used``) rather than ignored.
    used_doc: when the option takes effect, in words (for that error).

  Example::

      slope = fastpos.Option(0.5, "slope of head 0", type="number", low=0, low_open=True)
      slope.is_valid(0.25), slope.is_valid(-1.0)          # (True, False)
      slope.describe()                                     # 'a finite number > 0'
  """

  default: Any
  doc: str
  type: str = "any"
  choices: tuple | Mapping | None = None
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  even: bool = False
  none_ok: bool = False
  check: Callable[[Any], bool] | None = None
  valid: str = ""
  note: str = ""
  annotation: str = ""
  used_when: Callable[[Mapping, bool], bool] | None = None
  used_doc: str = ""

  def __post_init__(self):
    if self.type not in OPTION_TYPES:
      raise ValueError(f"Option type {self.type!r}; valid choices: {', '.join(OPTION_TYPES)}.")

  @property
  def value_type(self) -> type:
    """The Python type of a value (the type of the option's field on the command line,
    ``--config.model.positional_options.<scheme>.<option>``)."""
    return _VALUE_TYPES[self.type]

  @property
  def field_annotation(self) -> str:
    base = self.annotation or _ANNOTATIONS[self.type]
    return f"{base} | None" if self.none_ok and "None" not in base else base

  def describe(self) -> str:
    """The valid values in words (the error message's "must be ...")."""
    if self.choices is not None:
      return "one of " + self.choice_list()
    if self.valid:
      return self.valid
    words = {
        "bool": "True or False",
        "int": "an even integer" if self.even else "an integer",
        "number": "a finite number",
        "str": "a string",
        "any": "a valid value",
    }[self.type]
    if self.low is not None:
      words += f" {'>' if self.low_open else '>='} {self.low:g}"
    if self.high is not None:
      words += f"{' and' if self.low is not None else ''} {'<' if self.high_open else '<='} "
      words += f"{self.high:g}"
    if self.none_ok:
      words = "None, True or False" if self.type == "bool" else f"None or {words}"
    return words

  def choice_list(self) -> str:
    if isinstance(self.choices, Mapping):
      return ", ".join(
          f"{v!r} ({d})" if isinstance(v, str) else f"{v} ({d})" for v, d in self.choices.items()
      )
    return ", ".join(str(c) for c in self.choices)

  def is_valid(self, value) -> bool:
    if value is None and self.none_ok:
      return True
    if not _TYPE_CHECKS[self.type](value):
      return False
    if self.choices is not None:
      return any(value == c and type(value) is type(c) for c in self.choices)
    if self.even and value % 2:
      return False
    if self.low is not None and (value <= self.low if self.low_open else value < self.low):
      return False
    if self.high is not None and (value >= self.high if self.high_open else value > self.high):
      return False
    return self.check is None or bool(self.check(value))

  def error(self, scheme: str, name: str, value) -> str:
    """The message for a bad ``value``: the scheme, the option, the value, the valid values."""
    if self.choices is not None:
      return f"{scheme}: unknown {name} {value!r}; valid choices: {self.choice_list()}."
    note = f" ({self.note})" if self.note else ""
    return f"{scheme}: {name} must be {self.describe()}{note}; got {value!r}."


class Scheme(nn.Module):
  """Base class of positional schemes. Subclasses set the class attributes below, declare their
  options in ``option_spec`` (name -> ``Option``), create parameters in ``setup()`` from
  ``dims``, and implement the methods of the hooks they list in ``hooks``.

  Each option of ``option_spec`` becomes a dataclass field with its default, and
  ``resolve_options`` is the one validator: it runs before every ``compatibility``,
  ``feature_out_dim`` (which then see every option, defaults filled in) and ``setup`` of every
  scheme, so no scheme checks its options itself. Rules between options go in
  ``check_relations``.

  A hook's method gets the arrays at its place (``[batch, N, heads, dim]`` q and k, float) and
  a ``Context`` (mask, grid, causal, length); ``register_scheme`` makes the class a name
  (``examples/custom_scheme.py`` is a complete scheme, held against its hand-written form).

  Example::

      class HeadBias(fastpos.Scheme):                     # a constant logits bias per head
        scheme_name = "head_bias"
        hooks = ("logits",)                               # adds [1, h, Lq, Lk] to the logits
        option_spec = {"value": fastpos.Option(0.5, "the bias", type="number")}

        def logits(self, q, k, ctx):                      # q [b, Lq, h, d], k [b, Lk, h, d]
          return jnp.full((1, q.shape[2], q.shape[1], k.shape[1]), self.value, q.dtype)

      fastpos.register_scheme(HeadBias, replace=True)
      layer = fastpos.attention(16, 2, positional="head_bias", head_bias={"value": 1.0})
      x = jnp.ones((2, 5, 16))                            # [batch, N, D] float32
      y = layer.apply(layer.init(jax.random.key(0), x), x)   # [2, 5, 16]
  """

  dims: Dims

  option_spec: ClassVar[Mapping[str, Option]] = {}

  scheme_name: ClassVar[str] = ""  # the registry name (linen reserves `name`)
  hooks: ClassVar[tuple[str, ...]] = ()
  feature_stage: ClassVar[str] = "post_phi"
  keeps_nonnegative: ClassVar[bool] = True
  supports_causal: ClassVar[bool] = True
  supports_1d: ClassVar[bool] = True
  supports_2d: ClassVar[bool] = False
  # A post_phi features hook that only permutes each token's features: it commutes with a
  # per-key scale and maps a constant vector to itself, so it may act on keys split as
  # e exp(s) + eps (the causal running-maximum path of the attention layer).
  permutes_features: ClassVar[bool] = False
  # Packed rows (segment ids): the kernel paths ("softmax", "linear") on which the scheme's
  # terms stay inside a segment (in-segment positions or offsets j - i only), and why not
  # elsewhere (the refusal names it).
  packs: ClassVar[tuple[str, ...]] = ()
  packing_note: ClassVar[str] = "not checked for packing"
  # A logits scheme's counterpart for linear kernels, named when a linear kernel is refused.
  linear_hint: ClassVar[str] = ""

  def __init_subclass__(cls, **kwargs):
    spec = cls.__dict__.get("option_spec", {})
    if spec:  # the spec's options become dataclass fields (linen makes the class a dataclass)
      annotations = dict(cls.__dict__.get("__annotations__", {}))
      for name, option in spec.items():
        if name in annotations:
          raise TypeError(
              f"{cls.__name__}: option {name!r} is declared in option_spec; drop " f"its field."
          )
        annotations[name] = option.field_annotation
        setattr(cls, name, option.default)
      cls.__annotations__ = annotations
    for name, wrap in (
        ("compatibility", _validating_compatibility),
        ("feature_out_dim", _validating_out_dim),
    ):
      if name in cls.__dict__:
        setattr(cls, name, classmethod(wrap(cls.__dict__[name].__func__)))
    if "setup" in cls.__dict__:
      cls.setup = _validating_setup(cls.__dict__["setup"])
    super().__init_subclass__(**kwargs)

  @classmethod
  def check_option_names(cls, options: Mapping) -> None:
    valid = tuple(cls.option_spec)
    for key in options:
      if key not in valid:
        raise ValueError(
            f"unknown option {key!r} for positional scheme {cls.scheme_name!r}; valid options: "
            f"{', '.join(valid) or '(none)'}."
        )

  @classmethod
  def resolve_options(cls, options: Mapping | None = None) -> dict:
    """Every option's value (``options`` over the defaults), validated against ``option_spec``
    and ``check_relations``; raises ValueError naming the scheme, the option, the bad value and
    the valid ones.

    The check runs once per set of options: the layers of a model (and the plan, the
    compatibility table and each layer's ``setup`` of one layer) ask again for the options the
    config's validation checked, and get the remembered answer (``_RESOLVED``)."""
    options = dict(options or {})
    key = _options_key(cls, {**{n: o.default for n, o in cls.option_spec.items()}, **options})
    known = _RESOLVED.get(key) if key is not None else None
    if known is not None and known[0] is cls.option_spec:
      return dict(known[1])
    cls.check_option_names(options)
    resolved = {name: options.get(name, o.default) for name, o in cls.option_spec.items()}
    for name, option in cls.option_spec.items():
      if not option.is_valid(resolved[name]):
        raise ValueError(option.error(cls.scheme_name, name, resolved[name]))
    cls.check_relations(resolved)
    if key is not None:
      if len(_RESOLVED) >= _RESOLVED_MAX:
        _RESOLVED.clear()
      _RESOLVED[key] = (cls.option_spec, dict(resolved))
    return resolved

  @classmethod
  def check_used(cls, options: Mapping | None, *, two_d: bool) -> None:
    """Raises ValueError for an option of ``options`` (those given) set to a value other than
    its default where it has no effect (e.g. a 2D option on 1D input): never silently
    ignored."""
    options = dict(options or {})
    for name in cls.unused_options(options, two_d=two_d):
      option, where = cls.option_spec[name], "2D, a grid" if two_d else "1D, no grid"
      raise ValueError(
          f"{cls.scheme_name}: option {name}={options[name]!r} would be ignored: it acts "
          f"{option.used_doc} (this layer: {where}). Drop it or leave it at "
          f"{option.default!r}."
      )

  @classmethod
  def unused_options(cls, options: Mapping | None, *, two_d: bool) -> list[str]:
    """The options of ``options`` (those given) set to a value other than their default where
    they have no effect (``Option.used_when``)."""
    options = dict(options or {})
    resolved = cls.resolve_options(options)
    return [
        name
        for name, value in options.items()
        if cls.option_spec[name].used_when is not None
        and value != cls.option_spec[name].default
        and not cls.option_spec[name].used_when(resolved, two_d)
    ]

  @classmethod
  def check_relations(cls, options: dict) -> None:
    """Rules between options (each valid on its own); raises ValueError. ``options``: all."""

  def option_values(self) -> dict:
    """This module's options (its fields of ``option_spec``)."""
    return {name: getattr(self, name) for name in self.option_spec}

  def setup(self):
    """Schemes without parameters need no setup; their options are still validated."""
    type(self).resolve_options(self.option_values())

  @classmethod
  def compatibility(
      cls, kernel: KernelInfo, *, causal: bool, two_d: bool, options: dict
  ) -> str | None:
    """None when the scheme works with this kernel / setting, else the reason it does not.

    The generic checks (causal, 1D, 2D support from the class attributes; a logits bias
    needs the softmax kernel) are made by ``fastpos.positional.compatibility.plan``; override
    this for a scheme's own rules (e.g. PermuteFormer needs non-negative features)."""
    cls.resolve_options(options)
    return None

  @classmethod
  def kv_terms(cls, options: Mapping | None = None, *, causal: bool) -> tuple[str, ...]:
    """What the ``kv`` hook returns with these options: ``"table"`` (``KVMix.log_table``)
    and / or ``"decay"`` (``KVMix.log_decay``); the plan reads it (e.g. the causal linear
    path's running maximum runs without either). Override where it depends on options."""
    del options, causal
    return ("table",) if "kv" in cls.hooks else ()

  @classmethod
  def feature_out_dim(cls, dim: int, options: dict) -> int:
    """Last dim of q, k after ``features`` given ``dim`` before it (identity unless the scheme
    changes it, e.g. a complex rotation realised as [Re, Im] doubles it)."""
    cls.resolve_options(options)
    return dim

  # Hooks (implement the ones listed in ``hooks``).
  def embed(self, x, ctx: Context):
    raise NotImplementedError(f"{type(self).__name__} has no embed hook.")

  def features(self, q, k, ctx: Context):
    raise NotImplementedError(f"{type(self).__name__} has no features hook.")

  def logits(self, q, k, ctx: Context):
    raise NotImplementedError(f"{type(self).__name__} has no logits hook.")

  def kv(self, ctx: Context) -> KVMix:
    raise NotImplementedError(f"{type(self).__name__} has no kv hook.")

  def output(self, v, ctx: Context):
    raise NotImplementedError(f"{type(self).__name__} has no output hook.")


# Options that passed ``Scheme.resolve_options``: (class, options with their types) -> (the
# class's option_spec then, the resolved options). Options that do not hash are checked anew.
_RESOLVED: dict = {}
_RESOLVED_MAX = 4096


def _options_key(cls, options: Mapping):
  """A hashable key of ``options`` that tells 1, 1.0 and True apart; None when a value is not
  hashable (an array, a dict)."""

  def typed(v):
    if isinstance(v, (tuple, list)):
      return (type(v), tuple(typed(x) for x in v))
    return (type(v), v)

  key = (cls, tuple(sorted((k, typed(v)) for k, v in options.items())))
  try:
    hash(key)
  except TypeError:
    return None
  return key


def _validating_compatibility(method):
  @functools.wraps(method)
  def wrapper(cls, kernel, *, causal: bool, two_d: bool, options: Mapping | None = None):
    return method(cls, kernel, causal=causal, two_d=two_d, options=cls.resolve_options(options))

  return wrapper


def _validating_out_dim(method):
  @functools.wraps(method)
  def wrapper(cls, dim: int, options: Mapping | None = None):
    return method(cls, dim, cls.resolve_options(options))

  return wrapper


def _validating_setup(setup):
  @functools.wraps(setup)
  def wrapper(self):
    type(self).resolve_options(self.option_values())
    return setup(self)

  return wrapper


# ---------------------------------------------------------------------------------------------
# Offset tables: one parameter set for every length up to the maximum.
# ---------------------------------------------------------------------------------------------
def center_slice(table, n: int, max_length: int):
  """Offsets -(n-1)..(n-1) of a table ``[..., 2*max_length-1]`` indexed by offset + max-1.

  Returns ``[..., 2n-1]`` indexed by offset + n - 1 (the layout of ``toeplitz_matmul``)."""
  if n > max_length:
    raise ValueError(
        f"sequence length {n} exceeds the maximum length {max_length} the positional tables "
        f"were built for; raise max_length (model.max_length in a config)."
    )
  return table[..., max_length - n : max_length + n - 1]


def offset_rows(table, offset, num_queries: int):
  """Decoding: ``[..., Lq, T]`` rows of a ``[..., 2T-1]`` offset table (index j - i + T - 1)
  for queries at ``offset + i`` (i < Lq, ``offset`` may be traced) and keys at slots 0..T-1."""
  t = (table.shape[-1] + 1) // 2
  idx = (jnp.arange(t)[None, :] - (offset + jnp.arange(num_queries))[:, None]) + t - 1
  return jnp.take(table, jnp.clip(idx, 0, 2 * t - 2), axis=-1)


def center_slice_2d(table, grid: Sequence[int], max_grid: Sequence[int]):
  """``[..., 2H'-1, 2W'-1]`` of a ``[..., 2H-1, 2W-1]`` table for a grid (H', W') <= (H, W)."""
  (h, w), (mh, mw) = tuple(grid), tuple(max_grid)
  if h > mh or w > mw:
    raise ValueError(
        f"grid {tuple(grid)} exceeds the largest grid {tuple(max_grid)} the positional tables "
        f"were built for (the task's grid, TaskInfo.grid): build the model for the larger "
        f"grid."
    )
  return table[..., mh - h : mh + h - 1, mw - w : mw + w - 1]


def positions_2d(grid: Sequence[int]):
  """Row and column index of each raster position: two int32 ``[H*W]`` arrays."""
  h, w = tuple(grid)
  idx = jnp.arange(h * w, dtype=jnp.int32)
  return idx // w, idx % w


def query_key_positions(q, k, ctx: Context, *, two_d: bool, scheme: str):
  """Integer positions ``([Lq, c], [Lk, c])``, c = 1 (1D: queries at M + i after M memory
  keys, keys at j) or 2 (2D raster order: (row, column)). Numpy (static), except in a decoding
  step (``ctx.offset``): jax arrays ``offset + i`` for queries and keys alike."""
  lq, lk = q.shape[1], k.shape[1]
  if ctx.offset is not None:  # decoding: the new tokens' queries and keys share positions
    if two_d or lq != lk:
      raise ValueError(
          f"{scheme}: a decoding step is 1D with one key per query; got queries "
          f"{q.shape}, keys {k.shape}, grid {ctx.grid}."
      )
    pos = (ctx.offset + jnp.arange(lq, dtype=jnp.int32))[:, None]
    return pos, pos
  memory = lk - lq
  if memory != ctx.memory_length:
    raise ValueError(
        f"{scheme}: keys [b, {lk}, ...] and queries [b, {lq}, ...] imply memory "
        f"M = {memory}, but ctx.memory_length = {ctx.memory_length}."
    )
  if ctx.grid is None:
    if two_d:
      raise ValueError(f"{scheme}: built for a 2D grid but called without one.")
    return (memory + np.arange(lq))[:, None], np.arange(lk)[:, None]
  if not two_d:
    raise ValueError(f"{scheme}: called with a grid but built for 1D (dims.grid is None).")
  if memory:
    raise ValueError(
        f"{scheme}: memory (M = {memory}) is only defined for 1D sequences; got "
        f"grid {ctx.grid}."
    )
  h, w = (int(g) for g in ctx.grid)
  if h * w != lq:
    raise ValueError(f"{scheme}: grid {tuple(ctx.grid)} does not cover length {lq}.")
  idx = np.arange(lq)
  pos = np.stack([idx // w, idx % w], axis=-1)
  return pos, pos
