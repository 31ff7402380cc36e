"""The papers' claims on generated ListOps, CPU-sized: LRPE (types 1-3 against no position and
RoPE, ELU+1) and PermuteFormer (against Performer and the softmax Transformer), one variant
per run, ``model=<variant>``.

Command: python train.py --config=configs/claim_listops.py:model=lrpe2 --workdir=/tmp/claim_listops
Then:    python eval.py --workdir=/tmp/claim_listops --split=test
Claims:  scripts/claims.sh OUT_DIR runs every claim at 5 seeds (docs/claims.md); one claim:
         scripts/sweep.sh --config=configs/claim_listops.py --sweep_dir=DIR --mode=parallel arg.model=base,rope,lrpe1,lrpe2,lrpe3 seed=0,1,2,3,4
         python scripts/make_tables.py DIR --compare='Type1>Base' --compare='Type1>RoPE'
Hardware: a 2-core CPU; the settings of configs/listops_generated.py (2 layers x 64, 600
steps of batch 32 on 20-100 token expressions; the time a run took: results/claims/README.md).
":tiny": seconds.
Expected: no paper number applies (the papers report LRA ListOps at up to 2000 tokens); the
claim is the sign of the paired difference (results/claims/). The FastRPB claim uses
configs/listops_generated.py itself (its kernel x pos grid).
Variants: LRPE Table 4's rows (configs/lrpe_table4.py: ELU+1, positional none / rope /
lrpe type 1-3; this file keeps LayerNorm) and PermuteFormer Table 1's (configs/
permuteformer_table1.py: softmax + absolute, FAVOR+ + absolute, ReLU features + PermuteFormer).
"""

from __future__ import annotations

import ml_collections

from configs import common, listops_generated, lrpe_table4, permuteformer_table1

VARIANTS: dict[str, common.Row] = lrpe_table4.CLAIM_ROWS | common.pick(
    permuteformer_table1.ROWS, common.PERMUTEFORMER_CLAIM
)
TABLE = "Claims on generated ListOps"
ROW = common.Row({}, "generated ListOps")  # the block's one row: the task

ARGS = dict(model="lrpe2", tiny=False)
CHOICES = dict(model=tuple(VARIANTS))


def build(*, model: str, tiny: bool) -> ml_collections.ConfigDict:
  """The run of variant ``model`` (a key of ``VARIANTS``) on listops_generated's settings."""
  c = common.table_config(
      listops_generated.SETTINGS, ROW, VARIANTS[model], table=TABLE, results={}, tiny=tiny
  )
  if tiny:
    c.task.update(min_length=10, max_length=32, num_train=256, num_validation=64, num_test=64)
  return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return build(**common.parse_arg(arg, choices=CHOICES, **ARGS))
