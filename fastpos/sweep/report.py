"""What a sweep says: the plan of a dry run or print mode, the commands of print mode, and the
summary at the end with the sweep's exit code."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from fastpos.sweep.manifest import Manifest
from fastpos.sweep.plan import latest_checkpoint_step
from fastpos.sweep.runner import NEEDS_FIX, REPO, RESUMABLE, Slot, last_error_line, slot_plan
from fastpos.train import errors


def print_plan(
    todo: list[str], manifest: Manifest, sweep_dir: Path, slots: list[Slot], dry_run: bool
) -> None:
  """One line per unfinished run on stderr: run or resume (from which step, and why), and in
  the parallel and gpus modes where it starts."""
  where = slot_plan(todo, slots) if slots else {}
  for name in todo:
    step = latest_checkpoint_step(sweep_dir / name)
    why = manifest.data["runs"][name]["message"]
    action = f"resume from step {step} ({why})" if step else "run"
    on = f" {where[name]}" if name in where else ""
    print(f"[{'plan' if dry_run else 'print'}] {name}: {action}{on}", file=sys.stderr)


def print_commands(todo: list[str], manifest: Manifest) -> None:
  """Print mode: one shell line per unfinished run (train, then eval) on stdout."""
  for name in todo:
    train, ev = manifest.data["runs"][name]["commands"]
    print(f"cd {shlex.quote(str(REPO))} && {train} && {ev}")


def print_dry_run(num_runs: int, todo: list[str], slots: list[Slot], no_gpu: str) -> None:
  """The last lines of a dry run: how many runs are finished and to run, and on which GPUs
  or how many at a time."""
  gpus = [s.gpu for s in slots if s.gpu is not None]
  where = f" on GPUs {','.join(gpus)}" if gpus else (f", {len(slots)} at a time" if slots else "")
  print(
      f"sweep: {num_runs} runs, {num_runs - len(todo)} finished, {len(todo)} to run{where}",
      file=sys.stderr,
  )
  if no_gpu:
    print(
        f"sweep: --mode=gpus: no GPU found on this machine ({no_gpu}); a real run stops "
        "there. Pass --gpus=0,1,... to see which run starts on which GPU.",
        file=sys.stderr,
    )


def summarize(
    num_runs: int,
    todo: list[str],
    statuses: dict[str, str],
    manifest: Manifest,
    sweep_dir: Path,
    t0: float,
) -> int:
  """Prints the counts by status and what to do about each run that did not finish; returns
  the sweep's exit code: 1 when a run needs a fix, else ``EXIT_PREEMPTED`` when runs were
  preempted, interrupted or not started, else 0."""
  by_status: dict[str, list[str]] = {}
  for name, status in statuses.items():
    by_status.setdefault(status, []).append(name)
  not_started = [n for n in todo if n not in statuses]
  counts = ", ".join(
      f"{len(by_status.get(k, []))} {k}"
      for k in ("done", "failed", "bad_input", "nonfinite", "locked", "preempted")
  )
  print(
      f"\nsweep: {num_runs} runs in {sweep_dir} ({time.time() - t0:.0f} s): "
      f"{num_runs - len(todo)} skipped (finished before), {counts}, "
      f"{len(by_status.get('interrupted', [])) + len(not_started)} interrupted / not started."
  )
  _print_advice(by_status, not_started, manifest, sweep_dir)
  if any(by_status.get(k) for k in NEEDS_FIX):
    return 1
  if not_started or any(by_status.get(k) for k in RESUMABLE):
    return errors.EXIT_PREEMPTED
  return 0


def _print_advice(
    by_status: dict[str, list[str]], not_started: list[str], manifest: Manifest, sweep_dir: Path
) -> None:
  for status in NEEDS_FIX:
    for name in by_status.get(status, []):
      rec = manifest.data["runs"][name]
      print(
          f"  {status.upper()} {name}: {rec['message']}\n"
          f"    log: {sweep_dir / rec['log']}\n"
          f"    {last_error_line(sweep_dir / rec['log'])}"
      )
  for name in by_status.get("preempted", []):
    print(f"  PREEMPTED {name}: re-run the same command to resume it from its checkpoint.")
  for name in by_status.get("interrupted", []):
    print(f"  INTERRUPTED {name}: re-run the same command to resume it.")
  for name in not_started:
    print(f"  NOT STARTED {name}: re-run the same command to run it.")
