"""LRA Image (CIFAR-10 gray, 32x32): LRPE Table 4, linear attention (ELU+1, BatchNorm blocks) with
RoPE, PermuteFormer or LRPE Types 1-3.

Command: python train.py --config=configs/lra_image_lrpe.py --workdir=/tmp/lra_image_lrpe
Cells:   python train.py --config=configs/lra_image_lrpe.py:pe=type1 (pe: base rope per type1 type2 type3) --workdir=/tmp/lra_image_lrpe_cell
Then:    python eval.py --config=configs/lra_image_lrpe.py --workdir=/tmp/lra_image_lrpe --split=test
Hardware: one GPU; ":tiny" builds a small model for a CPU check (data still needed).
Paper: LRPE (Qin et al. 2023) Table 4: Type1 63.43, Type2 62.35, RoPE 62.50, Base 41.21
(accuracy %).
Settings: LRA's base config for the task (fastpos/train/experiments.py: LRA_TASKS), the
table's rows and columns and the paper's numbers in experiments.py (recorded in the run's
config.json as config.experiment / config.paper for scripts/make_tables.py).
"""

from __future__ import annotations

import ml_collections

from fastpos.train import experiments


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return experiments.lrpe_table4("image", arg)
