"""PermuteFormer Table 1 (LRA accuracy): one row per model on Text, Retrieval, Image and
Pathfinder, ``task=<task>,model=<row>``.

Command: python train.py --config=configs/permuteformer_table1.py:task=text,model=permuteformer --workdir=/tmp/permuteformer_text
Then:    python eval.py --workdir=/tmp/permuteformer_text --split=test
Sweep:   scripts/sweep.sh --config=configs/permuteformer_table1.py --sweep_dir=workdirs/permuteformer arg.task=text,retrieval,image,pathfinder arg.model=transformer,performer,permuteformer
Hardware: one GPU (the paper: 8 V100s; its Table 2 gives epoch times). ":tiny" builds a small
model for a CPU check, on the repository's fixtures for Retrieval (the others still need their
data: python scripts/download_data.py lra_text lra_image pathfinder).
Paper: PermuteFormer (Chen 2021) Table 1, accuracy % (mean of 5 runs), in config.paper: Text
PermuteFormer 65.95 / Performer 63.95 / Transformer 63.99; Retrieval 80.66 / 79.82 / 80.02;
Image 43.02 (36.10 without 2D positions) / 43.08 / 42.83; Pathfinder 72.91 / 72.63 / 72.40.
Settings: LRA's base config for each task (configs/common.py: LRA_TASKS). PermuteFormer is
built on Performer (Sec. 5: ReLU random features keep the features non-negative); RoFormer here
is Performer with RoPE on the features; "w/o 2D rel pos" treats images as sequences.
"""

from __future__ import annotations

import ml_collections

from configs import common

ROWS: dict[str, common.Row] = {
    "transformer": common.Row(dict(kernel="softmax", positional="absolute"), "Transformer"),
    "sinusoidal": common.Row(
        dict(kernel="softmax", positional="absolute", positional_options=common.SINUSOIDAL),
        "w/ sinusoidal pos emb",
    ),
    "performer": common.Row(dict(kernel="favor", positional="absolute"), "Performer"),
    "roformer": common.Row(dict(kernel="favor", positional="rope"), "RoFormer"),
    "permuteformer": common.Row(dict(kernel="relu", positional="permuteformer"), "PermuteFormer"),
    "permuteformer_1d": common.Row(
        dict(kernel="relu", positional="permuteformer", use_grid=False),
        "w/o 2D rel pos",
    ),
}
TASKS = ("text", "retrieval", "image", "pathfinder")
RESULTS = common.results(
    [label for _, label in ROWS.values()],
    [common.LRA_LABELS[t] for t in TASKS],
    [
        (63.99, 80.02, 42.83, 72.40),
        (64.06, 79.81, 43.30, 73.00),
        (63.95, 79.82, 43.08, 72.63),
        (66.00, 75.27, 26.16, 58.87),
        (65.95, 80.66, 43.02, 72.91),
        (65.95, 80.66, 36.10, 65.72),
    ],
)

ARGS = dict(task="text", model="permuteformer", tiny=False)
CHOICES = dict(task=TASKS, model=tuple(ROWS))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  a = common.parse_arg(arg, choices=CHOICES, **ARGS)
  return common.table_config(
      common.LRA_TASKS[a.task],
      ROWS[a.model],
      col=common.LRA_LABELS[a.task],
      table="PermuteFormer Table 1",
      results=RESULTS,
      tiny=a.tiny,
  )
