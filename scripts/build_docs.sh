#!/usr/bin/env bash
# The API reference of fastpos's public names (fastpos.__all__), generated from their
# docstrings by pdoc: scripts/build_docs.sh [OUT] writes OUT (default docs/api/) and prints its
# index page. tests/test_api_docs.py builds the same pages into a temporary folder, so a
# public name without documentation fails the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
[ -x "$python" ] || python=python3
out="${1:-docs/api}"
# The package's own page only: its __all__ is the public surface ('!fastpos\..*' leaves the
# internal modules out).
"$python" -m pdoc --docformat google --output-directory "$out" fastpos '!fastpos\..*'
echo "$out/index.html"
