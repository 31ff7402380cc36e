"""LRA ListOps from the project's own generator, short expressions: the README's first command.

Command: python train.py --config=configs/listops_generated.py --workdir=/tmp/fastpos_listops
Then:    python eval.py --config=configs/listops_generated.py --workdir=/tmp/fastpos_listops
Hardware: a 2-core CPU: 207 s wall with data generation and compilation (measured while
other jobs loaded the machine; 3-7 steps/s). ":tiny": seconds.
Expected: validation accuracy climbing well above the majority class (value 0, 16.5% of the
generated expressions): measured 29.8% / 36.4% / 38.3% at steps 200 / 400 / 600, test 37.4%
(eval.py, best checkpoint). This is not the LRA setting (lengths 500-2000, 96k examples, a
larger model for 5k steps; the LRA paper reports 36-37%, FastRPB Table 1 12-21%).
"""

from __future__ import annotations

import ml_collections

from fastpos.train.config import base_config, parse_arg


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  a = parse_arg(arg, tiny=False)
  c = base_config("listops")
  c.task.update(source="generated", min_length=20, max_length=100, num_train=20_000,
                num_validation=1000, num_test=1000)
  c.model.update(num_layers=2, embed_dim=64, num_heads=4, mlp_dim=128, dropout_rate=0.1,
                 kernel="softmax", positional="absolute")
  c.batch_size = 32
  c.num_train_steps = 600
  c.optimizer.learning_rate = 1e-3
  c.schedule.warmup_steps = 60
  c.log_every_steps = 50
  c.eval_every_steps = 200
  c.checkpoint_every_steps = 200
  if a.tiny:
    c.task.update(min_length=10, max_length=32, num_train=256, num_validation=64, num_test=64)
    c.model.update(num_layers=1, embed_dim=16, num_heads=2, mlp_dim=32)
    c.batch_size = 8
    c.num_train_steps = 20
    c.schedule.warmup_steps = 5
    c.log_every_steps = c.eval_every_steps = c.checkpoint_every_steps = 10
  return c
