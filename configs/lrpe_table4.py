"""LRPE Table 4 (LRA accuracy): linear attention (ELU+1, BatchNorm blocks) with each relative
positional encoding on Text, ListOps, Retrieval, Pathfinder and Image, ``task=<task>,pe=<row>``.

Command: python train.py --config=configs/lrpe_table4.py:task=text,pe=type2 --workdir=/tmp/lrpe_text
Then:    python eval.py --workdir=/tmp/lrpe_text --split=test
Sweep:   scripts/sweep.sh --config=configs/lrpe_table4.py --sweep_dir=workdirs/lrpe arg.task=text,listops arg.pe=base,rope,per,type1,type2,type3
Hardware: one GPU. ":tiny" builds a small model for a CPU check, on the repository's
fixtures for ListOps and Retrieval (the others still need their data: python
scripts/download_data.py lra_text pathfinder lra_image).
Paper: LRPE (Qin et al. 2023) Table 4, accuracy %, in config.paper: Text Type1 66.80 / Type2
66.52 / RoPE 66.53 / Base 64.81; ListOps Type1 39.84 / Base 39.17; Image Type1 63.43 / Base
41.21.
Settings: LRA's base config for each task (configs/common.py: LRA_TASKS) with the paper's LRA
code base's BatchNorm blocks (model.norm="batch"); the kernel is ELU+1 in every row.
"""

from __future__ import annotations

import ml_collections

from configs import common

ROWS: dict[str, common.Row] = {
    "base": common.Row(dict(kernel="elu1", positional="none"), "Base"),
    "rope": common.Row(dict(kernel="elu1", positional="rope"), "RoPE"),
    "per": common.Row(dict(kernel="elu1", positional="permuteformer"), "Per"),
    "type1": common.Row(
        dict(kernel="elu1", positional="lrpe", positional_options={"lrpe": {"type": 1}}),
        "Type1",
    ),
    "type2": common.Row(
        dict(kernel="elu1", positional="lrpe", positional_options={"lrpe": {"type": 2}}),
        "Type2",
    ),
    "type3": common.Row(
        dict(kernel="elu1", positional="lrpe", positional_options={"lrpe": {"type": 3}}),
        "Type3",
    ),
}
# The rows under the names the claims' configs give them (configs/claim_*.py: model=<name>).
CLAIM_ROWS = {"base": ROWS["base"], "rope": ROWS["rope"]} | {
    f"lrpe{t}": ROWS[f"type{t}"] for t in (1, 2, 3)
}
TASKS = ("text", "listops", "retrieval", "pathfinder", "image")
RESULTS = common.results(
    [label for _, label in ROWS.values()],
    [common.LRA_LABELS[t] for t in TASKS],
    [
        (64.81, 39.17, 84.71, 71.61, 41.21),
        (66.53, 40.57, 78.75, 72.68, 62.50),
        (65.50, 39.17, 83.40, 69.55, 42.03),
        (66.80, 39.84, 82.13, 73.79, 63.43),
        (66.52, 39.79, 81.55, 73.46, 62.35),
        (64.94, 39.56, 83.86, 70.78, 45.15),
    ],
)

ARGS = dict(task="text", pe="type2", tiny=False)
CHOICES = dict(task=TASKS, pe=tuple(ROWS))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  a = common.parse_arg(arg, choices=CHOICES, **ARGS)
  c = common.table_config(
      common.LRA_TASKS[a.task],
      ROWS[a.pe],
      col=common.LRA_LABELS[a.task],
      table="LRPE Table 4",
      results=RESULTS,
      tiny=a.tiny,
  )
  c.model.norm = "batch"
  return c
