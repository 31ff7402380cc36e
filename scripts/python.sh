# Sourced by the shell scripts here: sets $root (the repository) and $python, the interpreter
# they run: $PYTHON, else the repository's .venv, else python3.
root="$(dirname "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)")"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  python=python3
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; fi
fi
