"""Command-line plumbing shared by ``train.py`` and ``eval.py``.

- ``load_config(spec, overrides)``: a config from ``configs/<x>.py[:arg]`` (its
  ``get_config(arg)``) or from a run's saved ``config.json``, then the ``--config.<field>=<value>``
  overrides, each typed by the field it replaces. An unknown field, a value of the wrong type or
  a missing file raises ``ConfigError`` naming it (with the close matches and the valid fields).
  Options of a positional scheme can be set one at a time,
  ``--config.model.positional_options.fastrpb.per_head=True``: the scheme's block is created
  when missing and each option is checked against the scheme's own options and their types.
- ``list_configs(folder)``: every config file with its first docstring line and its
  arguments (``train.py --list_configs``).
- ``run(main, prog)``: runs ``main`` under absl. A failure that is the user's (a bad config,
  flag, data file or workdir: ``RunError`` and the errors listed in ``user_exit_code``) prints
  one line, ``<prog>: <message>``, to stderr and exits with its code from
  ``fastpos.train.errors``; nothing is printed at shutdown after it (no traceback from
  background threads). Any other exception is a bug: its traceback is printed, exit 1.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import errno
import importlib.util
import json
import logging as py_logging
import os
import re
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import ml_collections
from absl import app, flags, logging

from fastpos.train import config as config_lib
from fastpos.train import config_record, distributed, errors
from fastpos.train import workdir as workdir_lib

# The override flags: --config.<path>=<value>, --config.<path> (True) or --noconfig.<path>.
_OVERRIDE = re.compile(r"^--?(no)?config\.([A-Za-z0-9_.]+)(?:=(.*))?$", re.DOTALL)
_TRUE = ("true", "t", "yes", "y", "1")
_FALSE = ("false", "f", "no", "n", "0")
_OPTIONS_BLOCK = ("model", "positional_options")  # per-scheme options, by scheme name


class ConfigError(errors.RunError):
  """A config file, config argument or override that cannot be used (exit code 2)."""


class Argv(list):
  """The positional arguments ``main`` gets, with the ``--config.*`` overrides taken out of
  the command line (absl does not know them) as (path, raw value or None, negated)."""

  overrides: list[tuple[str, str | None, bool]]


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
  try:
    return config_lib.complete_task(cfg)  # the task's default fields the file leaves unset
  except (ValueError, TypeError) as e:
    raise ConfigError(f"--config={spec}: {e}") from None


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


def load_config(
    spec: str, overrides: Sequence = (), *, lock: bool = True
) -> ml_collections.ConfigDict:
  """The config of ``--config=spec`` with ``overrides`` applied, locked (no new fields).

  Args:
    spec: ``path.py`` / ``path.py:arg`` (a config file and its ``get_config`` argument) or
      ``path.json`` (a run's saved ``config.json``).
    overrides: (path, raw value) pairs, or (path, raw value or None, negated) as ``Argv``
      holds them; a mapping path -> raw value works too.

  Raises:
    ConfigError: naming the missing file, the bad argument, field or value, and the fix.
  """
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
    cfg = config_from_json(path)
  else:
    cfg = _from_python(path, arg, spec)
  if hasattr(overrides, "items"):
    overrides = list(overrides.items())
  with cfg.unlocked():
    for item in overrides:
      key, raw, negated = (tuple(item) + (False,))[:3]
      apply_override(cfg, key, raw, negated=negated)
  config_lib.validate(cfg)  # every value against its declared range, before anything is built
  if lock:
    cfg.lock()
  return cfg


# ---------------------------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------------------------
def _flag(key: str, raw: str | None, negated: bool) -> str:
  if raw is None:
    return f"--{'no' if negated else ''}config.{key}"
  return f"--config.{key}={raw}"


def _literal(raw: str) -> Any:
  if raw.strip() in ("true", "false"):  # absl's spelling of booleans
    return raw.strip() == "true"
  try:
    return ast.literal_eval(raw)
  except (SyntaxError, ValueError):
    return raw  # a bare word is a string


def _parse_bool(raw: str, where: str) -> bool:
  if raw.strip().lower() in _TRUE:
    return True
  if raw.strip().lower() in _FALSE:
    return False
  raise ConfigError(f"{where}: {raw!r} is not a boolean; use true or false.")


def _parse_typed(raw: str, kind: type, where: str) -> Any:
  """``raw`` as a value of ``kind`` (the type of the field it replaces)."""
  if kind is bool:
    return _parse_bool(raw, where)
  if kind is int:
    try:
      return int(raw.strip())
    except ValueError:
      pass
    try:
      return int(raw.strip(), 0)  # 0x.., 0o.., 1_000
    except ValueError:
      raise ConfigError(f"{where}: {raw!r} is not an integer (the field is an int).") from None
  if kind is float:
    try:
      return float(raw)
    except ValueError:
      raise ConfigError(
          f"{where}: could not convert string to float: {raw!r}; the field is " "a float."
      ) from None
  if kind is str:
    return raw
  if kind is tuple or kind is list:
    value = _literal(raw)
    if isinstance(value, (tuple, list)):
      return tuple(value)
    raise ConfigError(
        f"{where}: {raw!r} is not a tuple; write it as a Python tuple, e.g. "
        '--config.x="(1, 2)" (or "()" for an empty one).'
    )
  if isinstance(kind, type) and issubclass(kind, ml_collections.ConfigDict):
    value = _literal(raw)
    if not isinstance(value, dict):
      raise ConfigError(
          f"{where}: this is a block of fields; set one of them "
          f"(--config.<block>.<field>=...) or give a dict literal."
      )
    return ml_collections.ConfigDict(value)
  return _literal(raw)  # a None field (any type) or a type the config chose itself


def _field_error(cfg, key: str, where: str, block: str) -> ConfigError:
  """``key`` (a dotted path under ``block``) is not in the config."""
  node = cfg
  for part in block.split(".") if block else ():
    node = node[part]
  last = key.rsplit(".", 1)[-1]
  prefix = f"{block}." if block else ""
  # The fields beside it first; else a field of that name elsewhere (model.learning_rate).
  close = [prefix + k for k in difflib.get_close_matches(last, list(node.keys()), n=3, cutoff=0.6)]
  if not close:
    by_name = {}
    for k in config_keys(cfg):
      by_name.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    close = [
        k
        for n in difflib.get_close_matches(last, list(by_name), n=3, cutoff=0.8)
        for k in by_name[n]
    ][:3]
  fields = ", ".join(node.keys())
  name = f"config.{block}" if block else "the config"
  mean = f" Did you mean {' or '.join(close)}?" if close else ""
  return ConfigError(
      f"{where}: {name} has no field {key.rsplit('.', 1)[-1]!r}.{mean} "
      f"Fields of {name}: {fields}."
  )


def _scheme_option(cfg, key: str, parts: list[str], raw: str | None, negated: bool) -> None:
  """Sets ``model.positional_options.<scheme>[.<option>]``, creating the scheme's block."""
  from fastpos import positional  # pylint: disable=import-outside-toplevel

  where = _flag(key, raw, negated)
  scheme = parts[2]
  if scheme not in positional.SCHEMES:
    close = difflib.get_close_matches(scheme, list(positional.SCHEMES), n=3, cutoff=0.5)
    mean = f" Did you mean {' or '.join(close)}?" if close else ""
    raise ConfigError(
        f"{where}: unknown positional scheme {scheme!r}.{mean} Schemes: "
        f"{', '.join(positional.SCHEMES)}."
    )
  block = cfg.model.positional_options
  fields = {
      f.name: f
      for f in dataclasses.fields(positional.get_class(scheme))
      if f.name in positional.option_names(scheme)
  }
  if len(parts) == 3:  # the whole block: a dict literal of options
    if raw is None:
      raise ConfigError(
          f"{where}: needs a value, a dict of options such as "
          f"\"{{'{next(iter(fields), 'option')}': ...}}\"."
      )
    value = _literal(raw)
    if not isinstance(value, dict):
      raise ConfigError(
          f"{where}: {raw!r} is not a dict of options; set one option "
          f"(--config.{key}.<option>=...) or give a dict literal."
      )
    for name in value:
      if name not in fields:
        raise _option_error(where, scheme, name, fields)
    if scheme in block:
      del block[scheme]
    block[scheme] = ml_collections.ConfigDict(value)
    return
  if len(parts) != 4:
    raise ConfigError(
        f"{where}: options of a positional scheme are "
        f"model.positional_options.<scheme>.<option>; {key!r} goes deeper."
    )
  name = parts[3]
  if name not in fields:
    raise _option_error(where, scheme, name, fields)
  field = fields[name]
  default = field.default
  annotation = str(field.type)
  if raw is None:
    if not isinstance(default, bool) and "bool" not in annotation:
      raise ConfigError(f"{where}: needs a value (--config.{key}=VALUE).")
    value = not negated
  elif isinstance(default, bool):
    value = _parse_bool(raw, where)
  elif isinstance(default, int) and "tuple" not in annotation:
    value = _parse_typed(raw, int, where)
  elif isinstance(default, float) and "tuple" not in annotation:
    value = _parse_typed(raw, float, where)
  elif isinstance(default, str):
    value = raw
  elif "bool" in annotation and raw.strip().lower() in _TRUE + _FALSE:  # bool | None
    value = _parse_bool(raw, where)
  else:  # None or a union with tuples: a Python literal, checked by the scheme when built
    value = _literal(raw)
    if isinstance(value, list):
      value = tuple(value)
  if scheme not in block:
    block[scheme] = ml_collections.ConfigDict()
  options = block[scheme]
  if name in options:
    del options[name]  # a new value may change the type (a float decay -> a tuple per head)
  options[name] = value


def _option_error(where: str, scheme: str, name: str, fields: dict) -> ConfigError:
  close = difflib.get_close_matches(name, list(fields), n=3, cutoff=0.6)
  mean = f" Did you mean {' or '.join(close)}?" if close else ""
  return ConfigError(
      f"{where}: positional scheme {scheme!r} has no option {name!r}.{mean} "
      f"Its options: {', '.join(fields) or '(none)'}."
  )


def apply_override(
    cfg: ml_collections.ConfigDict, key: str, raw: str | None, *, negated: bool = False
) -> None:
  """Sets the field at dotted ``key`` from its command-line text ``raw`` (None for the bare
  boolean forms ``--config.key`` / ``--noconfig.key``), typed by the field it replaces."""
  where = _flag(key, raw, negated)
  parts = key.split(".")
  if not all(parts):
    raise ConfigError(f"{where}: {key!r} is not a field path (fields joined by '.').")
  if (
      tuple(parts[:2]) == _OPTIONS_BLOCK
      and len(parts) > 2
      and "model" in cfg
      and (
          isinstance(cfg.model, ml_collections.ConfigDict)
          and isinstance(cfg.model.get("positional_options"), ml_collections.ConfigDict)
      )
  ):
    _scheme_option(cfg, key, parts, raw, negated)
    return
  node = cfg
  for i, part in enumerate(parts[:-1]):
    if part not in node:
      raise _field_error(cfg, ".".join(parts[: i + 1]), where, ".".join(parts[:i]))
    node = node[part]
    if not isinstance(node, ml_collections.ConfigDict):
      raise ConfigError(
          f"{where}: config.{'.'.join(parts[:i + 1])} is a field "
          f"({type(node).__name__}), not a block of fields."
      )
  name = parts[-1]
  if name not in node:
    raise _field_error(cfg, key, where, ".".join(parts[:-1]))
  kind = node.get_type(name)
  if raw is None:
    if kind is not bool:
      raise ConfigError(
          f"{where}: needs a value (--config.{key}=VALUE); only boolean "
          "fields take the bare --config.<field> / --noconfig.<field> form."
      )
    value = not negated
  else:
    value = _parse_typed(raw, kind, where)
  try:
    node[name] = value
  except (TypeError, ValueError) as e:
    raise ConfigError(f"{where}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Running a main
# ---------------------------------------------------------------------------------------------
def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str | None, bool]]]:
  """(argv without the ``--config.*`` overrides, the overrides in order)."""
  rest, overrides = [], []
  for i, arg in enumerate(argv):
    if arg == "--":
      rest.extend(argv[i:])
      break
    m = _OVERRIDE.match(arg) if i else None
    if m is None:
      rest.append(arg)
      continue
    negated, key, raw = bool(m.group(1)), m.group(2), m.group(3)
    if negated and raw is not None:
      raise ConfigError(
          f"{arg}: the --noconfig.<field> form takes no value; write " f"--config.{key}={raw}."
      )
    overrides.append((key, raw, negated))
  return rest, overrides


def user_exit_code(e: BaseException) -> int | None:
  """The exit code of a failure that is the user's (bad config, flag, data or workdir), or
  None for a bug (its traceback is shown)."""
  if isinstance(e, errors.RunError):
    return e.exit_code
  if isinstance(e, (ValueError, NotImplementedError, OSError, flags.Error)):
    return errors.EXIT_BAD_INPUT
  return None


_OS_HINTS = {
    errno.EROFS: "the file system is read-only: use a --workdir on a writable disk",
    errno.EACCES: "use a --workdir you can write to (or fix its " "permissions)",
    errno.EPERM: "use a --workdir you can write to",
    errno.ENOSPC: "the disk is full: free space there or use a --workdir on another disk",
    errno.EDQUOT: "the disk quota is exceeded: free space or use a --workdir elsewhere",
    errno.ENOTDIR: "a part of the path is a file, not a folder: use another --workdir",
    errno.EEXIST: "a file is in the way: remove it or use another --workdir",
    errno.EISDIR: "a folder is where a file should be: remove it or use another path",
    errno.ENAMETOOLONG: "the path is too long: use a shorter --workdir",
}


def message(e: BaseException) -> str:
  """The one line printed for a user error."""
  if isinstance(e, OSError) and e.strerror and not isinstance(e, errors.RunError):
    where = " -> ".join(repr(os.fspath(p)) for p in (e.filename, e.filename2) if p)
    hint = _OS_HINTS.get(e.errno, "check the path and run again")
    text = f"{e.strerror}{': ' + where if where else ''}; {hint}."
  elif "No space left on device" in str(e) and not isinstance(e, errors.RunError):
    # tensorstore's write errors (orbax saves); a RunError already says the fix
    text = f"{e}; {_OS_HINTS[errno.ENOSPC]}."
  elif isinstance(e, (errors.RunError, FileNotFoundError, flags.Error)) or type(e) in (
      ValueError,
      NotImplementedError,
  ):
    text = str(e) or type(e).__name__
  else:
    text = f"{type(e).__name__}: {e}"
  # One line: a message split over lines (or carrying a nested error) is joined.
  return " ".join(line.strip() for line in text.splitlines() if line.strip())


class _OneLineBackgroundErrors(py_logging.Filter):
  """Log records of background threads and of orbax without their traceback: a failed save
  reaches the main thread as an exception too, and dozens of tracebacks (one per thread and
  array) would bury that one line."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.exc_info and (
        record.thread != threading.main_thread().ident
        or f"{os.sep}orbax{os.sep}" in record.pathname
    ):
      exc = record.exc_info[1]
      record.msg = f"{record.getMessage()} ({type(exc).__name__}: {exc})"
      record.args, record.exc_info, record.exc_text = None, None, None
    return True


_SEEN_BACKGROUND: set[tuple[str, str]] = set()


def _log_background(where: str, exc_type, exc) -> None:
  """One line per distinct background error (an event loop closed under a failed save is
  reported once per array otherwise)."""
  key = (exc_type.__name__, str(exc))
  if key not in _SEEN_BACKGROUND:
    _SEEN_BACKGROUND.add(key)
    logging.error("%s: %s: %s", where, exc_type.__name__, exc)


def _thread_hook(args) -> None:
  if args.exc_type is not SystemExit:
    _log_background(
        f"background thread {getattr(args.thread, 'name', '?')}", args.exc_type, args.exc_value
    )


def _unraisable_hook(unraisable) -> None:
  # Native threads (tensorstore's callbacks into asyncio) report here, with no object.
  _log_background(
      unraisable.err_msg or "ignored exception", unraisable.exc_type, unraisable.exc_value
  )


def _background_errors_in_one_line() -> None:
  """Errors of background and native threads as one log line each, never a traceback; the
  main thread's uncaught exceptions (bugs) keep theirs."""
  threading.excepthook = _thread_hook
  sys.unraisablehook = _unraisable_hook
  handlers = [logging.get_absl_handler(), *py_logging.getLogger().handlers]
  for handler in dict.fromkeys(handlers):
    if not any(isinstance(f, _OneLineBackgroundErrors) for f in handler.filters):
      handler.addFilter(_OneLineBackgroundErrors())


def _quiet_shutdown() -> None:
  """After a user error: nothing more on stderr. Background threads (orbax's async savers)
  and finalizers can still fail while the interpreter exits; their tracebacks would bury the
  one message, so they are dropped, and library log lines with them, and warnings (a save
  cut short by a full disk leaves orbax coroutines that are never awaited, reported at exit)."""
  threading.excepthook = lambda args: None
  sys.unraisablehook = lambda unraisable: None
  warnings.simplefilter("ignore")
  logging.set_verbosity(logging.FATAL)
  py_logging.getLogger().setLevel(py_logging.CRITICAL)


def fail(prog: str, e: BaseException, code: int) -> int:
  _quiet_shutdown()
  sys.stdout.flush()
  print(f"{prog}: {message(e)}", file=sys.stderr, flush=True)
  return code


def _parse_flags(prog: str, argv: list[str]) -> Argv:
  try:
    rest, overrides = split_overrides(argv)
    positional = flags.FLAGS(rest)
  except (flags.Error, errors.RunError) as e:
    sys.exit(fail(prog, e, user_exit_code(e) or errors.EXIT_BAD_INPUT))
  out = Argv(positional)
  out.overrides = overrides
  return out


def run(main: Callable[[Argv], int | None], prog: str) -> None:
  """``app.run(main)`` with the ``--config.*`` overrides in ``argv.overrides`` and every user
  error as one line (module docstring); exits with ``main``'s return value."""

  def wrapped(argv: Argv) -> int | None:
    _background_errors_in_one_line()
    # JAX logs at INFO each accelerator plugin it probes and does not find (libtpu on every
    # CPU or GPU machine): noise before the one line a failed run prints.
    py_logging.getLogger("jax._src.xla_bridge").setLevel(py_logging.WARNING)
    try:
      return main(argv)
    except KeyboardInterrupt:  # a second Ctrl-C: the first one asked for a save
      return fail(
          prog,
          errors.RunError(
              "interrupted twice: stopped without saving this step; "
              "the newest checkpoint is intact, run again to resume"
          ),
          errors.EXIT_INTERRUPTED,
      )
    except Exception as e:  # pylint: disable=broad-except
      e = distributed.as_peer_lost(e)  # a collective broken by a lost process: its own code
      code = user_exit_code(e)
      if code is None:
        raise  # a bug: the traceback is the report
      return fail(prog, e, code)

  app.run(wrapped, flags_parser=lambda argv: _parse_flags(prog, argv))


def require(name: str, value: Any, example: str) -> Any:
  if value in (None, ""):
    raise errors.RunError(f"--{name} is required, e.g. {example}.")
  return value


def no_extra_args(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise errors.RunError(
        f"unexpected arguments {list(argv[1:])}: every setting is a flag "
        "(--config=..., --workdir=..., --config.<field>=<value>)."
    )
