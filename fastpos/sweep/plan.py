"""The plan of a sweep: the grid, each combination's config resolved as train.py resolves it,
its workdir name, and whether its workdir already holds the finished run."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

from fastpos.train import cli, errors  # loads jax: configs need it anyway
from fastpos.train.workdir import Workdir

_SAFE = re.compile(r"[^A-Za-z0-9._=+-]")


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------
def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
  """``["model.kernel=elu1,sikf", "seed=0,1"]`` -> ``[("model.kernel", ["elu1", "sikf"]), ...]``.

  Values are split on ``|`` when the spec holds one, else on ``,``; a trailing ``|`` marks
  a single value that holds commas (``model.positional=absolute,fastrpb|``).
  """
  grid: list[tuple[str, list[str]]] = []
  for spec in specs:
    key, eq, values = spec.partition("=")
    key = key.strip()
    if key.startswith("--config."):
      key = key[len("--config.") :]
    if not eq or not key:
      raise ValueError(f"grid argument {spec!r} is not key=v1,v2,...")
    if "|" in values:
      vals = [v.strip() for v in values.split("|")]
      if len(vals) > 1 and not vals[-1]:
        vals = vals[:-1]  # "key=a,b|": the single value "a,b"
    else:
      vals = [v.strip() for v in values.split(",")]
    if any(not v for v in vals):
      raise ValueError(f"grid argument {spec!r} has an empty value.")
    if len(set(vals)) != len(vals):
      raise ValueError(f"grid argument {spec!r} repeats a value.")
    if key in (k for k, _ in grid):
      raise ValueError(f"grid key {key!r} is given twice.")
    grid.append((key, vals))
  return grid


def combinations(grid: list[tuple[str, list[str]]]) -> list[dict[str, str]]:
  """The Cartesian product of the grid, first key slowest, as ordered dicts."""
  keys = [k for k, _ in grid]
  return [dict(zip(keys, vals)) for vals in itertools.product(*(v for _, v in grid))]


def run_name(overrides: dict[str, str]) -> str:
  """The workdir name of a combination: ``key=value`` pairs joined by ``__``, sanitised."""
  if not overrides:
    return "default"
  parts = [f"{k}={v.replace(',', '+').replace('/', '_')}" for k, v in overrides.items()]
  return _SAFE.sub("-", "__".join(parts))


# ---------------------------------------------------------------------------------------------
# Configs, resolved as train.py resolves them
# ---------------------------------------------------------------------------------------------
def split_config_spec(spec: str) -> tuple[Path, str | None]:
  """``"configs/x.py:tiny"`` -> (absolute path, "tiny")."""
  path, colon, arg = spec.partition(".py:")
  path = Path(path + ".py" if colon else spec).expanduser()
  if not path.is_absolute():
    path = (Path.cwd() / path).resolve()
  if not path.is_file():
    raise ValueError(f"config file {path} does not exist.")
  return path, (arg if colon else None)


def config_flag(config_path: Path, arg: str | None) -> str:
  return f"--config={config_path}" + (f":{arg}" if arg is not None else "")


def merge_arg(base: str | None, arg_overrides: dict[str, str]) -> str | None:
  """The config argument with ``arg.<name>`` grid values set: ``("tiny", {"kernel": "dpfp"})``
  -> ``"tiny,kernel=dpfp"`` (a name already in ``base`` is replaced in place)."""
  parts: dict[str, str] = {}
  for part in filter(None, (base or "").split(",")):
    parts[part.partition("=")[0].strip()] = part
  for k, v in arg_overrides.items():
    parts[k] = f"{k}={v}"
  return ",".join(parts.values()) or None


def config_argv(config_path: Path, base_arg: str | None, overrides: dict[str, str]) -> list[str]:
  """train.py's config flags for a combination: ``arg.<name>`` keys go into the config
  argument (``--config=x.py:name=value``), the others become ``--config.<key>=<value>``."""
  arg = merge_arg(base_arg, {k[4:]: v for k, v in overrides.items() if k.startswith("arg.")})
  return [
      config_flag(config_path, arg),
      *(f"--config.{k}={v}" for k, v in overrides.items() if not k.startswith("arg.")),
  ]


def load_config(config_path: Path, arg: str | None, overrides: dict[str, str]):
  """The ConfigDict train.py would build from these flags (``fastpos.train.cli``)."""
  arg = merge_arg(arg, {k[4:]: v for k, v in overrides.items() if k.startswith("arg.")})
  return cli.load_config(
      config_flag(config_path, arg)[len("--config=") :],
      [(k, v) for k, v in overrides.items() if not k.startswith("arg.")],
  )


def _last_line(e: Exception) -> str:
  """An error's message; for an error raised inside get_config (absl wraps the whole
  traceback into its message), the traceback's last line, which says what went wrong."""
  msg = str(e).strip()
  return msg.splitlines()[-1] if "Traceback" in msg else msg


def validate(config_path: Path, arg: str | None, grid: list[tuple[str, list[str]]]):
  """Checks the keys against the config, then resolves every combination.

  Returns {run name: (overrides, resolved config as JSON values)}. Raises ValueError naming
  an unknown key (with nearby valid keys), a bad value, or two combinations whose names
  collide after sanitising.
  """
  try:
    base = load_config(config_path, arg, {})
  except Exception as e:  # a broken config file or config argument
    raise ValueError(
        f"cannot load {config_flag(config_path, arg)[9:]}: " f"{type(e).__name__}: {_last_line(e)}"
    ) from e
  _check_keys(config_path, arg, base, grid)
  runs: dict[str, tuple[dict[str, str], dict]] = {}
  for overrides in combinations(grid):
    name = run_name(overrides)
    if name in runs:
      raise ValueError(
          f"the combinations {runs[name][0]} and {overrides} get the same "
          f"workdir name {name!r}; use values that differ in [A-Za-z0-9._=+-]."
      )
    try:
      cfg = load_config(config_path, arg, overrides)
    except Exception as e:  # absl's IllegalFlagValueError names the flag and the value
      kind = "" if isinstance(e, errors.RunError) else f"{type(e).__name__}: "  # says it all
      raise ValueError(f"bad override in {overrides}: {kind}{_last_line(e)}") from e
    resolved = json.loads(cfg.copy_and_resolve_references().to_json_best_effort())
    runs[name] = (overrides, resolved)
  return runs


def _check_keys(
    config_path: Path, arg: str | None, base, grid: list[tuple[str, list[str]]]
) -> None:
  """Raises ValueError for a grid key that is not a field of ``base`` (with the nearby valid
  keys) or names a block of it, and for an ``arg.<name>`` value holding a comma."""
  keys = cli.config_keys(base)
  for key, values in grid:
    if key.startswith("arg."):  # a get_config argument: its names are checked on loading
      if any("," in v for v in values):
        raise ValueError(f"grid key {key!r}: a config argument value cannot hold a comma.")
      continue
    if key not in keys and not key.startswith("model.positional_options."):  # loader checks
      raise ValueError(
          f"unknown override key {key!r}: {config_path.name}"
          f"{':' + arg if arg else ''} has no field config.{key}. Nearby valid keys: "
          f"{', '.join(cli.nearby(key, keys))}."
      )
    if key in keys and hasattr(base[key], "keys"):
      raise ValueError(
          f"override key {key!r} is a block of the config, not a field; set its "
          f"fields ({', '.join(list(base[key].keys())[:8])})."
      )


# ---------------------------------------------------------------------------------------------
# Workdir state
# ---------------------------------------------------------------------------------------------
def latest_checkpoint_step(workdir: Path) -> int | None:
  """The newest checkpoint step of the run in ``workdir`` (the step folders of its
  ``Workdir.checkpoints_dir``, as orbax names them); None when there is none."""
  d = Workdir(workdir).checkpoints_dir
  if not d.is_dir():
    return None
  steps = [int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()]
  return max(steps) if steps else None


def finished(workdir: Path, resolved: dict, split: str = "test") -> tuple[bool, str]:
  """(done?, why not) for a workdir and the config its run should have: the run's effective
  config (``Workdir.config_values``: what it started with, plus the changes its resumes
  recorded) equal to ``resolved``, trained to ``num_train_steps`` and scored on ``split``
  after its config was last recorded."""
  run = Workdir(workdir)
  saved = run.config_values()
  if saved is None:
    return False, "not started"
  config_name = run.config_file.name
  if saved != resolved:
    diff = sorted(_diff_keys(saved, resolved))
    return False, (
        f"the run's config ({config_name} with its recorded changes) differs from the "
        f"sweep's config in {', '.join(diff[:6])}"
    )
  step = latest_checkpoint_step(workdir)
  if step is None or step < resolved["num_train_steps"]:
    return False, f"trained to step {step or 0} of {resolved['num_train_steps']}"
  results = run.results_file(split)
  if not results.exists():
    return False, "trained, not evaluated"
  records = [p for p in (run.config_file, run.changes_file) if p.exists()]
  newest = max(records, key=lambda p: p.stat().st_mtime)
  if results.stat().st_mtime < newest.stat().st_mtime:
    return False, f"{results.name} is older than {newest.name}"
  return True, "done"


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
  if isinstance(a, dict) and isinstance(b, dict):
    out = []
    for k in sorted(set(a) | set(b)):
      out += _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
    return out
  return [] if a == b else [prefix.rstrip(".")]
