#!/usr/bin/env bash
# Runs a grid of config overrides: train.py then eval.py --split=test per combination, each in
# its own workdir under --sweep_dir, with a sweep.json manifest (fastpos/sweep/__init__.py has
# the details: modes sequential / gpus / print, --dry_run, skip and resume).
#
#   scripts/sweep.sh --config=configs/X.py[:arg] --sweep_dir=DIR [--mode=sequential|gpus|print]
#       [--gpus=0,1] [--dry_run] model.kernel=elu1,sikf \
#       model.positional=absolute,absolute+fastrpb seed=0,1
#   scripts/sweep.sh --config=configs/fastrpb_table1.py:task=text --sweep_dir=DIR \
#       arg.kernel=sikf,dpfp arg.pos=none,fastrpb seed=0,1      # arg.*: the config's argument
#
# The interpreter: $PYTHON, else the repository's .venv, else python3.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$(dirname "${BASH_SOURCE[0]}")/python.sh"  # $root, $python
exec "$python" "$here/sweep.py" "$@"
