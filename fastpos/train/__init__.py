"""fastpos.train: one trainer for every task and model.

``train_and_evaluate(config, workdir)`` trains (resuming from the workdir's newest checkpoint)
and ``evaluate(config, workdir, split)`` scores a trained workdir; ``train.py`` / ``eval.py``
are thin command-line entry points over them. Modules: ``config`` (the base config),
``state`` (train state, AdamW and its schedule), ``steps`` (pure train / eval steps),
``sharding`` (mesh, shardings, multi-host batches), ``data`` (grain pipelines),
``checkpoint`` (orbax), ``metrics`` and ``tensorboard`` (what is logged, where),
``config_record`` (config.json and the changes of resumes), ``trainer``.
"""

from __future__ import annotations

from fastpos.train.errors import NonFiniteLossError, RunError, WorkdirLockedError
from fastpos.train.trainer import evaluate, train_and_evaluate

__all__ = ["NonFiniteLossError", "RunError", "WorkdirLockedError", "evaluate", "train_and_evaluate"]
