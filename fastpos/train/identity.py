"""A run is one thing: the identity that binds checkpoints and records to the run that made them.

At its first start a run gets an identity, written once to ``<workdir>/run.json`` (never
rewritten)::

  {"id": a random uuid (hex), "time": ISO 8601 UTC, "data": the task's data fingerprint
   (``fastpos.tasks.Task.fingerprint``)}

Its config is ``config.json`` with the changes of ``config_changes.jsonl`` applied in order
(``fastpos.train.config_record``); an accepted change of the data (``--allow_config_change``)
is an entry there too. Every checkpoint, ``best/`` included, carries in its digest-verified
metadata (``meta["run"]``) what it was trained as::

  {"id", "trajectory": {field: value} of the config's fields that change results
   (``fastpos.config_schema``, ``Field.trajectory``), "data": the data fingerprint's digest,
   "model_format": the oldest model format its parameters were trained under
   (``fastpos.train.launches``), "changes": entries of config_changes.jsonl, "launches": lines
   of launches.jsonl when it was saved}

Every restore (a resume, ``eval.py``, ``fastpos.load``, ``scripts/generate.py``) reads the
workdir's record (``read_record``) and refuses (``Record.check``, a RunError of one line naming
the checkpoint, what differs and the fix) a checkpoint of another run (another id), or one whose
trajectory or data are not in the record's history (``config.json`` edited or replaced by hand,
a record file missing or cut short). A checkpoint written before checkpoints carried an identity
is accepted as the run's, with one notice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import Any, Mapping

from absl import logging

from fastpos import config_schema
from fastpos.train import config_record, digest, errors, launches
from fastpos.train import workdir as workdir_lib
from fastpos.train.errors import RunError


def trajectory(values: Mapping[str, Any]) -> dict[str, Any]:
  """``{field path: value}`` of the fields of a JSON config (``config_record.as_json``) whose
  value changes the run's results."""
  flat = config_record.flatten(values)
  return {p: v for p, v in flat.items() if config_schema.is_trajectory(p, values)}


def data_digest(fingerprint: Mapping[str, Any] | None) -> str | None:
  """A short digest of a data fingerprint (None for None)."""
  return None if fingerprint is None else digest.json_digest(fingerprint)[:32]


def new_id() -> str:
  return uuid.uuid4().hex


def differences(old: Mapping[str, Any], new: Mapping[str, Any], limit: int = 4) -> str:
  """``"seed 0 -> 1, optimizer.learning_rate 0.01 -> 0.5"`` of two flat dicts (the first
  ``limit``; how many more)."""
  changes = config_record.compare(old, new)
  shown = ", ".join(map(str, changes[:limit]))
  return shown + (f" and {len(changes) - limit} more" if len(changes) > limit else "")


def data_differences(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> str:
  """What differs between two data fingerprints beyond their settings (which are config
  fields, compared as such), in a few words: files changed, added or removed, the
  vocabulary; "" when nothing else differs."""
  old, new = dict(old or {}), dict(new or {})
  parts = []
  if "files" in old or "files" in new:
    a, b = dict(old.get("files", [])), dict(new.get("files", []))
    parts += [f"{p} changed" for p in a if p in b and a[p] != b[p]][:3]
    parts += [f"{p} added" for p in b if p not in a][:3]
    parts += [f"{p} removed" for p in a if p not in b][:3]
    if not parts and list(a) != list(b):
      parts.append("the files' order changed")
  for key in sorted((set(old) | set(new)) - {"files", "settings"}):
    if old.get(key) != new.get(key):
      parts.append(f"the {key} differs")
  return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class Record:
  """A workdir's record of its run (``read_record``).

  workdir: the folder. id: the run's id (None: no run.json). start: run.json's fields.
  trajectories: the trajectory of config.json, then after each entry of config_changes.jsonl.
  data: the data fingerprint of run.json, then of each accepted data change (its last entry is
  the data the run trains on now; [] without run.json). data_digests: their digests.
  changes: the entries of config_changes.jsonl. launches: the lines of launches.jsonl.
  """

  workdir: Path
  id: str | None
  start: dict[str, Any] | None
  trajectories: list[dict[str, Any]]
  data: list[Any]
  changes: list[dict[str, Any]]
  launches: int

  @property
  def data_digests(self) -> list[str | None]:
    return [data_digest(d) for d in self.data]

  def check(self, meta: Mapping[str, Any], path: Path, *, records: bool = False) -> None:
    """Raises RunError (one line: ``path``, what differs, the fix) when the checkpoint whose
    verified ``meta`` this is belongs to another run than this record's, or was trained with
    a trajectory or data its history does not hold. ``records``: also that no record file
    the checkpoint counted is missing or cut short (a resume, which appends to them)."""
    ident = meta.get("run")
    if ident is None:
      logging.warning(
          "checkpoint %s was written by an earlier fastpos, without a run identity: accepted as "
          "this run's (legacy).",
          path,
      )
      return
    w = self.workdir
    if self.id is None or not self.trajectories:
      names = (workdir_lib.CONFIG_NAME, workdir_lib.RUN_NAME)
      missing = [n for n in names if not (w / n).is_file()]
      raise RunError(
          f"{' and '.join(f'{w}/{n}' for n in missing)} {'is' if len(missing) == 1 else 'are'} "
          f"missing, but checkpoint {path} belongs to run {ident['id']}: restore the run's "
          f"record from a copy of the workdir, or start over with train.py --fresh (the "
          f"records move to {w}/previous/)."
      )
    if ident["id"] != self.id:
      raise RunError(
          f"checkpoint {path} belongs to another run (id {ident['id'][:12]}, not "
          f"{self.id[:12]}: {self._versus(ident['trajectory'])}): move it out of {w}, or use "
          f"it from the workdir of its own run."
      )
    if records:
      self._check_counts(ident, path)
    if ident["trajectory"] not in self.trajectories:
      near = min(
          self.trajectories, key=lambda t: len(config_record.compare(ident["trajectory"], t))
      )
      raise RunError(
          f"checkpoint {path} was trained with {_trained_with(ident['trajectory'], near)}, "
          f"but the run's record ({w}/{workdir_lib.CONFIG_NAME} with "
          f"{workdir_lib.CHANGES_NAME}) says otherwise: the record was edited or replaced. "
          f"Restore it; change a setting with --config.<field>=<value> "
          f"{config_record.ALLOW_FLAG} (recorded in {workdir_lib.CHANGES_NAME})."
      )
    if ident.get("data") not in self.data_digests:
      raise RunError(
          f"checkpoint {path} was trained on data (fingerprint {ident.get('data')}) that the "
          f"run's record ({workdir_lib.RUN_NAME}, {workdir_lib.CHANGES_NAME}) does not name: "
          "restore the "
          f"record, or move the checkpoint out of {w}."
      )

  def _versus(self, other: Mapping[str, Any]) -> str:
    diff = differences(self.trajectories[-1], other)
    return (
        f"its config differs from this run's in {diff}"
        if diff
        else "the same config, another start"
    )

  def _check_counts(self, ident: Mapping[str, Any], path: Path) -> None:
    w = self.workdir
    for name, have, want in (
        (workdir_lib.CHANGES_NAME, len(self.changes), ident.get("changes", 0)),
        (workdir_lib.LAUNCHES_NAME, self.launches, ident.get("launches", 0)),
    ):
      if have < want:
        state = "is missing" if not (w / name).exists() else f"holds {have} line(s)"
        raise RunError(
            f"{w}/{name} {state}, but checkpoint {path} was saved after {want}: the run's "
            f"record was lost or cut short. Restore {name} from a copy of the workdir, or start "
            f"over with --fresh (the records move to {w}/previous/)."
        )
    metrics = workdir_lib.Workdir(w).metrics_file
    if not metrics.is_file():
      raise RunError(
          f"{metrics} is missing, but {path} holds a checkpoint of this run: restore it from a "
          f"copy of the workdir, or start over with --fresh (the records move to {w}/previous/)."
      )
    _check_jsonl(metrics)


def _trained_with(saved: Mapping[str, Any], record: Mapping[str, Any]) -> str:
  changes = config_record.compare(record, saved)  # old: the record's, new: the checkpoint's
  parts = [
      f"{c.field} {config_record.shown(c.new)} (the record: {config_record.shown(c.old)})"
      for c in changes[:4]
  ]
  return ", ".join(parts) + (f" and {len(changes) - 4} more" if len(changes) > 4 else "")


def _check_jsonl(path: Path) -> None:
  """Raises RunError naming the first line of ``path`` that is not a JSON record (a cut-off
  last line, left by a crash, is allowed: the writer drops it)."""
  try:
    lines = path.read_text(encoding="utf-8").split("\n")
  except (OSError, UnicodeDecodeError) as e:
    raise RunError(f"{path} cannot be read ({e}); restore it from a copy of the workdir.") from None
  last = len(lines) - (1 if lines and lines[-1] == "" else 0)
  for number, line in enumerate(lines[:last], 1):
    try:
      if not isinstance(json.loads(line), dict):
        raise ValueError("not a record")
    except ValueError as e:
      if number == last and not path.read_bytes().endswith(b"\n"):
        continue  # torn by a crash
      raise RunError(
          f"{path}:{number} is not a JSON record ({e}); it is written by train.py: restore the "
          "run's own file from a copy of the workdir."
      ) from None


def read_start(workdir: str | os.PathLike) -> dict[str, Any] | None:
  """run.json's fields (None when there is none); RunError naming it when damaged."""
  path = workdir_lib.Workdir(workdir).run_file
  if not path.is_file():
    return None
  try:
    value = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(value, dict) or not isinstance(value.get("id"), str):
      raise ValueError("no run id")
  except (ValueError, UnicodeDecodeError) as e:
    raise RunError(
        f"{path} is not a readable run record ({e}); it is written by train.py: restore the "
        "run's own file from a copy of the workdir."
    ) from None
  return value


def read_record(workdir: str | os.PathLike) -> Record:
  """The record of the run in ``workdir`` (no id and no trajectories where run.json or
  config.json is missing). Damaged files raise RunError naming them."""
  workdir = Path(workdir).absolute()
  values = config_record.read_config(workdir)
  entries = config_record.read_changes(workdir)
  start = read_start(workdir)
  trajectories, data = ([] if values is None else [trajectory(values)]), []
  if start is not None:
    data.append(start.get("data"))
  for entry in entries:
    if values is not None:
      config_record.apply_changes(values, [entry])
      trajectories.append(trajectory(values))
    if "data" in entry:
      data.append(entry["data"]["new"])
  return Record(
      workdir=workdir,
      id=None if start is None else start["id"],
      start=start,
      trajectories=trajectories,
      data=data,
      changes=entries,
      launches=len(launches.read(workdir)),
  )


def write_start(workdir: str | os.PathLike, fingerprint: Any) -> dict[str, Any]:
  """Writes run.json for a run that starts now (a new id); returns its fields."""
  start = {"id": new_id(), "time": config_record.utc_now(), "data": fingerprint}
  path = workdir_lib.Workdir(workdir).run_file
  tmp = path.with_suffix(".json.tmp")
  with errors.names_file(path):
    tmp.write_text(json.dumps(start, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
  return start


def stamp(
    run_id: str, cfg, fingerprint: Any, model_format: int, changes: int, launches: int
) -> dict[str, Any]:
  """What every checkpoint this launch saves records of its run (``meta["run"]``)."""
  return {
      "id": run_id,
      "trajectory": trajectory(config_record.as_json(cfg)),
      "data": data_digest(fingerprint),
      "model_format": int(model_format),
      "changes": int(changes),
      "launches": int(launches),
  }


def check_data(record: Record, fingerprint: Any, *, allow: bool) -> dict[str, Any] | None:
  """The change of the task's data at a resume (``fingerprint``, the task's now, against the
  record's last): None when they are the same, or the record names none (a run started before
  runs recorded their data; run.json records it now). Else {"old": digest, "new": fingerprint,
  "what": what differs beyond the settings, or ""} when ``allow`` or only the settings (config
  fields, checked as such) differ; a RunError naming what differs otherwise."""
  if not record.data or data_digest(record.data[-1]) == data_digest(fingerprint):
    return None
  what = data_differences(record.data[-1], fingerprint)
  if what and not allow:  # the settings alone: config fields, compared and refused as such
    raise RunError(
        f"the data of the run in {record.workdir} changed since the run recorded them ({what}): "
        f"resuming would train on other data. Restore the data, use another --workdir, or pass "
        f"{config_record.ALLOW_FLAG} to accept the change (it is recorded in "
        f"{workdir_lib.CHANGES_NAME})."
    )
  return {"old": data_digest(record.data[-1]), "new": fingerprint, "what": what}
