"""The run's record of its launches: ``launches.jsonl`` in the workdir, one line per start.

A number depends on more than the config: the code, the library versions, the devices and the
command. Every start of the trainer, from scratch or resumed, appends one JSON line (process 0
writes; the file is never rewritten):

  {"time": ISO 8601 UTC, "first_step": the first step this launch runs (1 from scratch),
   "resumed_from": the checkpoint's path or null, "command": the process's argv,
   "host": its hostname, "processes", "devices": {"count", "platform", "kind"},
   "mesh": {axis: size}, "versions": {"python", "fastpos", "jax", "jaxlib", "flax", "optax",
   "orbax-checkpoint", "grain", "numpy", "ml-collections"}, "source": {"commit", "dirty"} or
   null}

``source`` is the git commit of the checkout fastpos was imported from and whether tracked
files differ from it (null where fastpos is not in a git checkout or git is not installed).
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
from typing import Any, Mapping

import jax

from fastpos.train import config_record

LAUNCHES_NAME = "launches.jsonl"
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


def source(package_dir: str | os.PathLike | None = None) -> dict[str, Any] | None:
  """``{"commit", "dirty"}`` of the git checkout holding ``package_dir`` (default: fastpos's
  own folder), or None where it is in none, git is missing or does not answer in time."""
  where = Path(package_dir or Path(__file__).resolve().parents[1])

  def git(*args) -> str:
    return subprocess.run(
        ["git", "-C", str(where), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=_GIT_SECONDS,
    ).stdout.strip()

  try:
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
  config_record.append_line(Path(workdir) / LAUNCHES_NAME, line)
  return line


def read(workdir: str | os.PathLike) -> list[dict]:
  """The launches recorded in ``workdir``, oldest first ([] before the first)."""
  path = Path(workdir) / LAUNCHES_NAME
  if not path.is_file():
    return []
  return [json.loads(s) for s in path.read_text(encoding="utf-8").splitlines() if s.strip()]
