"""The run's record of its config: ``config.json`` and ``config_changes.jsonl`` in the workdir
(``fastpos.train.workdir`` names and reads them: ``Workdir.config``).

``config.json`` is the config a run started with; a resume never rewrites it. A resume whose
config differs from the run's (``effective_config``: config.json with the recorded changes
applied) is compared field by field (``compare``): a field that changes the run's results
(``fastpos.config_schema``, ``Field.trajectory``) is refused unless the user allows it
(``train.py --allow_config_change``); the fields that do not (log cadence, data threads,
device layout) change freely. Either way every change is appended to ``config_changes.jsonl``
as one JSON line: {"time": ISO 8601 UTC, "step": the first step run with the new values,
"checkpoint": the step resumed from, "changes": [{"field", "old", "new", "affects_results"}]},
and "data": {"old": digest, "new": fingerprint, "what"} when the task's data changed
(``fastpos.train.identity``; refused as a field that changes results is, unless allowed).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import ml_collections

from fastpos import config_schema
from fastpos.train import errors
from fastpos.train import workdir as workdir_lib
from fastpos.train.errors import RunError

ALLOW_FLAG = "--allow_config_change"
_UNSET = "(unset)"


@dataclasses.dataclass(frozen=True)
class Change:
  """One field whose value differs between the run's config and a resume's."""

  field: str
  old: Any
  new: Any
  affects_results: bool

  def __str__(self) -> str:
    return f"{self.field} {shown(self.old)} -> {shown(self.new)}"

  def to_json(self) -> dict[str, Any]:
    """The entry's form; a side where the field does not exist is left out."""
    out = {
        "field": self.field,
        "old": self.old,
        "new": self.new,
        "affects_results": self.affects_results,
    }
    return {k: v for k, v in out.items() if v is not _MISSING}


_MISSING = object()


def shown(value: Any) -> str:
  """A field's value as a change names it: JSON, or "(unset)" where the field is missing."""
  return _UNSET if value is _MISSING else json.dumps(value)


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{"model.num_layers": 1, ...} of a JSON config (nested dicts joined by dots)."""
  out = {}
  for key, value in values.items():
    if isinstance(value, Mapping) and value:
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def as_json(cfg) -> dict[str, Any]:
  """A ConfigDict as config.json holds it (tuples as lists)."""
  return json.loads(cfg.to_json_best_effort())


def from_json(values: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """The ConfigDict of a JSON config (``as_json``'s inverse: lists were tuples, since configs
  hold no lists)."""
  return ml_collections.ConfigDict(_tuples(dict(values)))


def _tuples(value: Any) -> Any:
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(_tuples(v) for v in value)
  return value


def compare(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
  """Every field whose value differs between JSON configs ``old`` and ``new``, classified."""
  a, b = flatten(old), flatten(new)
  changes = []
  for path in sorted(set(a) | set(b)):
    va, vb = a.get(path, _MISSING), b.get(path, _MISSING)
    if va is _MISSING or vb is _MISSING or not _same(va, vb):
      affects = config_schema.is_trajectory(path, old) or config_schema.is_trajectory(path, new)
      changes.append(Change(path, va, vb, affects))
  return changes


def _same(a: Any, b: Any) -> bool:
  # 1 == 1.0 and True == 1 for Python; a run's record tells them apart only by type.
  return a == b and isinstance(a, bool) == isinstance(b, bool)


def read_changes(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  """The entries of ``<workdir>/config_changes.jsonl`` in order ([] when there is none)."""
  path = workdir_lib.Workdir(workdir).changes_file
  if not path.is_file():
    return []
  entries = []
  for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
    if not line.strip():
      continue
    try:
      entry = json.loads(line)
      if not isinstance(entry, dict) or not isinstance(entry.get("changes"), list):
        raise ValueError("not an entry of changes")
    except ValueError as e:
      raise RunError(
          f"{path}:{number} is not a config change entry ({e}); it is written by "
          "train.py: restore the run's own file."
      ) from None
    entries.append(entry)
  return entries


def apply_changes(values: dict[str, Any], entries: Iterable[Mapping[str, Any]]) -> dict:
  """``values`` (a JSON config) with the recorded changes applied in order (in place)."""
  for entry in entries:
    for change in entry["changes"]:
      *parents, last = change["field"].split(".")
      node = values
      for part in parents:
        node = node.setdefault(part, {})
      if "new" not in change:  # the field was removed
        node.pop(last, None)
      else:
        node[last] = change["new"]
  return values


def read_config(workdir: str | os.PathLike) -> dict[str, Any] | None:
  """The config the run in ``workdir`` started with (its config.json); None when there is
  none. A damaged file raises RunError naming it."""
  path = workdir_lib.Workdir(workdir).config_file
  return read_json(path) if path.is_file() else None


def read_json(path: str | os.PathLike) -> dict[str, Any]:
  """The JSON config in file ``path`` (a run's config.json, or one saved like it); RunError
  naming the file when it does not read as one."""
  try:
    values = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(values, dict):
      raise ValueError(f"a JSON {type(values).__name__}, not an object of fields")
  except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
    raise RunError(
        f"{os.fspath(path)} is not a readable {workdir_lib.CONFIG_NAME} ({e}); it is written by "
        "train.py: "
        "restore the run's own file, or use the configs/*.py it was made from."
    ) from None
  return values


def effective_config(workdir: str | os.PathLike) -> dict[str, Any] | None:
  """The config the run in ``workdir`` last ran with: config.json and its recorded changes;
  None when there is no config.json."""
  values = read_config(workdir)
  return None if values is None else apply_changes(values, read_changes(workdir))


def check_resume(workdir: str | os.PathLike, cfg, *, allow: bool) -> list[Change]:
  """The changes of ``cfg`` against the run in ``workdir`` (none without a config.json).

  Raises:
    RunError: a change of a field that changes the run's results, and ``allow`` is False;
      the one line names each such field with its old and new value.
  """
  before = effective_config(workdir)
  if before is None:
    return []
  changes = compare(before, as_json(cfg))
  refused = [c for c in changes if c.affects_results]
  run = workdir_lib.Workdir(workdir)
  if refused and not allow:
    shown = "; ".join(map(str, refused))
    raise RunError(
        f"the run in {workdir} was made with another config, and resuming it with this one "
        f"would change its results: {shown}. Resume with its config ({run.config_file}"
        f"{', with ' + run.changes_file.name if read_changes(workdir) else ''}), use another "
        f"--workdir, or pass {ALLOW_FLAG} to accept the change (it is recorded in "
        f"{run.changes_file.name})."
    )
  return changes


def record(
    workdir: str | os.PathLike,
    checkpoint_step: int,
    changes: list[Change],
    data: Mapping[str, Any] | None = None,
) -> dict:
  """Appends one entry for ``changes`` (a resume from ``checkpoint_step``) and, when the data
  changed, ``data`` ({"old": digest, "new": fingerprint, "what": a few words}); returns it."""
  entry = {
      "time": utc_now(),
      "step": checkpoint_step + 1,
      "checkpoint": checkpoint_step,
      "changes": [c.to_json() for c in changes],
  }
  if data is not None:
    entry["data"] = dict(data)
  append_line(workdir_lib.Workdir(workdir).changes_file, entry)
  return entry


def utc_now() -> str:
  """The time of a record's entry: ISO 8601, UTC, to the second."""
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def append_line(path: str | os.PathLike, entry: Mapping[str, Any]) -> None:
  """Appends ``entry`` to ``path`` as one JSON line and syncs it to disk; a failed write
  raises an OSError naming ``path``."""
  with errors.names_file(path), open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps(entry) + "\n")
    f.flush()
    os.fsync(f.fileno())


def describe(entries: Iterable[Mapping[str, Any]]) -> str:
  """The changes that affect results, for the summary line ("" when none):
  "config changed at step 3: seed 0 -> 1; ..." """
  parts = []
  for entry in entries:
    items = [
        f"{c['field']} {shown(c.get('old', _MISSING))} -> {shown(c.get('new', _MISSING))}"
        for c in entry["changes"]
        if c.get("affects_results")
    ]
    if entry.get("data", {}).get("what"):
      items.append(f"data ({entry['data']['what']})")
    if items:
      parts.append(f"at step {entry['step']}: {', '.join(items)}")
  return f"config changed {'; '.join(parts)} ({workdir_lib.CHANGES_NAME})" if parts else ""
