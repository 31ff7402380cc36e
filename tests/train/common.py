"""The tiny config every trainer test starts from (real build_model, generated data)."""

from __future__ import annotations

import jax
import ml_collections
import numpy as np

from fastpos.train.config import base_config


def tiny_config(**overrides) -> ml_collections.ConfigDict:
  """Synthetic task (16 tokens, 4 classes), a 1-layer width-16 transformer with post
  BatchNorm (so a non-param collection is carried) and dropout (so the RNG matters)."""
  c = base_config("synthetic")
  # 12 training examples = 3 batches per epoch: the 4-step runs cross an epoch boundary.
  c.task.update(max_length=12, min_length=6, num_train=12, num_validation=10, num_test=13)
  c.model.update(
      num_layers=1, embed_dim=16, num_heads=2, mlp_dim=16, dropout_rate=0.1, norm="batch"
  )
  c.batch_size = 4
  c.num_train_steps = 4
  c.optimizer.learning_rate = 1e-2
  # Constant after the warmup: the schedule does not depend on num_train_steps, so a run of
  # 2 steps resumed to 4 follows the same learning rates as a run of 4.
  c.schedule.update(name="constant", warmup_steps=2)
  c.log_every_steps = 1
  c.eval_every_steps = 2
  c.checkpoint_every_steps = 2
  c.data.num_threads = 1
  for key, value in overrides.items():
    node = c
    *path, last = key.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  return c


def assert_trees_equal(a, b) -> None:
  """Same structure and every leaf equal bit for bit (resumed vs uninterrupted runs)."""
  la, ta = jax.tree.flatten(jax.device_get(a))
  lb, tb = jax.tree.flatten(jax.device_get(b))
  assert ta == tb
  assert len(la) > 0
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
