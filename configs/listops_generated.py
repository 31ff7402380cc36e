"""LRA ListOps from the project's own generator, short expressions, a CPU-sized fastpos model
(SIKF linear attention + absolute positions + FastRPB): the README's first command.

Command: python train.py --config=configs/listops_generated.py --workdir=/tmp/fastpos_listops
Then:    python eval.py --workdir=/tmp/fastpos_listops --split=test
Cells:   python train.py --config=configs/listops_generated.py:kernel=elu1,pos=none --workdir=...
         (kernel: softmax dpfp sikf relu elu1 favor; pos: none fastrpb sinspe convspe rpe)
Bucketed: ...:bucket pads each batch to 32 / 48 / 64 / 100 tokens instead of 100 (the share of
         real token slots: benchmarks/padding.md); its results differ.
Sweep:   scripts/sweep.sh --config=configs/listops_generated.py --sweep_dir=workdirs/listops_sweep arg.kernel=elu1,sikf arg.pos=none,fastrpb seed=0,1
         python scripts/make_tables.py workdirs/listops_sweep   (results/listops_sweep/)
Hardware: a 2-core CPU (data generation, compilation, 600 steps; results/quickstart.md has
the wall time and tokens/s measured).
":tiny": seconds.
Expected: results/quickstart.md (validation accuracy at steps 200 / 400 / 600 and the test
accuracy of the best checkpoint, each beside the majority-class baseline: always 0, the
training split's most frequent value); the sweep below over 2 seeds: results/README.md and
results/listops_sweep/. The trainer's last line prints the validation accuracy beside the
majority-class baseline, tokens/s and where the outputs are.
Columns as in FastRPB Table 1: "none" is learned absolute position embeddings only and
"fastrpb" is absolute + FastRPB (every model of the paper "also used trainable absolute
positional encodings", FastRPB Sec. 4). Model: 2 layers, width 64, 4 heads, mean pooling; 600
steps of batch 32 (about one epoch of 20k generated expressions of 20-100 tokens), AdamW 1e-3
(weight decay 0.01) with 60 warmup steps and cosine decay.
Paper (recorded in config.paper for scripts/make_tables.py): FastRPB Table 1, ListOps block:
Linear SIKF 12.55 (none) / 11.47 (FastRPB). That is LRA ListOps (up to 2000 tokens, 96k
examples, LRA's model and schedule, and the LRA inputs the paper used): another setting, shown
for the layout rather than as a target.
"""

from __future__ import annotations

import ml_collections

from configs import common, fastrpb_table1

ROWS = common.KERNELS
COLUMNS = fastrpb_table1.COLUMNS
SETTINGS = common.Settings(
    task="listops",
    task_fields=dict(
        source="generated",
        min_length=20,
        max_length=100,
        num_train=20_000,
        num_validation=1000,
        num_test=1000,
    ),
    model=dict(
        num_layers=2, embed_dim=64, num_heads=4, mlp_dim=128, dropout_rate=0.1, pooling="mean"
    ),
    batch_size=32,
    num_train_steps=600,
    warmup_steps=60,
    learning_rate=1e-3,
    weight_decay=0.01,
    eval_every_steps=200,
)

ARGS = dict(kernel="sikf", pos="fastrpb", tiny=False, bucket=False)
CHOICES = dict(kernel=tuple(ROWS), pos=tuple(COLUMNS))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  a = common.parse_arg(arg, choices=CHOICES, **ARGS)
  c = common.table_config(
      SETTINGS,
      ROWS[a.kernel],
      COLUMNS[a.pos],
      table="FastRPB Table 1 (ListOps)",
      results=fastrpb_table1.RESULTS["listops"],
      tiny=a.tiny,
  )
  if a.bucket:  # length bucketing: more real tokens/s (benchmarks/padding.md), 4 compiles (not 1)
    c.data.bucket_lengths = (16, 24) if a.tiny else (32, 48, 64)
  if a.tiny:
    c.task.update(min_length=10, max_length=32, num_train=256, num_validation=64, num_test=64)
  return c
