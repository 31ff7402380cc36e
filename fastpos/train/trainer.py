"""``train_and_evaluate(config, workdir)`` and ``evaluate(config, workdir, split)``.

One trainer for every task and model. Order of work: everything that can be wrong with the
config or the workdir is checked first (``fastpos.train.run.build_run``: task name, model
build and shapes, kernel / scheme names, batch sizes against devices; then a checkpoint of
another model, missing data), then the steps are compiled, then the loop runs
(``fastpos.train.loop``).

Nothing is created in the workdir before every check has passed (config, model, devices,
the data of every split the run reads, a workdir that can be written); then the trainer takes
the workdir's lock (``fastpos.train.workdir``: one trainer per workdir), restores, and only
then creates ``checkpoints/``, ``best/``, ``metrics.jsonl``, ``tensorboard/`` and ``train.log``
(process 0's log, appended to on resume); ``Workdir`` names every file there and is the
trainer's only way to them. ``config.json`` is written by a run from scratch and
never by a resume: a resume whose config changes the run's results is refused before anything
is restored unless allowed, and its changes go to ``config_changes.jsonl``
(``fastpos.train.config_record``). Every start, from scratch or resumed, appends one line to
``launches.jsonl``: its command, versions, source commit and devices
(``fastpos.train.launches``). Each step says when it is being compiled and how long that
took.

A run is one thing (``fastpos.train.identity``): run.json gives it an id and the fingerprint of
its data at its first start; every checkpoint records the id, the config fields that change
results and the data it was trained under, and a restore refuses a checkpoint of another run,
or one the record (config.json edited by hand, a record file lost) does not account for. A
start from scratch refuses a workdir holding another run's records unless ``fresh`` moves
them to ``previous/<UTC time>/``; nothing the trainer writes is ever deleted.

A run resumes from the newest checkpoint in the workdir that loads (a damaged one is reported
and moved aside): parameters, optimizer state, the steps' carry, step, data position and RNG
(``fastpos.train.resume``), so that the resumed run is bitwise the uninterrupted one on CPU,
and so are its logs. The data position is kept in examples, so a run may resume with another
batch size; another training split size is refused.

Every model goes through the same steps, ``train_step(state, batch, carry, rng)`` and
``eval_step(state, batch, carry)`` (``fastpos.train.steps``): the carry is ``{}`` for most
models and the Transformer-XL memory of a language model with ``model.memory_length > 0``,
whose data come as stream batches (``fastpos.train.feed``); the memory is checkpointed (a
resumed run carries on with it; sharded over "data" like a batch) and each evaluation starts
from an empty one and carries it across its batches in order.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from fastpos import interrupts, tasks
from fastpos.train import config_record, errors, launches
from fastpos.train import identity as identity_lib
from fastpos.train import loop as loop_lib
from fastpos.train import metrics as metrics_lib
from fastpos.train import resume as resume_lib
from fastpos.train import run as run_lib
from fastpos.train import state as state_lib
from fastpos.train import workdir as workdir_lib
from fastpos.train.checkpoint import Checkpoints, drop_orbax_leftovers
from fastpos.train.errors import RunError, WorkdirLockedError
from fastpos.train.run import Run
from fastpos.train.summary import PLOTTED_SCHEMES, summary_line
from fastpos.train.tensorboard import EventWriter
from fastpos.train.workdir import Workdir

__all__ = ["PLOTTED_SCHEMES", "evaluate", "summary_line", "train_and_evaluate"]


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    *,
    model: nn.Module | None = None,
    allow_config_change: bool = False,
    fresh: bool = False,
) -> dict[str, Any]:
  """Trains per ``config`` in ``workdir``, resuming from its newest checkpoint that loads.

  Args:
    config: the run's config (``configs/*.py``).
    workdir: checkpoints, ``metrics.jsonl``, ``tensorboard/``, ``config.json``, the log
      ``train.log`` and the lock ``train.lock`` go here.
    model: a linen module to train instead of ``build_model(config.model, task.info)``
      (tests use this to inject a throwaway model).
    allow_config_change: a resume may change fields that change the run's results (seeds,
      optimizer, schedule, task, model); each change is recorded in ``config_changes.jsonl``
      (``fastpos.train.config_record``). Without it such a resume is refused. A change of
      the task's data (``Task.fingerprint``) is such a change.
    fresh: start a new run: whatever the workdir holds (checkpoints and records of an
      earlier run) moves to ``<workdir>/previous/<UTC time>/`` first. Without it, a workdir
      holding another run's records but no checkpoint is refused (never overwritten).

  Returns:
    {"step", "train": last logged training metrics, "validation": last validation metrics,
    "best": {"step", metric}, "stopped_early": bool (SIGTERM / SIGINT: saved, restart to
    continue), "signal": its name or None, "tokens_per_second": the mean of the training
    rows (None on processes other than 0, or before the first row), "state": the final
    ``TrainState``, "carry": the steps' final carry ({} unless the model has a memory)}.

  Raises:
    NonFiniteLossError: the loss, gradient norm or parameters became NaN / Inf (names the
      step and the last good checkpoint, which is left intact).
    WorkdirLockedError: another trainer holds the workdir (named in the message).
    RunError: the workdir cannot be used (a file, read-only, full disk), no checkpoint in
      it loads, the training data changed size, or a resume changes the run's results
      without ``allow_config_change`` (naming each changed field).
    ValueError, FileNotFoundError: a bad config, a checkpoint of another model, missing data.

  Example::

      from fastpos.train import cli

      config = cli.load_config("configs/synthetic.py:tiny", {"num_train_steps": 2})
      result = fastpos.train_and_evaluate(config, workdir)   # a new folder, or a run to resume
      result["step"]                                          # 2
  """
  with metrics_lib.quiet_library_logs():
    return _train_and_evaluate(config, workdir, model, allow_config_change, fresh)


def _train_and_evaluate(config, workdir, model, allow_config_change, fresh) -> dict[str, Any]:
  # Relative data paths are resolved against this start's folder before anything records the
  # config, so config.json names the data wherever it is read from (fastpos.load, eval.py).
  config = absolute_paths(config)
  run = run_lib.build_run(config, workdir, model)
  train_src = run.task.source("train")  # missing data stops here, before anything is made
  val_src = run.task.source("validation")
  fingerprint = run.task.fingerprint()  # what the run reads (the files are read by now)
  workdir_lib.check_usable(run.workdir)
  run_dir = Workdir(run.workdir)
  lock = _take_lock(run_dir)
  signals = contextlib.ExitStack()  # train.py's SIGINT / SIGTERM (fastpos.interrupts)
  signals.enter_context(interrupts.exit_hook(lock.release))
  ckpts = None
  writer = None
  log_file = contextlib.ExitStack()
  try:
    if fresh:
      _move_previous(run.workdir)
    ckpts = run_dir.checkpoints(run.cfg, read_only=False)
    # A resume of another config or other data, a checkpoint of another run, a lost record
    # and the records of another run are refused before anything is restored or written.
    changes, data_change, record = [], None, None
    if ckpts.latest_step() is not None:
      record = run_dir.record()
      _require_config(run_dir, ckpts)
      changes = config_record.check_resume(run.workdir, run.cfg, allow=allow_config_change)
      data_change = identity_lib.check_data(record, fingerprint, allow=allow_config_change)
    else:
      _refuse_leftovers(run_dir)
    # An accepted change of what the files hold (not of settings) may change the split's size.
    start = resume_lib.start(
        run, ckpts, train_src, record, bool(data_change and data_change["what"])
    )
    model_format = _check_format(run, run_dir, start)
    # Writing starts: from here a first signal stops at the next safe point (the next check,
    # or the step being trained, saved).
    signals.enter_context(interrupts.deferred("stopping at the next safe point"))
    ckpts.open_for_writing()  # creates the folders; deletes leftovers of interrupted saves
    # The log file too only now: a run that fails its checks leaves the workdir untouched.
    log_file.enter_context(_log_file(run_dir.log_file))
    history = _announce(run, start, changes, (len(train_src), len(val_src)), data_change)
    ckpts.identity = _identity(run, run_dir, fingerprint, model_format)
    writer = _open_writer(run, start, changes, data_change)
    interrupts.check("before training started")
    drop_orbax_leftovers()  # after a failed save (a full disk)
    result = loop_lib.train_loop(run, ckpts, writer, start)
    ckpts.wait()  # a failed background save raises here
    if not result["stopped_early"]:
      interrupts.check(f"after step {result['step']}, the last")
    if not result["stopped_early"] and jax.process_index() == 0:
      logging.info("%s", _last_line(run, result, (train_src, val_src), history))
    return result
  except OSError as e:  # metrics.jsonl, config.json, tensorboard: the file system said no
    where = getattr(e, "filename", None) or (
        f"{run.workdir} (metrics.jsonl, config.json, config_changes.jsonl, launches.jsonl, "
        "run.json, tensorboard/, train.log)"
    )
    raise OSError(e.errno, e.strerror or str(e), where) from None  # one line: program.message
  finally:
    if ckpts is not None:
      ckpts.close()
    if writer is not None:
      writer.close()
    if jax.process_count() > 1:  # nobody leaves before the last save is complete everywhere
      multihost_utils.sync_global_devices("fastpos train_and_evaluate done")
    log_file.close()
    lock.release()
    signals.close()


def absolute_paths(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """``config``, or a copy whose relative ``task.data_dir``, ``task.cache_dir`` and
  ``task.paths`` (text_lm: comma-separated) are absolute (``~`` expanded) against the current
  folder; empty values (the defaults) stay empty."""
  task, changed = config.task, {}
  for key in ("data_dir", "cache_dir", "paths"):
    value = task.get(key)
    if isinstance(value, str) and value:
      parts = value.split(",") if key == "paths" else [value]
      full = ",".join(
          os.path.abspath(os.path.expanduser(p.strip())) if p.strip() else p for p in parts
      )
      if full != value:
        changed[key] = full
  if not changed:
    return config
  config = ml_collections.ConfigDict(config.to_dict())
  config.task.update(changed)
  return config


def _move_previous(workdir: Path) -> None:
  """``--fresh``: moves what the workdir holds to ``previous/<UTC time>/`` (process 0)."""
  if jax.process_index() == 0:
    moved = workdir_lib.move_previous(workdir)
    if moved is not None:
      logging.warning(
          "--fresh: moved the earlier run's files (%s) to %s; nothing was deleted.",
          ", ".join(sorted(p.name for p in moved.iterdir())),
          moved,
      )
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("fastpos fresh start")


def _refuse_leftovers(run_dir: Workdir) -> None:
  """A start from scratch in a workdir holding another run's records (and no checkpoint) would
  overwrite them: refused, naming them and ``--fresh``."""
  found = workdir_lib.leftover_records(run_dir.path)
  if found:
    raise RunError(
        f"{run_dir.path} holds the records of another run ({', '.join(found)}) but no "
        f"checkpoint to resume: starting a new run there would overwrite them. Pass --fresh to "
        f"move them to {run_dir.previous_dir}/<time>/ and start anew, or use another --workdir."
    )


def _require_config(run_dir: Workdir, ckpts: Checkpoints) -> None:
  if not run_dir.config_file.is_file():
    raise RunError(
        f"{run_dir.config_file} is missing, but {ckpts.latest_dir} holds "
        "checkpoints of a run: restore it from a copy of the workdir, or start over with "
        f"--fresh (everything moves to {run_dir.previous_dir}/<time>/)."
    )


def _check_format(run: Run, run_dir: Workdir, start: resume_lib.Start) -> int:
  """The oldest model format the restored checkpoint was trained under (this fastpos's from
  scratch), after refusing one whose later format changes touch the config."""
  if start.restored is None:
    return launches.MODEL_FORMAT
  return run_dir.check_format(run.cfg, "resume", start.restored.meta)


def _identity(run: Run, run_dir: Workdir, fingerprint, model_format: int) -> dict[str, Any]:
  """What every checkpoint of this launch records of its run (``identity.stamp``), once
  run.json and this launch's records are written."""
  if jax.process_count() > 1:  # process 0 wrote them
    multihost_utils.sync_global_devices("fastpos run record written")
  record = run_dir.record()
  return identity_lib.stamp(
      record.id, run.cfg, fingerprint, model_format, len(record.changes), record.launches
  )


def _announce(run: Run, start: resume_lib.Start, changes, sizes: tuple[int, int], data) -> list:
  """Logs where the run starts and what it is; writes config.json and run.json (a run from
  scratch) or records the resume's config and ``data`` changes. Returns the entries of the
  change record."""
  restored = start.restored
  if restored is not None:
    logging.info("resumed from %s", restored.path)
  history = _record_config(run, restored.step if restored is not None else None, changes, data)
  launches.record(
      run.workdir,
      int(jax.device_get(start.state.step)) + 1,
      None if restored is None else str(restored.path),
      dict(run.mesh.shape),
  )
  logging.info(
      "task %s: %d train / %d validation examples; model: %d parameters; %d "
      "devices (mesh %s), %d process(es)",
      run.cfg.task.name,
      *sizes,
      run.num_params,
      jax.device_count(),
      dict(run.mesh.shape),
      jax.process_count(),
  )
  return history


def _last_line(run: Run, result: dict[str, Any], sources, history: list) -> str:
  """The summary line from what the run holds: the loop's result, its config and the change
  record ``history`` (``_record_config``)."""
  return summary_line(
      run.workdir,
      run.task,
      run.info,
      result,
      *sources,
      positional=run.cfg.model.positional,
      changes=history,
  )


def _open_writer(run: Run, start: resume_lib.Start, changes, data) -> metrics_lib.MetricWriter:
  """The metric writer from the start's step (later records dropped), the config logged to
  TensorBoard and, on a resume, its config changes."""
  step = int(jax.device_get(start.state.step))
  writer = metrics_lib.MetricWriter(run.workdir, run.cfg.num_train_steps, resume_step=step)
  writer.config(
      run.cfg.to_dict(),
      run.cfg.to_json_best_effort(indent=2),
      [f"validation/{m}" for m in ("loss", run.task.metric)],
  )
  if (changes or data is not None) and start.restored is not None:  # in TensorBoard too
    lines = [f"{c}{'' if c.affects_results else ' (no effect on results)'}" for c in changes]
    text = "\n".join(lines + ([f"data ({data['what']})"] if data and data["what"] else []))
    writer.text("config_changes", step + 1, text)
  return writer


def _record_config(run: Run, resumed_step: int | None, changes, data) -> list:
  """config.json and run.json for a run from scratch (its workdir holds no earlier record:
  ``_refuse_leftovers``); a resume keeps them and appends its changes to config_changes.jsonl
  (run.json is written once, by the first resume of a run started before runs had one).
  Process 0 writes. Returns the record's entries (the summary line's; [] on other processes)."""
  if jax.process_index() != 0:
    return []
  if resumed_step is None:
    _write_json(Workdir(run.workdir).config_file, run.cfg.to_json_best_effort(indent=2))
    identity_lib.write_start(run.workdir, run.task.fingerprint())
    return []
  if identity_lib.read_start(run.workdir) is None:  # legacy: the run gets its identity now
    identity_lib.write_start(run.workdir, run.task.fingerprint())
  history = config_record.read_changes(run.workdir)  # parsed by check_resume just before
  if changes or data is not None:
    history.append(config_record.record(run.workdir, resumed_step, changes, data))
    shown = [*map(str, changes), *([f"data ({data['what']})"] if data and data["what"] else [])]
    logging.warning(
        "resumed with a changed config (recorded in %s): %s",
        workdir_lib.CHANGES_NAME,
        "; ".join(shown),
    )
  return history


@contextlib.contextmanager
def _log_file(path: Path):
  """Process 0 also writes the absl log to ``path`` (appending) while entered; the logging
  setup is as it was afterwards."""
  if jax.process_index() != 0:
    yield
    return
  handler = errors.LogFileHandler(path)  # a failed write stops the run, naming the file
  handler.setFormatter(logging.PythonFormatter())
  logger = logging.get_absl_logger()
  logger.addHandler(handler)
  try:
    yield
  finally:
    logger.removeHandler(handler)
    handler.close()


def _write_json(path: Path, obj: Any) -> None:
  if jax.process_index() == 0:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with errors.names_file(path):
      tmp.write_text(obj if isinstance(obj, str) else json.dumps(obj, indent=2))
    tmp.replace(path)


def _take_lock(run_dir: Workdir) -> workdir_lib.WorkdirLock:
  """Creates the workdir and takes its lock (process 0 only: the processes of one run are one
  trainer); every process raises when process 0 could not."""
  workdir = run_dir.path
  lock = run_dir.lock()
  error = None
  if jax.process_index() == 0:
    try:
      workdir.mkdir(parents=True, exist_ok=True)
      lock.acquire()
    except OSError as e:
      error = RunError(
          f"cannot create --workdir={workdir} "
          f"({os.strerror(e.errno) if e.errno else e}); use another --workdir."
      )
    except RunError as e:
      error = e
  if jax.process_count() > 1:
    ok = multihost_utils.process_allgather(np.int32(error is None))
    if not np.all(ok):
      lock.release()
      raise error or WorkdirLockedError(
          f"process 0 could not take the lock of {workdir}; its log says why."
      )
  elif error is not None:
    raise error
  return lock


def evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    split: str = "test",
    *,
    checkpoint: str = "best",
    model: nn.Module | None = None,
) -> dict[str, Any]:
  """Evaluates a trained workdir on ``split``; writes ``<workdir>/results_<split>.json``.

  Args:
    config: the config the workdir was trained with.
    workdir: a workdir written by ``train_and_evaluate``.
    split: "test" (default), "validation" or "train".
    checkpoint: "best" (the best on validation; the latest when no evaluation ran yet) or
      "latest" (the newest that loads: a damaged one is reported and skipped).
    model: as in ``train_and_evaluate``.

  Returns:
    The metrics with ``split``, ``step`` and ``checkpoint`` (which one was used).

  Example::

      from fastpos.train.workdir import Workdir

      config = Workdir(workdir).config()   # the config the run saved, with its recorded changes
      metrics = fastpos.evaluate(config, workdir, split="validation")
      metrics["split"], metrics["checkpoint"]                 # ('validation', 'best')
  """
  if checkpoint not in ("best", "latest"):
    raise ValueError(f"checkpoint must be 'best' or 'latest'; got {checkpoint!r}.")
  if split not in tasks.SPLITS:
    raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(tasks.SPLITS)}.")
  with metrics_lib.quiet_library_logs():
    return _evaluate(config, workdir, split, checkpoint, model)


def _evaluate(config, workdir, split, checkpoint, model) -> dict[str, Any]:
  run = run_lib.build_run(config, workdir, model)
  run.task.source(split)  # missing data stops here
  run_dir = Workdir(run.workdir)
  run_dir.require_run(config_given=True)
  found = run_dir.restore(run.checkpoint_abstract, checkpoint, expect=run.expect)
  which = run_dir.which(found)
  run_dir.check_format(run.cfg, "evaluate", found.meta)
  state, _ = state_lib.from_checkpoint_tree(found.state)
  with run.precision():
    out = run.evaluate_split(state, split)
  results = {"split": split, "step": found.step, "checkpoint": which, "task": run.cfg.task.name}
  results.update(out)
  _write_json(run_dir.results_file(split), results)
  if jax.process_index() == 0:  # the same numbers in TensorBoard, at the checkpoint's step
    tb = EventWriter(run_dir.tensorboard_dir, replaces=f"{split}-{results['step']}")
    tb.scalars(results["step"], {f"{split}/{k}": v for k, v in out.items()})
    tb.close()
  logging.info(
      "%s on %s (checkpoint %s, step %d): %s",
      run.cfg.task.name,
      split,
      which,
      results["step"],
      " ".join(f"{k}={v:.4g}" for k, v in out.items()),
  )
  return results
