"""LRA byte-level text classification (IMDB, 4K bytes): FastRPB Table 1, kernels x positional
encodings. The default cell is the README's headline: SIKF linear attention + FastRPB.

Command: python train.py --config=configs/lra_text_fastrpb.py --workdir=/tmp/lra_text_fastrpb
Cells:   python train.py --config=configs/lra_text_fastrpb.py:kernel=dpfp,pos=sinspe (kernel: softmax dpfp sikf relu favor; pos: none fastrpb sinspe convspe rpe) --workdir=/tmp/lra_text_fastrpb_cell
Then:    python eval.py --config=configs/lra_text_fastrpb.py --workdir=/tmp/lra_text_fastrpb --split=test
Hardware: one GPU (the paper used Tesla T4s; 4K tokens, batch 32); ":tiny" builds a small model for
a CPU check (data still needed).
Paper: FastRPB (Zubkov et al.) Table 1, Text block: SIKF + FastRPB 62.35 +- 0.24 test accuracy
(61.64 without FastRPB); best ReLU + FastRPB 63.95. Models "also used trainable absolute positional
encodings" (Sec. 4), hence positional = absolute+fastrpb.
Settings: LRA's base config for the task (fastpos/train/experiments.py: LRA_TASKS), the
table's rows and columns and the paper's numbers in experiments.py (recorded in the run's
config.json as config.experiment / config.paper for scripts/make_tables.py).
"""

from __future__ import annotations

import ml_collections

from fastpos.train import experiments


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return experiments.fastrpb_table1("text", arg)
