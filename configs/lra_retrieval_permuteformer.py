"""LRA Retrieval (AAN pairs, 2 x 4K): PermuteFormer Table 1, one row per model (Transformer,
sinusoidal, Performer, RoFormer, PermuteFormer, PermuteFormer w/o 2D positions).

Command: python train.py --config=configs/lra_retrieval_permuteformer.py --workdir=/tmp/lra_retrieval_permuteformer
Cells:   python train.py --config=configs/lra_retrieval_permuteformer.py:model=performer (model: transformer sinusoidal performer roformer permuteformer permuteformer_1d) --workdir=/tmp/lra_retrieval_permuteformer_cell
Then:    python eval.py --config=configs/lra_retrieval_permuteformer.py --workdir=/tmp/lra_retrieval_permuteformer --split=test
Hardware: one GPU (the paper: 8 V100s; Table 2 gives epoch times); ":tiny" builds a small model for
a CPU check (data still needed).
Paper: PermuteFormer (Chen 2021) Table 1: PermuteFormer 80.66, Performer 79.82, Transformer 80.02
(accuracy %, mean of 5 runs).
Settings: LRA's base config for the task (fastpos/train/experiments.py: LRA_TASKS), the
table's rows and columns and the paper's numbers in experiments.py (recorded in the run's
config.json as config.experiment / config.paper for scripts/make_tables.py).
"""

from __future__ import annotations

import ml_collections

from fastpos.train import experiments


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return experiments.permuteformer_table1("retrieval", arg)
