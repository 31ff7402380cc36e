"""A small generated classification task ("majority") for smoke runs and trainer tests.

Each example is a sequence of ``min_length``..``max_length`` random tokens (ids 1..vocab-1,
zero-padded to ``max_length``). Ids 1..num_classes are the class tokens; the label is the class
token that occurs most often, made a strict majority by overwriting random positions with it.
Counting over the whole sequence needs a global aggregation (attention or pooling), no
positional information, so every kernel and scheme can learn it; a width-32 model reaches
well above the 1/num_classes chance level within a few hundred steps on a CPU.

Deterministic: split s of seed k is drawn from ``SeedSequence([k, s])``.
"""

from __future__ import annotations

import ml_collections
import numpy as np

from fastpos import fields
from fastpos.tasks import base
from fastpos.tasks.info import TaskInfo


class SyntheticTask(base.Task):
  """The generated "majority" task (see the module docstring)."""

  generated = True
  task_name = "synthetic"
  config_fields = {
      "vocab_size": fields.integer(16, 4),  # token ids 0..vocab_size-1; 0 is padding
      "num_classes": fields.integer(4, 2),  # class tokens are ids 1..num_classes
      "min_length": fields.integer(16, 1),  # shortest sequence (before padding)
      "max_length": fields.integer(32, 1),  # longest sequence = padded length
      "num_train": fields.integer(4096, 1),  # examples per split
      "num_validation": fields.integer(512, 1),
      "num_test": fields.integer(500, 1),
      "seed": fields.seed(),  # data seed (independent of the training seed)
  }

  @classmethod
  def info_from_config(cls, cfg: ml_collections.ConfigDict) -> TaskInfo:
    if cfg.num_classes < 2 or cfg.vocab_size < cfg.num_classes + 2:
      raise ValueError(
          f"synthetic task: need num_classes >= 2 and vocab_size >= num_classes + 2 (a "
          f"distractor and padding); got num_classes={cfg.num_classes}, "
          f"vocab_size={cfg.vocab_size}."
      )
    if not 1 <= cfg.min_length <= cfg.max_length:
      raise ValueError(
          f"synthetic task: need 1 <= min_length <= max_length; got "
          f"{cfg.min_length}, {cfg.max_length}."
      )
    return TaskInfo(
        kind="classify",
        vocab_size=cfg.vocab_size,
        num_classes=cfg.num_classes,
        max_length=cfg.max_length,
    )

  def load_split(self, split: str) -> dict[str, np.ndarray]:
    cfg = self.cfg
    n = {"train": cfg.num_train, "validation": cfg.num_validation, "test": cfg.num_test}[split]
    return generate(
        n,
        vocab_size=cfg.vocab_size,
        num_classes=cfg.num_classes,
        min_length=cfg.min_length,
        max_length=cfg.max_length,
        seed=base.split_seed(cfg.seed, split),
    )


def generate(
    n: int,
    *,
    vocab_size: int,
    num_classes: int,
    min_length: int,
    max_length: int,
    seed: np.random.SeedSequence | int,
) -> dict[str, np.ndarray]:
  """n "majority" examples: inputs int32 ``[n, max_length]``, targets int32 ``[n]``."""
  rng = np.random.default_rng(seed)
  inputs = np.zeros((n, max_length), np.int32)
  targets = rng.integers(0, num_classes, size=n).astype(np.int32)
  lengths = rng.integers(min_length, max_length + 1, size=n)
  for i in range(n):
    length, label = int(lengths[i]), int(targets[i]) + 1
    seq = rng.integers(1, vocab_size, size=length)
    while True:
      counts = np.bincount(seq, minlength=vocab_size)[1 : num_classes + 1]
      others = np.delete(counts, label - 1)
      if counts[label - 1] > others.max():
        break
      candidates = np.flatnonzero(seq != label)
      seq[rng.choice(candidates)] = label
    inputs[i, :length] = seq
  return {"inputs": inputs, "targets": targets, "mask": inputs != 0}
