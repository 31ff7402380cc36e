"""Tasks: data plus a metric, one module per task, found by name (``config.task.name``).

``make_task(config.task)`` builds a task (``fastpos.tasks.base.Task``); ``task_info(config.task)``
gives its ``TaskInfo`` without reading any data; ``task_config(name)`` is the task's default
``config.task`` block for experiment files. A new task is a module with a ``Task`` subclass
listed in ``TASK_MODULES``.

Tasks named in ``PLANNED`` are not built yet: their shape is
known (so configs for them load and build their models) but asking for their data raises.
"""

from __future__ import annotations

import importlib

import ml_collections

from fastpos.models.config import TaskInfo
from fastpos.tasks.base import SPLITS, ArraySource, Task

# name -> "module:Class", imported on use (a task's module may pull in heavy readers).
TASK_MODULES = {
    "synthetic": "fastpos.tasks.synthetic:SyntheticTask",
    "listops": "fastpos.tasks.listops_task:ListOpsTask",
    "lra_text": "fastpos.tasks.text:TextTask",
    "lra_image": "fastpos.tasks.image:LraImageTask",
    "mnist": "fastpos.tasks.image:MnistTask",
    "wikitext103": "fastpos.tasks.wikitext:WikiTextTask",
    "lra_retrieval": "fastpos.tasks.retrieval:RetrievalTask",
    "pathfinder": "fastpos.tasks.pathfinder:PathfinderTask",
}

# Tasks that are not built yet: name -> the shape their data will have
# (none left).
PLANNED: dict[str, TaskInfo] = {}


def task_names() -> tuple[str, ...]:
  return tuple(TASK_MODULES)


def _unknown(name: str) -> ValueError:
  planned = f"; planned, not built yet: {', '.join(PLANNED)}" if PLANNED else ""
  return ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASK_MODULES)}{planned}.")


def get_task_class(name: str) -> type[Task]:
  """The Task class registered as ``name``."""
  if name in PLANNED:
    raise NotImplementedError(
        f"task {name!r} is not built yet; built tasks: "
        f"{', '.join(TASK_MODULES)}.")
  if name not in TASK_MODULES:
    raise _unknown(name)
  module, cls = TASK_MODULES[name].split(":")
  return getattr(importlib.import_module(module), cls)


def task_config(name: str) -> ml_collections.ConfigDict:
  """The default ``config.task`` block of task ``name`` (every field commented in its module)."""
  if name in PLANNED:
    c = ml_collections.ConfigDict()
    c.name = name
    c.data_dir = ""  # where the task's data will be read from
    c.max_length = PLANNED[name].max_length
    return c
  return get_task_class(name).default_config()


def task_info(cfg: ml_collections.ConfigDict) -> TaskInfo:
  """The ``TaskInfo`` of ``config.task`` (no data read; works for planned tasks too)."""
  name = cfg.get("name")
  if name in PLANNED:
    p = PLANNED[name]
    return TaskInfo(kind=p.kind, vocab_size=p.vocab_size, num_classes=p.num_classes,
                    max_length=cfg.get("max_length", p.max_length), grid=p.grid)
  return get_task_class(name).info_from_config(cfg)


def make_task(cfg: ml_collections.ConfigDict) -> Task:
  """Builds the task ``cfg.name`` from its config block (data are read on first use)."""
  name = cfg.get("name")
  cls = get_task_class(name)
  unknown = sorted(set(cfg.keys()) - set(cls.default_config().keys()))
  if unknown:
    raise ValueError(f"unknown field(s) {unknown} in config.task for task {name!r}; valid "
                     f"fields: {', '.join(sorted(cls.default_config().keys()))}.")
  return cls(cfg)


__all__ = ["SPLITS", "ArraySource", "Task", "TASK_MODULES", "PLANNED", "get_task_class",
           "make_task", "task_config", "task_info", "task_names"]
