"""How a config field is declared: ``Field`` (default, type, valid range or choices, whether a
new value changes a run's results) and the shorthands the owners declare their fields with.

A leaf module (the standard library only), so that every owner of config fields can declare
them beside its code without importing the trainer: the trainer's own fields
(``fastpos.config_schema.FIELDS``), each task's block
(``fastpos.tasks.<module>.<Task>.config_fields``) and the kernels' options
(``fastpos.ops.kernel_options.OPTIONS``). ``fastpos.config_schema`` puts them together into the
config's schema (docs/config.md). A positional scheme's options are declared by its
``option_spec`` (``fastpos.positional.Option``).

A declaration is one line, the default first, then the valid values, then a comment, e.g.::

    "num_pairs": fields.integer(8, 1),  # key-value pairs at the start
    "difficulty": fields.string("hard", ("easy", "intermediate", "hard")),
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

TYPES = ("bool", "int", "float", "str", "tuple", "block")
SEED_HIGH = 2**32 - 1  # numpy's and grain's seeds are uint32


class ConfigValueError(ValueError):
  """A config field holds a value outside its declared type, range or choices."""


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field: its type, valid values and whether it changes a run's results.

  Attributes:
    type: one of ``TYPES``; "float" takes ints too and must be finite; "block" is a group of
      fields not declared one by one (``open``), e.g. the paper's numbers.
    low, high: an inclusive range, unless ``low_open`` / ``high_open``.
    choices: the valid values (strings).
    valid: the valid values in words, for a field a type and range do not describe (a path).
    trajectory: whether a new value changes the run's results; a callable of the whole
      config for a field whose effect depends on another (``num_train_steps`` moves a
      decaying schedule only).
    default: the value of the base config; blocks start empty.
    base: False for a block only some configs have (the paper's cell and numbers).
    check: a predicate for what a type and range cannot say (the items of a tuple).
  """

  type: str
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  choices: tuple | None = None
  valid: str = ""
  trajectory: bool | Callable[[Any], bool] = True
  default: Any = None
  base: bool = True
  check: Callable[[Any], bool] | None = None

  def __post_init__(self):
    if self.type not in TYPES:
      raise ValueError(f"Field type {self.type!r}; valid choices: {', '.join(TYPES)}.")

  def describe(self) -> str:
    """The valid values in words (the error's "must be ...")."""
    if self.choices is not None:
      return "one of " + ", ".join(map(str, self.choices))
    if self.valid:
      return self.valid
    words = {
        "bool": "true or false",
        "int": "an integer",
        "float": "a finite number",
        "str": "a string",
        "tuple": "a tuple",
        "block": "a block of fields",
    }[self.type]
    if self.low is not None and self.high is not None and self.type == "float":
      left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
      return f"{words} in {left}{_num(self.low)}, {_num(self.high)}{right}"
    if self.low is not None:
      words += f" {'>' if self.low_open else '>='} {_num(self.low)}"
    if self.high is not None:
      words += f"{' and' if self.low is not None else ''} {'<' if self.high_open else '<='} "
      words += _num(self.high)
    return words

  def is_valid(self, value: Any) -> bool:
    if not _TYPE_CHECKS[self.type](value):
      return False
    if self.check is not None and not self.check(value):
      return False
    if self.choices is not None:
      return value in self.choices
    if self.low is not None and (value <= self.low if self.low_open else value < self.low):
      return False
    return self.high is None or (value < self.high if self.high_open else value <= self.high)

  def affects(self, cfg: Any) -> bool:
    """Whether a change of this field changes the results of a run with config ``cfg``."""
    return self.trajectory(cfg) if callable(self.trajectory) else bool(self.trajectory)


def _num(x: float) -> str:
  return str(int(x)) if float(x).is_integer() else f"{x:g}"


def is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_float(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_TYPE_CHECKS = {
    "bool": lambda x: isinstance(x, bool),
    "int": is_int,
    "float": _is_float,
    "str": lambda x: isinstance(x, str),
    "tuple": lambda x: isinstance(x, tuple),
    "block": lambda x: hasattr(x, "keys"),
}


# The shorthands: the default first, then the valid values.
def integer(default: int, low=None, high=None, **kw) -> Field:
  return Field("int", default=default, low=low, high=high, **kw)


def number(default: float, low=None, high=None, **kw) -> Field:
  return Field("float", default=default, low=low, high=high, **kw)


def string(default: str, choices=None, valid="", **kw) -> Field:
  choices = tuple(choices) if choices is not None else None
  return Field("str", default=default, choices=choices, valid=valid, **kw)


def boolean(default: bool, **kw) -> Field:
  return Field("bool", default=default, **kw)


def block(**kw) -> Field:
  return Field("block", **kw)


def seed(default: int = 0) -> Field:
  return integer(default, 0, SEED_HIGH)


def path(**kw) -> Field:
  return string("", valid="a path ('' for the default)", **kw)


def defaults(decls: Mapping[str, Field]) -> dict:
  """Nested dicts of the declarations' defaults (dotted names nest; blocks empty), in
  declaration order."""
  root: dict = {}
  for name, decl in decls.items():
    *parents, last = name.split(".")
    node = root
    for part in parents:
      node = node[part]
    node[last] = {} if decl.type == "block" else decl.default
  return root


def shown(value: Any) -> str:
  return repr(value) if isinstance(value, str) else str(value)


def error(path: str, decl: Field, value: Any) -> str:
  """One line: the field, the valid values, the value."""
  return f"config.{path} must be {decl.describe()}; got {shown(value)}."


def check_flags(values: Mapping[str, Any], decls: Mapping[str, Field]) -> None:
  """A program's own flags by the same rule: raises ConfigValueError with one line,
  "--<flag> must be <valid values>; got <value>.", for the first flag outside its declaration."""
  for name, decl in decls.items():
    if name in values and not decl.is_valid(values[name]):
      raise ConfigValueError(f"--{name} must be {decl.describe()}; got {shown(values[name])}.")
