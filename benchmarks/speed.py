"""Speed and memory of fastpos against sequence length, in one run (the ``ops``, ``layer``
and ``train_step`` modes: ``python -m benchmarks speed --mode=...``).

Modes:
  ops         toeplitz_matmul, toeplitz_matmul_2d, fastrpb_2d_matmul, linear_attention
              (bidirectional, causal, rpe) against their FFT floor and dense reference,
              forward and forward+backward (``benchmarks.ops``);
  layer       the attention layer, forward+backward: a sweep over N for the headline cells
              and every compatible kernel x scheme cell at one length (``benchmarks.models``;
              its softmax and ELU+1 + FastRPB rows are the FastRPB speed comparison);
  train_step  steps/s and memory of the LRA Text model's full train step, each row against
              the softmax Transformer (PermuteFormer Table 2 layout; ``benchmarks.models``);
  all         the three above.

  python -m benchmarks speed --mode=all                       # this machine's defaults
  python -m benchmarks speed --mode=ops --lengths 1024,4096
  python -m benchmarks speed --mode=layer --dtype bfloat16    # the GPU target
  python -m benchmarks speed --mode=train_step --scale 0.25   # shorter sequences, slow CPU
  python -m benchmarks speed --mode=all --update_committed    # rewrite benchmarks/ tables

Setting: float32 (``--dtype``), batch 1, 8 heads, head dim 64. Times are medians of several
runs after a warm-up; all rows of a table at one length are measured side by side, round
robin, in this process (``benchmarks.measure``). Memory is the compiled executable's temp +
argument + output bytes, plus the allocator's peak on GPU. Each table names its lower bound.
Writes ``<out>/<platform>/<mode>_<table>.md`` and ``.json`` (``benchmarks.report``; and
``.png`` when matplotlib is installed)
and the mode's section of ``<out>/README.md``; prints PASS / FAIL for each target that the
mode measures. ``<out>`` is ``--out`` when given, else a new temporary folder (its path is
printed): the committed tables in the repository's ``benchmarks/`` are rewritten only on
request, with ``--update_committed`` (or ``--out`` naming that folder); ``--smoke`` numbers
never go there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import platform as py_platform
import shlex
import sys
import tempfile
import time

import jax
import numpy as np

from benchmarks import measure as bm
from benchmarks import models as bench_models
from benchmarks import ops as bench_ops
from benchmarks import report

MODES = ("ops", "layer", "train_step")
DEFAULTS = {
    # platform -> mode -> lengths
    "cpu": {
        "ops": (256, 1024, 4096, 16384),
        "layer": (1024, 2048, 4096, 8192, 16384),
        "cell": 1024,
        "cells": "each",
        "train_batch": 1,
        "train_rows": "core",
        "max_run_s": 3.0,
        "target_run_s": 30.0,
    },
    "gpu": {
        "ops": (256, 1024, 4096, 16384, 65536),
        "layer": (1024, 2048, 4096, 8192, 16384, 32768),
        "cell": 4096,
        "cells": "all",
        "train_batch": 32,
        "train_rows": "all",
        "max_run_s": 30.0,
        "target_run_s": 120.0,
    },
}
COMMITTED = os.path.dirname(os.path.abspath(__file__))  # the tables the repository ships
SMOKE = {
    "ops": (16, 64),
    "layer": (16, 64),
    "cell": 16,
    "cell_memory": (16, 64),
    "train_length": 32,
}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks speed",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--mode", required=True, choices=MODES + ("all",), help="one mode, or all of them")
  p.add_argument(
      "--lengths",
      help="comma-separated N for ops and the layer sweep " "(default: per platform, see DEFAULTS)",
  )
  p.add_argument(
      "--scale",
      type=float,
      default=1.0,
      help="multiply every default length (ops, layer, train) by this factor",
  )
  p.add_argument("--max-length", type=int, default=0, help="drop lengths above this")
  p.add_argument(
      "--cell-length",
      type=int,
      default=0,
      help="N of the every-cell layer table (default: 1024 CPU, 4096 GPU)",
  )
  p.add_argument(
      "--cell-memory-lengths",
      default="1024,16384",
      help="N at which every cell's memory is compiled for its exponent",
  )
  p.add_argument(
      "--cells",
      default="",
      help="cells of the layer table: 'all' (every compatible kernel x scheme), "
      "'each' (every kernel with 'none', every scheme with softmax and ELU+1) or "
      "comma-separated kernel:scheme (default: 'each' on CPU, 'all' on GPU)",
  )
  p.add_argument("--train-length", type=int, default=4000, help="LRA Text length")
  p.add_argument("--train-batch", type=int, default=0, help="default: 1 CPU, 32 GPU")
  p.add_argument(
      "--train-rows",
      default="",
      help="'all', 'core' (Transformer, linear with and without FastRPB, Performer, "
      "kernelized RPE, PermuteFormer) or comma-separated row names (default: "
      "'core' on CPU, 'all' on GPU)",
  )
  p.add_argument(
      "--num-features",
      type=int,
      default=32,
      help="m of the random feature maps (Luo et al. use 32)",
  )
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--repeats", type=int, default=15, help="most timed runs per case")
  p.add_argument(
      "--min-time",
      type=float,
      default=1.0,
      help="seconds of timed runs to aim for per case (at least 3 runs)",
  )
  p.add_argument(
      "--max-run-seconds",
      type=float,
      default=0.0,
      help="skip cases predicted to run longer (default: 3 CPU, 30 GPU)",
  )
  p.add_argument(
      "--target-run-seconds",
      type=float,
      default=0.0,
      help="the same for the rows a target is read from (default: 30 CPU, 120 GPU)",
  )
  p.add_argument(
      "--max-memory-gb",
      type=float,
      default=0.0,
      help="skip running cases whose compiled memory exceeds this (default: 60%% "
      "of RAM on CPU, 90%% of the device's memory on GPU)",
  )
  p.add_argument(
      "--out",
      default="",
      help="output folder (default: a new temporary folder, printed; the "
      "repository's benchmarks/ only with --update_committed or --out naming it)",
  )
  p.add_argument(
      "--update_committed",
      action="store_true",
      help="write into the repository's benchmarks/ (its tables and README.md "
      "sections): for measurements meant to be committed",
  )
  p.add_argument("--no-readme", action="store_true", help="do not update <out>/README.md")
  p.add_argument(
      "--smoke",
      action="store_true",
      help="tiny sizes and a tiny model: checks that every mode runs (tests)",
  )
  args = p.parse_args(argv)
  args.all = args.mode == "all"
  if args.update_committed and args.out and not _same_dir(args.out, COMMITTED):
    p.error(
        f"--update_committed writes to {COMMITTED}; drop --out={args.out} or " "--update_committed"
    )
  if args.update_committed:
    args.out = COMMITTED
  if args.smoke and args.out and _same_dir(args.out, COMMITTED):
    p.error(
        f"--smoke measures tiny sizes only; its numbers do not go into the committed "
        f"tables in {COMMITTED} (drop --smoke, or give another --out)"
    )
  args.argv = list(sys.argv[1:] if argv is None else argv)
  return args


def _lengths(flag: str, text: str) -> tuple[int, ...]:
  """Comma-separated sequence lengths; a ValueError names the flag and the bad value."""
  try:
    values = tuple(int(n) for n in text.split(","))
  except ValueError:
    values = ()
  if not values or min(values) < 2:
    raise ValueError(f"{flag} must be comma-separated integers >= 2; got {text!r}.")
  return values


def _check_writable(out: str) -> None:
  """Raises ValueError unless ``out`` is, or can be created as, a writable folder (checked
  before measuring, so a long run does not end in a failed write)."""
  path = os.path.abspath(os.path.expanduser(out))
  probe = path
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    raise ValueError(f"--out={out}: {probe} is a file, not a folder; give another --out.")
  if not os.access(probe, os.W_OK | os.X_OK):
    raise ValueError(f"--out={out}: {probe} is not writable; give another --out.")


def _same_dir(a: str, b: str) -> bool:
  return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(b)


def _scaled(lengths, args, *, clip: bool = False) -> tuple[int, ...]:
  """``lengths`` times ``--scale``; above ``--max-length`` dropped (``clip``: lowered to it)."""
  out = set()
  for n in lengths:
    n = max(int(round(n * args.scale)), 2)
    if args.max_length and n > args.max_length:
      if not clip:
        continue
      n = args.max_length
    out.add(n)
  return tuple(sorted(out))


def resolve(args) -> argparse.Namespace:
  """Fills the platform-dependent defaults in ``args`` (and the derived fields)."""
  args.platform = jax.devices()[0].platform
  d = DEFAULTS.get(args.platform, DEFAULTS["gpu"])
  given = _lengths("--lengths", args.lengths) if args.lengths else None
  if args.smoke:
    args.ops_lengths = given or SMOKE["ops"]
    args.layer_lengths = given or SMOKE["layer"]
    args.cell_length, args.train_length = SMOKE["cell"], SMOKE["train_length"]
    args.cell_memory = SMOKE["cell_memory"]
    args.repeats, args.min_time = 1, 0.0
  else:
    args.ops_lengths = given or _scaled(d["ops"], args)
    args.layer_lengths = given or _scaled(d["layer"], args)
    args.cell_length = args.cell_length or _scaled((d["cell"],), args, clip=True)[0]
    args.cell_memory = _scaled(
        _lengths("--cell-memory-lengths", args.cell_memory_lengths), args, clip=True
    )
    args.train_length = _scaled((args.train_length,), args, clip=True)[0]
  args.train_batch = args.train_batch or d["train_batch"]
  args.cells = args.cells or d["cells"]
  args.train_rows = args.train_rows or d["train_rows"]
  stats = bm.device_memory_stats()
  if args.max_memory_gb:
    max_mem = args.max_memory_gb * 2**30
  elif stats and "bytes_limit" in stats:
    max_mem = 0.9 * stats["bytes_limit"]
  else:
    max_mem = 0.6 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  args.limits = bm.Limits(
      max_run_s=args.max_run_seconds or d["max_run_s"],
      max_memory_bytes=max_mem,
      target_run_s=args.target_run_seconds or d["target_run_s"],
  )
  return args


# ---------------------------------------------------------------------------------------------
# Where and how results are written
# ---------------------------------------------------------------------------------------------
def machine() -> dict:
  from fastpos.plots import cpu_name

  dev = jax.devices()[0]
  cpu = cpu_name()
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
  import flax
  import jaxlib
  import optax

  return {
      "device": f"{dev.platform}: {dev.device_kind}",
      "cpu": cpu,
      "cpu_count": os.cpu_count(),
      "ram_gib": round(ram, 1),
      "python": py_platform.python_version(),
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "flax": flax.__version__,
      "optax": optax.__version__,
      "numpy": np.__version__,
  }


def plot_table(table: bm.Table, path: str, subtitle: str):
  """Writes the table's panels (log-log, one line per row, every line its own colour, ticks
  at the measured N) to ``path``; returns the figure (closed), or None without matplotlib."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastpos import plots
  except ImportError:
    return None
  fig, axes = plt.subplots(
      1, len(table.panels), figsize=(6 * len(table.panels), 4.8), squeeze=False
  )
  for ax, panel in zip(axes[0], table.panels):
    series = {label: pts for label, pts in panel.series.items() if pts}
    for (label, pts), color in zip(series.items(), plots.distinct_colors(len(series))):
      ax.loglog([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=label)
    if series:
      plots.ticks_at(ax.xaxis, [p[0] for pts in series.values() for p in pts])
      ax.tick_params(axis="x", labelrotation=45)
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=1 + len(series) // 12)
  fig.suptitle(f"{table.title}\n{subtitle}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return fig


def plot_subtitle(mode: str, args) -> str:
  """What a benchmark figure's numbers depend on: batch, dtype and the machine."""
  from fastpos import plots

  batch = args.train_batch if mode == "train_step" else 1
  return f"batch {batch}, {args.dtype}; {plots.machine()}"


def write_outputs(
    mode: str, tables: list[bm.Table], targets: list[bm.Target], meta: dict, args
) -> None:
  folder = os.path.join(args.out, args.platform)
  os.makedirs(folder, exist_ok=True)
  plotted = []
  for t in tables:
    stem = os.path.join(folder, f"{mode}_{t.name}")
    report.write(
        folder,
        f"{mode}_{t.name}",
        f"#### {t.title}\n\n{t.markdown()}",
        {
            "mode": mode,
            "table": t.name,
            "title": t.title,
            "meta": meta,
            "header": t.header,
            "rows": t.rows,
            "notes": t.notes,
            "data": t.data,
            "targets": [vars(x) | {"verdict": x.verdict} for x in targets],
        },
    )
    if t.panels and plot_table(t, stem + ".png", plot_subtitle(mode, args)):
      plotted.append(stem + ".png")
  if tables and not plotted and any(t.panels for t in tables):
    print(
        f"[{mode}] matplotlib is not installed in this environment: no PNG plots written "
        "(the JSON files hold every number; `pip install matplotlib` to get the plots)."
    )
  if not args.no_readme:
    update_readme(os.path.join(args.out, "README.md"), mode, tables, targets, meta, args)


def section_text(
    mode: str, tables: list[bm.Table], targets: list[bm.Target], meta: dict, args
) -> str:
  m = meta["machine"]
  lines = [
      f"### {args.platform.upper()}: {mode}",
      "",
      f"Machine: {m['device']} ({m['cpu']}, {m['cpu_count']} cores, {m['ram_gib']} GiB); "
      f"python {m['python']}, jax {m['jax']} / jaxlib {m['jaxlib']}, flax {m['flax']}, "
      f"optax {m['optax']}, numpy {m['numpy']}. Date: {meta['date']}. Load average "
      f"before / after: {meta['load_before']} / {meta['load_after']}. Wall time "
      f"{meta['wall_s']:.0f} s.",
      "",
      f"Command: `{meta['command']}`",
      "",
  ]
  if targets:
    lines += ["Targets:", ""]
    lines += [f"- **{t.verdict}** {t.text}: {t.measured}" for t in targets]
    lines.append("")
  for t in tables:
    lines += [f"#### {t.title}", "", t.markdown(), ""]
  return "\n".join(lines).rstrip() + "\n"


def update_readme(path: str, mode: str, tables, targets, meta, args) -> None:
  """Replaces the text between this (platform, mode)'s markers; appends them if absent."""
  start = f"<!-- benchmark:{args.platform}:{mode}:start -->"
  end = f"<!-- benchmark:{args.platform}:{mode}:end -->"
  body = section_text(mode, tables, targets, meta, args)
  text = pathlib.Path(path).read_text() if os.path.exists(path) else "# Measurements\n"
  if start in text and end in text:
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    text = f"{head}{start}\n{body}{end}{tail}"
  else:
    text = f"{text.rstrip()}\n\n{start}\n{body}{end}\n"
  with open(path, "w") as f:
    f.write(text)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
def run_mode(mode: str, args) -> list[bm.Target]:
  log = lambda s: print(f"[{mode}] {s}", flush=True)
  t0, load0 = time.time(), _load()
  if mode == "ops":
    tables, targets = bench_ops.run(args, log)
  else:
    tables, targets = (bench_models.run_layer if mode == "layer" else bench_models.run_train)(
        args, log
    )
  meta = {
      "machine": machine(),
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "load_before": load0,
      "load_after": _load(),
      "wall_s": time.time() - t0,
      "command": "python -m benchmarks speed " + shlex.join(args.argv),
      "settings": {k: v for k, v in vars(args).items() if k not in ("limits", "argv")}
      | {"limits": dataclasses.asdict(args.limits)},
  }
  for t in tables:
    print(f"\n## {mode}: {t.title}\n\n{t.markdown()}\n", flush=True)
  for t in targets:
    print(f"{t.verdict}: {t.text}: {t.measured}", flush=True)
  write_outputs(mode, tables, targets, meta, args)
  return targets


def _load() -> str:
  try:
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
  except OSError:
    return "unknown"


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    args = resolve(args)
    # Bad cells / rows stop here, before any compute.
    if args.all or args.mode == "layer":
      bench_models.all_cells(args.cells)
    if args.all or args.mode == "train_step":
      bench_models.select_train_models(args.train_rows, args.num_features)
    if args.out:
      _check_writable(args.out)
  except ValueError as e:
    print(f"benchmark: {e}", file=sys.stderr)
    return 2
  if not args.out:
    args.out = tempfile.mkdtemp(prefix="fastpos_benchmark_")
  print(
      f"fastpos benchmark on {jax.devices()[0]} ({args.dtype}); output under "
      f"{os.path.join(args.out, args.platform)}",
      flush=True,
  )
  targets = []
  for mode in (MODES if args.all else (args.mode,)):
    try:
      targets += run_mode(mode, args)
    except KeyboardInterrupt:
      print(
          f"\nbenchmark: interrupted during {mode}; the modes finished before are under "
          f"{args.out}.",
          file=sys.stderr,
      )
      return 130
    except OSError as e:  # writing the results (the tables were printed above)
      print(
          f"benchmark: cannot write {e.filename or args.out}: {e.strerror or e}; the tables "
          f"of {mode} are printed above. Give another --out.",
          file=sys.stderr,
      )
      return 2
  if targets:
    print("\nTargets:")
    for t in targets:
      print(f"  {t.verdict}: {t.text}: {t.measured}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
