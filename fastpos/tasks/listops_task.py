"""LRA ListOps as a trainer task: a thin wrapper over ``fastpos.tasks.listops``.

``fastpos.tasks.listops`` generates (``source="generated"``) or reads (``source="tsv"``, the
LRA release files) the nested-list expressions and tokenises them, brackets included; this
module maps ``config.task`` onto its ``load_split`` and declares the task's shape: 10 classes
(the value 0..9 of the expression), vocabulary ``listops.VOCAB``.

``config.task.data_dir`` is the data root (``fastpos.tasks.paths``; "" = ``$FASTPOS_DATA_DIR``,
else ``~/fastpos_data``). With ``source="tsv"`` the files are read from
``<root>/lra_release/listops-1000/basic_{train,val,test}.tsv`` (96,000 / 2,000 / 2,000 rows),
which ``python scripts/download_data.py listops --data_dir <root>`` fetches (the LRA release
archive, ~7 GB, shared with lra_retrieval and pathfinder). The generated source reads nothing.
"""

from __future__ import annotations

import importlib
import os

import ml_collections
import numpy as np

from fastpos.tasks import base, paths
from fastpos.tasks.info import TaskInfo

NUM_CLASSES = 10


def _listops():
  # Imported on use: tasks that do not need ListOps never load its generator.
  return importlib.import_module("fastpos.tasks.listops")


class ListOpsTask(base.Task):
  """LRA ListOps (Tay et al. 2021, Sec. 3.1; Nangia & Bowman 2018): classify the value 0..9."""
  task_name = "listops"

  @classmethod
  def default_config(cls) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = cls.task_name
    # "generated": the project's own generator (deterministic from `seed`); "tsv": the LRA
    # release (basic_train.tsv, basic_val.tsv, basic_test.tsv) under the data root.
    c.source = "generated"
    # Data root (fastpos.tasks.paths; "" = $FASTPOS_DATA_DIR, else ~/fastpos_data); source="tsv"
    # reads <root>/lra_release/listops-1000/basic_{train,val,test}.tsv.
    c.data_dir = ""
    c.cache_dir = ""  # where generated / tokenised splits are cached ("" = no cache)
    c.max_length = 2000  # padded length (LRA: 2000)
    c.min_length = 500  # shortest generated expression in tokens (LRA: 500)
    # Examples per split; 0 means the loader's default (LRA sizes: 96k / 2k / 2k).
    c.num_train = 0
    c.num_validation = 0
    c.num_test = 0
    c.seed = 0  # generator seed (independent of the training seed)
    c.on_overflow = "truncate"  # longer expressions: "truncate" or "error"
    # Keep the parentheses of the LRA release format (False: the fixed LRA task, where `]` is
    # a token and the parentheses are dropped).
    c.parens = False
    return c

  @classmethod
  def info_from_config(cls, cfg: ml_collections.ConfigDict) -> TaskInfo:
    return TaskInfo(kind="classify", vocab_size=len(_listops().VOCAB), num_classes=NUM_CLASSES,
                    max_length=cfg.max_length)

  def load_split(self, split: str) -> dict[str, np.ndarray]:
    cfg = self.cfg
    n = {"train": cfg.num_train, "validation": cfg.num_validation, "test": cfg.num_test}[split]
    lo = _listops()
    tsv_dir = None
    if cfg.source == "tsv":
      tsv_dir = lo.tsv_dir(cfg.data_dir or None)
      paths.require(self.task_name, os.path.join(tsv_dir, lo.TSV_FILES[split]),
                    cfg.data_dir or None, "an LRA ListOps file")
    data = lo.load_split(
        split, source=cfg.source, max_length=cfg.max_length, data_dir=tsv_dir,
        num_examples=n, seed=cfg.seed, min_length=cfg.min_length,
        cache_dir=cfg.cache_dir or None, on_overflow=cfg.on_overflow, parens=cfg.parens)
    return {"inputs": data["inputs"], "targets": data["targets"]}
