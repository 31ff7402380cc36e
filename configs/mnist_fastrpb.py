"""Pixel MNIST (28x28 = 784 tokens, 2D FastRPB): FastRPB Table 2, kernels x (w/o, w/ FastRPB).

Command: python train.py --config=configs/mnist_fastrpb.py --workdir=/tmp/mnist_fastrpb
Cells:   python train.py --config=configs/mnist_fastrpb.py:kernel=elu1,pos=none --workdir=...
         (kernel: softmax dpfp sikf elu1 favor; pos: none fastrpb)
Then:    python eval.py --config=configs/mnist_fastrpb.py --workdir=/tmp/mnist_fastrpb --split=test
Hardware: one GPU (the paper: 4 Tesla T4s; 8 layers, 8 heads, width 256, 25 epochs);
":tiny" builds a small model for a CPU check (data still needed).
Paper: FastRPB (Zubkov et al.) Table 2, F1 score (%): SIKF 96.49 -> 97.37 with FastRPB,
ELU+1 94.01 -> 96.71, softmax 97.34 -> 98.27. fastpos reports accuracy (MNIST's classes are
balanced: macro F1 and accuracy differ by a few hundredths). Learning rates per cell from the
paper's Table 4, decayed linearly to 0; batch 64 is this file's choice (not given).
"""

from __future__ import annotations

import ml_collections

from fastpos.train import experiments


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return experiments.mnist_table2(arg)
