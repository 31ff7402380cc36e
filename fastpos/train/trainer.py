"""``train_and_evaluate(config, workdir)`` and ``evaluate(config, workdir, split)``.

One trainer for every task and model. Order of work: everything that can be wrong with the
config or the workdir is checked first (task name, model build and shapes, kernel / scheme
names, batch sizes against devices, a checkpoint of another model, missing data), then the
steps are compiled, then the loop runs:

  train_step (jit, donated state) -> every log_every_steps: check finiteness, log
  -> every eval_every_steps: validation metrics, best checkpoint -> every
  checkpoint_every_steps / at the end / on SIGTERM: checkpoint.

Nothing is created in the workdir before every check has passed (config, model, devices,
the data of every split the run reads, a workdir that can be written); then the trainer takes
the workdir's lock (``fastpos.train.workdir``: one trainer per workdir), restores, and only
then creates ``checkpoints/``, ``best/``, ``metrics.jsonl``, ``tensorboard/`` and ``train.log``
(process 0's log, appended to on resume). ``config.json`` is written by a run from scratch and
never by a resume: a resume whose config changes the run's results is refused before anything
is restored unless allowed, and its changes go to ``config_changes.jsonl``
(``fastpos.train.config_record``). Each step says when it is being compiled and how long
that took.

A run resumes from the newest checkpoint in the workdir that loads (a damaged one is reported
and moved aside): parameters, optimizer state, step, data position and RNG, so that the
resumed run is bitwise the uninterrupted one on CPU, and so are its logs (training rows average
the steps since the last multiple of ``log_every_steps``; the current window travels in the
checkpoint). The data position is kept in examples, so a run may resume with another batch
size; another training split size is refused.

A checkpoint is saved only from a state that is finite and whose loss, on the batch it was
just trained on, is finite (``_Run.state_is_good``): a NaN stop leaves a checkpoint that
evaluates and trains.

Language models with a Transformer-XL memory (``model.memory_length > 0``): the data come as
stream batches (``data.stream_train_iterator``: row r of step t + 1 continues row r of step t),
the memory for the next training batch lives in ``TrainState.memory`` (checkpointed, so a
resumed run carries on with it; sharded over "data" like a batch), and each evaluation starts
from an empty memory and carries it across its batches in order
(``data.stream_eval_iterator``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from fastpos import tasks
from fastpos.models import build_model
from fastpos.tasks.info import TaskInfo
from fastpos.train import bucketing, config_record, errors, packing
from fastpos.train import config as config_lib
from fastpos.train import data as data_lib
from fastpos.train import metrics as metrics_lib
from fastpos.train import sharding as sharding_lib
from fastpos.train import workdir as workdir_lib
from fastpos.train.checkpoint import (
    CheckpointLoadError,
    Checkpoints,
    check_compatible,
    config_meta,
    quiet_closed_event_loop,
)
from fastpos.train.errors import NonFiniteLossError, RunError, WorkdirLockedError
from fastpos.train.state import TrainState, make_optimizer, make_schedule
from fastpos.train.steps import make_eval_step, make_train_step
from fastpos.train.tensorboard import EventWriter


class _Run:
  """Everything built (and checked) from a config before anything is compiled."""

  def __init__(
      self, config: ml_collections.ConfigDict, workdir: str | Path, model: nn.Module | None
  ):
    cfg = config.copy_and_resolve_references()  # complete: get_config / base_config built it
    config_lib.validate(cfg)  # each value against its declared range (fastpos.config_schema)
    self.cfg = cfg
    self.workdir = Path(workdir)
    self.task = tasks.make_task(cfg.task)  # unknown / not-built task names stop here
    self.info: TaskInfo = self.task.info
    if model is None:
      # Bad kernel / scheme names or options and incompatible pairs stop here.
      model = build_model(cfg.model, self.info)
    self.model = model
    # A Transformer-XL memory carried across batches (DecoderLM with memory_length > 0).
    self.memory = self.info.kind == "lm" and getattr(model, "memory_length", 0) > 0
    if self.memory and 0 < cfg.task.get("eval_stride", 0) < self.info.max_length:
      raise ValueError(
          "config.task.eval_stride > 0 (overlapping evaluation windows) cannot "
          "carry a Transformer-XL memory across segments; set it to 0 or "
          "model.memory_length to 0."
      )
    self.mesh = sharding_lib.make_mesh(cfg)
    sharding_lib.check_batch_sizes(cfg, self.mesh)
    sharding_lib.check_seq_split(self.mesh, self.info.max_length, model)
    bucketing.check_config(
        cfg, self.info.kind, self.info.max_length, self.info.grid, sharding_lib.seq_size(self.mesh)
    )
    packing.check_config(
        cfg, self.info.kind, self.info.max_length, model, sharding_lib.seq_size(self.mesh)
    )
    self.tx = make_optimizer(cfg)
    self.schedule = make_schedule(cfg)
    self.init_rng, self.train_rng = jax.random.split(jax.random.PRNGKey(cfg.seed))
    self.batch_sharding = sharding_lib.batch_sharding(self.mesh)
    self.replicated = sharding_lib.replicated(self.mesh)
    # Traces the model once (no compilation): shape errors surface here, before compiling.
    abstract = jax.eval_shape(self._init, self.init_rng)
    self.state_sharding = sharding_lib.tree_shardings(abstract, self.mesh, cfg.mesh.rules)
    # The memory has the batch's rows: split over "data" like a batch, whatever the rules say.
    self.state_sharding = self.state_sharding.replace(
        memory=jax.tree.map(lambda _: self.batch_sharding, abstract.memory)
    )
    self.abstract_state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        abstract,
        self.state_sharding,
    )
    self.num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))

  def dummy_batch(self) -> dict[str, jax.Array]:
    n = self.info.max_length
    batch = {"inputs": jnp.ones((1, n), jnp.int32), "mask": jnp.ones((1, n), bool)}
    if self.info.kind == "retrieval":
      batch.update(inputs2=batch["inputs"], mask2=batch["mask"])
    return batch

  def _init(self, rng: jax.Array) -> TrainState:
    params_rng, dropout_rng, features_rng = jax.random.split(rng, 3)
    variables = self.model.init(
        {"params": params_rng, "dropout": dropout_rng, "features": features_rng},
        self.dummy_batch(),
        train=False,
    )
    variables = dict(variables)
    params = variables.pop("params")
    memory = self.model.init_memory(self.cfg.batch_size) if self.memory else {}
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=self.tx.init(params),
        collections=variables,
        memory=memory,
    )

  def init_state(self) -> TrainState:
    return jax.jit(self._init, out_shardings=self.state_sharding)(self.init_rng)

  def compile_eval(self):
    step = sharding_lib.in_seq_mesh(
        make_eval_step(self.model, self.info.kind, memory=self.memory), self.mesh
    )
    if self.memory:
      return _SaysCompiling(
          "eval",
          jax.jit(
              step,
              in_shardings=(self.state_sharding, self.batch_sharding, self.batch_sharding),
              out_shardings=(self.replicated, self.batch_sharding),
          ),
      )
    return _SaysCompiling(
        "eval",
        jax.jit(
            step,
            in_shardings=(self.state_sharding, sharding_lib.batch_in_sharding(self.mesh)),
            out_shardings=self.replicated,
        ),
    )

  @functools.cached_property
  def empty_eval_memory(self):
    """() -> an empty memory for one evaluation batch, sharded like a batch."""
    size = self.cfg.eval_batch_size or self.cfg.batch_size
    return jax.jit(lambda: self.model.init_memory(size), out_shardings=self.batch_sharding)

  def train_iterator(self, source, start: int = 0):
    if self.memory:
      assert start == 0  # stream batches: a resumed run keeps the batch size (_data_iter_for)
      return data_lib.stream_train_iterator(source, self.cfg)
    return data_lib.train_iterator(source, self.cfg, start)

  def check_meta(self, meta: dict[str, Any]) -> None:
    check_compatible(meta, self.cfg, self.info, self.workdir / "checkpoints")

  @functools.cached_property
  def _all_finite(self):
    def all_finite(tree):
      leaves = [
          jnp.all(jnp.isfinite(x))
          for x in jax.tree.leaves(tree)
          if jnp.issubdtype(x.dtype, jnp.inexact)
      ]
      return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)

    return jax.jit(all_finite, out_shardings=self.replicated)

  def state_is_good(self, eval_step, state: TrainState, batch) -> bool:
    """Whether ``state`` may be saved: parameters, optimizer state and other collections
    finite, and a finite loss on ``batch`` (the batch the step just trained on; evaluation
    mode, as ``evaluate`` would score it). Huge but finite weights pass the first test and
    fail the second."""
    finite = self._all_finite((state.params, state.opt_state, state.collections))
    if self.memory:
      out, _ = eval_step(state, batch, state.memory)
    else:
      out = eval_step(state, batch)
    loss_sum, count = jax.device_get(out["loss"])
    return bool(jax.device_get(finite)) and bool(np.isfinite(loss_sum)) and count > 0

  def evaluate_split(
      self, eval_step, state: TrainState, split: str, limit: int = 0
  ) -> dict[str, float]:
    total = None
    source = self.task.source(split)
    if self.memory:  # stream batches, from an empty memory carried across them in order
      memory = self.empty_eval_memory()
      batches = data_lib.stream_eval_iterator(source, self.cfg, limit)
    else:
      batches = data_lib.eval_iterator(source, self.cfg, limit)
    for local in batches:
      batch = sharding_lib.global_batch(local, self.batch_sharding)
      if self.memory:
        step_metrics, memory = eval_step(state, batch, memory)
      else:
        step_metrics = eval_step(state, batch)
      total = metrics_lib.add(total, step_metrics)
    out = metrics_lib.summarize(total, perplexity=self.info.kind == "lm")
    out["num_examples"] = float(jax.device_get(total["loss"][1]))
    return out

  def precision(self):
    p = self.cfg.precision
    return contextlib.nullcontext() if p == "default" else jax.default_matmul_precision(p)


class _StopOnSignal:
  """Turns SIGTERM (preemption) and SIGINT (Ctrl-C) into a request to save and exit after the
  current step; a second SIGINT aborts at once (KeyboardInterrupt)."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested: str | None = None  # the signal's name
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    if signum == signal.SIGINT and self.requested == "SIGINT":
      raise KeyboardInterrupt
    if self.requested is None:
      self.requested = signal.Signals(signum).name
      logging.warning(
          "%s: saving after this step (Ctrl-C again to abort without saving).", self.requested
      )

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for s in self.SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def stop_now(self, step: int, every: int) -> bool:
    """Whether to stop after ``step``. With several processes the hosts agree every ``every``
    steps (one all-gather), so that all of them save the same step and exit together."""
    if jax.process_count() == 1:
      return self.requested is not None
    if step % every:
      return False
    votes = multihost_utils.process_allgather(np.int32(self.requested is not None))
    if np.any(votes) and self.requested is None:
      self.requested = "SIGTERM"  # another host was signalled
    return bool(np.any(votes))

  def __exit__(self, *exc):
    for s, previous in self._previous.items():
      signal.signal(s, previous)
    self._previous = {}


class _SaysCompiling:
  """A jitted step that logs "compiling the <name> step..." before its first compilation and
  the seconds it took after it: a run is otherwise silent for the tens of seconds a model's
  first compile takes. The compile is done ahead of the call (``lower().compile()``), whose
  executable jit's own cache then serves, so the time is compilation only."""

  def __init__(self, name: str, jitted):
    self.name, self._jitted, self._compiled = name, jitted, False

  def __call__(self, *args):
    if not self._compiled:
      logging.info("compiling the %s step...", self.name)
      start = time.perf_counter()
      self._jitted.lower(*args).compile()
      logging.info("compiled the %s step in %.1f s", self.name, time.perf_counter() - start)
      self._compiled = True
    return self._jitted(*args)


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


def _better(value: float, best: float | None, mode: str) -> bool:
  if not np.isfinite(value):
    return False
  return best is None or (value > best if mode == "max" else value < best)


def _write_json(path: Path, obj: Any) -> None:
  if jax.process_index() == 0:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with errors.names_file(path):
      tmp.write_text(obj if isinstance(obj, str) else json.dumps(obj, indent=2))
    tmp.replace(path)


def _take_lock(workdir: Path) -> workdir_lib.WorkdirLock:
  """Creates the workdir and takes its lock (process 0 only: the processes of one run are one
  trainer); every process raises when process 0 could not."""
  lock = workdir_lib.WorkdirLock(workdir)
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


def _data_meta(
    run: _Run, num_examples: int, start: int, start_step: int, step: int
) -> dict[str, Any]:
  """The data position a checkpoint records, in examples (see ``_data_iter_for``)."""
  meta = {
      "examples": start + (step - start_step) * run.cfg.batch_size,
      "start": start,
      "start_step": start_step,
      "batch_size": run.cfg.batch_size,
      "num_examples": num_examples,
  }
  batching = _batching(run.cfg)
  return {**meta, "batching": batching} if batching else meta


def _batching(cfg: ml_collections.ConfigDict) -> list:
  """How the training stream is cut into batches beyond its order: [] for plain batches, else
  the bucket lengths or "pack", and the window (another value maps a position to other
  batches)."""
  lengths = list(cfg.data.get("bucket_lengths", ()) or ())
  if cfg.data.get("pack", False):
    lengths = ["pack"]
  return [*lengths, int(cfg.data.get("bucket_window", 1))] if lengths else []


def _saved_process_count(data_dir: Path) -> int | None:
  """How many processes saved a checkpoint's data iterator (grain writes one
  ``process_<i>-of-<n>.json`` each), or None when it cannot tell."""
  counts = {
      name.rsplit("-of-", 1)[-1].removesuffix(".json")
      for name in (p.name for p in data_dir.glob("process_*-of-*.json"))
  }
  return int(counts.pop()) if len(counts) == 1 and next(iter(counts)).isdigit() else None


def _data_iter_for(run: _Run, source, meta: dict[str, Any], where: Path):
  """(training iterator, whether to restore its position from the checkpoint, start example,
  start step) for resuming from a checkpoint's ``meta``.

  Same batch size and process count: the iterator of the checkpointed run, at its position.
  Another batch size or process count: a new iterator that starts at the example where the
  checkpointed run stopped. Another training split size (or batch size or process count with
  stream batches, whose layout depends on them) cannot carry the position over: RunError
  naming both values.
  """
  data = meta.get("data")
  if data is None:  # written before positions were kept in examples: batches of this size
    return run.train_iterator(source), True, 0, 0
  n, batch = len(source), run.cfg.batch_size
  if data["num_examples"] != n:
    raise RunError(
        f"{where}/{meta['step']} was trained on a training split of {data['num_examples']} "
        f"examples; it now has {n}: the data position cannot carry over. Use the data the run "
        "started with, or a new --workdir."
    )
  # The iterator's saved position is per process: it carries over to the same processes.
  procs = jax.process_count()
  saved_procs = _saved_process_count(where / str(meta["step"]) / "data") or procs
  same_batching = data.get("batching", []) == _batching(run.cfg)
  if data["batch_size"] == batch and saved_procs == procs and same_batching:
    return run.train_iterator(source, data["start"]), True, data["start"], data["start_step"]
  if run.memory:
    raise RunError(
        f"{where}/{meta['step']} was trained with config.batch_size={data['batch_size']} on "
        f"{saved_procs} process(es); now {batch} on {procs}. Stream batches (a Transformer-XL "
        f"memory) keep their layout: resume with --config.batch_size={data['batch_size']} on "
        f"{saved_procs} process(es), or use a new --workdir."
    )
  if not same_batching:
    logging.warning(
        "config.data bucketing changed (%s -> %s): resuming at example %d of the "
        "training data (step %d).",
        data.get("batching", []),
        _batching(run.cfg),
        data["examples"],
        meta["step"],
    )
  elif data["batch_size"] != batch:
    logging.warning(
        "config.batch_size changed from %d to %d: resuming at example %d of the "
        "training data (step %d).",
        data["batch_size"],
        batch,
        data["examples"],
        meta["step"],
    )
  else:
    logging.info(
        "%d process(es) now, %d when saved: resuming at example %d of the training "
        "data (step %d).",
        procs,
        saved_procs,
        data["examples"],
        meta["step"],
    )
  return run.train_iterator(source, data["examples"]), False, data["examples"], meta["step"]


def _window_meta(window: list[dict]) -> dict[str, list[float]] | None:
  """The summed metrics of the current log window, as JSON (float32 values, exact)."""
  if not window:
    return None
  total = jax.device_get(_sum_window(window))
  return {k: [float(np.float32(s)), float(np.float32(c))] for k, (s, c) in total.items()}


def _window_from_meta(saved: dict[str, list[float]] | None) -> list[dict]:
  if not saved:
    return []
  return [{k: (np.float32(s), np.float32(c)) for k, (s, c) in saved.items()}]


def _sum_window(window: list[dict]) -> dict:
  # Left to right, in float32: a window restored from a checkpoint (its first entry) adds up
  # to the same bits as the uninterrupted run's.
  return jax.tree.map(lambda *xs: sum(xs), *window) if len(window) > 1 else window[0]


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    *,
    model: nn.Module | None = None,
    allow_config_change: bool = False,
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
      (``fastpos.train.config_record``). Without it such a resume is refused.

  Returns:
    {"step", "train": last logged training metrics, "validation": last validation metrics,
    "best": {"step", metric}, "stopped_early": bool (SIGTERM / SIGINT: saved, restart to
    continue), "signal": its name or None, "state": the final ``TrainState``}.

  Raises:
    NonFiniteLossError: the loss, gradient norm or parameters became NaN / Inf (names the
      step and the last good checkpoint, which is left intact).
    WorkdirLockedError: another trainer holds the workdir (named in the message).
    RunError: the workdir cannot be used (a file, read-only, full disk), no checkpoint in
      it loads, the training data changed size, or a resume changes the run's results
      without ``allow_config_change`` (naming each changed field).
    ValueError, FileNotFoundError: a bad config, a checkpoint of another model, missing data.
  """
  with metrics_lib.quiet_library_logs():
    return _train_and_evaluate(config, workdir, model, allow_config_change)


def _train_and_evaluate(config, workdir, model, allow_config_change) -> dict[str, Any]:
  run = _Run(config, workdir, model)
  cfg = run.cfg
  train_src = run.task.source("train")  # missing data stops here, before anything is made
  val_src = run.task.source("validation")
  workdir_lib.check_usable(run.workdir)
  lock = _take_lock(run.workdir)
  ckpts = Checkpoints(run.workdir, cfg)
  writer = None
  log_file = contextlib.ExitStack()
  try:
    # A resume of another config is refused before anything is restored or written.
    changes = (
        config_record.check_resume(run.workdir, cfg, allow=allow_config_change)
        if ckpts.latest_step() is not None
        else []
    )
    best_metric, best_value = run.task.metric, None
    position = {}

    def data_iter_for(meta):
      it, restore, position["start"], position["start_step"] = _data_iter_for(
          run, train_src, meta, ckpts.latest_dir
      )
      return it, restore

    restored = ckpts.restore_newest(
        run.abstract_state, check=run.check_meta, data_iter_for=data_iter_for
    )
    window: list[dict] = []
    if restored is not None:
      state, meta, train_iter = restored
      data_start, data_start_step = position["start"], position["start_step"]
      train_rng = jnp.asarray(np.asarray(meta["rng"], np.uint32))
      window = _window_from_meta(meta.get("log_window"))
      try:
        best_meta = ckpts.read_meta("best")
      except Exception as e:  # pylint: disable=broad-except
        logging.warning(
            "the best checkpoint in %s does not load (%s); the next evaluation "
            "that improves on nothing replaces it.",
            ckpts.best_dir,
            e,
        )
        best_meta = None
      if best_meta is not None:
        best_value = best_meta["metrics"][best_metric]
      resumed = f"resumed from {ckpts.latest_dir}/{meta['step']}"
    else:
      state, train_iter, train_rng = None, run.train_iterator(train_src), run.train_rng
      data_start = data_start_step = 0
      resumed = None
    ckpts.open_for_writing()  # creates the folders; deletes leftovers of interrupted saves
    # The log file too only now: a run that fails its checks leaves the workdir untouched.
    log_file.enter_context(_log_file(run.workdir / "train.log"))
    if resumed:
      logging.info("%s", resumed)
    _record_config(run, cfg, meta["step"] if restored is not None else None, changes)
    logging.info(
        "task %s: %d train / %d validation examples; model: %d parameters; %d "
        "devices (mesh %s), %d process(es)",
        cfg.task.name,
        len(train_src),
        len(val_src),
        run.num_params,
        jax.device_count(),
        dict(run.mesh.shape),
        jax.process_count(),
    )
    if state is None:
      state = run.init_state()
    step = int(jax.device_get(state.step))
    writer = metrics_lib.MetricWriter(run.workdir, cfg.num_train_steps, resume_step=step)
    writer.config(
        cfg.to_dict(),
        cfg.to_json_best_effort(indent=2),
        [f"validation/{m}" for m in ("loss", run.task.metric)],
    )
    if changes and restored is not None:  # the change's entry, in TensorBoard too
      writer.text(
          "config_changes",
          step + 1,
          "\n".join(
              f"{c}{'' if c.affects_results else ' (no effect on results)'}" for c in changes
          ),
      )
    with quiet_closed_event_loop():  # after a failed save (a full disk)
      result = _train_loop(
          run,
          ckpts,
          writer,
          state,
          train_iter,
          train_rng,
          window,
          train_src,
          data_start,
          data_start_step,
          best_value,
      )
      ckpts.wait()  # a failed background save raises here
    if not result["stopped_early"] and jax.process_index() == 0:
      logging.info("%s", summary_line(run.workdir, run.task, run.info, result, train_src, val_src))
    return result
  except OSError as e:  # metrics.jsonl, config.json, tensorboard: the file system said no
    where = getattr(e, "filename", None) or (
        f"{run.workdir} (metrics.jsonl, config.json, "
        "config_changes.jsonl, tensorboard/, train.log)"
    )
    raise OSError(e.errno, e.strerror or str(e), where) from None  # one line: cli.message
  finally:
    ckpts.close()
    if writer is not None:
      writer.close()
    if jax.process_count() > 1:  # nobody leaves before the last save is complete everywhere
      multihost_utils.sync_global_devices("fastpos train_and_evaluate done")
    log_file.close()
    lock.release()


def _record_config(run: _Run, cfg, resumed_step: int | None, changes) -> None:
  """config.json for a run from scratch (a stale change record goes); a resume keeps it and
  appends its changes to config_changes.jsonl (process 0 writes)."""
  if jax.process_index() != 0:
    return
  config_json = run.workdir / config_record.CONFIG_NAME
  if resumed_step is None or not config_json.is_file():
    (run.workdir / config_record.CHANGES_NAME).unlink(missing_ok=True)
    _write_json(config_json, cfg.to_json_best_effort(indent=2))
    return
  if changes:
    config_record.record(run.workdir, resumed_step, changes)
    logging.warning(
        "resumed with a changed config (recorded in %s): %s",
        config_record.CHANGES_NAME,
        "; ".join(map(str, changes)),
    )


def summary_line(
    workdir: Path, task, info: TaskInfo, result: dict[str, Any], train_src, val_src
) -> str:
  """The run's last line: the validation metric (and the test one when eval.py scored this
  workdir) beside the accuracy of always answering the training split's majority class, the
  mean training tokens/s and where the outputs are."""
  metric = task.metric

  def shown(value: float) -> str:
    return f"{100 * value:.2f}%" if metric in ("accuracy", "f1") else f"{value:.4g}"

  parts = [f"{task.task_name}: step {result['step']}"]
  val = result.get("validation", {})
  if metric in val:
    best = result.get("best", {})
    at = (
        f" (best {shown(best[metric])} at step {best['step']})"
        if best.get(metric) is not None and best.get("step") != result["step"]
        else ""
    )
    parts.append(f"validation {metric} {shown(val[metric])}{at}")
  test_file = workdir / "results_test.json"
  if test_file.is_file():  # eval.py scored this workdir before (a finished run resumed)
    test = json.loads(test_file.read_text())
    if metric in test:
      parts.append(f"test {metric} {shown(test[metric])} (step {test.get('step')})")
  train_y, val_y = (getattr(src, "arrays", {}).get("targets") for src in (train_src, val_src))
  if (
      info.kind != "lm"
      and train_y is not None
      and val_y is not None
      and train_y.ndim == 1
      and len(train_y)
      and len(val_y)
  ):
    majority = int(np.bincount(train_y).argmax())  # always answering training's majority
    parts.append(
        f"majority-class baseline {100 * np.mean(val_y == majority):.2f}% " f"(always {majority})"
    )
  rates = []
  with contextlib.suppress(OSError):
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
      row = json.loads(line)
      if row.get("split") == "train" and "tokens_per_second" in row:
        rates.append(row["tokens_per_second"])
  if rates:
    parts.append(f"{np.mean(rates):,.0f} tokens/s")
  with contextlib.suppress(RunError):
    changed = config_record.describe(config_record.read_changes(workdir))
    if changed:
      parts.append(changed)
  parts.append(f"workdir {workdir}: metrics.jsonl, tensorboard/, config.json")
  if task.has_split("test"):  # only commands that will produce something
    parts[-1] += f"; test: python eval.py --workdir={workdir} --split=test"
  if _plotted_schemes(workdir):
    parts.append(f"plots: python scripts/plot_positional.py {workdir}")
  return "; ".join(parts)


PLOTTED_SCHEMES = ("fastrpb", "kernelized_rpe", "lrpe")  # what scripts/plot_positional.py draws


def _plotted_schemes(workdir: Path) -> list[str]:
  """The schemes of the run's config.json that ``scripts/plot_positional.py`` can plot."""
  try:
    names = json.loads((workdir / "config.json").read_text())["model"]["positional"]
  except (OSError, ValueError, KeyError, TypeError):
    return []
  return [n for n in re.split(r"[,+]", str(names)) if n.strip() in PLOTTED_SCHEMES]


def _train_loop(
    run: _Run,
    ckpts: Checkpoints,
    writer,
    state: TrainState,
    train_iter,
    train_rng,
    window: list[dict],
    train_src,
    data_start: int,
    data_start_step: int,
    best_value: float | None,
) -> dict[str, Any]:
  cfg = run.cfg
  best_metric = run.task.metric
  train_step = _SaysCompiling(
      "train",
      jax.jit(
          sharding_lib.in_seq_mesh(
              make_train_step(
                  run.model, run.tx, run.info.kind, cfg.grad_accum_steps, memory=run.memory
              ),
              run.mesh,
          ),
          in_shardings=(
              run.state_sharding,
              sharding_lib.batch_in_sharding(run.mesh),
              run.replicated,
          ),
          out_shardings=(run.state_sharding, run.replicated),
          donate_argnums=0,
      ),
  )
  eval_step = run.compile_eval()
  step = int(jax.device_get(state.step))
  last_good = step if ckpts.latest_step() is not None else None
  meta_base = {
      "rng": np.asarray(jax.device_get(train_rng)).tolist(),
      "config": config_meta(cfg, run.info),
  }
  result: dict[str, Any] = {"train": {}, "validation": {}, "stopped_early": False, "signal": None}
  unchecked_steps: list[int] = []
  unchecked: list[dict] = []
  first_step = step
  writer.start_timer(step)

  def stop_nonfinite(what: str, at: int):
    ckpts.wait()
    raise NonFiniteLossError(_nonfinite_message(run, ckpts, what, at, last_good, first_step))

  with _StopOnSignal() as signals, run.precision():
    while step < cfg.num_train_steps:
      batch = sharding_lib.global_batch(next(train_iter), run.batch_sharding)
      state, step_metrics = train_step(state, batch, train_rng)
      step += 1
      if step == first_step + 1:  # steps/s from here on: the first step includes compiling
        jax.block_until_ready(step_metrics)
        writer.start_timer(step)
      window.append(step_metrics)
      unchecked_steps.append(step)
      unchecked.append(step_metrics)
      stop = signals.stop_now(step, cfg.log_every_steps)
      last = step == cfg.num_train_steps
      # Rows at multiples of log_every_steps (and the last step): a resumed run logs the
      # windows of an uninterrupted one.
      do_log = step % cfg.log_every_steps == 0 or last
      do_eval = step % cfg.eval_every_steps == 0 or last
      do_save = step % cfg.checkpoint_every_steps == 0 or last or do_eval or stop
      if do_log or do_save:
        bad = metrics_lib.first_nonfinite(unchecked_steps, unchecked)
        if bad is not None:
          stop_nonfinite("loss or gradient", bad)
        unchecked_steps, unchecked = [], []
      if do_log:
        summary = metrics_lib.summarize(_sum_window(window), perplexity=run.info.kind == "lm")
        summary["learning_rate"] = float(run.schedule(step - 1))
        rate = writer.steps_per_second(step)
        tokens_rate = metrics_lib.tokens_per_second(rate, summary)
        writer.write(step, "train", summary, steps_per_second=rate, tokens_per_second=tokens_rate)
        writer.progress(step, summary, rate, tokens_rate)
        result["train"] = summary
        if step % cfg.log_every_steps == 0:
          window = []
      if do_save and not run.state_is_good(eval_step, state, batch):
        stop_nonfinite("the parameters after the step (or their loss)", step)
      meta = {
          **meta_base,
          "step": step,
          "data": _data_meta(run, len(train_src), data_start, data_start_step, step),
          "log_window": _window_meta(window),
      }
      if do_eval:
        val = run.evaluate_split(eval_step, state, "validation", cfg.num_eval_batches)
        writer.write(step, "validation", val)
        logging.info(
            "step %d validation: %s", step, " ".join(f"{k}={v:.4g}" for k, v in val.items())
        )
        result["validation"] = val
        if np.isfinite(val["loss"]) and _better(val[best_metric], best_value, run.task.metric_mode):
          best_value = val[best_metric]
          ckpts.save_best(step, state, {**meta, "metrics": val})
      if do_save:
        ckpts.save(step, state, train_iter, meta)
        last_good = step
      if do_eval or do_save:
        writer.start_timer(step)  # steps/s counts training steps, not evaluation or saving
      if stop:
        logging.warning(
            "preempted at step %d (%s): saved %s/%d; restart to continue.",
            step,
            signals.requested,
            ckpts.latest_dir,
            step,
        )
        result["stopped_early"] = True
        result["signal"] = signals.requested
        break
  result["step"] = step
  result["best"] = {"step": ckpts.best_step(), best_metric: best_value}
  result["state"] = state
  return result


def _nonfinite_message(
    run: _Run, ckpts: Checkpoints, what: str, at: int, last_good: int | None, first_step: int
) -> str:
  """Why a run stopped on a NaN / Inf: the first step after a restore blames the checkpoint;
  otherwise the newest saved checkpoint whose digests verify is named as the last good one."""
  if ckpts.restored is not None and at == first_step + 1:
    path, verified = ckpts.restored
    how = (
        "its digests verify, so it is as it was saved: was a setting changed on resume?"
        if verified
        else "it was written without digests, so it is unverified"
    )
    return (
        f"{what} became NaN/Inf at step {at}, the first step after restoring {path}; "
        f"training stopped. Suspect that checkpoint, not the learning rate ({how}). Move "
        "it aside to resume from the one before it, or use a new --workdir."
    )
  good, skipped = (
      ckpts.newest_verified(run.abstract_state, last_good) if last_good is not None else (None, [])
  )
  if good is not None:
    where = f"The last good checkpoint is step {good} in {ckpts.latest_dir} (verified, left intact)"
  else:
    where = (
        "No checkpoint had been saved yet"
        if last_good is None
        else f"No checkpoint in {ckpts.latest_dir} verifies"
    )
  if skipped:
    where += f"; newer ones do not verify: {'; '.join(skipped)}"
  return (
      f"{what} became NaN/Inf at step {at}; training stopped. {where}. Lower the learning "
      "rate, enable clipping (optimizer.grad_clip_norm) or check the data."
  )


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
  """
  if checkpoint not in ("best", "latest"):
    raise ValueError(f"checkpoint must be 'best' or 'latest'; got {checkpoint!r}.")
  if split not in tasks.SPLITS:
    raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(tasks.SPLITS)}.")
  with metrics_lib.quiet_library_logs():
    return _evaluate(config, workdir, split, checkpoint, model)


def _evaluate(config, workdir, split, checkpoint, model) -> dict[str, Any]:
  run = _Run(config, workdir, model)
  run.task.source(split)  # missing data stops here
  if run.workdir.exists() and not run.workdir.is_dir():
    raise RunError(f"--workdir={run.workdir} is a file, not a workdir written by train.py.")
  ckpts = Checkpoints(run.workdir, run.cfg, read_only=True)
  try:
    which = "best" if checkpoint == "best" and ckpts.best_step() is not None else "latest"
    if ckpts.latest_step() is None and which == "latest":
      raise FileNotFoundError(
          f"no checkpoint in {ckpts.latest_dir}; train first: python train.py "
          f"--config=... --workdir={workdir}"
      )
    try:
      state, meta, _ = ckpts.restore_newest(run.abstract_state, which, check=run.check_meta)
    except CheckpointLoadError as e:
      if which == "best":
        raise CheckpointLoadError(
            f"{e} Or evaluate the newest checkpoint: " "--checkpoint=latest."
        ) from None
      raise
  finally:
    ckpts.close()
  with run.precision():
    out = run.evaluate_split(run.compile_eval(), state, split)
  results = {
      "split": split,
      "step": int(meta["step"]),
      "checkpoint": which,
      "task": run.cfg.task.name,
      **out,
  }
  _write_json(run.workdir / f"results_{split}.json", results)
  if jax.process_index() == 0:  # the same numbers in TensorBoard, at the checkpoint's step
    tb = EventWriter(run.workdir / "tensorboard", replaces=f"{split}-{results['step']}")
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
