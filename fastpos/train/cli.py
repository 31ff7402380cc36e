"""The config on the command line: ``--config=<file.py[:arg] | config.json>`` and its overrides.

ml_collections' ``config_flags.DEFINE_config_file`` defines the flag, finds each
``--config.<field>=<value>`` (also ``--config.<field> <value>``, ``--[no]config.<bool field>``)
and parses the value by the type of the field it replaces. This module adds what the library
does not do: reading the value (``fastpos.train.config_files``: a config file with one-line
errors, or a run's saved config.json); every positional scheme's options pre-declared, typed by
its ``option_spec``, so that ``--config.model.positional_options.<scheme>.<option>=<value>`` is
an ordinary typed field (``config_of`` drops the options left unset, and those of a scheme a
``--config.model.positional`` override took out of the list); hints for an override that names
no field, before the library sees it; the schema check of the result before anything is built.
``load_config(spec, overrides)`` does the same for Python callers (tests, the sweep planner).
"""

from __future__ import annotations

import contextlib
import difflib
import numbers
import re
import sys
from typing import Iterable, Mapping, Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

from fastpos.train import config as config_lib
from fastpos.train.config_files import ConfigError, read
from fastpos.train.workdir import Workdir

_OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=]+)")  # what config_flags takes as an override
_OPTIONS = "model.positional_options"  # per-scheme options, by scheme name


class _NumberParser(flags.ArgumentParser):
  """A "number" option's value on the command line: an int literal stays an int (``3``), any
  other number is a float (``0.5``, ``1e3``)."""

  def parse(self, argument):
    if not isinstance(argument, str):
      return argument
    try:
      return int(argument)
    except ValueError:  # not an int literal: a float, or float()'s error (absl's wording)
      return float(argument)

  def flag_type(self) -> str:
    return "number"


config_flags.register_flag_parser_for_type(numbers.Real, _NumberParser())


# ---------------------------------------------------------------------------------------------
# Close matches
# ---------------------------------------------------------------------------------------------
def nearby(key: str, keys: Sequence[str]) -> list[str]:
  """Valid keys to suggest for a mistyped dotted ``key``: the close matches first, then the
  fields beside it (same parent, same depth); the top-level fields when nothing is near."""
  keys = list(keys)
  close = difflib.get_close_matches(key, keys, n=6, cutoff=0.6)
  parent = key.rsplit(".", 1)[0] if "." in key else ""
  siblings = [
      k for k in keys if parent and k.startswith(parent + ".") and k.count(".") == key.count(".")
  ]
  out = list(dict.fromkeys(close + siblings))
  return out[:12] or [k for k in keys if "." not in k]


def config_keys(cfg, prefix: str = "") -> list[str]:
  """Every field path of a ConfigDict, blocks and leaves (``model``, ``model.kernel``...)."""
  out = []
  for k in cfg:
    path = f"{prefix}{k}"
    out.append(path)
    v = cfg[k]
    if isinstance(v, ml_collections.ConfigDict):
      out.extend(config_keys(v, path + "."))
  return out


# ---------------------------------------------------------------------------------------------
# The flag
# ---------------------------------------------------------------------------------------------
class _Parser(flags.ArgumentParser):
  """``--config``'s value: the config read, scheme options declared, the overrides in ``argv``
  (``sys.argv`` when None; what config_flags reads) checked to be fields."""

  def __init__(self, argv: list[str] | None):
    self.argv = argv

  def parse(self, argument):
    if isinstance(argument, ml_collections.ConfigDict):
      return argument
    cfg = read(argument)
    _declare_options(cfg)
    for arg, path in overrides_in(self.argv if self.argv is not None else sys.argv):
      _check_path(cfg, path, arg)
    return cfg

  def flag_type(self) -> str:
    return "config file"


def define_config_flag(
    help_string: str, flag_values: flags.FlagValues = flags.FLAGS, argv: list[str] | None = None
) -> flags.FlagHolder:
  """``--config`` (``config_flags.DEFINE_config_file``) read by this module's parser; its
  value becomes a checked config through ``config_of``."""
  holder = config_flags.DEFINE_config_file(
      "config", None, help_string, flag_values, lock_config=False, sys_argv=argv
  )
  flag_values["config"].parser = _Parser(argv)
  return holder


def config_of(
    holder: flags.FlagHolder, flag_values: flags.FlagValues = flags.FLAGS, *, lock: bool = True
) -> ml_collections.ConfigDict | None:
  """The config of a parsed ``--config`` with its overrides: unset scheme options dropped,
  checked against the schema (``config_lib.validate``), locked. None without ``--config``."""
  cfg = holder.value
  if cfg is None:
    return None
  _finish_options(cfg, config_flags.get_override_values(flag_values[holder.name]))
  config_lib.validate(cfg)  # every value against its declared range, before anything is built
  if lock:
    cfg.lock()
  return cfg


def load_config(
    spec: str, overrides: Sequence | Mapping = (), *, lock: bool = True
) -> ml_collections.ConfigDict:
  """The config of ``--config=spec`` with ``overrides`` applied, checked and locked.

  Args:
    spec: ``path.py`` / ``path.py:arg`` (a config file and its ``get_config`` argument) or
      ``path.json`` (a run's saved ``config.json``).
    overrides: (path, raw value) pairs, or (path, None, negated) for the bare boolean forms;
      a mapping path -> raw value works too.

  Raises:
    ConfigError: naming the missing file, the bad argument, field or value, and the fix.
  """
  argv = ["fastpos", f"--config={spec}", *_override_args(overrides)]
  flag_values = flags.FlagValues()
  holder = define_config_flag("", flag_values, argv)
  try:
    flag_values(argv)
  except flags.Error as e:  # a value the field's type refuses, an override order
    raise ConfigError(str(e)) from None
  return config_of(holder, flag_values, lock=lock)


def _override_args(overrides) -> list[str]:
  items = list(overrides.items()) if hasattr(overrides, "items") else list(overrides)
  out = []
  for item in items:
    key, raw, negated = (tuple(item) + (False,))[:3]
    no = "no" if negated else ""
    out.append(f"--{no}config.{key}" if raw is None else f"--config.{key}={raw}")
  return out


def with_saved_config(argv: list[str]) -> list[str]:
  """``argv`` with ``--config=<workdir>/config.json`` first when it names no ``--config`` (the
  default of eval.py and generate.py: the config the run saved)."""
  if any(a == "--config" or a.startswith("--config=") for a in argv):
    return argv
  for i, arg in enumerate(argv):
    workdir = arg[len("--workdir=") :] if arg.startswith("--workdir=") else None
    if arg == "--workdir" and i + 1 < len(argv):
      workdir = argv[i + 1]
    saved = Workdir(workdir).config_file if workdir else None
    if saved is not None and saved.is_file():
      return [argv[0], f"--config={saved}", *argv[1:]]
  return argv


def overrides_in(argv: Sequence[str]) -> list[tuple[str, str]]:
  """(argument, field path) of each ``--config.<path>`` override in ``argv``."""
  out = []
  for arg in argv[1:]:
    if arg == "--":
      break
    m = _OVERRIDE.match(arg)
    if m:
      out.append((arg, m.group(1)))
  return out


# ---------------------------------------------------------------------------------------------
# Hints
# ---------------------------------------------------------------------------------------------
def _check_path(cfg: ml_collections.ConfigDict, path: str, arg: str) -> None:
  """Raises ConfigError for an override ``path`` that is not a field of ``cfg``."""
  parts = path.split(".")
  if not all(parts):
    raise ConfigError(f"{arg}: {path!r} is not a field path (fields joined by '.').")
  node = cfg
  for i, part in enumerate(parts):
    where = ".".join(parts[:i])
    if not isinstance(node, ml_collections.ConfigDict):
      kind = _get(cfg, where.rpartition(".")[0]).get_type(parts[i - 1])
      kind = "number" if kind is numbers.Real else kind.__name__
      raise ConfigError(f"{arg}: config.{where} is a field ({kind}), not a block of fields.")
    if part not in node:
      raise ConfigError(f"{arg}: {_unknown(cfg, where, part, node)}")
    node = node[part]


def _get(cfg, path: str):
  for part in filter(None, path.split(".")):
    cfg = cfg[part]
  return cfg


def _unknown(cfg, where: str, name: str, block) -> str:
  """The message for a field ``name`` that block ``where`` lacks, with close matches."""
  close = difflib.get_close_matches(name, list(block.keys()), n=3, cutoff=0.6)
  if where == _OPTIONS:
    return f"unknown positional scheme {name!r}.{_mean(close)} Schemes: {', '.join(block)}."
  if where.startswith(_OPTIONS + "."):
    scheme = where.rsplit(".", 1)[1]
    return (
        f"positional scheme {scheme!r} has no option {name!r}.{_mean(close)} Its options: "
        f"{', '.join(block) or '(none)'}."
    )
  close = [f"{where}.{k}" if where else k for k in close]
  if not close:  # a field of that name elsewhere (model.learning_rate)
    by_name: dict[str, list[str]] = {}
    for k in config_keys(cfg):
      by_name.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    matches = difflib.get_close_matches(name, list(by_name), n=3, cutoff=0.8)
    close = [k for n in matches for k in by_name[n]][:3]
  owner = f"config.{where}" if where else "the config"
  return (
      f"{owner} has no field {name!r}.{_mean(close)} Fields of {owner}: "
      f"{', '.join(block.keys())}."
  )


def _mean(close: list[str]) -> str:
  return f" Did you mean {' or '.join(close)}?" if close else ""


# ---------------------------------------------------------------------------------------------
# Scheme options, typed by their option_spec
# ---------------------------------------------------------------------------------------------
def _declare_options(cfg: ml_collections.ConfigDict) -> None:
  """Every scheme's options in ``config.model.positional_options``, each a field of the type
  its ``Option`` declares (``Option.value_type``; None where the config leaves it unset)."""
  from fastpos import positional  # pylint: disable=import-outside-toplevel (flax)

  model = cfg.get("model")
  if not isinstance(model, ml_collections.ConfigDict) or not isinstance(
      model.get("positional_options"), ml_collections.ConfigDict
  ):
    return  # the schema check names what is wrong
  block = model.positional_options
  for scheme, cls in positional.SCHEMES.items():
    given = block.get(scheme, ml_collections.ConfigDict())
    if not isinstance(given, ml_collections.ConfigDict):
      continue  # not a block of options: the schema check says so
    typed = ml_collections.ConfigDict()
    for name, option in cls.option_spec.items():
      typed[name] = _field(given.get(name), option.value_type)
    for name in set(given.keys()) - set(typed.keys()):
      typed[name] = given[name]  # not an option: the schema check names it
    if scheme in block:
      del block[scheme]
    block[scheme] = typed


def _field(value, kind: type):
  if value is not None and (
      not isinstance(value, kind) or (kind is numbers.Real and isinstance(value, bool))
  ):
    return value  # of another type: the schema check names it
  return ml_collections.FieldReference(value, field_type=kind)


def _finish_options(cfg: ml_collections.ConfigDict, overridden: Iterable[str]) -> None:
  """Drops the options left unset, and the blocks of schemes a ``--config.model.positional``
  override took out of the list (unless the command line set their options too)."""
  from fastpos import positional  # pylint: disable=import-outside-toplevel (flax)

  model = cfg.get("model")
  if not isinstance(model, ml_collections.ConfigDict) or not isinstance(
      model.get("positional_options"), ml_collections.ConfigDict
  ):
    return
  overridden = list(overridden)
  listed = None
  if "model.positional" in overridden:
    with contextlib.suppress(ValueError):  # a bad name: the schema check names it
      listed = set(positional.parse_names(model.positional))
  kept = {}
  for scheme, options in model.positional_options.items():
    explicit = any(p == _OPTIONS or p.startswith(f"{_OPTIONS}.{scheme}") for p in overridden)
    if listed is not None and scheme not in listed and not explicit:
      continue
    if isinstance(options, ml_collections.ConfigDict):
      options = {k: v for k, v in options.items() if v is not None}
    if options:
      kept[scheme] = options
  with model.unlocked():
    del model["positional_options"]
    model.positional_options = ml_collections.ConfigDict(kept)
