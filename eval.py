"""Evaluates a trained workdir: ``python eval.py --workdir=DIR [--split=test]``.

The config is the one the run saved (``DIR/config.json``) unless ``--config`` names another
(a ``configs/*.py[:variant]`` file or a ``config.json``); ``--config.<field>=<value>`` overrides
apply on top. Scores the best checkpoint on validation (``--checkpoint=latest`` for the newest
one) and writes ``DIR/results_<split>.json``. Only this script reads test splits.

Exit codes as ``train.py``'s: 0 done, 2 bad config, flag, data or workdir (one line on stderr),
130 / 75 stopped by SIGINT / SIGTERM (one line, at any instant), 1 an unexpected error (a bug:
its traceback is printed).
"""

from __future__ import annotations

from fastpos import interrupts

if __name__ == "__main__":  # the program (not an import of it, as tests do)
  interrupts.install("eval.py")  # first: SIGINT / SIGTERM stop with one line at any instant

import json  # noqa: E402

from absl import flags  # noqa: E402

from fastpos.train import cli, distributed, errors, evaluate, program  # noqa: E402
from fastpos.train.workdir import Workdir  # noqa: E402

_CONFIG = cli.define_config_flag(
    "the config the workdir was trained with; default: <workdir>/config.json. "
    "Override fields with --config.<field>=<value>"
)
_WORKDIR = flags.DEFINE_string("workdir", None, "a workdir written by train.py")
_SPLIT = flags.DEFINE_enum("split", "test", ["test", "validation", "train"], "split to score")
_CHECKPOINT = flags.DEFINE_enum(
    "checkpoint", "best", ["best", "latest"], "best on validation, or the newest checkpoint"
)
_DISTRIBUTED = distributed.define_flags()  # --coordinator_address, --num_processes, ...


def main(argv: list[str]) -> int:
  program.no_extra_args(argv)
  workdir = program.require("workdir", _WORKDIR.value, "--workdir=/tmp/fastpos_run")
  # One message for a folder that is not a run's (fastpos.train.workdir): a --config given,
  # or the run's config.json that cli.with_saved_config put on the command line.
  Workdir(workdir).require_run(config_given=_CONFIG.value is not None)
  cfg = cli.config_of(_CONFIG)  # checked against the schema before anything is built
  distributed.initialize(_DISTRIBUTED)  # before anything touches the devices
  results = evaluate(cfg, workdir, _SPLIT.value, checkpoint=_CHECKPOINT.value)
  print(json.dumps(results, indent=2))
  return errors.EXIT_OK


if __name__ == "__main__":
  program.run(main, "eval.py", cli.with_saved_config)
