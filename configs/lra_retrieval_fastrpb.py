"""LRA Retrieval (AAN document pairs, 2 x 4K bytes, dual encoder): FastRPB Table 1.

Command: python train.py --config=configs/lra_retrieval_fastrpb.py --workdir=/tmp/lra_retrieval_fastrpb
Cells:   python train.py --config=configs/lra_retrieval_fastrpb.py:kernel=dpfp,pos=sinspe (kernel: softmax dpfp sikf relu favor; pos: none fastrpb sinspe convspe rpe) --workdir=/tmp/lra_retrieval_fastrpb_cell
Then:    python eval.py --config=configs/lra_retrieval_fastrpb.py --workdir=/tmp/lra_retrieval_fastrpb --split=test
Hardware: one GPU (16 GB+); softmax runs out of memory at 4K x 2 on the paper's T4s; ":tiny" builds
a small model for a CPU check (data still needed).
Paper: FastRPB (Zubkov et al.) Table 1, Retrieval block: SIKF + FastRPB 67.19 +- 1.64
(59.51 without); softmax OOM.
Settings: LRA's base config for the task (fastpos/train/experiments.py: LRA_TASKS), the
table's rows and columns and the paper's numbers in experiments.py (recorded in the run's
config.json as config.experiment / config.paper for scripts/make_tables.py).
"""

from __future__ import annotations

import ml_collections

from fastpos.train import experiments


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return experiments.fastrpb_table1("retrieval", arg)
