"""eval.py --config=... --workdir=...: thin entry point over fastpos.train (not built yet).

Until the trainer issue lands this script says so and exits non-zero rather than pretending.
"""

import sys

from fastpos.train import not_built

if __name__ == "__main__":
  sys.exit(not_built("eval.py"))
