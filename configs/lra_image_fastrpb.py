"""LRA Image (CIFAR-10 grayscale, 32x32 = 1024 tokens): FastRPB Table 1; FastRPB is 2D here.

Command: python train.py --config=configs/lra_image_fastrpb.py --workdir=/tmp/lra_image_fastrpb
Cells:   python train.py --config=configs/lra_image_fastrpb.py:kernel=dpfp,pos=fastrpb (kernel: softmax dpfp sikf relu favor; pos: none fastrpb sinspe convspe rpe) --workdir=/tmp/lra_image_fastrpb_cell
Then:    python eval.py --config=configs/lra_image_fastrpb.py --workdir=/tmp/lra_image_fastrpb --split=test
Hardware: one GPU (batch 256, 200 epochs); a CPU manages a few epochs of the 1-layer model; ":tiny"
builds a small model for a CPU check (data still needed).
Paper: FastRPB (Zubkov et al.) Table 1, CIFAR block: SIKF 41.96 (none) / 38.89 (FastRPB); best ReLU
42.25 (none). SPE columns see the raster sequence (SPE is 1D).
Settings: LRA's base config for the task (fastpos/train/experiments.py: LRA_TASKS), the
table's rows and columns and the paper's numbers in experiments.py (recorded in the run's
config.json as config.experiment / config.paper for scripts/make_tables.py).
"""

from __future__ import annotations

import ml_collections

from fastpos.train import experiments


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return experiments.fastrpb_table1("image", arg)
