"""Result tables from sweeps, in the papers' layout, or a claim's paired comparisons.

  python scripts/make_tables.py SWEEP_DIR [SWEEP_DIR ...] [--format=markdown|latex]
      [--rows=KEY] [--cols=KEY] [--metric=accuracy] [--split=test] [--stat=std|ci]
  python scripts/make_tables.py SWEEP_DIR --compare='FastRPB>None' [--compare=...]

The command line of ``fastpos.sweep.tables`` (its docstring has the layout, the blocks, the
cells and the paper numbers; ``fastpos.sweep.claim_table`` the claim layout with its paired
differences and verdicts).
"""

import sys

from fastpos.sweep.tables import main

if __name__ == "__main__":
  sys.exit(main())
