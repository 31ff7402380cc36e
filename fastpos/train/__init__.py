"""fastpos.train: one trainer for every task and model.

``train_and_evaluate(config, workdir)`` trains (resuming from the workdir's newest checkpoint)
and ``evaluate(config, workdir, split)`` scores a trained workdir; ``train.py`` / ``eval.py``
are thin command-line entry points over them. Modules: ``config`` (the base config),
``state`` (train state, AdamW and its schedule), ``steps`` (pure train / eval steps, one
signature with a carry), ``feed`` (plain or stream batches, the empty carry), ``sharding``
(mesh, shardings, multi-host batches), ``data`` (grain pipelines), ``run`` (the frozen run
description), ``resume`` (where a run starts), ``loop`` (the training loop), ``checkpoint``
(orbax), ``metrics`` and ``tensorboard`` (what is logged, where), ``summary`` (the last line),
``config_record`` (config.json and the changes of resumes), ``trainer``.
"""

from __future__ import annotations

from fastpos.train.errors import NonFiniteLossError, RunError, WorkdirLockedError
from fastpos.train.trainer import evaluate, train_and_evaluate

__all__ = ["NonFiniteLossError", "RunError", "WorkdirLockedError", "evaluate", "train_and_evaluate"]
