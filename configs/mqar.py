"""Multi-query associative recall (fastpos.tasks.mqar; Zoology, Arora et al. 2023) on a small
causal decoder; ``variant=copy`` is the copying / induction variant.

Command: python train.py --config=configs/mqar.py --workdir=/tmp/fastpos_mqar
Arguments (comma-separated after a colon): ``tiny`` (a seconds-long smoke run),
``kernel=<softmax|elu1|sikf|favor|...>``, ``pos=<none|rope|fastrpb|kernelized_rpe|...>``,
``seq_len=<N>``, ``pairs=<P>`` (key-value pairs), ``vocab=<V>``, ``variant=<mqar|copy>``,
``steps=<S>`` (train S steps, evaluate once at the end); e.g.
``--config=configs/mqar.py:kernel=elu1,pos=rope,seq_len=256``.
Hardware: a shared 2-core CPU; the sweep in results/mqar.md gives each run's time.
Expected: results/mqar.md (answer accuracy of every kernel x scheme at the default 4 pairs and
600 steps; chance is 1/8, or 1/4 knowing which values are in the context).
"""

from __future__ import annotations

import ml_collections

from configs import common

ARGS = dict(
    tiny=False, kernel="softmax", pos="none", seq_len=64, pairs=4, variant="mqar", steps=0, vocab=19
)
CHOICES = dict(variant=("mqar", "copy"))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  a = common.parse_arg(arg, choices=CHOICES, **ARGS)
  c = common.base_config("mqar")
  # vocab 19: 8 keys and 8 values (chance 1/8 on answers; 1/pairs knowing the context's values)
  c.task.update(
      variant=a.variant,
      vocab_size=a.vocab,
      seq_len=a.seq_len,
      num_pairs=a.pairs,
      num_train=10_000,
      num_validation=500,
      num_test=500,
  )
  c.model.update(
      num_layers=2,
      embed_dim=32,
      num_heads=2,
      mlp_dim=64,
      dropout_rate=0.0,
      norm="pre",
      kernel=a.kernel,
      positional=a.pos,
  )
  c.batch_size = 32
  c.num_train_steps = 600
  c.optimizer.learning_rate = 3e-3
  c.optimizer.weight_decay = 0.1
  c.schedule.warmup_steps = 100
  c.log_every_steps = 100
  c.eval_every_steps = 200
  c.checkpoint_every_steps = 200
  if a.tiny:
    c.task.update(num_train=256, num_validation=32, num_test=32)
    c.model.update(num_layers=1, embed_dim=16, mlp_dim=32)
    c.batch_size = 8
    c.num_train_steps = 20
    c.schedule.warmup_steps = 5
    c.log_every_steps = c.eval_every_steps = c.checkpoint_every_steps = 10
  if a.steps:
    c.num_train_steps = c.eval_every_steps = c.checkpoint_every_steps = a.steps
  return c
