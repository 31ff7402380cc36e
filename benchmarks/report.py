"""Where a benchmark's results go: its markdown table and its JSON record, side by side.

Every benchmark of this package (``python -m benchmarks NAME``) writes through
``write``; values JSON cannot hold (numpy scalars, dataclasses) are written as their text."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time

import jax


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


def command(name: str, argv: list[str] | None) -> str:
  """``python -m benchmarks <name> <argv>`` (``argv`` None: this process's arguments): the
  command that re-runs a benchmark, as its tables quote it."""
  return f"python -m benchmarks {name} " + " ".join(sys.argv[1:] if argv is None else argv)


def quoted_command(prog: str, argv: list[str] | None) -> str:
  """``prog`` and ``argv`` (None: this process's arguments) as a shell line, each argument
  quoted where the shell needs it."""
  return " ".join([prog, shlex.join(sys.argv[1:] if argv is None else argv)]).strip()


def headline(command: str, device: str) -> str:
  """A table's first line: the command that made it, then (host, ``device``, jax version,
  date)."""
  return (
      f"`{command}` ({platform.node() or 'host'}, {device}, jax {jax.__version__}, "
      f"{time.strftime('%Y-%m-%d')})"
  )


def run_record(name: str, argv: list[str] | None) -> dict:
  """What a benchmark run ran as: its command (``command(name, argv)``), the machine, the
  date and the load average at its start."""
  return {
      "command": command(name, argv),
      "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
      f"{jax.devices()[0].platform}",
      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
      "load_average": " ".join(f"{x:.1f}" for x in os.getloadavg()),
  }


def provenance(run: dict) -> str:
  """``run_record``'s record as the sentence a table's section opens with."""
  return (
      f"`{run['command']}` on {run['machine']}, {run['date']}, load average at start "
      f"{run['load_average']}"
  )


def increasing_ints(text: str, flag: str) -> list[int]:
  """``"512,1024"`` -> ``[512, 1024]``: a flag's increasing positive integers; raises
  ValueError naming the flag and the value otherwise (the caller prints it as one line)."""
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    values = []
  if not values or any(v < 1 for v in values) or values != sorted(set(values)):
    raise ValueError(f"{flag}={text!r}: give increasing positive integers, comma-separated.")
  return values
