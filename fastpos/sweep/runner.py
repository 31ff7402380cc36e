"""Running a sweep: train.py then eval.py per combination, in this process's environment one
after another, or several at a time on slots (one per GPU, or CPU jobs that split the host's
cores); a child's exit code becomes the run's status, and each finished run prints the
progress of the whole grid."""

from __future__ import annotations

import json
import math
import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import NamedTuple

from fastpos.sweep.manifest import Manifest, now
from fastpos.sweep.plan import config_argv, latest_checkpoint_step
from fastpos.train import errors
from fastpos.train.workdir import Workdir

# The checkout whose train.py / eval.py the runs call (the package is installed editable).
REPO = Path(__file__).resolve().parents[2]
# A child's exit code -> (status, what it means for the sweep). The codes are train.py /
# eval.py's (fastpos/train/errors.py); any other non-zero code is "failed".
EXIT_STATUS = {
    errors.EXIT_PREEMPTED: (
        "preempted",
        "preempted after saving a checkpoint; re-run the sweep " "to resume it",
    ),
    errors.EXIT_INTERRUPTED: (
        "interrupted",
        "stopped by SIGINT (Ctrl-C); re-run the sweep to resume it",
    ),
    errors.EXIT_NONFINITE: (
        "nonfinite",
        "the loss became NaN / Inf; the last good checkpoint is "
        "kept: change the config (e.g. a lower learning rate) "
        "before resuming",
    ),
    errors.EXIT_LOCKED: (
        "locked",
        "another trainer holds the workdir (another sweep on this "
        "directory?); wait for it or stop it, then re-run",
    ),
    errors.EXIT_BAD_INPUT: (
        "bad_input",
        "bad config, flag, data or workdir; fix it (see the " "log's last line) and re-run",
    ),
}
# Statuses a re-run of the same command continues; the others need a fix first.
RESUMABLE = ("preempted", "interrupted")
NEEDS_FIX = ("failed", "nonfinite", "locked", "bad_input")
LOG = "sweep.log"  # each run's train and eval output, in its workdir


def check_checkout() -> None:
  """Raises ValueError when ``REPO`` lacks train.py / eval.py (fastpos installed, not checked
  out): the runs need the repository's entry points."""
  absent = [f for f in ("train.py", "eval.py") if not (REPO / f).is_file()]
  if absent:
    raise ValueError(
        f"{REPO} has no {' or '.join(absent)}: sweeps run the repository's "
        "entry points; install fastpos from a checkout (pip install -e .)."
    )


class Runner:
  """Runs train.py then eval.py for one combination; stops cleanly on SIGTERM."""

  def __init__(
      self, args, config_path: Path, arg: str | None, manifest: Manifest, env: dict[str, str]
  ):
    self.args, self.config_path, self.arg, self.manifest = args, config_path, arg, manifest
    self.env = env
    self.python = args.python
    self.stop = threading.Event()
    self.children: set[subprocess.Popen] = set()
    self.children_lock = threading.Lock()
    self.print_lock = threading.Lock()
    self.progress: Progress | None = None  # set by the caller to print one line per run

  def commands(self, workdir: Path, overrides: dict[str, str]) -> list[list[str]]:
    flags = config_argv(self.config_path, self.arg, overrides)
    common = [flags[0], f"--workdir={workdir}", *flags[1:]]
    return [
        [self.python, str(REPO / "train.py"), *common],
        [self.python, str(REPO / "eval.py"), *common, f"--split={self.args.split}"],
    ]

  def say(self, msg: str) -> None:
    with self.print_lock:
      print(msg, flush=True)

  def terminate(self) -> None:
    self.stop.set()
    with self.children_lock:
      for p in self.children:
        if p.poll() is None:
          p.send_signal(signal.SIGTERM)

  def _call(self, argv: list[str], log, env: dict[str, str]) -> int:
    log.write(f"\n=== {now()} $ {shlex.join(argv)}\n")
    log.flush()
    p = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    with self.children_lock:
      self.children.add(p)
    try:
      return p.wait()
    finally:
      with self.children_lock:
        self.children.discard(p)

  def run(
      self, name: str, overrides: dict[str, str], resolved: dict, slot: Slot | None = None
  ) -> str:
    """Runs one combination (on ``slot``: its environment added); returns its final status
    (done / interrupted / a status of ``EXIT_STATUS`` / failed). A file that cannot be
    written (disk full, permissions) fails the run with one line, never a traceback from a
    worker thread."""
    start = time.time()
    status = self._run_or_fail(name, overrides, resolved, slot)
    if self.progress is not None:
      self.say(self.progress.line(status, time.time() - start))
    return status

  def _run_or_fail(
      self, name: str, overrides: dict[str, str], resolved: dict, slot: Slot | None
  ) -> str:
    try:
      return self._run(name, overrides, resolved, slot)
    except OSError as e:
      message = f"cannot write {e.filename or self.args.sweep_dir / name}: {e.strerror or e}"
      self.say(f"[failed] {name}: {message}")
      try:
        self.manifest.set(name, status="failed", returncode=None, message=message, finished=now())
      except OSError:  # the manifest cannot be written either; the summary still lists it
        pass
      return "failed"

  def _run(self, name: str, overrides: dict[str, str], resolved: dict, slot: Slot | None) -> str:
    workdir = self.args.sweep_dir / name
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / LOG
    env = {**self.env, **(slot.env if slot else {})}
    gpu = slot.gpu if slot else None
    start = time.time()
    self.manifest.set(name, status="running", started=now(), gpu=gpu, returncode=None, message="")
    where = f" on {slot.label}" if slot else ""
    self.say(f"[run] {name}{where} (log: {log_path})")
    with open(log_path, "a", encoding="utf-8") as log:
      status, rc, message = self._stages(workdir, overrides, resolved, log, env)
    wall = time.time() - start
    fields = dict(
        status=status, returncode=rc, message=message, finished=now(), wall_s=round(wall, 1)
    )
    if status == "done":
      fields["results"] = self._report_done(name, workdir, wall)
    else:
      self.say(
          f"[{status}] {name}: {message}; log: {log_path}\n" f"        {last_error_line(log_path)}"
      )
    self.manifest.set(name, **fields)
    return status

  def _stages(
      self, workdir: Path, overrides: dict[str, str], resolved: dict, log, env: dict[str, str]
  ) -> tuple[str, int, str]:
    """Runs train then eval; (status, return code, message) of the first that stops the run,
    else ("done", 0, "")."""
    for stage, argv in zip(("train", "eval"), self.commands(workdir, overrides)):
      rc = self._call(argv, log, env)
      if self.stop.is_set():
        return "interrupted", rc, f"stopped during {stage} (SIGTERM / SIGINT)"
      if rc != 0:
        status, meaning = EXIT_STATUS.get(rc, ("failed", ""))
        return status, rc, f"{stage} exited with status {rc}" + (f" ({meaning})" if meaning else "")
      if stage == "train":
        step = latest_checkpoint_step(workdir)
        if step is None or step < resolved["num_train_steps"]:
          return (
              "failed",
              1,
              (
                  f"train exited 0 at step {step} of "
                  f"{resolved['num_train_steps']} (stopped early)"
              ),
          )
    return "done", 0, ""

  def _report_done(self, name: str, workdir: Path, wall: float) -> dict:
    """Says a finished run's headline metric; returns its numeric results for the manifest."""
    results = json.loads(Workdir(workdir).results_file(self.args.split).read_text())
    metric = next((k for k in ("accuracy", "perplexity", "loss") if k in results), None)
    summary = f"{metric}={results[metric]:.4g}" if metric else ""
    self.say(f"[done] {name} in {wall:.0f} s {summary}")
    return {k: v for k, v in results.items() if isinstance(v, (int, float))}


def last_error_line(log_path: Path) -> str:
  """The most telling line of a log: the last one naming an error, else the last line."""
  try:
    lines = [l.strip() for l in log_path.read_text(errors="replace").splitlines() if l.strip()]
  except OSError:
    return ""
  for line in reversed(lines):
    if re.search(r"Error|error:|Traceback|FAILED", line):
      return line[-400:]
  return lines[-1][-400:] if lines else ""


class NoGpuError(ValueError):
  """--mode=gpus found no GPU; ``why`` says what was looked at."""

  def __init__(self, why: str):
    self.why = why
    super().__init__(
        f"--mode=gpus: no GPU found on this machine ({why}). Run the sweep where "
        "GPUs are, name them with --gpus=0,1,..., or use --mode=sequential (one "
        "run after another on this machine's devices)."
    )


def discover_gpus(flag: str | None, env: dict[str, str]) -> list[str]:
  """GPU ids: ``--gpus``, else CUDA_VISIBLE_DEVICES, else ``nvidia-smi -L``. Raises
  ValueError (saying how to go on) when none is found."""
  if flag:
    gpus = [g.strip() for g in flag.split(",") if g.strip()]
    if not gpus:
      raise ValueError(f"--gpus={flag!r} names no GPU; give ids such as --gpus=0,1.")
    return gpus
  if env.get("CUDA_VISIBLE_DEVICES", "").strip():
    return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
  try:
    out = subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    why = "nvidia-smi -L lists none"
  except FileNotFoundError:
    out, why = "", "nvidia-smi is not installed"
  except (OSError, subprocess.SubprocessError) as e:
    detail = getattr(e, "stderr", None) or str(e)
    out, why = "", f"nvidia-smi -L failed: {detail.strip().splitlines()[-1] if detail else e}"
  gpus = re.findall(r"^GPU (\d+):", out, flags=re.M)
  if not gpus:
    raise NoGpuError(why)
  return gpus


class Slot(NamedTuple):
  """Where a run of a parallel sweep goes: ``label`` for the messages ("GPU 3", "CPU job 1"),
  the variables added to its environment, and its GPU id (recorded in the manifest) or None."""

  label: str
  env: dict[str, str]
  gpu: str | None = None


def gpu_slots(gpus: list[str]) -> list[Slot]:
  """One slot per GPU id: the run sees only that GPU (``CUDA_VISIBLE_DEVICES``)."""
  return [Slot(f"GPU {g}", {"CUDA_VISIBLE_DEVICES": g}, g) for g in gpus]


def host_cpus() -> int:
  """The CPUs this process may run on (its affinity mask, else the machine's count)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


# XLA:CPU's thread pools: the Eigen pool of one op and the pool running independent ops.
_XLA_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads={n}"


def cpu_slots(jobs: int, env: dict[str, str], cpus: int | None = None) -> list[Slot]:
  """``jobs`` slots that split the host's ``cpus`` between them: each run's XLA limited to
  ``max(1, cpus // jobs)`` threads (``XLA_FLAGS``, added to the flags ``env`` already
  has), so that ``jobs`` runs at a time do not oversubscribe the cores."""
  if jobs < 1:
    raise ValueError(f"--jobs={jobs}: give at least 1 run at a time.")
  threads = max(1, (cpus or host_cpus()) // jobs)
  flags = f"{env.get('XLA_FLAGS', '')} {_XLA_THREAD_FLAGS.format(n=threads)}".strip()
  return [
      Slot(
          f"CPU job {i + 1} of {jobs} ({threads} thread{'s' * (threads > 1)})", {"XLA_FLAGS": flags}
      )
      for i in range(jobs)
  ]


def slot_plan(todo: list[str], slots: list[Slot]) -> dict[str, str]:
  """Where each run of a parallel sweep starts: the first ``len(slots)`` runs on one slot
  each, the rest queued for whichever slot frees first."""
  kind = "GPU" if slots and slots[0].gpu is not None else "job"
  return {
      name: (f"on {slots[i].label}" if i < len(slots) else f"queued for the next free {kind}")
      for i, name in enumerate(todo)
  }


class Progress:
  """The grid's progress after each run: cells done of all, and the time left estimated
  from the mean wall time of the runs finished in this invocation (``jobs`` at a time)."""

  def __init__(self, total: int, done_before: int, to_run: int, jobs: int):
    self.total, self.done, self.left, self.jobs = total, done_before, to_run, jobs
    self.walls: list[float] = []
    self.lock = threading.Lock()

  def line(self, status: str, wall: float) -> str:
    """Counts one ended run (``status``, ``wall`` seconds) and says where the grid stands."""
    with self.lock:
      self.left -= 1
      if status == "done":
        self.done += 1
        self.walls.append(wall)
      mean = sum(self.walls) / len(self.walls) if self.walls else None
      if not self.left:
        eta = "none left to run"
      elif mean is None:
        eta = "time left unknown (no run finished yet)"
      else:
        eta = f"about {format_duration(math.ceil(self.left / self.jobs) * mean)} left"
      mean_text = f", mean {format_duration(mean)} per cell" if mean is not None else ""
      return (
          f"[progress] {self.done}/{self.total} cells done, {self.left} to run: "
          f"{eta}{mean_text}"
      )


def format_duration(seconds: float) -> str:
  """``42 s``, ``7.5 min``, ``2.3 h``."""
  if seconds < 90:
    return f"{seconds:.0f} s"
  if seconds < 5400:
    return f"{seconds / 60:.1f} min"
  return f"{seconds / 3600:.1f} h"


def run_sequential(runner: Runner, runs: dict, todo: list[str]) -> dict[str, str]:
  """Runs ``todo`` one after another until done or stopped; {run name: final status}."""
  statuses: dict[str, str] = {}
  for name in todo:
    if runner.stop.is_set():
      break
    overrides, resolved = runs[name]
    statuses[name] = runner.run(name, overrides, resolved)
  return statuses


def run_parallel(runner: Runner, runs: dict, todo: list[str], slots: list[Slot]) -> dict[str, str]:
  """Runs ``todo`` one per slot in parallel, each slot taking the next run as it frees,
  until done or stopped; {run name: final status}."""
  statuses: dict[str, str] = {}
  work: queue.Queue[str] = queue.Queue()
  for name in todo:
    work.put(name)

  def worker(slot: Slot) -> None:
    while not runner.stop.is_set():
      try:
        name = work.get_nowait()
      except queue.Empty:
        return
      overrides, resolved = runs[name]
      statuses[name] = runner.run(name, overrides, resolved, slot)

  threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in slots]
  for t in threads:
    t.start()
  for t in threads:
    while t.is_alive():
      t.join(timeout=1.0)  # wake up for signals
  return statuses
