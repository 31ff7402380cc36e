"""Generated ListOps, kernels x {none, FastRPB} in FastRPB Table 1's layout, sized for a CPU.

Command (the reproduction in results/listops_sweep/: 8 runs, 987 s on a shared 2-core CPU):

  scripts/sweep.sh --config=configs/listops_sweep.py --sweep_dir=workdirs/listops_sweep \\
      arg.kernel=elu1,sikf arg.pos=none,fastrpb seed=0,1
  python scripts/make_tables.py workdirs/listops_sweep

One cell: python train.py --config=configs/listops_sweep.py:kernel=elu1,pos=fastrpb --workdir=...
(kernel: softmax dpfp sikf relu elu1 favor; pos: none fastrpb sinspe convspe rpe).
Columns as in FastRPB Table 1: "None" is learned absolute position embeddings only and
"FastRPB" is absolute + FastRPB: every model of the paper "also used trainable absolute
positional encodings" (FastRPB Sec. 4; fastpos/train/experiments.py: FASTRPB_COLUMNS).
Model, data and schedule are those of listops_generated.py: 2 layers, width 64, 4 heads,
mean pooling, 600 steps of batch 32 (~1 epoch of 20k generated expressions of 20-100 tokens),
AdamW 1e-3 with 60 warmup steps and cosine decay. ":tiny": a smoke run in seconds.

Hardware: a 2-core CPU shared with other jobs: one run 83-158 s wall (4-10 steps/s; up to
~4 min when the machine is busier).
Expected (measured, test accuracy over 2 seeds): ELU+1 30.3 / 37.6 (none / FastRPB), SIKF
37.7 / 39.1, against 16.2% for the majority class (value 0) of the test split; the table and
what limits it are in results/README.md.
Paper (recorded in config.paper for scripts/make_tables.py): FastRPB Table 1, ListOps block:
Linear SIKF 12.55 (None) / 11.47 (FastRPB); the paper has no ELU+1 row on LRA. That is LRA
ListOps (up to 2000 tokens, 96k examples, LRA's model and schedule, and the LRA inputs the
paper used): another setting, shown for the layout rather than as a target.
"""

from __future__ import annotations

import ml_collections

from fastpos.train import experiments
from fastpos.train.config import parse_arg

SETTINGS = dict(
    task="listops",
    task_fields=dict(source="generated", min_length=20, max_length=100, num_train=20_000,
                     num_validation=1000, num_test=1000),
    model=dict(num_layers=2, embed_dim=64, num_heads=4, mlp_dim=128, dropout_rate=0.1,
               pooling="mean"),
    batch_size=32, num_train_steps=600, warmup_steps=60, learning_rate=1e-3,
    weight_decay=0.01, eval_every_steps=200)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = experiments.experiment_config(
      "listops", arg, rows=experiments.KERNEL_ROWS, columns=experiments.FASTRPB_COLUMNS,
      paper_table="FastRPB Table 1 (ListOps)",
      paper_results=experiments.FASTRPB_TABLE1["listops"], default_row="sikf",
      default_col="fastrpb", settings=SETTINGS)
  if parse_arg(arg, tiny=False, kernel="sikf", pos="fastrpb").tiny:
    c.task.update(min_length=10, max_length=32, num_train=256, num_validation=64, num_test=64)
  return c
