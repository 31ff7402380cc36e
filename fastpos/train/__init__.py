"""fastpos.train: the trainer is not built yet (see the trainer issue)."""

import sys


def not_built(entry: str) -> int:
  """Says clearly that an entry point has no trainer behind it yet; returns exit status 2."""
  print(f"fastpos: {entry} is not built yet (the trainer issue adds fastpos.train and the "
        "configs). For now run: python scripts/demo_fastrpb.py", file=sys.stderr)
  return 2
