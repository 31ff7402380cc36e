"""Training curves of several runs, overlaid: one panel per metric, one line per workdir.

  python scripts/plot_curves.py WORKDIR [WORKDIR ...] [--metrics train/loss,validation/loss]
      [--labels "ELU+1,ELU+1 + FastRPB"] [--out curves.png] [--title TEXT]

Each workdir's ``metrics.jsonl`` (what ``train.py`` writes; the last record of a step counts,
so a resumed run shows each step once) gives the points. The default metrics are the training
loss and every validation metric the runs share (bookkeeping such as ``num_examples`` apart).
Runs with the same legend entry are seeds of one variant: they draw one line, their mean, with
a band from their minimum to their maximum at the steps all of them have. A line's legend says
what sets the run apart: the config fields other than the seed whose values differ between
the runs (the config each last ran with:
``config.json`` with the changes its resumes recorded, read through the workdir's owner,
``fastpos.train.workdir.Workdir``), e.g. ``kernel=sikf, positional=absolute+fastrpb``;
``--labels`` replaces them. The format follows ``--out``'s
extension (png, pdf, svg). Bad input (a workdir without metrics.jsonl, a metric no run has,
too few labels) stops with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fastpos.plots import distinct_colors, integer_ticks  # noqa: E402
from fastpos.train.errors import RunError  # noqa: E402
from fastpos.train.workdir import Workdir  # noqa: E402

EXIT_BAD_INPUT = 2
# Config fields that never set runs apart in a legend (paths, cadence, bookkeeping).
IGNORED = (
    "data.",
    "log_every_steps",
    "eval_every_steps",
    "checkpoint_every_steps",
    "keep_checkpoints",
    "async_checkpoints",
    "num_eval_batches",
    "paper.",
    "experiment.",
    "seed",
)
BOOKKEEPING = ("num_examples",)  # metrics that count, not measure: no default panel
NAMES = {"train": "training", "validation": "validation"}


class InputError(ValueError):
  """Bad input: the message names it."""


def read_metrics(workdir: Path) -> dict[str, dict[int, float]]:
  """``{"train/loss": {step: value}, ...}`` of ``workdir/metrics.jsonl`` (last record wins)."""
  path = Workdir(workdir).metrics_file
  if not path.is_file():
    raise InputError(f"{path} not found: give the workdir of a train.py run.")
  out: dict[str, dict[int, float]] = {}
  for number, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
      step, split = int(row["step"]), str(row["split"])
    except (ValueError, KeyError, TypeError) as e:
      raise InputError(f"{path}:{number} is not a metrics record ({e}).") from None
    for key, value in row.items():
      if key not in ("step", "split", "time") and isinstance(value, (int, float)):
        out.setdefault(f"{split}/{key}", {})[step] = float(value)
  return out


def _flat(config: dict, prefix: str = "") -> dict[str, object]:
  out = {}
  for key, value in config.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def labels(workdirs: list[Path]) -> list[str]:
  """What sets each run apart: ``field=value`` of the config fields that differ between the
  runs (the last part of the field's name), else the workdir's name."""
  configs = []
  for w in workdirs:
    try:
      values = Workdir(w).config_values()
    except (OSError, RunError):
      values = None
    configs.append(None if values is None else _flat(values))
  if len(workdirs) < 2 or any(c is None for c in configs):
    return [Path(w).name for w in workdirs]
  keys = sorted({k for c in configs for k in c if not k.startswith(IGNORED)})
  differ = [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]
  if not differ:
    return [Path(w).name for w in workdirs]
  return [", ".join(f"{k.rsplit('.', 1)[-1]}={c.get(k)}" for k in differ) for c in configs]


def default_metrics(runs: list[dict]) -> list[str]:
  """The training loss, then every validation metric all runs have."""
  shared = set.intersection(*(set(r) for r in runs)) if runs else set()
  return [
      m
      for m in ["train/loss"] + sorted(m for m in shared if m.startswith("validation/"))
      if m in shared and not m.endswith(BOOKKEEPING)
  ]


def _seed_band(series: list[dict[int, float]]) -> tuple[list[int], list[float], ...]:
  """(steps all runs have, their mean, minimum and maximum over the runs)."""
  steps = sorted(set.intersection(*(set(s) for s in series)))
  values = [[s[k] for s in series] for k in steps]
  return (
      steps,
      [sum(v) / len(v) for v in values],
      [min(v) for v in values],
      [max(v) for v in values],
  )


def plot(runs: list[dict], names: list[str], metrics: list[str], title: str = ""):
  """The figure: a panel per metric, a line per legend entry (the runs that share it: their
  mean and a min-max band), one colour per entry across panels."""
  fig, axes = plt.subplots(1, len(metrics), figsize=(4.8 * len(metrics), 3.6), squeeze=False)
  groups: dict[str, list[dict]] = {}
  for run, name in zip(runs, names):
    groups.setdefault(name, []).append(run)
  colors = distinct_colors(len(groups))
  for ax, metric in zip(axes[0], metrics):
    for (name, group), color in zip(groups.items(), colors):
      series = [r[metric] for r in group if r.get(metric)]
      if not series:
        continue
      steps, mean, low, high = _seed_band(series)
      label = name if len(series) == 1 else f"{name} (mean, min-max of {len(series)})"
      marker = "o" if len(steps) < 20 else None
      ax.plot(steps, mean, label=label, color=color, marker=marker, markersize=3)
      if len(series) > 1:
        ax.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
    split, _, key = metric.partition("/")
    ax.set_title(f"{NAMES.get(split, split)} {key.replace('_', ' ')}")
    ax.set_xlabel("training step")
    integer_ticks(ax.xaxis)
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize="small")
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  return fig


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("workdirs", nargs="+", type=Path)
  parser.add_argument("--metrics", default="", help="comma-separated split/metric tags")
  parser.add_argument("--labels", default="", help="comma-separated legend entries, one a run")
  parser.add_argument("--out", type=Path, default=Path("curves.png"))
  parser.add_argument("--title", default="")
  args = parser.parse_args(argv)
  try:
    runs = [read_metrics(w) for w in args.workdirs]
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] or default_metrics(runs)
    have = sorted(set().union(*runs))
    for m in metrics:
      if not any(m in r for r in runs):
        raise InputError(f"--metrics: no run has {m!r}; they have: {', '.join(have)}.")
    if not metrics:
      raise InputError(
          f"the runs share no metric; give --metrics (they have: " f"{', '.join(have) or 'none'})."
      )
    names = [s.strip() for s in args.labels.split(",")] if args.labels else labels(args.workdirs)
    if len(names) != len(runs):
      raise InputError(f"--labels has {len(names)} entries for {len(runs)} workdirs.")
    fig = plot(runs, names, metrics, args.title)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
      fig.savefig(args.out, dpi=150)
    except ValueError as e:  # an extension matplotlib cannot write
      raise InputError(f"--out={args.out}: {e}") from None
  except (InputError, OSError) as e:
    print(f"plot_curves: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  print(f"plot_curves: {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
