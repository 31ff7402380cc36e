"""The generated "majority" task (fastpos.tasks.synthetic): a trainer smoke run.

Command: python train.py --config=configs/synthetic.py --workdir=/tmp/fastpos_synthetic
Hardware: a 2-core CPU (":tiny": seconds).
Expected: validation accuracy near 100% within 300 steps (chance: 25%). No paper number: the
task checks the trainer, not attention.
"""

from __future__ import annotations

import ml_collections

from configs import common

ARGS = dict(tiny=False)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  a = common.parse_arg(arg, **ARGS)
  c = common.base_config("synthetic")
  c.model.update(num_layers=2, embed_dim=32, num_heads=2, mlp_dim=64, dropout_rate=0.0)
  c.batch_size = 32
  c.num_train_steps = 300
  c.optimizer.learning_rate = 3e-3
  c.schedule.warmup_steps = 20
  c.log_every_steps = 50
  c.eval_every_steps = 100
  c.checkpoint_every_steps = 100
  if a.tiny:
    c.task.update(max_length=16, min_length=8, num_train=256, num_validation=64, num_test=50)
    c.model.update(num_layers=1, embed_dim=16, num_heads=2, mlp_dim=32)
    c.batch_size = 8
    c.num_train_steps = 20
    c.schedule.warmup_steps = 5
    c.log_every_steps = c.eval_every_steps = c.checkpoint_every_steps = 10
  return c
