"""LRA ListOps (LRA release TSVs, 2K tokens): FastRPB Table 1, kernels x positional encodings.

Command: python train.py --config=configs/lra_listops_fastrpb.py --workdir=/tmp/lra_listops_fastrpb
Cells:   python train.py --config=configs/lra_listops_fastrpb.py:kernel=dpfp,pos=sinspe (kernel: softmax dpfp sikf relu favor; pos: none fastrpb sinspe convspe rpe) --workdir=/tmp/lra_listops_fastrpb_cell
Then:    python eval.py --config=configs/lra_listops_fastrpb.py --workdir=/tmp/lra_listops_fastrpb --split=test
Hardware: one GPU (16 GB+; the paper: Tesla T4s); ":tiny" builds a small model for a CPU check (data
still needed).
Paper: FastRPB (Zubkov et al.) Table 1, ListOps block: SIKF 12.55 (none) / 11.47 (FastRPB); best
DPFP 20.67 (none). The paper used LRA's buggy ListOps inputs (brackets dropped, SPE setup); with the
fixed task (here) expect ~37% like LRA's Transformer.
Settings: LRA's base config for the task (fastpos/train/experiments.py: LRA_TASKS), the
table's rows and columns and the paper's numbers in experiments.py (recorded in the run's
config.json as config.experiment / config.paper for scripts/make_tables.py).
"""

from __future__ import annotations

import ml_collections

from fastpos.train import experiments


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return experiments.fastrpb_table1("listops", arg)
