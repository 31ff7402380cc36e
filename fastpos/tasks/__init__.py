"""Tasks: data plus a metric, one module per task, found by name (``config.task.name``).

``make_task(config.task)`` builds a task (``fastpos.tasks.base.Task``) from its complete block;
``task_info(config.task)`` gives its ``TaskInfo`` without reading any data; ``task_config(name)``
is the task's default ``config.task`` block, built from the fields its class declares
(``Task.config_fields``). A new task is a module with a ``Task`` subclass (its fields declared
on the class) and one line in ``TASK_MODULES``; the config's schema
(``fastpos.config_schema``) finds its fields there.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fastpos.tasks.base import SPLITS, ArraySource, Task
from fastpos.tasks.info import TaskInfo

if TYPE_CHECKING:  # at run time this package imports numpy only (scripts/download_data.py)
  import ml_collections

# name -> "module:Class", imported on use (a task's module may pull in heavy readers).
TASK_MODULES = {
    "synthetic": "fastpos.tasks.synthetic:SyntheticTask",
    "listops": "fastpos.tasks.listops:ListOpsTask",
    "lra_text": "fastpos.tasks.text:TextTask",
    "lra_image": "fastpos.tasks.image:LraImageTask",
    "mnist": "fastpos.tasks.image:MnistTask",
    "wikitext103": "fastpos.tasks.wikitext:WikiTextTask",
    "lra_retrieval": "fastpos.tasks.retrieval:RetrievalTask",
    "pathfinder": "fastpos.tasks.pathfinder:PathfinderTask",
    "pathfinder_generated": "fastpos.tasks.pathfinder_generator:GeneratedPathfinderTask",
    "mqar": "fastpos.tasks.mqar:MqarTask",
    "text_lm": "fastpos.tasks.text_lm:TextLmTask",
}


def task_names() -> tuple[str, ...]:
  return tuple(TASK_MODULES)


def get_task_class(name: str) -> type[Task]:
  """The Task class registered as ``name``."""
  if name not in TASK_MODULES:
    raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASK_MODULES)}.")
  module, cls = TASK_MODULES[name].split(":")
  return getattr(importlib.import_module(module), cls)


def task_config(name: str) -> ml_collections.ConfigDict:
  """The default ``config.task`` block of task ``name`` (``name`` first, then its fields)."""
  return get_task_class(name).default_config()


def task_info(cfg: ml_collections.ConfigDict) -> TaskInfo:
  """The ``TaskInfo`` of ``config.task`` (no data read)."""
  return get_task_class(cfg.get("name")).info_from_config(cfg)


def make_task(cfg: ml_collections.ConfigDict) -> Task:
  """Builds the task ``cfg.name`` from its config block (data are read on first use)."""
  name = cfg.get("name")
  cls = get_task_class(name)
  valid = {"name", *cls.config_fields}
  unknown = sorted(set(cfg.keys()) - valid)
  if unknown:  # a typo must not be ignored (a block train.py's validation has not seen)
    raise ValueError(
        f"unknown field(s) {unknown} in config.task for task {name!r}; valid "
        f"fields: {', '.join(sorted(valid))}."
    )
  return cls(cfg)


__all__ = [
    "SPLITS",
    "ArraySource",
    "Task",
    "TASK_MODULES",
    "TaskInfo",
    "get_task_class",
    "make_task",
    "task_config",
    "task_info",
    "task_names",
]
