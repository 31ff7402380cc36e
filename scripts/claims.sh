#!/usr/bin/env bash
# The papers' central claims, measured: every claim's sweeps (5 seeds, one run after another
# unless --mode=parallel; --all adds the sweeps skipped by default), then results/claims/
# <claim>.md tables with 95% intervals, paired differences and verdicts, figures, and
# results/claims/README.md (fastpos/sweep/claims.py; docs/claims.md).
#
#   scripts/claims.sh OUT_DIR [--claims=fastrpb,lrpe,...] [--seeds=5] [--all] [--jobs=2]
#       [--mode=parallel|sequential] [--results=results/claims] [--tiny] [--tables_only]
#
# Re-running the same command continues where it stopped (finished runs are skipped,
# interrupted ones resume from their checkpoints). The interpreter: $PYTHON, else the
# repository's .venv, else python3.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/python.sh"  # $root, $python
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m fastpos.sweep.claims "$@"
