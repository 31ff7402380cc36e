"""Evaluates a trained workdir: ``python eval.py --config=... --workdir=DIR [--split=test]``.

Scores the best checkpoint on validation (``--checkpoint=latest`` for the newest one) and
writes ``DIR/results_<split>.json``. Only this script reads test splits.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags
from ml_collections import config_flags

from fastpos.train import evaluate
from fastpos.train import sharding

_CONFIG = config_flags.DEFINE_config_file("config", None, "the config the workdir was trained "
                                          "with", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "a workdir written by train.py")
_SPLIT = flags.DEFINE_enum("split", "test", ["test", "validation", "train"], "split to score")
_CHECKPOINT = flags.DEFINE_enum("checkpoint", "best", ["best", "latest"],
                                "best on validation, or the newest checkpoint")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  sharding.maybe_initialize_distributed()  # before anything touches the devices
  try:
    results = evaluate(_CONFIG.value, _WORKDIR.value, _SPLIT.value,
                       checkpoint=_CHECKPOINT.value)
  except (ValueError, NotImplementedError, FileNotFoundError) as e:  # bad config / workdir
    print(f"eval.py: {type(e).__name__}: {e}", file=sys.stderr)
    return 2
  print(json.dumps(results, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
