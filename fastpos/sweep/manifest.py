"""``SWEEP_DIR/sweep.json``, the manifest of a sweep: the config, the grid and one record per
run (overrides, workdir, log, status, return code, wall time, commands, resolved config)."""

from __future__ import annotations

import datetime
import json
import threading
from pathlib import Path

MANIFEST = "sweep.json"


def now() -> str:
  """The local time to the second, as the manifest and the logs write it."""
  return datetime.datetime.now().isoformat(timespec="seconds")


class Manifest:
  """``sweep.json``: written atomically (tmp + rename) under a lock after every change."""

  def __init__(
      self, sweep_dir: Path, config: str, grid: list[tuple[str, list[str]]], *, write: bool
  ):
    self.path = sweep_dir / MANIFEST
    self.write_enabled = write
    self.lock = threading.Lock()
    try:
      old = json.loads(self.path.read_text()) if self.path.exists() else None
    except (OSError, ValueError) as e:
      raise ValueError(
          f"cannot read the manifest {self.path}: {e}; move it away (the runs' "
          "workdirs stay usable) or use another --sweep_dir."
      ) from e
    if old is not None and old.get("config") != config:
      raise ValueError(
          f"{sweep_dir} holds a sweep of {old.get('config')!r}, not {config!r}; "
          "use another --sweep_dir."
      )
    self.data = {
        "config": config,
        "grid": {k: v for k, v in grid},
        "created": old["created"] if old else now(),
        "updated": now(),
        "runs": {},
    }
    if old:  # keep the records of runs outside this grid (an earlier, larger grid)
      self.data["runs"].update(old.get("runs", {}))

  def set(self, name: str, **fields) -> None:
    with self.lock:
      self.data["runs"].setdefault(name, {}).update(fields)
      self.data["updated"] = now()
      self._write()

  def save(self) -> None:
    """Writes ``sweep.json`` now (unless the manifest was made with ``write=False``)."""
    with self.lock:
      self._write()

  def _write(self) -> None:
    if not self.write_enabled:
      return
    self.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = self.path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(self.data, indent=2))
    tmp.replace(self.path)
