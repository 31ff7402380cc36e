"""Where a benchmark's results go: its markdown table and its JSON record, side by side.

Every benchmark of ``fastpos.bench`` (``scripts/benchmark.py --mode=...``) writes through
``write``; values JSON cannot hold (numpy scalars, dataclasses) are written as their text."""

from __future__ import annotations

import json
import os


def write(out_dir: str | None, name: str, table: str, record: dict) -> None:
  """Writes ``<out_dir>/<name>.md`` (the table) and ``<out_dir>/<name>.json`` (the record);
  nothing when ``out_dir`` is empty or None."""
  if not out_dir:
    return
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, f"{name}.md"), "w", encoding="utf-8") as f:
    f.write(table + "\n")
  with open(os.path.join(out_dir, f"{name}.json"), "w", encoding="utf-8") as f:
    json.dump(record, f, indent=2, default=str)


def goals_table(goals: list[dict]) -> list[str]:
  """Markdown lines of a ``## Goals`` section: one row per ``{"goal", "measured", "pass"}``."""
  lines = ["## Goals", "", "| goal | measured | result |", "|---|---|---|"]
  return lines + [
      f"| {g['goal']} | {g['measured']} | {'PASS' if g['pass'] else 'FAIL'} |" for g in goals
  ]
