"""Trains a model: ``python train.py --config=configs/<experiment>.py[:variant] --workdir=DIR``.

Any config field can be overridden on the command line, e.g. ``--config.model.kernel=sikf
--config.num_train_steps=2000``; options of a positional scheme one at a time, e.g.
``--config.model.positional_options.fastrpb.per_head=True``. The run resumes from the newest
checkpoint in ``--workdir`` with the config it was started with: a resume that changes a field
that changes the run's results (seeds, optimizer, schedule, task, model) is refused unless
``--allow_config_change`` is given, which records the change in ``config_changes.jsonl``
(``config.json`` keeps the config the run started with); so does a change of the task's data
(``docs/robustness.md``). A workdir holding another run's records but no checkpoint is
refused; ``--fresh`` moves whatever it holds to ``<workdir>/previous/<UTC time>/`` and starts
anew. ``--print_config`` prints the config
with the overrides applied (checked, as for a run) and exits (no ``--workdir`` needed, nothing
is written); ``--list_configs`` prints every
``configs/*.py`` with its first docstring sentence and its arguments (``:name=value``).
One run as several processes (hosts, or one per accelerator): the same command on each with
``--coordinator_address=HOST:PORT --num_processes=N --process_id=I``, or
``scripts/launch_local.sh N -- train.py ...`` on one machine (docs/scaling.md, "Launching on
many hosts").

Exit codes (``fastpos.train.errors``): 0 finished; 2 bad config, flag, data or workdir (one
line on stderr says which and how to fix it); 3 the loss became NaN / Inf; 4 another trainer
holds the workdir; 5 another process of the run died or froze; 75 SIGTERM (preempted) and 130
SIGINT (Ctrl-C), at any instant: the first one during training saves the step and stops, a
second one stops at once; one line on stderr names the newest checkpoint (run the same command
again to continue; ``fastpos.interrupts``); 1 an unexpected error (a bug: its traceback is
printed).
"""

from __future__ import annotations

from fastpos import interrupts

if __name__ == "__main__":  # the program (not an import of it, as tests do)
  interrupts.install("train.py")  # first: SIGINT / SIGTERM stop with one line at any instant

from pathlib import Path  # noqa: E402

from absl import flags  # noqa: E402

from fastpos.train import (  # noqa: E402
    cli,
    config_files,
    distributed,
    errors,
    program,
    train_and_evaluate,
)
from fastpos.train.workdir import Workdir  # noqa: E402

_CONFIG = cli.define_config_flag(
    "experiment config: configs/<experiment>.py[:variant]; override any field "
    "with --config.<field>=<value> (e.g. --config.model.kernel=sikf)"
)
_WORKDIR = flags.DEFINE_string("workdir", None, "where checkpoints, metrics and logs go")
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config",
    False,
    "print the resolved config (after the --config.* overrides) and " "exit without training",
)
_LIST_CONFIGS = flags.DEFINE_bool(
    "list_configs",
    False,
    "print every configs/*.py with its first docstring sentence and "
    "its arguments (--config=configs/<file>.py:<name>=<value>,...) and exit",
)
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change",
    False,
    "resume a workdir with a config that changes the run's "
    "results (seeds, optimizer, schedule, task, model); each change is recorded in "
    "<workdir>/config_changes.jsonl. Without it such a resume is refused",
)
_FRESH = flags.DEFINE_bool(
    "fresh",
    False,
    "start a new run in --workdir: what it holds (an earlier run's checkpoints, metrics, "
    "best/, tensorboard/, config.json...) moves to <workdir>/previous/<UTC time>/ first, "
    "nothing is deleted. Without it a workdir holding another run's records but no "
    "checkpoint is refused",
)
_DISTRIBUTED = distributed.define_flags()  # --coordinator_address, --num_processes, ...


def main(argv: list[str]) -> int:
  program.no_extra_args(argv)
  if _LIST_CONFIGS.value:
    print(
        config_files.list_configs(Path(__file__).resolve().parent / "configs"), end="", flush=True
    )
    return errors.EXIT_OK
  cfg = cli.config_of(_CONFIG)  # checked against the schema before anything is built
  if cfg is None:
    raise errors.RunError("--config is required, e.g. --config=configs/listops_generated.py.")
  if _PRINT_CONFIG.value:
    print(cfg, end="", flush=True)
    return errors.EXIT_OK
  workdir = program.require("workdir", _WORKDIR.value, "--workdir=/tmp/fastpos_run")
  interrupts.describe_checkpoints(Workdir(workdir).checkpoints_dir)  # in the stop line
  distributed.initialize(_DISTRIBUTED)  # before anything touches the devices
  result = train_and_evaluate(
      cfg, workdir, allow_config_change=_ALLOW_CONFIG_CHANGE.value, fresh=_FRESH.value
  )
  if result.get("stopped_early"):  # the trainer logged "preempted at step k ..."
    raise interrupts.Interrupted(result["signal"], f"at step {result['step']} after saving it")
  return errors.EXIT_OK  # the trainer's last line summarised the run


if __name__ == "__main__":
  program.run(main, "train.py")
