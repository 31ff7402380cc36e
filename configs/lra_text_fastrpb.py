"""LRA byte-level text classification (IMDB, 4K bytes) with SIKF linear attention + FastRPB:
the README's headline, the Text cell of FastRPB Table 1 (configs/fastrpb_table1.py:task=text).

Command: python train.py --config=configs/lra_text_fastrpb.py --workdir=/tmp/lra_text_fastrpb
Cells:   python train.py --config=configs/lra_text_fastrpb.py:kernel=dpfp,pos=sinspe --workdir=/tmp/lra_text_cell
         (kernel: softmax dpfp sikf relu favor; pos: none fastrpb sinspe convspe rpe)
Then:    python eval.py --workdir=/tmp/lra_text_fastrpb --split=test
Data:    python scripts/download_data.py lra_text
Hardware: one GPU (the paper used Tesla T4s; 4K tokens, batch 32, 20k steps). ":tiny" builds a
small model for a CPU check (data still needed: python scripts/download_data.py lra_text).
Expected: the paper's FastRPB (Zubkov et al.) Table 1, Text block: SIKF + FastRPB 62.35 +-
0.24 test accuracy (61.64 without FastRPB; best ReLU + FastRPB 63.95), against 50% for
either class (IMDB is balanced). Models "also used trainable absolute positional encodings"
(Sec. 4), hence positional = absolute+fastrpb.
Memory: the layers run as one scanned body with block rematerialisation (model.remat="block",
model.scan_layers=True) and each block's token-wise part in chunks of 2048 tokens
(model.mlp_chunk=2048): the paper's batch 32 x 4K tokens fits in a fraction of the memory
(benchmarks/memory.md has the figures), with the same numbers up to round-off: every cell, favor's included
(each scanned layer draws the random-feature projection and SPE noise of its unrolled twin).
Settings: LRA's Text base config (configs/common.py: LRA_TASKS["text"]); the table's rows,
columns and numbers are in configs/fastrpb_table1.py.
"""

from __future__ import annotations

import ml_collections

from configs import common, fastrpb_table1

ARGS = {k: v for k, v in fastrpb_table1.ARGS.items() if k != "task"}
CHOICES = {k: v for k, v in fastrpb_table1.CHOICES.items() if k != "task"}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  a = common.parse_arg(arg, choices=CHOICES, **ARGS)  # no task= here: this file is Text's
  c = fastrpb_table1.build(task="text", **a)
  c.model.update(remat="block", scan_layers=True, mlp_chunk=2048)
  return c
