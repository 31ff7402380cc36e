"""Checkpoints in the workdir (orbax): the last few for resuming, the best one for eval.

Layout::

  <workdir>/checkpoints/<step>/{state, data, meta}   every checkpoint_every_steps, at each
                                                     evaluation, at the end and on SIGTERM;
                                                     the last config.keep_checkpoints kept
  <workdir>/best/<step>/{state, meta}                 the best by the validation metric

``state`` is the ``TrainState`` (step, params, optimizer state, other collections); ``data`` the
grain iterator position (one JSON file per process); ``meta`` a JSON record: step, the
training RNG key, the model and task config blocks (a resumed run must match them) and, in
best/, the validation metrics. Orbax writes each step into a temporary folder and renames it
when complete, so a crash mid-save leaves the previous checkpoint as the newest usable one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import grain
import ml_collections
import orbax.checkpoint as ocp

from fastpos.models.config import TaskInfo


def _normalize(block: Any) -> Any:
  """A config block as plain JSON values (tuples -> lists), for comparisons."""
  if isinstance(block, ml_collections.ConfigDict):
    block = block.to_dict()
  return json.loads(json.dumps(block, default=str))


def config_meta(cfg: ml_collections.ConfigDict, info: TaskInfo) -> dict[str, Any]:
  """What a checkpoint's parameters belong to: the model block and the task's shape."""
  return {"model": _normalize(cfg.model),
          "task": _normalize({"name": cfg.task.name, **dataclasses.asdict(info)})}


def _manager(directory: Path, *, keep: int, async_save: bool, items: tuple[str, ...],
             read_only: bool = False) -> ocp.CheckpointManager:
  handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
  if "data" in items:
    handlers["data"] = grain.checkpoint.CheckpointHandler()
  options = ocp.CheckpointManagerOptions(
      max_to_keep=None if read_only else keep, create=not read_only, read_only=read_only,
      save_interval_steps=0 if read_only else 1,
      enable_async_checkpointing=async_save, cleanup_tmp_directories=not read_only)
  return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


class Checkpoints:
  """The workdir's two checkpoint managers (latest and best)."""

  def __init__(self, workdir: str | Path, cfg: ml_collections.ConfigDict, *,
               read_only: bool = False):
    workdir = Path(workdir).absolute()
    self.latest_dir, self.best_dir = workdir / "checkpoints", workdir / "best"
    self.read_only = read_only
    if read_only and not self.latest_dir.exists():
      self.latest = self.best = None
      return
    self.latest = _manager(self.latest_dir, keep=cfg.keep_checkpoints,
                           async_save=cfg.async_checkpoints, items=("state", "data", "meta"),
                           read_only=read_only)
    self.best = None
    if not read_only or self.best_dir.exists():
      self.best = _manager(self.best_dir, keep=1, async_save=cfg.async_checkpoints,
                           items=("state", "meta"), read_only=read_only)

  # Reading.
  def latest_step(self) -> int | None:
    return self.latest.latest_step() if self.latest else None

  def best_step(self) -> int | None:
    return self.best.latest_step() if self.best else None

  def read_meta(self, which: str = "latest", step: int | None = None) -> dict[str, Any] | None:
    manager = self.latest if which == "latest" else self.best
    if manager is None:
      return None
    step = manager.latest_step() if step is None else step
    if step is None:
      return None
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def check_compatible(self, cfg: ml_collections.ConfigDict, info: TaskInfo) -> None:
    """Stops when the newest checkpoint belongs to a different model or task."""
    meta = self.read_meta("latest")
    if meta is None:
      return
    want = config_meta(cfg, info)
    for block in ("model", "task"):
      saved, now = meta["config"][block], want[block]
      if saved != now:
        diffs = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diffs)
        raise ValueError(
            f"{self.latest_dir} holds a checkpoint (step {meta['step']}) of a different "
            f"{block} (config.{block} differs in {detail}). Use a new --workdir, or the config "
            f"that made it (its config.json).")

  def restore(self, abstract_state: Any, data_iter=None, which: str = "latest",
              step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """(state, meta) of a checkpoint; restores ``data_iter``'s position in place if given."""
    manager = self.latest if which == "latest" else self.best
    step = manager.latest_step() if step is None else step
    args = {"state": ocp.args.StandardRestore(abstract_state), "meta": ocp.args.JsonRestore()}
    if data_iter is not None:
      args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    out = manager.restore(step, args=ocp.args.Composite(**args))
    return out["state"], out["meta"]

  # Writing.
  def save(self, step: int, state: Any, data_iter, meta: dict[str, Any]) -> None:
    self.latest.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iter),
        meta=ocp.args.JsonSave(meta)), force=True)

  def save_best(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    self.best.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

  def wait(self) -> None:
    for m in (self.latest, self.best):
      if m is not None:
        m.wait_until_finished()

  def close(self) -> None:
    for m in (self.latest, self.best):
      if m is not None:
        m.close()
