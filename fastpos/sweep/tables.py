"""Result tables from sweeps, in the papers' layout (FastRPB Tables 1-2: rows kernels, columns
positional encodings, one block per task).

  python scripts/make_tables.py SWEEP_DIR [SWEEP_DIR ...] [--format=markdown|latex]
      [--rows=KEY] [--cols=KEY] [--metric=accuracy] [--split=test]

Reads every run of each sweep (a folder of workdirs, as written by scripts/sweep.sh) through
the workdir's owner (``fastpos.train.workdir.Workdir``): the config the run last ran with
(``Workdir.config_values``: its ``config.json``, written by train.py, with the changes its
resumes recorded; for runs that never started, the resolved config recorded in
``SWEEP_DIR/sweep.json``) and its score from ``results_<split>.json`` (written by eval.py).
Several sweep folders (one per task) give one table with a block each.

Rows and columns. By default the table's row and column of a run are its config's
``experiment.row`` / ``experiment.col`` (the paper's labels, e.g. "Linear, SIKF" / "FastRPB",
recorded by the papers' table configs, e.g. configs/fastrpb_table1.py) when every run has
them, else ``model.kernel`` / ``model.positional``; ``--rows`` / ``--cols`` pick any config
field. Blocks: one per paper table (``paper.table``; LRPE Table 4's columns are tasks, so its
sweeps, one per task, share a block), else one per task (``task.name``), and one per value of
any other config field that differs between runs of the same cell (e.g. a sweep over
``optimizer.learning_rate`` gives a block per rate, and so would two tasks in one cell; a
field set per cell, like FastRPB's per-cell MNIST learning rates, does not split). Each cell
averages the runs that differ only in ``--seed_key``:

  ``37.40 ± 0.52 (n=2)``  mean ± sample standard deviation (ddof=1) over n runs;
  ``37.40 (n=1 of 2)``    one run has results, the block's runs span 2 seeds;
  ``missing``             no run with results (``missing (1 failed)`` when sweep.json records
                          failures); a cell is never shown as 0.

``--stat=ci`` shows ``37.40 [36.10, 38.70] (n=3)`` instead: the mean and its 95% Student-t
interval (``fastpos.sweep.stats``). ``--compare='FastRPB>None'`` (repeatable) or
``--baseline=None`` switch to a claim's layout (``fastpos.sweep.claim_table``): one line per
cell with its interval, and the paired difference against the baseline column over the same
seeds with its interval and a verdict (holds / does not hold / inconclusive).

The metric is ``--metric``, else the config's ``paper.metric``, else the task's validation
metric (``fastpos.tasks``); accuracy-like metrics (accuracy, f1) are shown in percent, as the
papers do. Rows and columns come in the sweep's grid order (sweep.json), then in the paper's
order (``paper.results``), then sorted.

Paper numbers: the convention is the run's config (so config.json alone carries it), as
configs/common.py ``set_paper`` writes it; any config may set the fields itself:

  config.experiment.row = "Linear, SIKF"            # the run's row label in the paper table
  config.experiment.col = "FastRPB"                 # and its column label
  config.paper.table = "FastRPB Table 1 (ListOps)"  # printed with the block
  config.paper.metric = "accuracy"                  # the results key the numbers compare with
  config.paper.results = {"Linear, SIKF|FastRPB": 11.47, ...}  # "<row>|<col>" -> the paper's
                                                    # number (or [mean, std]), in percent

With rows / columns taken from ``experiment.row`` / ``.col``, each column that has a paper
number in the block is followed by a "(paper)" column (``–`` where the paper has none).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from fastpos.sweep import stats
from fastpos.train.errors import RunError

PERCENT_METRICS = ("accuracy", "f1")
MISSING = "missing"
ROW, COL = "experiment.row", "experiment.col"


# ---------------------------------------------------------------------------------------------
# Reading runs
# ---------------------------------------------------------------------------------------------
def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
  """Nested config -> {"a.b": leaf}; lists (and empty blocks) as JSON text, so hashable."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict) and v:
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (dict, list)) else v
  return out


def read_sweep(sweep_dir: Path, split: str) -> tuple[dict | None, list[dict]]:
  """(manifest or None, runs): each run {name, order, config (nested), flat, results,
  status}; ``order`` is the run's place in the sweep's grid (None off the manifest)."""
  # Here, not at the top: the owner loads JAX and orbax (its checkpoints), which the table's
  # flags and messages do without.
  from fastpos.train.workdir import Workdir  # pylint: disable=import-outside-toplevel

  manifest_path = sweep_dir / "sweep.json"
  manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
  records = (manifest or {}).get("runs", {})
  order = {name: i for i, name in enumerate(records)}
  names = set(records)
  if sweep_dir.is_dir():
    names |= {p.name for p in sweep_dir.iterdir() if Workdir(p).config_file.exists()}
  runs = []
  for name in sorted(names):
    run = Workdir(sweep_dir / name)
    record = records.get(name, {})
    # The config the run last ran with (its recorded changes applied), else the manifest's.
    config = run.config_values() if run.config_file.exists() else record.get("config")
    if config is None:
      continue  # nothing to place the run by
    results_path = run.results_file(split)
    results = json.loads(results_path.read_text()) if results_path.exists() else None
    status = "done" if results is not None else record.get("status", "pending")
    runs.append(
        {
            "name": f"{sweep_dir}/{name}",
            "order": order.get(name),
            "config": config,
            "flat": flatten(config),
            "results": results,
            "status": status,
        }
    )
  return manifest, runs


def default_metric(task: str, results: list[dict]) -> str:
  """The task's validation metric (fastpos.tasks), else the first usual key present."""
  try:
    from fastpos import tasks  # pylint: disable=import-outside-toplevel

    return tasks.get_task_class(task).metric
  except Exception:  # not importable here, or a task this checkout does not have
    for key in ("accuracy", "f1", "perplexity", "loss"):
      if any(key in r for r in results):
        return key
    raise ValueError(f"no known metric in the results of task {task!r}; pass --metric.") from None


# ---------------------------------------------------------------------------------------------
# Cells
# ---------------------------------------------------------------------------------------------
def mean_std(values: list[float]) -> tuple[float, float | None]:
  """Mean and sample standard deviation (ddof=1; None for one value)."""
  n = len(values)
  mean = sum(values) / n
  if n < 2:
    return mean, None
  return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def format_number(mean: float, std: float | None, digits: int, latex: bool) -> str:
  if std is None:
    return f"{mean:.{digits}f}"
  pm = r" \pm " if latex else " ± "
  s = f"{mean:.{digits}f}{pm}{std:.{digits}f}"
  return f"${s}$" if latex else s


# The statuses sweep.py records for runs that stopped and need a fix (sweep.NEEDS_FIX).
FAILED = ("failed", "bad_input", "nonfinite", "locked")


def format_interval(interval: stats.Interval, digits: int, latex: bool = False) -> str:
  """``37.40 [36.10, 38.70]``: a mean and its interval (the mean alone for one value)."""
  if interval.lo is None:
    return f"{interval.mean:.{digits}f}"
  s = f"{interval.mean:.{digits}f} [{interval.lo:.{digits}f}, {interval.hi:.{digits}f}]"
  return f"${s}$" if latex else s


def cell_values(runs: list[dict], metric: str, scale: float) -> list[float]:
  """The ``metric`` of each run of a cell that has results, times ``scale``."""
  return [
      r["results"][metric] * scale
      for r in runs
      if r["results"] is not None and metric in r["results"]
  ]


def cell_text(
    runs: list[dict],
    expected: int,
    metric: str,
    scale: float,
    digits: int,
    latex: bool,
    stat: str = "std",
) -> str:
  """A cell: ``mean ± std (n=2)`` (``stat="std"``) or ``mean [lo, hi] (n=3)``, the 95%
  t-interval (``stat="ci"``); ``missing`` without results."""
  values = cell_values(runs, metric, scale)
  failed = sum(r["status"] in FAILED for r in runs)
  if not values:
    return f"{MISSING} ({failed} failed)" if failed else MISSING
  n = len(values)
  count = f"n={n}" if n >= expected else f"n={n} of {expected}"
  if failed:
    count += f", {failed} failed"
  if stat == "ci":
    return f"{format_interval(stats.mean_interval(values), digits, latex)} ({count})"
  mean, std = mean_std(values)
  return f"{format_number(mean, std, digits, latex)} ({count})"


def paper_text(value, digits: int, latex: bool) -> str:
  if value is None:
    return "--" if latex else "–"
  if isinstance(value, (list, tuple)):
    return format_number(float(value[0]), float(value[1]), digits, latex)
  return format_number(float(value), None, digits, latex)


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------
def _ordered(values_with_order: list[tuple[Any, int | None]], paper_order: list[str]) -> list:
  """Distinct values by their first place in the sweep's grid, then in the paper's table,
  then sorted."""
  first: dict[Any, float] = {}
  for v, o in values_with_order:
    first[v] = min(first.get(v, math.inf), math.inf if o is None else o)
  rank = {v: i for i, v in enumerate(dict.fromkeys(paper_order))}
  return sorted(first, key=lambda v: (first[v], rank.get(v, len(rank)), str(type(v)), str(v)))


def build_blocks(runs: list[dict], rows: str, cols: str, seed_key: str) -> list[dict]:
  """Groups runs into blocks: {title, task, paper, rows, cols, cells {(r, c): [runs]},
  expected (the number of seeds the block's runs span), runs}."""
  for key in (rows, cols):
    lacking = [r["name"] for r in runs if key not in r["flat"]]
    if lacking:
      raise ValueError(
          f"--rows/--cols key {key!r} is not in the config of {lacking[0]}; "
          f"some keys: {', '.join(sorted(runs[0]['flat'])[:12])}."
      )
  groups: dict[tuple, list[dict]] = {}
  for r in runs:  # one block per paper table (its columns may be tasks), else per task
    table = r["flat"].get("paper.table")
    key = ("table", table) if table else ("task", r["flat"].get("task.name"))
    groups.setdefault(key, []).append(r)
  out = []
  for (kind, name), group in groups.items():
    table = name if kind == "table" else None
    task = group[0]["flat"].get("task.name")
    # Fields that differ between runs of one cell (besides the seed) split the block.
    cells: dict[tuple, list[dict]] = {}
    for r in group:
      cells.setdefault((r["flat"][rows], r["flat"][cols]), []).append(r)
    keys = set().union(*(r["flat"] for r in group)) - {rows, cols, seed_key}
    keys = {k for k in keys if not k.startswith(("experiment.", "paper."))}
    extra = sorted(
        k
        for k in keys
        if any(len({json.dumps(r["flat"].get(k)) for r in cell}) > 1 for cell in cells.values())
    )
    sub: dict[tuple, list[dict]] = {}
    for r in group:
      sub.setdefault(tuple((k, r["flat"].get(k)) for k in extra), []).append(r)
    for values, block_runs in sub.items():
      paper: dict[str, Any] = {}
      if rows == ROW and cols == COL:
        for r in block_runs:
          paper.update(r["config"].get("paper", {}).get("results", {}) or {})
      b = {"task": task, "table": table, "runs": block_runs, "cells": {}, "paper": paper}
      labels = [k.split("|", 1) for k in paper if "|" in k]
      b["rows"] = _ordered(
          [(r["flat"][rows], r["order"]) for r in block_runs], [l[0] for l in labels]
      )
      b["cols"] = _ordered(
          [(r["flat"][cols], r["order"]) for r in block_runs], [l[1] for l in labels]
      )
      for r in block_runs:
        b["cells"].setdefault((r["flat"][rows], r["flat"][cols]), []).append(r)
      b["expected"] = len({json.dumps(r["flat"].get(seed_key)) for r in block_runs})
      title = table or str(task)
      extra_text = ", ".join(f"{k}={v}" for k, v in values)
      b["title"] = title + (f" ({extra_text})" if extra_text else "")
      out.append(b)
  return out


def block_metric(b: dict, override: str | None) -> str:
  if override:
    return override
  metrics = {r["flat"].get("paper.metric") for r in b["runs"]} - {None}
  if len(metrics) == 1:
    return metrics.pop()
  return default_metric(b["task"], [r["results"] for r in b["runs"] if r["results"]])


def render(
    blocks: list[dict], *, fmt: str, row_name: str, digits: int, split: str, stat: str = "std"
) -> str:
  """The tables: markdown (one table per block) or LaTeX (one tabular, a band per block);
  cells as ``cell_text`` with ``stat``."""
  latex = fmt == "latex"

  def body(b):
    metric = b["metric"]
    scale = 100.0 if metric in PERCENT_METRICS else 1.0
    cols = []
    for c in b["cols"]:
      cols.append(("ours", c))
      if any(k.endswith(f"|{c}") for k in b["paper"]):
        cols.append(("paper", c))
    lines = []
    for rv in b["rows"]:
      cells = [str(rv)]
      for kind, c in cols:
        if kind == "paper":
          cells.append(paper_text(b["paper"].get(f"{rv}|{c}"), digits, latex))
        else:
          cells.append(
              cell_text(
                  b["cells"].get((rv, c), []), b["expected"], metric, scale, digits, latex, stat
              )
          )
      lines.append(cells)
    heads = [row_name] + [str(c) + (" (paper)" if kind == "paper" else "") for kind, c in cols]
    unit = f"{split} {metric}" + (" (%)" if scale == 100.0 else "")
    return heads, lines, unit

  note = (
      "mean [95% t-interval] over seeds" if stat == "ci" else "mean ± sample std over seeds"
  ) + "; n = runs with results"
  if not latex:
    out = []
    for b in blocks:
      heads, lines, unit = body(b)
      out.append(f"### {b['title']}: {unit}\n")
      out.append("| " + " | ".join(heads) + " |")
      out.append("|" + "---|" * len(heads))
      out += ["| " + " | ".join(cells) + " |" for cells in lines]
      paper = f" (paper): {b['table']}." if b["paper"] and b["table"] else ""
      out.append(f"\n{note}.{paper}\n")
    return "\n".join(out)

  def esc(s: str) -> str:
    for a, r in (
        ("\\", r"\textbackslash{}"),
        ("&", r"\&"),
        ("%", r"\%"),
        ("#", r"\#"),
        ("_", r"\_"),
        ("{", r"\{"),
        ("}", r"\}"),
        ("~", r"\textasciitilde{}"),
        ("^", r"\textasciicircum{}"),
    ):
      s = s.replace(a, r)
    return s

  rendered = [body(b) for b in blocks]
  width = max(len(h) for h, _, _ in rendered)
  out = [
      r"% " + note.replace("±", "+-") + r"; needs \usepackage{booktabs}",
      r"\begin{tabular}{l" + "c" * (width - 1) + "}",
      r"\toprule",
  ]
  for b, (heads, lines, unit) in zip(blocks, rendered):
    pad = [""] * (width - len(heads))
    out.append(r"\multicolumn{%d}{l}{\textbf{%s}: %s} \\" % (width, esc(b["title"]), esc(unit)))
    out.append(" & ".join(esc(h) for h in heads + pad) + r" \\")
    out.append(r"\midrule")
    for cells in lines:
      text = [esc(cells[0])] + [c if c.startswith("$") else esc(c) for c in cells[1:]]
      out.append(" & ".join(text + pad) + r" \\")
    out.append(r"\midrule" if b is not blocks[-1] else r"\bottomrule")
  out.append(r"\end{tabular}")
  return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("sweep_dirs", nargs="+", type=Path)
  p.add_argument("--format", default="markdown", choices=("markdown", "latex"))
  p.add_argument("--rows", default=None, help="default: experiment.row, else model.kernel")
  p.add_argument("--cols", default=None, help="default: experiment.col, else model.positional")
  p.add_argument("--seed_key", default="seed", help="runs differing only in this are averaged")
  p.add_argument(
      "--metric", default=None, help="default: the config's paper.metric, else the task's metric"
  )
  p.add_argument("--split", default="test")
  p.add_argument("--digits", type=int, default=2)
  p.add_argument(
      "--stat",
      default="std",
      choices=("std", "ci"),
      help="cells as mean ± sample std, or mean [95%% t-interval]",
  )
  p.add_argument(
      "--compare",
      action="append",
      default=[],
      metavar="CLAIM>BASELINE",
      help="claim layout (markdown): the paired difference of column CLAIM minus column "
      "BASELINE in each row over the seeds both have, its 95%% t-interval and a verdict; "
      "repeat for more pairs",
  )
  p.add_argument(
      "--baseline",
      default=None,
      metavar="COL",
      help="claim layout: compare every other column with COL (as --compare C>COL each)",
  )
  p.add_argument(
      "--better",
      default=None,
      choices=("higher", "lower"),
      help="claim layout: which way the metric is better (default: the task's metric_mode, "
      "else lower for loss / perplexity)",
  )
  args = p.parse_args(argv)

  try:
    runs: list[dict] = []
    for d in args.sweep_dirs:
      _, found = read_sweep(d, args.split)
      if not found:
        raise ValueError(
            f"{d}: no runs (no sweep.json records, no workdir holding a run's config)."
        )
      runs += found
    labelled = all(ROW in r["flat"] and COL in r["flat"] for r in runs)
    rows = args.rows or (ROW if labelled else "model.kernel")
    cols = args.cols or (COL if labelled else "model.positional")
    blocks = build_blocks(runs, rows, cols, args.seed_key)
    for b in blocks:
      b["metric"] = block_metric(b, args.metric)
    row_name = "model" if rows == ROW else rows.rsplit(".", 1)[-1]
    if args.compare or args.baseline:
      from fastpos.sweep import claim_table  # pylint: disable=import-outside-toplevel

      text = claim_table.render(
          blocks,
          compare=args.compare,
          baseline=args.baseline,
          better=args.better,
          seed_key=args.seed_key,
          row_name=row_name,
          digits=args.digits,
          split=args.split,
      )
    else:
      text = render(
          blocks,
          fmt=args.format,
          row_name=row_name,
          digits=args.digits,
          split=args.split,
          stat=args.stat,
      )
  except (ValueError, RunError) as e:  # RunError: a damaged record of a run (named)
    print(f"make_tables: {e}", file=sys.stderr)
    return 2
  print(text)
  return 0
