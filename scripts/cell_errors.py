"""Worst fast-vs-dense error of every kernel x positional-scheme cell, from a pytest run.

tests/models/test_cells.py records, for every compatible cell (1D / 2D, causal or not, each
option variant), the relative error max|fast - dense| / max|dense| of the attention layer
against the same layer computed with dense references (float64). This script runs that test
(or reads a JUnit XML file of an earlier run) and prints the worst error per kernel x scheme:

    python scripts/cell_errors.py                  # default kernels (about 5 minutes)
    python scripts/cell_errors.py --all            # every kernel (the slow cells too)
    python scripts/cell_errors.py --junit run.xml  # from `pytest --junitxml=run.xml`
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CELL_ID = re.compile(
    r"\[(?P<kernel>[a-z0-9_]+)-(?P<schemes>[a-z0-9_+]+)(?:\[[^\]]*\])?-"
    r"(?P<causal>causal|bidir)-(?P<dim>1d|2d)\]$"
)


def read_junit(path: str) -> list[tuple[str, str, str, float]]:
  """(kernel, schemes, setting, rel_err) for every recorded cell of a JUnit XML file."""
  out = []
  for case in ET.parse(path).getroot().iter("testcase"):
    prop = case.find("properties/property[@name='rel_err']")
    m = CELL_ID.search(case.get("name", ""))
    if prop is None or m is None:
      continue
    out.append((m["kernel"], m["schemes"], f"{m['causal']}-{m['dim']}", float(prop.get("value"))))
  return out


def table(rows: list[tuple[str, str, str, float]]) -> str:
  """Markdown: kernels x schemes, the worst error over settings and variants in each cell."""
  worst: dict[tuple[str, str], float] = collections.defaultdict(float)
  count: collections.Counter = collections.Counter()
  for kernel, schemes, _, err in rows:
    worst[kernel, schemes] = max(worst[kernel, schemes], err)
    count[kernel, schemes] += 1
  kernels = list(dict.fromkeys(k for k, _, _, _ in rows))
  schemes = sorted({s for _, s, _, _ in rows}, key=lambda s: ("+" in s, s))
  lines = ["| kernel | " + " | ".join(schemes) + " |", "|---|" + "---:|" * len(schemes)]
  for k in kernels:
    cells = [f"{worst[k, s]:.1e} ({count[k, s]})" if (k, s) in worst else "-" for s in schemes]
    lines.append(f"| {k} | " + " | ".join(cells) + " |")
  overall = max(err for *_, err in rows)
  lines.append("")
  lines.append(
      f"Worst relative error (float64) in each cell over its settings (bidirectional / "
      f"causal, 1D / 2D) and option variants; in brackets the number of cases. "
      f"{len(rows)} cases, worst overall {overall:.1e}; '-' = incompatible."
  )
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--junit", help="read this JUnit XML instead of running the tests")
  ap.add_argument("--all", action="store_true", help="include the kernels marked slow")
  args = ap.parse_args(argv)
  path = args.junit
  if path is None:
    path = os.path.join(tempfile.mkdtemp(), "cells.xml")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/models/test_cells.py",
        "-k",
        "fast_equals_dense",
        f"--junitxml={path}",
    ]
    if args.all:
      cmd += ["-m", ""]
    print("running:", " ".join(cmd), file=sys.stderr)
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc != 0:
      print(f"pytest exited with {rc}; the table below covers the cases that ran.", file=sys.stderr)
  rows = read_junit(path)
  if not rows:
    print(f"no recorded cells in {path}", file=sys.stderr)
    return 1
  print(table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
