"""Runs a grid of config overrides: every combination trains, then is scored on the test split.

  scripts/sweep.sh --config=configs/listops_generated.py --sweep_dir=workdirs/listops_sweep \\
      arg.kernel=elu1,sikf arg.pos=none,fastrpb seed=0,1
  scripts/sweep.sh --config=configs/listops_generated.py --sweep_dir=workdirs/lg \\
      model.kernel=elu1,sikf model.positional=absolute,absolute+fastrpb seed=0,1

Each grid argument is ``key=v1,v2,...`` with ``key`` a config field (as in ``--config.key=v``
of train.py) or ``arg.<name>``, a field of the config file's argument (``get_config(arg)``:
``arg.kernel=dpfp,sikf`` runs ``--config=x.py:kernel=dpfp`` and ``--config=x.py:kernel=sikf``,
merged with the argument given in ``--config``, e.g. ``:tiny``); the papers' table configs
pick a table's cell this way (configs/fastrpb_table1.py: ``arg.task=text arg.kernel=dpfp,sikf``).
When a value itself holds a comma (``model.positional=absolute,fastrpb``; ``absolute+fastrpb``
also works), separate the values with ``|`` instead (quote it for the shell; a single value holding
commas ends with ``|``: ``'model.positional=absolute,fastrpb|'``). Every combination (the
Cartesian product, in the order given) gets its own workdir ``SWEEP_DIR/<name>``, its name
built from the overrides: ``model.kernel=elu1__model.positional=absolute+fastrpb__seed=0``
(``,`` -> ``+``, other characters outside ``[A-Za-z0-9._=+-]`` -> ``-``). A run is

  python train.py --config=CONFIG --workdir=WORKDIR --config.key=value ...
  python eval.py  --config=CONFIG --workdir=WORKDIR --config.key=value ... --split=test

with both outputs appended to ``WORKDIR/sweep.log``.

Before anything runs, each combination's config is resolved exactly as train.py resolves it
(ml_collections ``config_flags``): an unknown key stops the sweep with the nearby valid keys,
a value of the wrong type with the flag's error. ``SWEEP_DIR/sweep.json`` is the manifest:
the config, the grid and one record per run (overrides, workdir, log, status, return code,
wall time, the commands and the resolved config, which scripts/make_tables.py reads for runs
that never started); it is rewritten after every change of status.

Re-running the same command skips finished runs (``results_test.json`` newer than the
workdir's ``config.json``, that ``config.json`` equal to the combination's resolved config,
and the newest checkpoint at ``num_train_steps``) and resumes unfinished ones (train.py
resumes from the newest checkpoint by itself). A run that exits non-zero is recorded with
its log and a status read from train.py / eval.py's exit code (``fastpos/train/errors.py``):

  preempted   75: stopped by SIGTERM / SIGINT after saving a checkpoint; re-running the sweep
              resumes it;
  nonfinite   3: the loss became NaN / Inf; the last good checkpoint is kept (resuming it
              with the same settings will likely diverge again: change the config);
  locked      4: another trainer holds the workdir (another sweep on the same directory?);
  bad_input   2: a bad config, flag, data or workdir: the log's last line says which;
  failed      any other code (a bug: the log has the traceback).

The others go on; the summary at the end lists each kind apart. The sweep's exit status is
0 when every run is done, 1 when a run needs a fix (failed, nonfinite, locked, bad_input),
else 75 (``EXIT_PREEMPTED``) when runs were preempted, interrupted or not started: re-run
the same command to continue.

Modes:
  sequential  (default) one run after another in this process's environment;
  gpus        one run per GPU in parallel, each with CUDA_VISIBLE_DEVICES set to its GPU
              (the GPUs: ``--gpus=0,1``, else CUDA_VISIBLE_DEVICES, else ``nvidia-smi -L``;
              with none found the sweep stops with a message before running anything);
  print       prints one shell command per unfinished run (train then eval) and runs
              nothing: ``... --mode=print | xargs -P 4 -I{} sh -c '{}'`` or one line per
              task of a job array. Re-run with ``--mode=sequential`` (it skips the finished
              runs) or run scripts/make_tables.py directly afterwards.
``--dry_run`` shows what each mode would do (run / resume / skip, and in gpus mode which run
starts on which GPU) and writes nothing; it needs no GPU (on a machine without one, pass
``--gpus=0,1,...`` to see the assignment for those).

In the sequential and gpus modes the runs share a JAX persistent compilation cache
(``--compilation_cache``, by default ``SWEEP_DIR/jax_cache``): runs that differ only in their
seed compile their steps once. Printed commands set nothing (export JAX_COMPILATION_CACHE_DIR
for the jobs to share one).

SIGTERM (a preempted job) and SIGINT (Ctrl-C) are passed on to the running trainings, which
save a checkpoint and stop; their runs are recorded as interrupted and the next invocation
resumes them.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fastpos.train import cli, errors  # noqa: E402  (loads jax: configs need it anyway)

MODES = ("sequential", "gpus", "print")
# A child's exit code -> (status, what it means for the sweep). The codes are train.py /
# eval.py's (fastpos/train/errors.py); any other non-zero code is "failed".
EXIT_STATUS = {
    errors.EXIT_PREEMPTED: ("preempted", "preempted after saving a checkpoint; re-run the sweep "
                                         "to resume it"),
    errors.EXIT_NONFINITE: ("nonfinite", "the loss became NaN / Inf; the last good checkpoint is "
                                         "kept: change the config (e.g. a lower learning rate) "
                                         "before resuming"),
    errors.EXIT_LOCKED: ("locked", "another trainer holds the workdir (another sweep on this "
                                   "directory?); wait for it or stop it, then re-run"),
    errors.EXIT_BAD_INPUT: ("bad_input", "bad config, flag, data or workdir; fix it (see the "
                                         "log's last line) and re-run"),
}
# Statuses a re-run of the same command continues; the others need a fix first.
RESUMABLE = ("preempted", "interrupted")
NEEDS_FIX = ("failed", "nonfinite", "locked", "bad_input")
MANIFEST = "sweep.json"
LOG = "sweep.log"
_SAFE = re.compile(r"[^A-Za-z0-9._=+-]")


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------
def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
  """``["model.kernel=elu1,sikf", "seed=0,1"]`` -> ``[("model.kernel", ["elu1", "sikf"]), ...]``.

  Values are split on ``|`` when the spec holds one, else on ``,``; a trailing ``|`` marks
  a single value that holds commas (``model.positional=absolute,fastrpb|``).
  """
  grid: list[tuple[str, list[str]]] = []
  for spec in specs:
    key, eq, values = spec.partition("=")
    key = key.strip()
    if key.startswith("--config."):
      key = key[len("--config."):]
    if not eq or not key:
      raise ValueError(f"grid argument {spec!r} is not key=v1,v2,...")
    if "|" in values:
      vals = [v.strip() for v in values.split("|")]
      if len(vals) > 1 and not vals[-1]:
        vals = vals[:-1]  # "key=a,b|": the single value "a,b"
    else:
      vals = [v.strip() for v in values.split(",")]
    if any(not v for v in vals):
      raise ValueError(f"grid argument {spec!r} has an empty value.")
    if len(set(vals)) != len(vals):
      raise ValueError(f"grid argument {spec!r} repeats a value.")
    if key in (k for k, _ in grid):
      raise ValueError(f"grid key {key!r} is given twice.")
    grid.append((key, vals))
  return grid


def combinations(grid: list[tuple[str, list[str]]]) -> list[dict[str, str]]:
  """The Cartesian product of the grid, first key slowest, as ordered dicts."""
  keys = [k for k, _ in grid]
  return [dict(zip(keys, vals)) for vals in itertools.product(*(v for _, v in grid))]


def run_name(overrides: dict[str, str]) -> str:
  """The workdir name of a combination: ``key=value`` pairs joined by ``__``, sanitised."""
  if not overrides:
    return "default"
  parts = [f"{k}={v.replace(',', '+').replace('/', '_')}" for k, v in overrides.items()]
  return _SAFE.sub("-", "__".join(parts))


# ---------------------------------------------------------------------------------------------
# Configs, resolved as train.py resolves them
# ---------------------------------------------------------------------------------------------
def split_config_spec(spec: str) -> tuple[Path, str | None]:
  """``"configs/x.py:tiny"`` -> (absolute path, "tiny")."""
  path, colon, arg = spec.partition(".py:")
  path = Path(path + ".py" if colon else spec).expanduser()
  if not path.is_absolute():
    path = (Path.cwd() / path).resolve()
  if not path.is_file():
    raise ValueError(f"config file {path} does not exist.")
  return path, (arg if colon else None)


def config_flag(config_path: Path, arg: str | None) -> str:
  return f"--config={config_path}" + (f":{arg}" if arg is not None else "")


def merge_arg(base: str | None, arg_overrides: dict[str, str]) -> str | None:
  """The config argument with ``arg.<name>`` grid values set: ``("tiny", {"kernel": "dpfp"})``
  -> ``"tiny,kernel=dpfp"`` (a name already in ``base`` is replaced in place)."""
  parts: dict[str, str] = {}
  for part in filter(None, (base or "").split(",")):
    parts[part.partition("=")[0].strip()] = part
  for k, v in arg_overrides.items():
    parts[k] = f"{k}={v}"
  return ",".join(parts.values()) or None


def config_argv(config_path: Path, base_arg: str | None, overrides: dict[str, str]) -> list[str]:
  """train.py's config flags for a combination: ``arg.<name>`` keys go into the config
  argument (``--config=x.py:name=value``), the others become ``--config.<key>=<value>``."""
  arg = merge_arg(base_arg, {k[4:]: v for k, v in overrides.items() if k.startswith("arg.")})
  return [config_flag(config_path, arg),
          *(f"--config.{k}={v}" for k, v in overrides.items() if not k.startswith("arg."))]


def load_config(config_path: Path, arg: str | None, overrides: dict[str, str]):
  """The ConfigDict train.py would build from these flags (``fastpos.train.cli``)."""
  arg = merge_arg(arg, {k[4:]: v for k, v in overrides.items() if k.startswith("arg.")})
  return cli.load_config(config_flag(config_path, arg)[len("--config="):],
                         [(k, v) for k, v in overrides.items() if not k.startswith("arg.")])


def _last_line(e: Exception) -> str:
  """An error's message; for an error raised inside get_config (absl wraps the whole
  traceback into its message), the traceback's last line, which says what went wrong."""
  msg = str(e).strip()
  return msg.splitlines()[-1] if "Traceback" in msg else msg


def validate(config_path: Path, arg: str | None, grid: list[tuple[str, list[str]]]):
  """Checks the keys against the config, then resolves every combination.

  Returns {run name: (overrides, resolved config as JSON values)}. Raises ValueError naming
  an unknown key (with nearby valid keys), a bad value, or two combinations whose names
  collide after sanitising.
  """
  try:
    base = load_config(config_path, arg, {})
  except Exception as e:  # a broken config file or config argument
    raise ValueError(f"cannot load {config_flag(config_path, arg)[9:]}: "
                     f"{type(e).__name__}: {_last_line(e)}") from e
  keys = cli.config_keys(base)
  for key, values in grid:
    if key.startswith("arg."):  # a get_config argument: its names are checked on loading
      if any("," in v for v in values):
        raise ValueError(f"grid key {key!r}: a config argument value cannot hold a comma.")
      continue
    if key not in keys and not key.startswith("model.positional_options."):  # loader checks
      raise ValueError(
          f"unknown override key {key!r}: {config_path.name}"
          f"{':' + arg if arg else ''} has no field config.{key}. Nearby valid keys: "
          f"{', '.join(cli.nearby(key, keys))}.")
    if key in keys and hasattr(base[key], "keys"):
      raise ValueError(f"override key {key!r} is a block of the config, not a field; set its "
                       f"fields ({', '.join(list(base[key].keys())[:8])}).")
  runs: dict[str, tuple[dict[str, str], dict]] = {}
  for overrides in combinations(grid):
    name = run_name(overrides)
    if name in runs:
      raise ValueError(f"the combinations {runs[name][0]} and {overrides} get the same "
                       f"workdir name {name!r}; use values that differ in [A-Za-z0-9._=+-].")
    try:
      cfg = load_config(config_path, arg, overrides)
    except Exception as e:  # absl's IllegalFlagValueError names the flag and the value
      kind = "" if isinstance(e, errors.RunError) else f"{type(e).__name__}: "  # says it all
      raise ValueError(f"bad override in {overrides}: {kind}{_last_line(e)}") from e
    resolved = json.loads(cfg.copy_and_resolve_references().to_json_best_effort())
    runs[name] = (overrides, resolved)
  return runs


# ---------------------------------------------------------------------------------------------
# Workdir state
# ---------------------------------------------------------------------------------------------
def latest_checkpoint_step(workdir: Path) -> int | None:
  """The newest complete checkpoint step in ``workdir/checkpoints`` (orbax step folders)."""
  d = workdir / "checkpoints"
  if not d.is_dir():
    return None
  steps = [int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()]
  return max(steps) if steps else None


def finished(workdir: Path, resolved: dict, split: str = "test") -> tuple[bool, str]:
  """(done?, why not) for a workdir and the config its run should have."""
  results, config = workdir / f"results_{split}.json", workdir / "config.json"
  if not config.exists():
    return False, "not started"
  step = latest_checkpoint_step(workdir)
  saved = json.loads(config.read_text())
  if saved != resolved:
    diff = sorted(_diff_keys(saved, resolved))
    return False, f"config.json differs from the sweep's config in {', '.join(diff[:6])}"
  if step is None or step < resolved["num_train_steps"]:
    return False, f"trained to step {step or 0} of {resolved['num_train_steps']}"
  if not results.exists():
    return False, "trained, not evaluated"
  if results.stat().st_mtime < config.stat().st_mtime:
    return False, f"{results.name} is older than config.json"
  return True, "done"


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
  if isinstance(a, dict) and isinstance(b, dict):
    out = []
    for k in sorted(set(a) | set(b)):
      out += _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
    return out
  return [] if a == b else [prefix.rstrip(".")]


# ---------------------------------------------------------------------------------------------
# The manifest
# ---------------------------------------------------------------------------------------------
def _now() -> str:
  return datetime.datetime.now().isoformat(timespec="seconds")


class Manifest:
  """``sweep.json``: written atomically (tmp + rename) under a lock after every change."""

  def __init__(self, sweep_dir: Path, config: str, grid: list[tuple[str, list[str]]],
               *, write: bool):
    self.path = sweep_dir / MANIFEST
    self.write_enabled = write
    self.lock = threading.Lock()
    try:
      old = json.loads(self.path.read_text()) if self.path.exists() else None
    except (OSError, ValueError) as e:
      raise ValueError(f"cannot read the manifest {self.path}: {e}; move it away (the runs' "
                       "workdirs stay usable) or use another --sweep_dir.") from e
    if old is not None and old.get("config") != config:
      raise ValueError(f"{sweep_dir} holds a sweep of {old.get('config')!r}, not {config!r}; "
                       "use another --sweep_dir.")
    self.data = {"config": config, "grid": {k: v for k, v in grid},
                 "created": old["created"] if old else _now(), "updated": _now(),
                 "runs": {}}
    if old:  # keep the records of runs outside this grid (an earlier, larger grid)
      self.data["runs"].update(old.get("runs", {}))

  def set(self, name: str, **fields) -> None:
    with self.lock:
      self.data["runs"].setdefault(name, {}).update(fields)
      self.data["updated"] = _now()
      self._write()

  def _write(self) -> None:
    if not self.write_enabled:
      return
    self.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = self.path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(self.data, indent=2))
    tmp.replace(self.path)


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
class Runner:
  """Runs train.py then eval.py for one combination; stops cleanly on SIGTERM."""

  def __init__(self, args, config_path: Path, arg: str | None, manifest: Manifest,
               env: dict[str, str]):
    self.args, self.config_path, self.arg, self.manifest = args, config_path, arg, manifest
    self.env = env
    self.python = args.python
    self.stop = threading.Event()
    self.children: set[subprocess.Popen] = set()
    self.children_lock = threading.Lock()
    self.print_lock = threading.Lock()

  def commands(self, workdir: Path, overrides: dict[str, str]) -> list[list[str]]:
    flags = config_argv(self.config_path, self.arg, overrides)
    common = [flags[0], f"--workdir={workdir}", *flags[1:]]
    return [[self.python, str(REPO / "train.py"), *common],
            [self.python, str(REPO / "eval.py"), *common, f"--split={self.args.split}"]]

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
    log.write(f"\n=== {_now()} $ {shlex.join(argv)}\n")
    log.flush()
    p = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    with self.children_lock:
      self.children.add(p)
    try:
      return p.wait()
    finally:
      with self.children_lock:
        self.children.discard(p)

  def run(self, name: str, overrides: dict[str, str], resolved: dict,
          gpu: str | None = None) -> str:
    """Runs one combination; returns its final status (done / interrupted / a status of
    ``EXIT_STATUS`` / failed). A file that cannot be written (disk full, permissions) fails
    the run with one line, never a traceback from a worker thread."""
    try:
      return self._run(name, overrides, resolved, gpu)
    except OSError as e:
      message = f"cannot write {e.filename or self.args.sweep_dir / name}: {e.strerror or e}"
      self.say(f"[failed] {name}: {message}")
      try:
        self.manifest.set(name, status="failed", returncode=None, message=message,
                          finished=_now())
      except OSError:  # the manifest cannot be written either; the summary still lists it
        pass
      return "failed"

  def _run(self, name: str, overrides: dict[str, str], resolved: dict,
           gpu: str | None) -> str:
    workdir = self.args.sweep_dir / name
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / LOG
    env = dict(self.env)
    if gpu is not None:
      env["CUDA_VISIBLE_DEVICES"] = gpu
    start = time.time()
    self.manifest.set(name, status="running", started=_now(), gpu=gpu, returncode=None,
                      message="")
    where = f" on GPU {gpu}" if gpu is not None else ""
    self.say(f"[run] {name}{where} (log: {log_path})")
    status, rc, message = "done", 0, ""
    with open(log_path, "a", encoding="utf-8") as log:
      for stage, argv in zip(("train", "eval"), self.commands(workdir, overrides)):
        rc = self._call(argv, log, env)
        if self.stop.is_set():
          status, message = "interrupted", f"stopped during {stage} (SIGTERM / SIGINT)"
          break
        if rc != 0:
          status, meaning = EXIT_STATUS.get(rc, ("failed", ""))
          message = f"{stage} exited with status {rc}" + (f" ({meaning})" if meaning else "")
          break
        if stage == "train":
          step = latest_checkpoint_step(workdir)
          if step is None or step < resolved["num_train_steps"]:
            status, rc = "failed", 1
            message = (f"train exited 0 at step {step} of {resolved['num_train_steps']} "
                       "(stopped early)")
            break
    wall = time.time() - start
    fields = dict(status=status, returncode=rc, message=message, finished=_now(),
                  wall_s=round(wall, 1))
    if status == "done":
      results = json.loads((workdir / f"results_{self.args.split}.json").read_text())
      fields["results"] = {k: v for k, v in results.items() if isinstance(v, (int, float))}
      metric = next((k for k in ("accuracy", "perplexity", "loss") if k in results), None)
      summary = f"{metric}={results[metric]:.4g}" if metric else ""
      self.say(f"[done] {name} in {wall:.0f} s {summary}")
    else:
      self.say(f"[{status}] {name}: {message}; log: {log_path}\n"
               f"        {last_error_line(log_path)}")
    self.manifest.set(name, **fields)
    return status


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
    super().__init__(f"--mode=gpus: no GPU found on this machine ({why}). Run the sweep where "
                     "GPUs are, name them with --gpus=0,1,..., or use --mode=sequential (one "
                     "run after another on this machine's devices).")


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
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
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


def gpu_plan(todo: list[str], gpus: list[str]) -> dict[str, str]:
  """Where each run of a gpus-mode sweep starts: the first ``len(gpus)`` runs on one GPU each,
  the rest queued for whichever GPU frees first."""
  return {name: (f"on GPU {gpus[i]}" if i < len(gpus) else "queued for the next free GPU")
          for i, name in enumerate(todo)}


class _OneLineParser(argparse.ArgumentParser):
  """argparse with its errors as one line (the usage is in --help), exit code 2."""

  def error(self, message):
    print(f"{self.prog}: {message}; see {self.prog} --help.", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
  p = _OneLineParser(
      description=__doc__.split("\n\n", 1)[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="configs/X.py[:arg]")
  p.add_argument("--sweep_dir", required=True, type=Path, help="one workdir per run goes here")
  p.add_argument("--mode", default="sequential", choices=MODES)
  p.add_argument("--gpus", default=None, help="--mode=gpus: GPU ids, e.g. 0,1")
  p.add_argument("--dry_run", action="store_true", help="show the plan; run and write nothing")
  p.add_argument("--python", default=sys.executable, help="interpreter for train.py / eval.py")
  p.add_argument("--split", default="test", choices=("test", "validation"),
                 help="the split eval.py scores (results_<split>.json); validation for tables "
                      "that report it (Luo et al. Table 2)")
  p.add_argument("--compilation_cache", default="SWEEP_DIR/jax_cache",
                 help="JAX persistent compilation cache shared by the runs (runs that differ "
                      "only in seed compile once); 'none' disables it; ignored when "
                      "JAX_COMPILATION_CACHE_DIR is set")
  p.add_argument("grid", nargs="*", help="key=v1,v2,... (or key=v1|v2 when values hold commas)")
  args = p.parse_args(argv)
  args.sweep_dir = args.sweep_dir.expanduser().absolute()
  # Children get the environment as it was given; this process only loads configs (CPU).
  child_env = dict(os.environ)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if args.compilation_cache != "none" and "JAX_COMPILATION_CACHE_DIR" not in child_env:
    cache = args.compilation_cache.replace("SWEEP_DIR", str(args.sweep_dir))
    child_env["JAX_COMPILATION_CACHE_DIR"] = str(Path(cache).expanduser().absolute())

  try:
    config_path, arg = split_config_spec(args.config)
    grid = parse_grid(args.grid)
    runs = validate(config_path, arg, grid)
    gpus, no_gpu = [], ""
    if args.mode == "gpus":
      try:
        gpus = discover_gpus(args.gpus, child_env)
      except NoGpuError as e:
        if not args.dry_run:
          raise
        no_gpu = e.why  # a dry run shows the plan all the same
    manifest = Manifest(args.sweep_dir, config_flag(config_path, arg)[len("--config="):], grid,
                        write=not args.dry_run)
  except ValueError as e:
    print(f"sweep: {e}", file=sys.stderr)
    return 2

  runner = Runner(args, config_path, arg, manifest, child_env)
  todo: list[str] = []
  for name, (overrides, resolved) in runs.items():
    workdir = args.sweep_dir / name
    done, why = finished(workdir, resolved, args.split)
    record = dict(overrides=overrides, workdir=name, log=str(Path(name) / LOG),
                  commands=[shlex.join(c) for c in runner.commands(workdir, overrides)],
                  config=resolved)
    if done:
      old = manifest.data["runs"].get(name, {})
      manifest.data["runs"][name] = {**old, **record, "status": "done"}
      print(f"[skip] {name}: finished (results_{args.split}.json)", file=sys.stderr)
      continue
    manifest.data["runs"][name] = {**manifest.data["runs"].get(name, {}), **record,
                                   "status": "pending", "message": why}
    todo.append(name)
  if args.mode == "print" or args.dry_run:
    where = gpu_plan(todo, gpus) if gpus else {}
    for name in todo:
      step = latest_checkpoint_step(args.sweep_dir / name)
      why = manifest.data["runs"][name]["message"]
      action = f"resume from step {step} ({why})" if step else "run"
      on = f" {where[name]}" if name in where else ""
      print(f"[{'plan' if args.dry_run else 'print'}] {name}: {action}{on}", file=sys.stderr)
  try:
    manifest._write()  # pylint: disable=protected-access
  except OSError as e:
    print(f"sweep: cannot write {manifest.path}: {e.strerror or e}; choose a --sweep_dir that "
          "can be written.", file=sys.stderr)
    return 2

  if args.mode == "print":
    for name in todo:
      train, ev = manifest.data["runs"][name]["commands"]
      print(f"cd {shlex.quote(str(REPO))} && {train} && {ev}")
    return 0
  if args.dry_run:
    print(f"sweep: {len(runs)} runs, {len(runs) - len(todo)} finished, {len(todo)} to run"
          + (f" on GPUs {','.join(gpus)}" if gpus else ""), file=sys.stderr)
    if no_gpu:
      print(f"sweep: --mode=gpus: no GPU found on this machine ({no_gpu}); a real run stops "
            "there. Pass --gpus=0,1,... to see which run starts on which GPU.", file=sys.stderr)
    return 0

  # SIGTERM (a preempted job) and Ctrl-C: the trainings save and stop, the summary says what
  # to re-run.
  signal.signal(signal.SIGTERM, lambda *_: runner.terminate())
  signal.signal(signal.SIGINT, lambda *_: runner.terminate())
  statuses: dict[str, str] = {}
  t0 = time.time()
  if args.mode == "sequential":
    for name in todo:
      if runner.stop.is_set():
        break
      overrides, resolved = runs[name]
      statuses[name] = runner.run(name, overrides, resolved)
  else:
    work: queue.Queue[str] = queue.Queue()
    for name in todo:
      work.put(name)

    def worker(gpu: str) -> None:
      while not runner.stop.is_set():
        try:
          name = work.get_nowait()
        except queue.Empty:
          return
        overrides, resolved = runs[name]
        statuses[name] = runner.run(name, overrides, resolved, gpu=gpu)

    threads = [threading.Thread(target=worker, args=(g,), daemon=True) for g in gpus]
    for t in threads:
      t.start()
    for t in threads:
      while t.is_alive():
        t.join(timeout=1.0)  # wake up for signals

  # Summary.
  by_status: dict[str, list[str]] = {}
  for name, status in statuses.items():
    by_status.setdefault(status, []).append(name)
  not_started = [n for n in todo if n not in statuses]
  counts = ", ".join(f"{len(by_status.get(k, []))} {k}" for k in (
      "done", "failed", "bad_input", "nonfinite", "locked", "preempted"))
  print(f"\nsweep: {len(runs)} runs in {args.sweep_dir} ({time.time() - t0:.0f} s): "
        f"{len(runs) - len(todo)} skipped (finished before), {counts}, "
        f"{len(by_status.get('interrupted', [])) + len(not_started)} interrupted / not started.")
  for status in NEEDS_FIX:
    for name in by_status.get(status, []):
      rec = manifest.data["runs"][name]
      print(f"  {status.upper()} {name}: {rec['message']}\n"
            f"    log: {args.sweep_dir / rec['log']}\n"
            f"    {last_error_line(args.sweep_dir / rec['log'])}")
  for name in by_status.get("preempted", []):
    print(f"  PREEMPTED {name}: re-run the same command to resume it from its checkpoint.")
  for name in by_status.get("interrupted", []):
    print(f"  INTERRUPTED {name}: re-run the same command to resume it.")
  for name in not_started:
    print(f"  NOT STARTED {name}: re-run the same command to run it.")
  if any(by_status.get(k) for k in NEEDS_FIX):
    return 1
  if not_started or any(by_status.get(k) for k in RESUMABLE):
    return errors.EXIT_PREEMPTED
  return 0

if __name__ == "__main__":
  sys.exit(main())
