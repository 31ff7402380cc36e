"""Runs a grid of config overrides: every combination trains, then is scored on the test split.

  scripts/sweep.sh --config=configs/listops_generated.py --sweep_dir=workdirs/listops_sweep \\
      arg.kernel=elu1,sikf arg.pos=none,fastrpb seed=0,1
  scripts/sweep.sh --config=configs/listops_generated.py --sweep_dir=workdirs/lg \\
      model.kernel=elu1,sikf model.positional=absolute,absolute+fastrpb seed=0,1

The command line of ``fastpos.sweep`` (its docstring has the details: the grid syntax, the
modes sequential / gpus / print, --dry_run, skip and resume, the manifest, the statuses and the
exit codes).
"""

import sys

from fastpos.sweep.cli import main  # loads jax: configs need it anyway

if __name__ == "__main__":
  sys.exit(main())
