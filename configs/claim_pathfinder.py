"""The papers' claims on generated Pathfinder-32 (2D positions): kernelized RPE (NPRF + RPE
against NPRF alone and softmax, Luo et al.) and LRPE (types 1-3 against no position and RoPE,
ELU+1), one variant per run, ``model=<variant>``.

Command: python train.py --config=configs/claim_pathfinder.py:model=nprf_rpe --workdir=/tmp/claim_pf
Then:    python eval.py --workdir=/tmp/claim_pf --split=test
Claims:  not in the default run of scripts/claims.sh: at this CPU's budget every Pathfinder-32
         model stays at chance (docs/claims.md, "Pathfinder"); scripts/claims.sh OUT_DIR --all
         runs these sweeps too (an accelerator's budget).
Hardware: configs/pathfinder_generated.py's settings (LRA's Pathfinder model, 1 layer x 32;
3000 steps of 128 images of the hard setting, 14 paddles); a run took 1.6 h on a 2-core CPU.
":tiny": 64 / 32 / 32 images and a tiny model, seconds.
Expected: no paper number applies at this size (LRPE Table 4 has LRA Pathfinder, trained
about 80 times as long: configs/lrpe_table4.py); chance is 50%.
Variants: Luo et al.'s rows as in configs/claim_text_lm.py (softmax, NPRF, NPRF + kernelized
RPE, sinusoidal absolute positions) and LRPE Table 4's (configs/lrpe_table4.py: ELU+1 with
none / RoPE / LRPE types 1-3), each on the 32 x 32 grid.
"""

from __future__ import annotations

import ml_collections

from configs import claim_text_lm, common, lrpe_table4, pathfinder_generated

VARIANTS: dict[str, common.Row] = {
    k: claim_text_lm.VARIANTS[k] for k in ("softmax", "nprf", "nprf_rpe")
} | lrpe_table4.CLAIM_ROWS
TABLE = "Claims on generated Pathfinder-32"
ROW = common.Row({}, "generated Pathfinder-32")  # the block's one row: the task

ARGS = dict(model="nprf_rpe", tiny=False)
CHOICES = dict(model=tuple(VARIANTS))


def build(*, model: str, tiny: bool) -> ml_collections.ConfigDict:
  """The run of variant ``model`` (a key of ``VARIANTS``) on pathfinder_generated's settings."""
  c = common.table_config(
      pathfinder_generated.SETTINGS, ROW, VARIANTS[model], table=TABLE, results={}, tiny=tiny
  )
  c.task.update(difficulty="hard", resolution=32)
  if tiny:
    c.task.update(num_train=64, num_validation=32, num_test=32)
  return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return build(**common.parse_arg(arg, choices=CHOICES, **ARGS))
