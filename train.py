"""Trains a model: ``python train.py --config=configs/<experiment>.py[:variant] --workdir=DIR``.

Any config field can be overridden on the command line, e.g. ``--config.model.kernel=sikf
--config.num_train_steps=2000``. The run resumes from the newest checkpoint in ``--workdir``.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from fastpos.train import NonFiniteLossError, train_and_evaluate
from fastpos.train import sharding

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (configs/)",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "where checkpoints, metrics and logs go")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  sharding.maybe_initialize_distributed()  # before anything touches the devices
  try:
    result = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except NonFiniteLossError as e:
    print(f"train.py: {e}", file=sys.stderr)
    return 3
  except (ValueError, NotImplementedError, FileNotFoundError) as e:  # bad config / data
    print(f"train.py: {type(e).__name__}: {e}", file=sys.stderr)
    return 2
  logging.info("done at step %d; best %s", result["step"], result["best"])
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
