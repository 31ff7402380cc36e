"""The config on the command line: ``--config=<file.py[:arg] | config.json>`` and its overrides.

ml_collections' ``config_flags.DEFINE_config_file`` defines the flag, finds each
``--config.<field>=<value>`` (also ``--config.<field> <value>``, ``--[no]config.<bool field>``)
and parses the value by the type of the field it replaces. This module adds what the library
does not do:

- loading (``--config``'s parser): a config file's ``get_config(arg)`` (its package importable,
  a failure in one line naming the file and line) or a run's saved ``config.json`` with the
  changes its resumes recorded;
- every positional scheme's options pre-declared, typed by the scheme's ``option_spec``, so
  that ``--config.model.positional_options.<scheme>.<option>=<value>`` is an ordinary typed
  field (``config_of`` drops the options left unset, and the options of a scheme that a
  ``--config.model.positional`` override took out of the list);
- the hints: an override naming no field fails in one line with the close matches before the
  library sees it;
- the schema check (``fastpos.train.config.validate``) of the result, before anything is built;
- ``list_configs(folder)`` (``train.py --list_configs``).

``load_config(spec, overrides)`` is the same for Python callers (tests, the sweep planner).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import json
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Iterable, Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

from fastpos.train import config as config_lib
from fastpos.train import config_record, errors
from fastpos.train import workdir as workdir_lib

_OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=]+)")  # what config_flags takes as an override
_OPTIONS = "model.positional_options"  # per-scheme options, by scheme name
_OPTION_TYPES = {"bool": bool, "int": int, "number": float, "str": str, "any": object}


class ConfigError(errors.RunError):
  """A config file, config argument or override that cannot be used (exit code 2)."""


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
  for k in cfg.keys():
    path = f"{prefix}{k}"
    out.append(path)
    v = cfg[k]
    if isinstance(v, ml_collections.ConfigDict):
      out.extend(config_keys(v, path + "."))
  return out


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def _split_spec(spec: str) -> tuple[str, str | None]:
  """``path[:arg]`` -> (path, arg); a path that exists as written keeps its colons."""
  if os.path.exists(spec) or ":" not in spec:
    return spec, None
  path, arg = spec.split(":", 1)
  return path, arg


def _is_config_file(path: Path) -> bool:
  """A config file defines get_config (not configs/common.py or the package's __init__.py)."""
  try:
    return "def get_config(" in path.read_text(encoding="utf-8")
  except (OSError, UnicodeDecodeError):
    return False


def _missing_file(path: str, spec: str) -> ConfigError:
  folder = Path(path).parent if str(Path(path).parent) not in ("", ".") else Path("configs")
  candidates = (
      sorted(p.as_posix() for p in folder.glob("*.py") if _is_config_file(p))
      if folder.is_dir()
      else []
  )
  close = difflib.get_close_matches(path, candidates, n=3, cutoff=0.75)
  hint = (
      f"did you mean {' or '.join(close)}?"
      if close
      else f"the configs are {', '.join(candidates[:20])}."
      if candidates
      else "give the path of a configs/<experiment>.py file (relative to the current folder, "
      f"{os.getcwd()}) or of a run's config.json."
  )
  return ConfigError(f"--config={spec}: config file {path!r} not found; {hint}")


def _tuples(value: Any) -> Any:
  """JSON values back to config values: lists were tuples (configs hold no lists)."""
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(_tuples(v) for v in value)
  return value


def config_from_json(path: str | os.PathLike) -> ml_collections.ConfigDict:
  """The config a run saved as ``config.json`` (``ConfigDict.to_json_best_effort``), with the
  changes its resumes recorded beside it (``config_changes.jsonl``) applied."""
  try:
    with open(path, encoding="utf-8") as f:
      values = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
    raise ConfigError(
        f"{os.fspath(path)} is not a readable config.json ({e}); it is written "
        "by train.py: use the run's own file or the configs/*.py it was made "
        "from."
    ) from None
  if not isinstance(values, dict):
    raise ConfigError(
        f"{os.fspath(path)} holds a JSON {type(values).__name__}, not a config "
        "(an object of fields)."
    )
  if Path(path).name == config_record.CONFIG_NAME:  # a run's: with the changes of its resumes
    values = config_record.apply_changes(values, config_record.read_changes(Path(path).parent))
  return ml_collections.ConfigDict(_tuples(values))


@contextlib.contextmanager
def _package_importable(path: str):
  """While loading a config file that sits in a package (``configs/__init__.py``), the folder
  above the package is first on ``sys.path``, so that ``from configs import common`` works
  from any current folder; a same-named package loaded from elsewhere is dropped first."""
  folder = Path(path).resolve().parent
  if not (folder / "__init__.py").is_file():
    yield
    return
  loaded = sys.modules.get(folder.name)
  if loaded is not None and Path(getattr(loaded, "__file__", None) or "").parent != folder:
    for key in [k for k in sys.modules if k == folder.name or k.startswith(folder.name + ".")]:
      del sys.modules[key]
  root = str(folder.parent)
  sys.path.insert(0, root)
  try:
    yield
  finally:
    sys.path.remove(root)  # the first occurrence: the one inserted here


def load_module(path: str, spec: str | None = None):
  """The module of config file ``path`` (executed; its package importable)."""
  spec = spec or path
  name = "fastpos_config_" + re.sub(r"\W", "_", Path(path).stem)
  module_spec = importlib.util.spec_from_file_location(name, path)
  if module_spec is None or module_spec.loader is None:
    raise ConfigError(
        f"--config={spec}: {path!r} is not a Python config file (configs/*.py) " "or a config.json."
    )
  module = importlib.util.module_from_spec(module_spec)
  try:
    with _package_importable(path):
      module_spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ConfigError(
        f"--config={spec}: {e.filename}:{e.lineno}: syntax error: {e.msg}; fix " "the config file."
    ) from None
  except ImportError as e:
    raise ConfigError(
        f"--config={spec}: {_where(e, path)}imports {e.name or 'a module'!r}, "
        f"which is not installed or not found ({e}); fix the import or install "
        "it."
    ) from None
  except Exception as e:  # pylint: disable=broad-except  (the config file's own code failed)
    raise ConfigError(
        f"--config={spec}: {_where(e, path)}loading the file raised "
        f"{type(e).__name__}: {e}; fix the config file."
    ) from None
  return module


def _where(e: BaseException, path: str) -> str:
  """ "<file>:<line>: " of the config file's frame nearest the error (or "")."""
  frames = traceback.extract_tb(e.__traceback__)
  target = os.path.realpath(path)
  own = [f for f in frames if os.path.realpath(f.filename) == target]
  frame = (own or frames or [None])[-1]
  return f"{frame.filename}:{frame.lineno}: " if frame is not None else ""


def _from_python(path: str, arg: str | None, spec: str) -> ml_collections.ConfigDict:
  module = load_module(path, spec)
  get_config = getattr(module, "get_config", None)
  if not callable(get_config):
    raise ConfigError(
        f"--config={spec}: {path} defines no get_config(arg=None); a config "
        "file returns its ConfigDict from get_config."
    )
  try:
    cfg = get_config(arg) if arg is not None else get_config()
  except ValueError as e:  # parse_arg: an unknown or ill-typed config argument
    raise ConfigError(f"--config={spec}: {e} Fix the part after ':'.") from None
  except Exception as e:  # pylint: disable=broad-except  (the config file's own code failed)
    raise ConfigError(
        f"--config={spec}: {_where(e, path)}get_config raised "
        f"{type(e).__name__}: {e}; fix the config file."
    ) from None
  if not isinstance(cfg, ml_collections.ConfigDict):
    raise ConfigError(
        f"--config={spec}: get_config returned {type(cfg).__name__}, not a " "ConfigDict."
    )
  return cfg


def list_configs(folder: str | os.PathLike) -> str:
  """Every config file in ``folder`` (those defining ``get_config``) with the first sentence
  of its docstring and its arguments: ``name=default`` (``ARGS``) and the valid values
  (``CHOICES``)."""
  lines = []
  for path in sorted(p for p in Path(folder).glob("*.py") if _is_config_file(p)):
    module = load_module(str(path))
    paragraph = (module.__doc__ or "(no docstring)").strip().split("\n\n")[0]
    shown_path = os.path.relpath(path)  # relative to the current folder when below it
    shown_path = Path(path if shown_path.startswith("..") else shown_path).as_posix()
    lines.append(f"{shown_path}: {' '.join(paragraph.split())}")
    choices = getattr(module, "CHOICES", {})
    for name, default in getattr(module, "ARGS", {}).items():
      shown = str(default).lower() if isinstance(default, bool) else str(default)
      valid = f"one of: {' '.join(map(str, choices[name]))}" if name in choices else ""
      lines.append(f"    {name + '=' + shown:<22}{valid}".rstrip())
  return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The flag
# ---------------------------------------------------------------------------------------------
def _read(spec: str) -> ml_collections.ConfigDict:
  """The config of ``--config=spec`` as its file or config.json gives it."""
  if not spec:
    raise ConfigError(
        "--config is empty; give configs/<experiment>.py[:variant] or a run's " "config.json."
    )
  path, arg = _split_spec(spec)
  if workdir_lib.is_symlink_loop(path):
    raise ConfigError(
        f"--config={spec}: {path!r} is a symlink loop (its links point at each "
        "other); fix the link or give the config file's real path."
    )
  if not os.path.isfile(path):
    if os.path.isdir(path):
      raise ConfigError(
          f"--config={spec}: {path!r} is a folder; give a configs/*.py file or "
          "a run's config.json (eval.py: --workdir alone loads its config.json)."
      )
    raise _missing_file(path, spec)
  if path.endswith(".json"):
    if arg is not None:
      raise ConfigError(
          f"--config={spec}: a config.json takes no ':{arg}' argument; it holds "
          "the whole config (override fields with --config.<field>=<value>)."
      )
    return config_from_json(path)
  return _from_python(path, arg, spec)


class _Parser(flags.ArgumentParser):
  """``--config``'s value: the config read, scheme options declared, the overrides in ``argv``
  (``sys.argv`` when None; what config_flags reads) checked to be fields."""

  def __init__(self, argv: list[str] | None):
    self.argv = argv

  def parse(self, argument):
    if isinstance(argument, ml_collections.ConfigDict):
      return argument
    cfg = _read(argument)
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
    spec: str, overrides: Sequence | Any = (), *, lock: bool = True
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
    if workdir and os.path.isfile(os.path.join(workdir, "config.json")):
      return [argv[0], f"--config={os.path.join(workdir, 'config.json')}", *argv[1:]]
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
      kind = _get(cfg, where.rsplit(".", 1)[0]).get_type(parts[i - 1]).__name__
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
  its ``Option`` declares (None where the config leaves it unset)."""
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
      typed[name] = _field(given.get(name), _OPTION_TYPES[option.type])
    for name in set(given.keys()) - set(typed.keys()):
      typed[name] = given[name]  # not an option: the schema check names it
    if scheme in block:
      del block[scheme]
    block[scheme] = typed


def _field(value, kind: type):
  if (
      value is not None
      and not isinstance(value, kind)
      and not (kind is float and isinstance(value, int) and not isinstance(value, bool))
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
