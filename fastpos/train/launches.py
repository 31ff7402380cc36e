"""The run's record of its launches: ``launches.jsonl`` in the workdir, one line per start.

A number depends on more than the config: the code, the library versions, the devices and the
command. Every start of the trainer, from scratch or resumed, appends one JSON line (process 0
writes; the file is never rewritten):

  {"time": ISO 8601 UTC, "first_step": the first step this launch runs (1 from scratch),
   "resumed_from": the checkpoint's path or null, "command": the process's argv,
   "host": its hostname, "processes", "devices": {"count", "platform", "kind"},
   "mesh": {axis: size}, "versions": {"python", "fastpos", "jax", "jaxlib", "flax", "optax",
   "orbax-checkpoint", "grain", "numpy", "ml-collections"}, "source": {"commit", "dirty"} or
   null, "model_format": ``MODEL_FORMAT``}

``source`` is the git commit of the checkout fastpos was imported from and whether tracked
files differ from it (null where fastpos is not imported from a checkout of its own, or git
is not installed).

``model_format`` says which function a config and its parameters compute. It goes up when a
change of fastpos makes the same config and parameters compute another function; each step's
``FORMAT_CHANGES`` entry names the configs it changes. ``check_format`` refuses to resume,
evaluate or load a checkpoint trained under an older format that such a change touches. A
checkpoint's verified metadata records its format (``checkpoint_format``); for one written
before they did, the launches say it (a run with checkpoints but no launch record is format 1:
it predates it).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import jax

from fastpos import positional
from fastpos.train import config_record
from fastpos.train import workdir as workdir_lib
from fastpos.train.errors import RunError

# The distributions a result depends on (as pip names them).
DISTRIBUTIONS = (
    "fastpos",
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "grain",
    "numpy",
    "ml-collections",
)
# The current model format, and for each step up to it what changed and which configs
# (``model`` ConfigDicts) compute another function because of it.
MODEL_FORMAT = 2
FORMAT_CHANGES: dict[int, tuple[str, Callable[[Any], bool]]] = {
    2: (
        "under model.scan_layers SPE draws each layer's noise as the unrolled layer does "
        "(before, the scanned layers drew theirs otherwise)",
        lambda model: bool(model.get("scan_layers", False))
        and "spe" in positional.parse_names(model.positional),
    ),
}
_GIT_SECONDS = 10  # a hung git (a network file system) must not hold the run


def versions() -> dict[str, str | None]:
  """Python's and each of ``DISTRIBUTIONS``' installed version (None where not installed)."""
  out: dict[str, str | None] = {"python": platform.python_version()}
  for name in DISTRIBUTIONS:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def source(root: str | os.PathLike | None = None) -> dict[str, Any] | None:
  """``{"commit", "dirty"}`` of the git checkout whose top folder is ``root`` (default: the
  folder holding the fastpos package), or None where ``root`` is no checkout's top (fastpos
  installed into site-packages, even inside another project's checkout), git is missing or
  does not answer in time."""
  where = Path(root or Path(__file__).resolve().parents[2]).resolve()

  def git(*args) -> str:
    return subprocess.run(
        ["git", "-C", str(where), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=_GIT_SECONDS,
    ).stdout.strip()

  try:
    if Path(git("rev-parse", "--show-toplevel")).resolve() != where:
      return None  # another project's checkout holds this folder
    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
  except (OSError, subprocess.SubprocessError):
    return None
  return {"commit": commit, "dirty": dirty}


def entry(first_step: int, resumed_from: str | None, mesh_shape: Mapping[str, int]) -> dict:
  """This launch's line (module docstring)."""
  devices = jax.devices()
  return {
      "time": config_record.utc_now(),
      "first_step": int(first_step),
      "resumed_from": resumed_from,
      "command": list(sys.argv),
      "host": socket.gethostname(),
      "processes": jax.process_count(),
      "devices": {
          "count": len(devices),
          "platform": devices[0].platform,
          "kind": devices[0].device_kind,
      },
      "mesh": {str(k): int(v) for k, v in mesh_shape.items()},
      "versions": versions(),
      "source": source(),
      "model_format": MODEL_FORMAT,
  }


def record(
    workdir: str | os.PathLike,
    first_step: int,
    resumed_from: str | None,
    mesh_shape: Mapping[str, int],
) -> dict | None:
  """Appends this launch's line to ``<workdir>/launches.jsonl``, synced to disk, and returns
  it (process 0; None on the others). A failed write raises an OSError naming the file."""
  if jax.process_index() != 0:
    return None
  line = entry(first_step, resumed_from, mesh_shape)
  config_record.append_line(workdir_lib.Workdir(workdir).launches_file, line)
  return line


def read(workdir: str | os.PathLike) -> list[dict]:
  """The launches recorded in ``workdir``, oldest first ([] before the first). A line that is
  not a JSON object (cut off by an interrupted write, or edited) raises RunError naming the
  file, the line and the fix."""
  path = workdir_lib.Workdir(workdir).launches_file
  if not path.is_file():
    return []
  data = path.read_bytes()
  out = []
  for n, raw in enumerate(data.splitlines(), 1):
    if not raw.strip():
      continue
    try:
      line = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # not UTF-8, or not JSON
      cut = " (cut off: its write was interrupted)" if n == data.count(b"\n") + 1 else ""
      raise _bad_line(path, n, f"is not JSON{cut}: {getattr(e, 'msg', e)}") from None
    if not isinstance(line, dict):
      raise _bad_line(path, n, f"is a JSON {type(line).__name__}, not a launch record (an object)")
    out.append(line)
  return out


def _bad_line(path: Path, n: int, what: str) -> RunError:
  return RunError(
      f"{path}:{n} {what}. The file records the run's launches, one JSON object per line: "
      "fix that line or delete it, then run again."
  )


def trained_format(workdir: str | os.PathLike) -> int:
  """The oldest model format the run's launches trained under: 1 where the record is missing
  or begins with a resume (the run started before fastpos kept it)."""
  lines = read(workdir)
  formats = [int(e.get("model_format", 1)) for e in lines]
  if not lines or lines[0].get("first_step", 1) > 1:
    formats.append(1)
  return min(formats)


def checkpoint_format(workdir: str | os.PathLike, meta: Mapping[str, Any]) -> int:
  """The oldest model format a checkpoint's parameters were trained under: what its verified
  metadata records (``fastpos.train.identity``), else (a checkpoint written before they
  recorded it) what the run's launches say (``trained_format``)."""
  run = meta.get("run") or {}
  if "model_format" in run:
    return int(run["model_format"])
  return trained_format(workdir)


def check_format(workdir: str | os.PathLike, cfg, doing: str, trained: int | None = None) -> None:
  """Raises RunError when the run in ``workdir`` trained its checkpoints under an older model
  format whose later changes touch ``cfg`` (its parameters would compute another function
  here). ``doing``: what was asked ("resume", "evaluate", "load"), for the message.
  ``trained``: the format of the checkpoint to use (``checkpoint_format``); None: what the
  launches say."""
  if trained is None:
    run = workdir_lib.Workdir(workdir)
    if not (run.checkpoints_dir.is_dir() or run.best_dir.is_dir()):
      return  # nothing trained here yet
    trained = trained_format(workdir)
  old = trained
  changed = [what for n, (what, hits) in FORMAT_CHANGES.items() if n > old and hits(cfg.model)]
  if changed:
    raise RunError(
        f"cannot {doing} the run in {workdir}: it was trained by an older fastpos (model "
        f"format {old}; this one is {MODEL_FORMAT}) and since then {'; '.join(changed)}, so "
        "its checkpoints would compute another function here. Use the fastpos version that "
        "trained it, or train the run again."
    )
