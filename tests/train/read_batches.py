"""Writes the training and evaluation batches this process reads, bucketed and packed:
``python tests/train/read_batches.py OUT`` (run as several processes by
``scripts/launch_local.sh``; ``tests/train/test_multiprocess_batches.py`` compares them with the
global batches of one process)."""

from __future__ import annotations

import sys

import jax
import numpy as np

from fastpos import tasks
from fastpos.train import data, sharding
from tests.train.common import tiny_config

STEPS = 5  # training batches read per layout

# name -> the config overrides of each layout (bucketed with "seq" across the processes: every
# process reads the same whole rows)
LAYOUTS = {
    "bucket": {"data.bucket_lengths": (7, 9), "data.bucket_window": 3},
    "bucket_seq": {"data.bucket_lengths": (8,), "data.bucket_window": 3, "mesh.seq": 2},
    "pack": {"data.pack": True, "data.pack_segments": 2, "data.bucket_window": 2},
}


def read(name: str) -> dict[str, np.ndarray]:
  """``{"train_<step>_<field>": ..., "eval_<batch>_<field>": ...}`` of layout ``name``."""
  cfg = tiny_config(**LAYOUTS[name])
  task = tasks.make_task(cfg.task)
  out = {}
  it = data.train_iterator(task.source("train"), cfg)
  for step in range(STEPS):
    out.update({f"train_{step}_{k}": v for k, v in next(it).items()})
  for b, batch in enumerate(data.eval_iterator(task.source("validation"), cfg)):
    out.update({f"eval_{b}_{k}": v for k, v in batch.items()})
  return out


def main(out: str) -> None:
  sharding.maybe_initialize_distributed()
  for name in LAYOUTS:
    np.savez(f"{out}/{name}_process_{jax.process_index()}.npz", **read(name))
  print(f"RESULT process {jax.process_index()} of {jax.process_count()}: wrote {len(LAYOUTS)}")


if __name__ == "__main__":
  main(sys.argv[1])
