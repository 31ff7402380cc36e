"""A claim's table: each cell's mean with its 95% t-interval, and the paired difference of a
claimed setting against its baseline over the same seeds, with a verdict.

  python scripts/make_tables.py SWEEP_DIR --compare='FastRPB>None'
  python scripts/make_tables.py SWEEP_DIR --baseline=None      # every other column > None

``CLAIM>BASELINE`` names two columns (``experiment.col`` labels, or values of ``--cols``) and
reads "CLAIM is better than BASELINE". In each row of each block (``fastpos.sweep.tables``
builds them) the runs of the two cells are paired by seed (``--seed_key``); the table gives

  | model | variant | test accuracy (%)          | vs   | difference               | verdict |
  | SIKF  | FastRPB | 37.60 [35.10, 40.10] (n=3) | None | 7.30 [2.10, 12.50] (n=3) | holds   |

  and two more columns: | paper | paper's difference |  e.g.  | 11.47 | -1.08 (worse) |

``difference`` is the mean of CLAIM - BASELINE over the seeds both cells have and its 95%
t-interval (``fastpos.sweep.stats.paired_difference``); the verdict is ``holds`` when that
interval excludes 0 on the better side (above 0 for accuracy, below 0 for perplexity and
loss), ``does not hold`` when it excludes 0 on the other side, ``inconclusive`` otherwise or
with fewer than 2 pairs. ``paper`` is the paper's number for the cell (``config.paper.results``,
"–" where its table has none) and ``paper's difference`` the paper's CLAIM - BASELINE with its
direction, so a reader sees beside each verdict what the paper itself reported.

Which side is better: ``--better``, else the task's ``metric_mode``
when the metric is the task's, else lower for loss / perplexity / bits and higher otherwise.
"""

from __future__ import annotations

from typing import Any

from fastpos.sweep import stats
from fastpos.sweep.tables import (
    PERCENT_METRICS,
    cell_text,
    cell_values,
    format_interval,
    paper_text,
)

LOWER_IS_BETTER = ("loss", "perplexity", "bits_per_byte", "bits_per_token", "bpc")


def parse_compare(specs: list[str], baseline: str | None, cols: list) -> list[tuple[str, str]]:
  """``["FastRPB>None"]`` -> ``[("FastRPB", "None")]``, plus every column of ``cols`` against
  ``baseline``; raises ValueError naming a pair that is not ``A>B``."""
  pairs: list[tuple[str, str]] = []
  for spec in specs:
    claim, sep, base = spec.partition(">")
    if not sep or not claim.strip() or not base.strip():
      raise ValueError(f"--compare={spec!r} is not CLAIM>BASELINE (two column labels).")
    pairs.append((claim.strip(), base.strip()))
  if baseline is not None:
    pairs += [(str(c), baseline) for c in cols if str(c) != baseline]
  return list(dict.fromkeys(pairs))


def higher_is_better(metric: str, task: str | None, better: str | None) -> bool:
  """Which way ``metric`` is better: ``better`` if given, else the task's ``metric_mode``
  when ``metric`` is the task's metric, else by name (``LOWER_IS_BETTER``)."""
  if better is not None:
    return better == "higher"
  try:
    from fastpos import tasks  # pylint: disable=import-outside-toplevel

    cls = tasks.get_task_class(task)
    if cls.metric == metric:
      return cls.metric_mode == "max"
  except Exception:  # a task this checkout does not have: judge by the name
    pass
  return not any(word in metric for word in LOWER_IS_BETTER)


def _paper_mean(value) -> float | None:
  """A paper's cell as one number: ``12.5`` or the mean of ``(mean, std)``; None if absent."""
  if value is None:
    return None
  return float(value[0]) if isinstance(value, (list, tuple)) else float(value)


def paper_difference(claim, baseline) -> float | None:
  """The paper's CLAIM - BASELINE (its cells' means), None where its table lacks either."""
  a, b = _paper_mean(claim), _paper_mean(baseline)
  return None if a is None or b is None else a - b


def paper_difference_text(d: float | None, higher_is_better: bool, digits: int) -> str:
  """``-1.08 (worse)``: the paper's difference and the side it falls on; "–" without one."""
  if d is None:
    return "–"
  side = "equal" if d == 0 else ("better" if (d > 0) == higher_is_better else "worse")
  return f"{d:.{digits}f} ({side})"


def by_seed(runs: list[dict], metric: str, scale: float, seed_key: str) -> dict[Any, float]:
  """{seed: metric * scale} of the runs of one cell that have results."""
  return {
      r["flat"].get(seed_key): r["results"][metric] * scale
      for r in runs
      if r["results"] is not None and metric in r["results"]
  }


def compare_block(
    b: dict, pairs: list[tuple[str, str]], *, better: str | None, seed_key: str
) -> list[dict]:
  """One record per (row, column) of block ``b`` (and per comparison of that column):
  {row, col, cell (Interval or None), runs, vs, difference (Interval or None), verdict}."""
  metric = b["metric"]
  scale = 100.0 if metric in PERCENT_METRICS else 1.0
  higher = higher_is_better(metric, b["task"], better)
  labels = {str(c): c for c in b["cols"]}
  unknown = sorted({name for pair in pairs for name in pair if name not in labels})
  if unknown:
    raise ValueError(
        f"--compare / --baseline name the column(s) {', '.join(map(repr, unknown))}, which "
        f"block {b['title']!r} does not have; its columns: {', '.join(labels)}."
    )
  out = []
  for rv in b["rows"]:
    for c in b["cols"]:
      runs = b["cells"].get((rv, c), [])
      values = cell_values(runs, metric, scale)
      cell = stats.mean_interval(values) if values else None
      vs = [base for claim, base in pairs if claim == str(c)] or [None]
      for base in vs:
        record = dict(
            row=rv,
            col=c,
            cell=cell,
            runs=runs,
            vs=base,
            difference=None,
            verdict="",
            paper=b["paper"].get(f"{rv}|{c}"),
            paper_difference=None,
        )
        if base is not None:
          mine = by_seed(runs, metric, scale, seed_key)
          theirs = by_seed(b["cells"].get((rv, labels[base]), []), metric, scale, seed_key)
          if set(mine) & set(theirs):
            record["difference"] = stats.paired_difference(mine, theirs)
            record["verdict"] = stats.verdict(record["difference"], higher_is_better=higher)
          else:
            record["verdict"] = "missing"
          record["paper_difference"] = paper_difference(
              record["paper"], b["paper"].get(f"{rv}|{base}")
          )
        out.append(record)
  b["higher_is_better"] = higher
  return out


def render(
    blocks: list[dict],
    *,
    compare: list[str],
    baseline: str | None,
    better: str | None,
    seed_key: str,
    row_name: str,
    digits: int,
    split: str,
) -> str:
  """The claim layout in markdown, one table per block (module docstring)."""
  out = []
  for b in blocks:
    pairs = parse_compare(compare, baseline, b["cols"])
    records = compare_block(b, pairs, better=better, seed_key=seed_key)
    out.append(markdown_block(b, records, row_name=row_name, digits=digits, split=split))
  return "\n".join(out)


def markdown_block(b: dict, records: list[dict], *, row_name: str, digits: int, split: str) -> str:
  """One block's table (``records`` from ``compare_block``) and its note."""
  metric = b["metric"]
  scale = 100.0 if metric in PERCENT_METRICS else 1.0
  unit = f"{split} {metric}" + (" (%)" if scale == 100.0 else "")
  side = "higher" if b["higher_is_better"] else "lower"
  out = [
      f"### {b['title']}: {unit}, {side} is better\n",
      f"| {row_name} | variant | {unit}: mean [95% CI] | vs | difference [95% CI] | verdict "
      "| paper | paper's difference |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for r in records:
    cell = cell_text(r["runs"], b["expected"], metric, scale, digits, False, "ci")
    d = r["difference"]
    diff = f"{format_interval(d, digits)} (n={d.n})" if d is not None else ""
    paper = paper_text(r["paper"], digits, False)
    paper_diff = (
        paper_difference_text(r["paper_difference"], b["higher_is_better"], digits)
        if r["vs"] is not None
        else ""
    )
    out.append(
        f"| {r['row']} | {r['col']} | {cell} | {r['vs'] or ''} | {diff} | {r['verdict']} "
        f"| {paper} | {paper_diff} |"
    )
  out.append(
      "\nmean [95% t-interval] over seeds; difference: variant minus vs, paired by seed "
      "(the seeds both have), its 95% t-interval; holds / does not hold: the interval "
      "excludes 0 on the better / the worse side; inconclusive: it holds 0 (or n < 2). "
      "paper: the paper's number for the cell (–: its table has none); paper's difference: "
      "the paper's variant minus vs and the side it falls on.\n"
  )
  return "\n".join(out)
