"""LRA Pathfinder from the project's own generator (no download): a FastRPB-2D linear model.

Command: python train.py --config=configs/pathfinder_generated.py --workdir=/tmp/fastpos_pathfinder
Then:    python eval.py --workdir=/tmp/fastpos_pathfinder --split=test
Choices: ...:difficulty=easy|intermediate|hard (target path of 6 / 9 / 14 paddles; LRA's
         folder names curv_baseline / curv_contour_length_9 / curv_contour_length_14 work
         too), resolution=32|64,
         kernel=softmax|dpfp|sikf|relu|elu1|favor, pos=none|fastrpb, tiny.
Data: fastpos.tasks.pathfinder_generator, Linsley et al.'s generator ported to numpy with the
settings of LRA's Pathfinder32 / Pathfinder64 builders; 20k / 2k / 2k images generated once per
(resolution, difficulty, seed) into the cache (docs/data.md, "Generated Pathfinder": the
generator's statistics against the original's). Tokens = intensity + 1, raster order, the
grid (r, r) passed to the model, so FastRPB is 2D.
Model: LRA's Pathfinder model (1 layer, width 32, 2 heads of 8, mean pooling; configs/common.py
LRA_TASKS) with SIKF linear attention + learned absolute positions + 2D FastRPB; AdamW 1e-3,
batch 128, 3000 steps (about 19 epochs of 20k images), cosine decay after 300 warmup steps.
Hardware: a 2-core CPU; the training split is generated once per (settings, seed) and then
read from the cache. ":tiny": 64 / 32 / 32 images and a tiny model, seconds.
Expected: at chance on this CPU's budget (51.2% test after the 3,000 steps above; docs/
claims.md, "Pathfinder"); the papers train on about 80 times the images.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from configs import common, fastrpb_table1

COLUMNS = {k: fastrpb_table1.COLUMNS[k] for k in ("none", "fastrpb")}
SETTINGS = dataclasses.replace(
    common.LRA_TASKS["pathfinder"],
    task="pathfinder_generated",
    batch_size=128,
    num_train_steps=3000,
    warmup_steps=300,
    eval_every_steps=500,
)
ARGS = dict(difficulty="hard", resolution=32, kernel="sikf", pos="fastrpb", tiny=False)
# LRA's folder names are accepted too (the task's field takes the short names, as `pathfinder`).
FOLDERS = {"curv_baseline": "easy", "curv_contour_length_9": "intermediate"}
FOLDERS["curv_contour_length_14"] = "hard"
CHOICES = dict(
    difficulty=("easy", "intermediate", "hard", *FOLDERS),
    resolution=(32, 64),
    kernel=tuple(common.KERNELS),
    pos=tuple(COLUMNS),
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  a = common.parse_arg(arg, choices=CHOICES, **ARGS)
  # The cell recorded in FastRPB Table 1's layout (rows kernels, columns encodings) for
  # scripts/make_tables.py and the claims' tables; the paper has no Pathfinder column.
  c = common.table_config(
      SETTINGS,
      common.KERNELS[a.kernel],
      COLUMNS[a.pos],
      table="FastRPB Table 1 layout (Pathfinder-32, generated)",
      results={},
      tiny=a.tiny,
  )
  c.task.update(difficulty=FOLDERS.get(a.difficulty, a.difficulty), resolution=a.resolution)
  if a.tiny:
    c.task.update(num_train=64, num_validation=32, num_test=32)
  return c
