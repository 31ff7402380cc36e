"""The command line of ``scripts/sweep.py`` (``fastpos.sweep`` documents the flags, the grid,
the manifest, the statuses and the exit codes): ``main(argv)`` returns the exit code."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import NamedTuple

from fastpos.sweep import report
from fastpos.sweep.manifest import Manifest
from fastpos.sweep.plan import config_flag, finished, parse_grid, split_config_spec, validate
from fastpos.sweep.runner import (
    LOG,
    NoGpuError,
    Progress,
    Runner,
    Slot,
    check_checkout,
    cpu_slots,
    discover_gpus,
    gpu_slots,
    run_parallel,
    run_sequential,
)
from fastpos.train import errors
from fastpos.train.workdir import Workdir

MODES = ("sequential", "parallel", "gpus", "print")
DESCRIPTION = (
    "Runs a grid of config overrides: every combination trains, then is scored on "
    "the test split."
)


class _OneLineParser(argparse.ArgumentParser):
  """argparse with its errors as one line (the usage is in --help), exit code 2."""

  def error(self, message):
    print(f"{self.prog}: {message}; see {self.prog} --help.", file=sys.stderr)
    sys.exit(2)


def _parser() -> argparse.ArgumentParser:
  p = _OneLineParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="configs/X.py[:arg]")
  p.add_argument("--sweep_dir", required=True, type=Path, help="one workdir per run goes here")
  p.add_argument("--mode", default="sequential", choices=MODES)
  p.add_argument("--gpus", default=None, help="--mode=gpus: GPU ids, e.g. 0,1")
  p.add_argument(
      "--jobs",
      type=int,
      default=2,
      help="--mode=parallel: runs at a time on this machine's CPUs, each limited to its "
      "share of the cores",
  )
  p.add_argument("--dry_run", action="store_true", help="show the plan; run and write nothing")
  p.add_argument("--python", default=sys.executable, help="interpreter for train.py / eval.py")
  p.add_argument(
      "--split",
      default="test",
      choices=("test", "validation"),
      help="the split eval.py scores (results_<split>.json); validation for tables "
      "that report it (Luo et al. Table 2)",
  )
  p.add_argument(
      "--compilation_cache",
      default="SWEEP_DIR/jax_cache",
      help="JAX persistent compilation cache shared by the runs (runs that differ "
      "only in seed compile once); 'none' disables it; ignored when "
      "JAX_COMPILATION_CACHE_DIR is set",
  )
  p.add_argument("grid", nargs="*", help="key=v1,v2,... (or key=v1|v2 when values hold commas)")
  return p


def _child_env(args: argparse.Namespace) -> dict[str, str]:
  """The runs' environment: this one as given, plus the shared compilation cache. This
  process itself only loads configs, on the CPU."""
  child_env = dict(os.environ)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if args.compilation_cache != "none" and "JAX_COMPILATION_CACHE_DIR" not in child_env:
    cache = args.compilation_cache.replace("SWEEP_DIR", str(args.sweep_dir))
    child_env["JAX_COMPILATION_CACHE_DIR"] = str(Path(cache).expanduser().absolute())
  return child_env


class _Sweep(NamedTuple):
  config_path: Path
  arg: str | None
  runs: dict  # run name -> (overrides, resolved config)
  slots: list[Slot]  # parallel and gpus modes: where the runs go
  no_gpu: str  # why a dry run in gpus mode found no GPU ("" otherwise)
  manifest: Manifest


def _prepare(args: argparse.Namespace, child_env: dict[str, str]) -> _Sweep:
  """Resolves every combination, finds the GPUs and opens the manifest; raises ValueError
  (one line) before anything runs."""
  check_checkout()
  config_path, arg = split_config_spec(args.config)
  grid = parse_grid(args.grid)
  runs = validate(config_path, arg, grid)
  slots, no_gpu = [], ""
  if args.mode == "gpus":
    try:
      slots = gpu_slots(discover_gpus(args.gpus, child_env))
    except NoGpuError as e:
      if not args.dry_run:
        raise
      no_gpu = e.why  # a dry run shows the plan all the same
  elif args.mode == "parallel":
    slots = cpu_slots(args.jobs, child_env)
  manifest = Manifest(
      args.sweep_dir,
      config_flag(config_path, arg)[len("--config=") :],
      grid,
      write=not args.dry_run,
  )
  return _Sweep(config_path, arg, runs, slots, no_gpu, manifest)


def _record_runs(args: argparse.Namespace, sweep: _Sweep, runner: Runner) -> list[str]:
  """Records every run in the manifest (done, or pending and why); returns the unfinished."""
  todo: list[str] = []
  runs = sweep.manifest.data["runs"]
  for name, (overrides, resolved) in sweep.runs.items():
    workdir = args.sweep_dir / name
    done, why = finished(workdir, resolved, args.split)
    record = dict(
        overrides=overrides,
        workdir=name,
        log=str(Path(name) / LOG),
        commands=[shlex.join(c) for c in runner.commands(workdir, overrides)],
        config=resolved,
    )
    if done:
      runs[name] = {**runs.get(name, {}), **record, "status": "done"}
      results = Workdir(workdir).results_file(args.split).name
      print(f"[skip] {name}: finished ({results})", file=sys.stderr)
      continue
    runs[name] = {**runs.get(name, {}), **record, "status": "pending", "message": why}
    todo.append(name)
  return todo


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _execute(args: argparse.Namespace, sweep: _Sweep, runner: Runner, todo: list[str]) -> int:
  """Runs ``todo`` in the chosen mode; returns the summary's exit code."""
  # SIGTERM (a preempted job) and Ctrl-C: the trainings save and stop, the summary says what
  # to re-run. The caller's handlers come back afterwards (``main`` may be called in-process).
  previous = {s: signal.signal(s, lambda *_: runner.terminate()) for s in _STOP_SIGNALS}
  try:
    t0 = time.time()
    jobs = max(1, min(len(sweep.slots), len(todo))) if sweep.slots else 1
    runner.progress = Progress(len(sweep.runs), len(sweep.runs) - len(todo), len(todo), jobs)
    if args.mode == "sequential":
      statuses = run_sequential(runner, sweep.runs, todo)
    else:
      statuses = run_parallel(runner, sweep.runs, todo, sweep.slots)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  return report.summarize(len(sweep.runs), todo, statuses, sweep.manifest, args.sweep_dir, t0)


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  args.sweep_dir = args.sweep_dir.expanduser().absolute()
  child_env = _child_env(args)
  try:
    sweep = _prepare(args, child_env)
  except ValueError as e:
    print(f"sweep: {e}", file=sys.stderr)
    return 2
  runner = Runner(args, sweep.config_path, sweep.arg, sweep.manifest, child_env)
  try:
    todo = _record_runs(args, sweep, runner)
  except errors.RunError as e:  # a damaged record of a run (Workdir names the file)
    print(f"sweep: {e}", file=sys.stderr)
    return errors.EXIT_BAD_INPUT
  if args.mode == "print" or args.dry_run:
    report.print_plan(todo, sweep.manifest, args.sweep_dir, sweep.slots, args.dry_run)
  try:
    sweep.manifest.save()
  except OSError as e:
    print(
        f"sweep: cannot write {sweep.manifest.path}: {e.strerror or e}; choose a --sweep_dir "
        "that can be written.",
        file=sys.stderr,
    )
    return 2
  if args.mode == "print":
    report.print_commands(todo, sweep.manifest)
    return 0
  if args.dry_run:
    report.print_dry_run(len(sweep.runs), todo, sweep.slots, sweep.no_gpu)
    return 0
  return _execute(args, sweep, runner, todo)
