"""Reading a ``--config`` value: a config file's ``get_config(arg)`` or a run's ``config.json``.

``read("configs/x.py:arg")`` executes the file with its package (``configs/``) importable from
any current folder and returns what ``get_config(arg)`` returns; ``read("<workdir>/config.json")``
returns the config a run saved, with the changes its resumes recorded. Every failure is a
``ConfigError`` with one line naming the file (and line) and the fix. ``list_configs(folder)``
is ``train.py --list_configs``. ``fastpos.train.cli`` puts these behind the ``--config`` flag.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import os
import re
import sys
import traceback
from pathlib import Path

import ml_collections

from fastpos.train import config_record, errors
from fastpos.train import workdir as workdir_lib


class ConfigError(errors.RunError):
  """A config file, config argument or override that cannot be used (exit code 2)."""


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


def config_from_json(path: str | os.PathLike) -> ml_collections.ConfigDict:
  """The config saved in JSON file ``path``; a run's ``config.json`` is its run's config, with
  the changes its resumes recorded (``workdir.Workdir.config``)."""
  path = Path(path)
  if path.name == workdir_lib.CONFIG_NAME:
    return workdir_lib.Workdir(path.parent).config()
  return config_record.from_json(config_record.read_json(path))


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


def read(spec: str) -> ml_collections.ConfigDict:
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
