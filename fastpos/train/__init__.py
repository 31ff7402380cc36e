"""fastpos.train: one trainer for every task and model.

``train_and_evaluate(config, workdir)`` trains (resuming from the workdir's newest checkpoint)
and ``evaluate(config, workdir, split)`` scores a trained workdir; ``train.py`` / ``eval.py``
are thin command-line entry points over them. Modules: ``config`` (the base config),
``state`` (train state, AdamW and its schedule), ``steps`` (pure train / eval steps, one
signature with a carry), ``feed`` (plain or stream batches, the empty carry), ``sharding``
(mesh, shardings, multi-host batches), ``data`` (grain pipelines), ``run`` (the frozen run
description), ``resume`` (where a run starts), ``loop`` (the training loop), ``checkpoint``
(orbax), ``metrics`` and ``tensorboard`` (what is logged, where), ``summary`` (the last line),
``workdir`` (the workdir's one owner: its layout, records, checkpoints and lock),
``config_record`` (config.json and the changes of resumes), ``trainer``.

The trainer and the modules load on first use of their names (PEP 562), so that a reader of
workdirs (``fastpos.load``, ``fastpos.train.workdir``) imports nothing of the trainer.
"""

from __future__ import annotations

import importlib

from fastpos.train.errors import NonFiniteLossError, RunError, WorkdirLockedError

__all__ = ["NonFiniteLossError", "RunError", "WorkdirLockedError", "evaluate", "train_and_evaluate"]
_TRAINER = ("evaluate", "train_and_evaluate")


def __getattr__(name: str):
  """The trainer's names, and the package's modules (``fastpos.train.cli``), on first use."""
  if name in _TRAINER:
    return getattr(importlib.import_module(f"{__name__}.trainer"), name)
  try:
    return importlib.import_module(f"{__name__}.{name}")
  except ModuleNotFoundError as e:
    if e.name != f"{__name__}.{name}":
      raise
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
