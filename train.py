"""train.py --config=... --workdir=...: thin entry point over fastpos.train (not built yet).

The trainer is tracked by the trainer issue; until it lands this script says so and exits
non-zero rather than pretending to train.
"""

import sys


def main() -> int:
  print("fastpos: train.py is not built yet (the trainer issue adds fastpos.train and the "
        "configs). For now run: python scripts/demo_fastrpb.py", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main())
