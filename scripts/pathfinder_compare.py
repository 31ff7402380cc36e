"""Two sets of Pathfinder images compared statistic by statistic, with two-sample tests.

    python scripts/pathfinder_compare.py REF.npz OURS.npz
    python scripts/pathfinder_compare.py REF.npz --generate 400 --difficulty hard --seed 0
    python scripts/pathfinder_compare.py IMAGES.npz --save_stats STATS.npz

Each .npz holds either images (``images`` uint8 ``[n, r, r]``, ``labels`` ``[n]``, optionally
``num_distractors`` ``[n]``) or their per-image statistics (``--save_stats``' output, what
tests/testdata/pathfinder_reference/ holds). ``--generate N`` compares against N images of
``fastpos.tasks.pathfinder_generator`` instead of a second file.

Per image: ``lit`` (pixels > 0), ``bright`` (pixels >= 128), ``mean`` intensity, ``dashes``
(8-connected components of the pixels >= 128: paddles, markers and their unions),
``distractors`` (distractor snakes placed), ``label``; and a 16-bin intensity histogram of the
non-zero pixels. Tests: two-sample Kolmogorov-Smirnov for the counts and the mean (asymptotic
p-value with Stephens' correction); permutation tests (images shuffled between the sets, so
pixels of one image stay together) for the positive rate and for the histogram's L1 distance.
Prints a markdown table; exits 1 when a p-value is under ``--alpha`` (default 0.01). The
statistics and the tests are ``fastpos.tasks.pathfinder_stats``'s.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from fastpos.tasks.pathfinder_stats import compare, load, statistics, table


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("ref")
  ap.add_argument("ours", nargs="?")
  ap.add_argument("--generate", type=int, default=0, help="compare N generated images")
  ap.add_argument("--difficulty", default="hard")
  ap.add_argument("--resolution", type=int, default=32)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--alpha", type=float, default=0.01)
  ap.add_argument("--save_stats", help="write the statistics of REF to this .npz and exit")
  a = ap.parse_args(argv)
  try:
    ref = load(a.ref)
    if a.save_stats:
      np.savez_compressed(a.save_stats, **ref)
      print(f"wrote the statistics of {len(ref['lit'])} images to {a.save_stats}")
      return 0
    if a.generate:
      from fastpos.tasks import pathfinder_generator

      g = pathfinder_generator.generate(
          a.generate, resolution=a.resolution, difficulty=a.difficulty, seed=a.seed
      )
      ours = statistics(g["images"], g["labels"], g["num_distractors"])
    elif a.ours:
      ours = load(a.ours)
    else:
      raise ValueError("give a second .npz or --generate N.")
  except (OSError, ValueError) as e:
    print(f"pathfinder_compare: {e}", file=sys.stderr)
    return 2
  rows = compare(ref, ours, seed=a.seed)
  print(table(rows, len(ref["lit"]), len(ours["lit"])))
  worst = min(p for *_, p in rows)
  print(f"smallest p = {worst:.3f} ({'below' if worst < a.alpha else 'above'} alpha {a.alpha})")
  return int(worst < a.alpha)


if __name__ == "__main__":
  sys.exit(main())
