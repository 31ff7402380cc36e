"""The repository stands alone: no code, docstring or doc cites a file or a tracker outside it.

Scans every ``.py``, ``.md`` and ``.sh`` file of the repository (hidden folders and caches
skipped) for references that cannot be followed from a clone: design / peer / style notes
that are not in the repository, paths into a shared folder beside it, and issue numbers.
The patterns are assembled from pieces so that this file does not match itself.
"""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUFFIXES = (".py", ".md", ".sh")
SKIP_DIRS = ("__pycache__", "node_modules", "workdirs")

PATTERNS = {
    "a notes file that is not in the repository": re.compile(
        r"\b(" + "DESIGN" + "|" + "PEERS" + "|" + "STYLE" + r")\.md\b"
    ),
    "a path outside the repository": re.compile(r"(?<![\w-])" + "shared" + "/"),
    "an issue number": re.compile(r"\b" + "issue" + r"\s+#?\d+", re.IGNORECASE),
}


def _files():
  for dirpath, dirnames, filenames in os.walk(ROOT):
    dirnames[:] = sorted(
        d
        for d in dirnames
        if not d.startswith(".") and d not in SKIP_DIRS and not d.endswith(".egg-info")
    )
    for name in sorted(filenames):
      if name.endswith(SUFFIXES):
        yield os.path.join(dirpath, name)


def find_references(paths) -> list[str]:
  """``file:line: what (text)`` for every match in ``paths``."""
  found = []
  for path in paths:
    with open(path, encoding="utf-8", errors="replace") as f:
      for number, line in enumerate(f, 1):
        for what, pattern in PATTERNS.items():
          m = pattern.search(line)
          if m:
            found.append(f"{os.path.relpath(path, ROOT)}:{number}: {what} ({m.group(0)!r})")
  return found


def test_every_reference_resolves_inside_the_repository():
  files = list(_files())
  assert len(files) > 50 and os.path.join(ROOT, "README.md") in files  # the scan saw the repo
  found = find_references(files)
  assert not found, "references that do not resolve in the repository:\n" + "\n".join(found)


def test_the_scan_finds_each_kind(tmp_path):
  path = tmp_path / "bad.py"
  path.write_text(
      "ok\n# see " + "DESIGN" + ".md\nx = 1  # " + "Issue" + " 12\n"
      "# ../" + "shared" + "/papers/x.txt\n# upstream issues #6, #20 are fine\n"
      "# not in ``" + "shared" + "/papers``; a shared_/ or unshared/ folder is\n"
  )
  found = [f.split(": ", 1)[0].rsplit(":", 1)[1] for f in find_references([str(path)])]
  assert found == ["2", "3", "4", "6"]
