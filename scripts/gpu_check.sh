#!/usr/bin/env bash
# The GPU check in one call (python -m benchmarks gpu): what the device is, then its seven parts
# (linear attention by mode, the causal layer, the LM step, kernelized RPE, linear attention
# against the matmul peak, the LRA train step, train-step memory) within BUDGET_S seconds.
#
#   bash scripts/gpu_check.sh OUT_DIR [extra flags for python -m benchmarks gpu]
#   BUDGET_S=390 bash scripts/gpu_check.sh /tmp/gpu            # the default budget
#   bash scripts/gpu_check.sh /tmp/gpu_smoke --smoke            # tiny sizes, any machine
#
# Writes OUT_DIR/gpu.md, OUT_DIR/gpu.json and OUT_DIR/gpu_log.txt (everything printed); then
# (not with --smoke) measures mode="auto"'s entry for this backend (python -m benchmarks modes:
# OUT_DIR/modes_<backend>.md|json and OUT_DIR/auto.py, the rewritten table). About 8 minutes
# on a GPU in all.
# Exit status: the driver's (0 every part ran and every goal passed, 1 otherwise, 2 bad flag).
# Runs from the repository root (benchmarks/ is not installed with the package), wherever it is
# called from.
set -uo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: bash scripts/gpu_check.sh OUT_DIR [flags of python -m benchmarks gpu]" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
out=$(cd "$1" && pwd) || exit 2
shift
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
  "$python" -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__,
"optax", optax.__version__, jax.devices())'
} 2>&1 | tee "$out/gpu_log.txt"
"$python" -m benchmarks gpu --out "$out" --budget-s "${BUDGET_S:-390}" "$@" 2>&1 \
  | tee -a "$out/gpu_log.txt"
status=${PIPESTATUS[0]}
# mode="auto"'s entry for this backend, measured here (recurrent against chunk, fwd+bwd): the
# table is rewritten in this checkout and a copy of it lands in OUT_DIR, to commit with the
# figures (fastpos/ops/linear_attn/auto.py).
if [[ " $* " != *" --smoke "* ]]; then
  "$python" -m benchmarks modes --out "$out" --rounds 3 --update_auto 2>&1 | tee -a "$out/gpu_log.txt"
  cp fastpos/ops/linear_attn/auto.py "$out/auto.py"
fi
exit "$status"
