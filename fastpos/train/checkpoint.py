"""Checkpoints in the workdir (orbax): the last few for resuming, the best one for eval::

  <workdir>/checkpoints/<step>/{state, data, meta}   every checkpoint_every_steps, at each
                                                     evaluation, at the end and on SIGTERM /
                                                     SIGINT; the last keep_checkpoints kept
  <workdir>/best/<step>/{state, meta}                the best by the validation metric

``state`` is the ``TrainState`` with the steps' carry (``state.checkpoint_tree``: the
Transformer-XL memory, or ``{}``); ``data`` the grain iterator position (a JSON file per
process); ``meta`` a JSON record of the step, the training RNG key, the model and task config
blocks (a resumed run must match them), the data position in examples, the current log
window's training metrics (so a resumed run logs what an uninterrupted one would), the run it
belongs to (``meta["run"]``, ``fastpos.train.identity``: a restore refuses another run's) and,
in best/, the validation metrics; and ``meta["digests"]``, the digests of every array of the
state, of each process's data-iterator state and of the rest of ``meta``
(``fastpos.train.digest``). Orbax saves into a temporary folder and renames it when complete.

Every restore (resume, ``eval.py``, ``generate.py``, ``best/``) checks the digests. A checkpoint
that does not load or does not match its digests (a flipped bit in an array chunk, the RNG key
or the data position) is damaged: reported (path, and which arrays differ) and the next older
one is used; a training run moves it aside to ``<step>.corrupt``. A checkpoint written before
digests were recorded loads unverified, with one warning saying so. ``Checkpoints(...)``
creates nothing: the writing managers come from ``open_for_writing()``, called once the
workdir's lock is held.

A restore returns what it found (``Restored``: the state, its record, step, folder, whether it
verified and this process's data position) and decides nothing about the run: the trainer
decides whether the data position carries over. ``fastpos.train.workdir.Workdir.restore``
restores a workdir's checkpoint without a trainer (``eval.py``, ``fastpos.load``, the
scripts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging as std_logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import grain
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import flags, logging
from jax.experimental import multihost_utils

from fastpos.tasks.info import TaskInfo
from fastpos.train import digest as digest_lib
from fastpos.train import workdir as workdir_lib
from fastpos.train.digest import DigestMismatch
from fastpos.train.errors import RunError

# A reader beside a trainer that deletes old steps as it saves new ones: how often a restore
# reads again when the folder changed under it, and how it lists a folder that changes.
_REREADS = 20
_LIST_ATTEMPTS = 10
_RELIST_PAUSE_S = 0.05


class CheckpointLoadError(RunError):
  """No checkpoint of a workdir loads; the message lists each one and why."""


def _normalize(block: Any) -> Any:
  """A config block as plain JSON values (tuples -> lists), for comparisons."""
  if isinstance(block, ml_collections.ConfigDict):
    block = block.to_dict()
  return json.loads(json.dumps(block, default=str))


def config_meta(cfg: ml_collections.ConfigDict, info: TaskInfo) -> dict[str, Any]:
  """What a checkpoint's parameters belong to: the model block and the task's shape."""
  return {
      "model": _normalize(cfg.model),
      "task": _normalize({"name": cfg.task.name, **dataclasses.asdict(info)}),
  }


def check_expected(
    meta: dict[str, Any], want: dict[str, Any], where: Path, path: Path | None = None
) -> None:
  """Stops (ValueError naming each differing field) when a checkpoint's ``meta`` belongs to
  another model or task than ``want`` (a ``config_meta``); then, when ``want`` has a "run"
  entry (``identity.Record.check``), calls it with ``meta`` and the checkpoint's ``path``
  (it raises RunError for a checkpoint of another run)."""
  for block in ("model", "task"):
    saved, now = meta["config"][block], want[block]
    if saved != now:
      diffs = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
      detail = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diffs)
      raise ValueError(
          f"{where} holds a checkpoint (step {meta['step']}) of a different "
          f"{block} (config.{block} differs in {detail}). Use a new --workdir, or the config "
          f"that made it (its config.json)."
      )
  if "run" in want:
    want["run"](meta, path or where)


@dataclasses.dataclass(frozen=True)
class Restored:
  """What a restore found.

  state: the restored tree, shaped like the abstract target (as saved without one).
  meta: the checkpoint's record (step, RNG key, data position in examples, config blocks,
    log window, digests; in ``best/`` the validation metrics).
  step: its step. path: its folder. verified: whether it matched its digests (False: written
    before checkpoints recorded them, loaded unverified).
  data_state: this process's data-iterator state (``get_state()`` of the saved iterator, a
    grain ``set_state`` argument), verified with the rest; None when the checkpoint has none
    (``best/``) or was saved by another number of processes.
  data_processes: how many processes saved the data position (None: none saved, or unknown).
  """

  state: Any
  meta: dict[str, Any]
  step: int
  path: Path
  verified: bool
  data_state: dict[str, Any] | None = None
  data_processes: int | None = None


class _Damaged(Exception):
  """A checkpoint does not load or does not match its digests; ``__cause__`` says why."""


def saved_process_count(data_dir: Path) -> int | None:
  """How many processes saved a checkpoint's data iterator (grain writes one
  ``process_<i>-of-<n>.json`` each), or None when it cannot tell."""
  counts = {
      name.rsplit("-of-", 1)[-1].removesuffix(".json")
      for name in (p.name for p in data_dir.glob("process_*-of-*.json"))
  }
  return int(counts.pop()) if len(counts) == 1 and next(iter(counts)).isdigit() else None


def _read_data_state(data_dir: Path) -> dict[str, Any]:
  """This process's data-iterator state, as grain's checkpoint handler saved it."""
  name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
  return json.loads((data_dir / name).read_text())


def _manager(
    directory: Path, *, keep: int, async_save: bool, items: tuple[str, ...], read_only: bool = False
) -> ocp.CheckpointManager:
  handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
  if "data" in items:
    handlers["data"] = grain.checkpoint.CheckpointHandler()
  if jax.process_count() > 1 and "experimental_orbax_use_distributed_barrier" in flags.FLAGS:
    # Orbax's barriers over the distributed service rather than device collectives: the
    # async savers wait at them in background threads, and collectives that two threads issue
    # in different orders on different processes deadlock.
    flags.FLAGS["experimental_orbax_use_distributed_barrier"].value = True
  options = ocp.CheckpointManagerOptions(
      max_to_keep=None if read_only else keep,
      create=not read_only,
      read_only=read_only,
      save_interval_steps=0 if read_only else 1,
      enable_async_checkpointing=async_save and not read_only,
      cleanup_tmp_directories=not read_only,
      # The two managers' barriers apart (their names carry no folder).
      multiprocessing_options=ocp.options.MultiprocessingOptions(
          barrier_sync_key_prefix=directory.name
      ),
  )
  return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def abandoned_orbax_read(obj) -> bool:
  """Whether ``obj`` is one of orbax's read coroutines: when one array's read fails, orbax
  raises that failure where the restore was asked for (reported there: the checkpoint does not
  load) and abandons the sibling reads, which Python reports one by one when it collects them,
  seconds later and from another thread."""
  code = getattr(obj, "cr_code", None)
  return (
      code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename and "read" in (code.co_name)
  )


def closed_loop_callback(unraisable) -> bool:
  """Whether ``unraisable`` is tensorstore's callback into an asyncio loop that orbax already
  closed: it follows a read or write that failed, and that failure is raised where the read
  or write was asked for."""
  return isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(
      unraisable.exc_value
  )


def orbax_leftover(unraisable) -> bool:
  """Whether an unraisable exception is what a failed orbax read or write leaves behind."""
  return abandoned_orbax_read(unraisable.object) or closed_loop_callback(unraisable)


def drop_orbax_leftovers() -> None:
  """Drops, from now on, what a failed orbax read or write leaves behind after its failure was
  raised where the read or write was asked for: ``sys.unraisablehook`` is wrapped (once; again
  if it was replaced since) in a hook that drops ``orbax_leftover`` and passes everything else
  on, and asyncio's logger gets ``_AbandonedReads`` (once). Both stay: the leftovers come
  seconds later, from orbax's loop thread."""
  previous = sys.unraisablehook
  if not getattr(previous, "drops_orbax_leftovers", False):

    def hook(unraisable):
      if not orbax_leftover(unraisable):
        previous(unraisable)

    hook.drops_orbax_leftovers = True
    sys.unraisablehook = hook
  asyncio_logger = std_logging.getLogger("asyncio")
  if not any(isinstance(f, _AbandonedReads) for f in asyncio_logger.filters):
    asyncio_logger.addFilter(_AbandonedReads())


class _AbandonedReads(std_logging.Filter):
  """Drops asyncio's log of a tensorstore future whose error nobody retrieved. A failed read
  makes orbax abandon its sibling reads; asyncio logs each one's error, with a traceback, when
  it collects the future: seconds later, from orbax's loop thread, after the first error was
  raised (and reported) where the read was asked for. So the filter stays installed."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    text = str(record.msg)
    return not ("exception was never retrieved" in text and "tensorstore" in text.lower())


class _MissingMetadata(std_logging.Filter):
  """Drops orbax's warnings about a step's metadata file that is missing or unreadable while
  it lists a folder: a step being deleted beside the reader, or a damaged one, which the
  restore reports itself."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    return not str(record.msg).startswith(
        ("Metadata file does not exist", "Failed to read Metadata file")
    )


@contextlib.contextmanager
def _quiet_listing() -> Iterator[None]:
  logger, quiet = logging.get_absl_logger(), _MissingMetadata()
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)


def _unlistable_steps(directory: Path) -> list[tuple[Path, Exception]]:
  """(step folder, error) of each step whose _CHECKPOINT_METADATA parses as JSON but not as
  orbax's step metadata (what stops a CheckpointManager from listing the folder)."""
  # pylint: disable-next=import-outside-toplevel
  from orbax.checkpoint._src.metadata import step_metadata_serialization

  out = []
  for step_dir in sorted(p for p in directory.iterdir() if p.name.isdigit()):
    try:
      record = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
    except (OSError, ValueError):
      continue  # orbax lists a step whose metadata does not read
    try:
      step_metadata_serialization.deserialize(record)
    except Exception as e:  # pylint: disable=broad-except
      out.append((step_dir, e))
  return out


def _reason(exc: BaseException) -> str:
  """One line on why a checkpoint did not load: the error, cut before tensorstore's spec dump,
  and the error that caused it (e.g. which file failed to decode)."""
  parts = []
  while exc is not None and len(parts) < 2:
    text = " ".join(str(exc).split(" See full TensorStore details", 1)[0].split())
    parts.append(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
    exc = exc.__cause__
  text = "; caused by ".join(parts)
  return text if len(text) <= 400 else text[:400] + "..."


class Checkpoints:
  """The workdir's two checkpoint managers (latest and best)."""

  def __init__(
      self,
      workdir: str | Path,
      cfg: ml_collections.ConfigDict | None = None,
      *,
      read_only: bool = False,
  ):
    run = workdir_lib.Workdir(Path(workdir).absolute())
    self.latest_dir, self.best_dir = run.checkpoints_dir, run.best_dir
    self.cfg = cfg
    self.read_only = read_only
    self.writable = False
    self.latest = self.best = None
    # (path, whether its digests verified) of the checkpoint restore_newest returned.
    self.restored: tuple[Path, bool] | None = None
    self._arrays_digested = None  # ((step, id(state)), the state's array digests)
    # What every checkpoint saved records of its run (``identity.stamp``; None: nothing).
    self.identity: dict[str, Any] | None = None
    self._open_read_only()

  def _open_read_only(self) -> None:
    # Read-only managers create nothing; a folder that does not exist has no checkpoint.
    self.close()
    has_latest, has_best = self.latest_dir.is_dir(), self.best_dir.is_dir()
    if jax.process_count() > 1:
      # Process 0's view: another process may look after process 0 has created the folders,
      # and every process must build the same managers (their constructors synchronize).
      has_latest, has_best = (
          bool(x) for x in multihost_utils.broadcast_one_to_all(np.array([has_latest, has_best]))
      )
    if has_latest:
      self.latest = self._listing_manager(self.latest_dir, items=("state", "data", "meta"))
    if has_best:
      self.best = self._listing_manager(self.best_dir, items=("state", "meta"))

  def _listing_manager(self, directory: Path, items: tuple[str, ...]) -> ocp.CheckpointManager:
    """A read-only manager of ``directory``. Orbax reads every step's _CHECKPOINT_METADATA to
    list them and fails on one that is damaged: that step is reported as damaged (moved
    aside unless read-only, where the listing cannot go on: CheckpointLoadError). A step
    that a trainer deletes while orbax reads it (keep_checkpoints) only makes it list again."""
    for attempt in range(_LIST_ATTEMPTS):
      try:
        with _quiet_listing():
          return _manager(directory, keep=0, async_save=False, items=items, read_only=True)
      except Exception as e:  # pylint: disable=broad-except
        bad = _unlistable_steps(directory)
        if bad:
          break
        if attempt == _LIST_ATTEMPTS - 1:
          raise CheckpointLoadError(
              f"cannot list the checkpoints in {directory} ({_reason(e)}); check the folder "
              "(its permissions, a file system that is still mounted) and run again."
          ) from None
        time.sleep(_RELIST_PAUSE_S)
    if self.read_only:
      path, e = bad[0]
      raise CheckpointLoadError(
          f"no checkpoint in {directory} can be listed: {path} ({_reason(e)} in its "
          "_CHECKPOINT_METADATA). Move it away (or restore it from a copy) and run again."
      )
    for path, e in bad:
      self._damaged(path, e)
    return _manager(directory, keep=0, async_save=False, items=items, read_only=True)

  def open_for_writing(self) -> None:
    """Writing managers: creates the folders, deletes orbax's leftover temporary folders of
    interrupted saves. Only with the workdir's lock held."""
    assert not self.read_only and self.cfg is not None
    self.close()
    cfg = self.cfg
    try:
      self.latest = _manager(
          self.latest_dir,
          keep=cfg.keep_checkpoints,
          async_save=cfg.async_checkpoints,
          items=("state", "data", "meta"),
      )
      self.best = _manager(
          self.best_dir, keep=1, async_save=cfg.async_checkpoints, items=("state", "meta")
      )
    except Exception as e:  # pylint: disable=broad-except
      self._raise_io(e, self.latest_dir.parent)
      raise
    self.writable = True

  # Reading.
  def _manager_of(self, which: str) -> ocp.CheckpointManager | None:
    if which not in ("latest", "best"):
      raise ValueError(f"which must be 'latest' or 'best'; got {which!r}.")
    return self.latest if which == "latest" else self.best

  def _dir_of(self, which: str) -> Path:
    return self.latest_dir if which == "latest" else self.best_dir

  def steps(self, which: str = "latest") -> list[int]:
    """The complete steps, newest first."""
    manager = self._manager_of(which)
    return sorted(manager.all_steps(), reverse=True) if manager else []

  def latest_step(self) -> int | None:
    return self.latest.latest_step() if self.latest else None

  def best_step(self) -> int | None:
    return self.best.latest_step() if self.best else None

  def read_meta(self, which: str = "latest", step: int | None = None) -> dict[str, Any] | None:
    """A checkpoint's meta (the newest by default), checked against its digest."""
    manager = self._manager_of(which)
    if manager is None:
      return None
    step = manager.latest_step() if step is None else step
    if step is None:
      return None
    return self._read_meta_checked(manager, step)

  def restore(
      self, abstract_state: Any, data_iter=None, which: str = "latest", step: int | None = None
  ) -> tuple[Any, dict[str, Any]]:
    """(state, meta) of one checkpoint (the newest by default), checked against its digests
    (DigestMismatch naming the path and what differs); restores ``data_iter``'s position in
    place if given. No fallback: see ``restore_newest``."""
    manager = self._manager_of(which)
    step = manager.latest_step() if step is None else step
    path = self._dir_of(which) / str(step)
    meta = self._read_meta_checked(manager, step)
    args = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None:
      args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    state = manager.restore(step, args=ocp.args.Composite(**args))["state"]
    try:
      self._verify(path, meta, state, data=data_iter is not None)
    except DigestMismatch as e:
      raise DigestMismatch(f"checkpoint {path} is damaged: {e}") from None
    return state, meta

  def restore_newest(
      self,
      abstract_state: Any,
      which: str = "latest",
      *,
      expect: dict[str, Any] | None = None,
  ) -> Restored | None:
    """The newest checkpoint of ``which`` that loads and matches its digests (``Restored``);
    None when there is none.

    ``expect``: what the checkpoint must belong to (``config_meta`` of the run); a checkpoint
    of another model or task stops the restore (ValueError naming the differences), unlike a
    damaged one, which is skipped for the next older one and reported (``logging.warning``:
    path and reason; read-only: once an older one loaded), and moved aside to
    ``<step>.corrupt`` unless read-only. Raises CheckpointLoadError listing every checkpoint
    when none loads. The caller decides what to do with what was found (e.g. whether the data
    position carries over).

    Beside a trainer that saves and deletes steps as this reads (``keep_checkpoints``), a
    step that fails while the folder changes is not damaged: the folder is listed again and
    its newest step read (CheckpointLoadError, saying so, if it changed ``_REREADS`` times).
    """
    drop_orbax_leftovers()
    return self._restore_newest(abstract_state, which, expect)

  def _restore_newest(self, abstract_state, which, expect) -> Restored | None:
    failed, skipped, damaged, rereads = [], [], set(), 0
    listing = self.steps(which)
    while (step := next((s for s in listing if s not in damaged), None)) is not None:
      path = self._dir_of(which) / str(step)
      try:
        found = self._restore_step(abstract_state, which, step, expect)
      except _Damaged as e:
        # A trainer beside this reader saves and deletes steps (keep_checkpoints): a step
        # that failed while the folder changed is read again from its new listing, not
        # called damaged.
        now = self._relist(which)
        if now != listing:
          rereads += 1
          if rereads > _REREADS:
            raise CheckpointLoadError(self._changing_message(which, rereads)) from None
          listing = now
          continue
        damaged.add(step)
        failed.append(self._damaged(path, e.__cause__))
        skipped.append((path, e.__cause__))
        if not self.read_only:  # moved aside: no longer in the folder's listing
          listing = [s for s in listing if s != step]
        continue
      self.restored = (found.path, found.verified)
      if failed and not self.read_only:
        self._open_read_only()  # the moved steps are gone from the managers' lists
      for bad, exc in skipped if self.read_only else []:  # (moves aside were logged)
        logging.warning(
            "checkpoint %s does not load (%s); loaded %s instead.", bad, _reason(exc), found.path
        )
      return found
    if failed:
      listing = "; ".join(failed)
      raise CheckpointLoadError(
          f"no checkpoint in {self._dir_of(which)} loads: {listing}. Restore them from a "
          f"copy, or move them away to start over (or use another --workdir)."
      )
    if rereads:
      raise CheckpointLoadError(
          f"the checkpoints in {self._dir_of(which)} were deleted while being read; none is "
          "left there."
      )
    return None

  def _relist(self, which: str) -> list[int]:
    """The steps of ``which`` as its folder holds them now (newest first)."""
    manager = self._manager_of(which)
    if manager is None:
      return []
    for attempt in range(_LIST_ATTEMPTS):
      try:
        with _quiet_listing():
          manager.reload()
        break
      except Exception:  # pylint: disable=broad-except
        if attempt == _LIST_ATTEMPTS - 1:
          raise
        time.sleep(_RELIST_PAUSE_S)  # a step deleted while orbax read its metadata
    return self.steps(which)

  def _changing_message(self, which: str, rereads: int) -> str:
    return (
        f"the checkpoints in {self._dir_of(which)} changed {rereads} times while being read: "
        "a trainer is saving there and deleting older ones (keep_checkpoints) faster than "
        "one can be read. Read again, copy the workdir first, or train with a larger "
        "keep_checkpoints."
    )

  def _restore_step(self, abstract_state, which: str, step: int, expect) -> Restored:
    """One step's ``Restored``; _Damaged (its cause the reason) when it does not load or does
    not match its digests; ValueError / RunError when it is intact but not of this run."""
    manager, path = self._manager_of(which), self._dir_of(which) / str(step)
    try:
      meta = self._read_meta_checked(manager, step)
    except Exception as e:  # pylint: disable=broad-except
      raise _Damaged() from e
    if int(meta["step"]) != step:  # its record (digest-checked) names another step
      raise RunError(
          f"{path} holds the checkpoint of step {meta['step']}, not {step}: the folder was "
          f"renamed. Rename it back to {path.with_name(str(meta['step']))} (or move it out of "
          f"{path.parent}) and run again."
      )
    if expect is not None:
      check_expected(meta, expect, self.latest_dir, path)
    state = self._restore_state(manager, path, step, abstract_state, meta)
    processes = saved_process_count(path / "data")
    own_data = processes == jax.process_count()
    try:
      if which == "latest" and processes is None:  # every checkpoints/ step saves one
        raise FileNotFoundError(f"no data-iterator state in {path / 'data'}")
      verified = self._verify(path, meta, state, data=own_data)
      data_state = _read_data_state(path / "data") if own_data else None
    except Exception as e:  # pylint: disable=broad-except
      raise _Damaged() from e
    if not verified:
      logging.warning(
          "checkpoint %s was written without digests (before checkpoints "
          "recorded them): loaded unverified.",
          path,
      )
    return Restored(state, meta, int(meta["step"]), path, verified, data_state, processes)

  def _restore_state(self, manager, path: Path, step: int, abstract_state, meta) -> Any:
    """The state item of ``step`` restored into ``abstract_state``; a RunError when it is
    intact but does not fit (another optimizer or variables), _Damaged otherwise."""
    try:
      state = manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
      )["state"]
      return jax.block_until_ready(state)
    except Exception as e:  # pylint: disable=broad-except
      if self._loads_as_saved(manager, step, meta):  # intact, but not the state of this config
        raise RunError(
            f"checkpoint {path} does not fit the train state of this config ({_reason(e)}): "
            "was a setting that shapes the optimizer state or the model's variables "
            "changed (e.g. optimizer.grad_clip_norm, batch_size with a memory)? Use the "
            "config that made it (its config.json), or a new --workdir."
        ) from None
      raise _Damaged() from e

  @staticmethod
  def _read_meta_checked(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """A step's meta, checked against its digest (DigestMismatch) before anything reads it."""
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if not isinstance(meta, dict) or "step" not in meta or "config" not in meta:
      raise ValueError(f"meta is not a checkpoint record: {str(meta)[:100]}")
    digest_lib.check_meta(meta)
    return meta

  @staticmethod
  def _verify(path: Path, meta: dict[str, Any], state: Any, *, data: bool) -> bool:
    """Checks a restored ``state`` (and this process's data-iterator state when ``data``)
    against the digests in ``meta``: True when they match, False when the checkpoint has no
    digests, DigestMismatch naming what differs otherwise. Every process raises when any
    process found a difference (they go on to the same older checkpoint)."""
    rec = meta.get("digests")
    if rec is None:
      return False
    problem = None
    try:
      digest_lib.check_arrays(rec["arrays"], state)
      if data:
        digest_lib.check_data(rec, path / "data")
    except DigestMismatch as e:
      problem = e
    if jax.process_count() > 1:
      bad = np.asarray(multihost_utils.process_allgather(np.int32(problem is not None)))
      if problem is None and np.any(bad):
        problem = DigestMismatch(
            f"process(es) {np.flatnonzero(bad).tolist()} found their "
            "part of it differs from its digests"
        )
    if problem is not None:
      raise problem
    return True

  @staticmethod
  def _loads_as_saved(manager: ocp.CheckpointManager, step: int, meta: dict[str, Any]) -> bool:
    """Whether a step's state loads as saved (no target) and matches its digests, i.e. the
    checkpoint is not damaged."""
    try:
      raw = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
      jax.block_until_ready(raw["state"])
      if "digests" in meta:
        digest_lib.check_arrays(meta["digests"]["arrays"], raw["state"])
      return True
    except Exception:  # pylint: disable=broad-except
      return False

  def newest_verified(self, abstract_state: Any, upto: int) -> tuple[int | None, list[str]]:
    """The newest step <= ``upto`` in checkpoints/ that loads and matches its digests (None
    when none does), and ``path (reason)`` of each newer one that does not (not moved)."""
    skipped = []
    drop_orbax_leftovers()
    for step in self.steps("latest"):
      if step > upto:
        continue
      path = self.latest_dir / str(step)
      try:
        meta = self._read_meta_checked(self.latest, step)
        state = self.latest.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        )["state"]
        # The data position is checked when this run's processes saved it.
        saved = len((meta.get("digests") or {}).get("data") or [])
        if not self._verify(path, meta, state, data=saved == jax.process_count()):
          raise DigestMismatch("written without digests: unverified")
      except Exception as e:  # pylint: disable=broad-except
        skipped.append(f"{path} ({_reason(e)})")
        continue
      return step, skipped
    return None, skipped

  def _damaged(self, path: Path, exc: BaseException) -> str:
    """``path (reason)``; the folder is moved aside and the move logged, unless read-only
    (``_restore_newest`` reports it then)."""
    reason = _reason(exc)
    if self.read_only:
      return f"{path} ({reason})"
    aside = path.with_name(f"{path.name}.corrupt")
    n = 1
    while aside.exists():
      aside = path.with_name(f"{path.name}.corrupt.{n}")
      n += 1
    try:
      if jax.process_index() == 0:  # the processes of a run share the folder
        path.rename(aside)
    except OSError as e:
      raise RunError(
          f"checkpoint {path} does not load ({reason}) and cannot be moved aside "
          f"({os.strerror(e.errno) if e.errno else e}); move it away by hand."
      ) from e
    logging.warning(
        "checkpoint %s does not load (%s); moved it to %s and trying the next " "older one.",
        path,
        reason,
        aside,
    )
    return f"{path} ({reason}; moved to {aside.name})"

  # Writing.
  def _raise_io(self, exc: BaseException, directory: Path) -> None:
    """Re-raises an error of the file system as a RunError naming ``directory``."""
    reason = workdir_lib.os_error_reason(exc)
    if reason is not None:
      raise RunError(
          f"{reason} in {directory}: free space or use another --workdir "
          f"(writing a checkpoint failed)."
      ) from None

  def _with_digests(self, step: int, state: Any, data_iter, meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with the digest record of ``state``, ``data_iter`` and itself; the arrays'
    digests are computed once per state (the best and the latest checkpoint of a step)."""
    if self.identity is not None:
      meta = {**meta, "run": self.identity}
    key = (step, id(state))
    if self._arrays_digested is None or self._arrays_digested[0] != key:
      self._arrays_digested = (key, digest_lib.array_digests(state))
    rec = digest_lib.record(state, data_iter, meta, arrays=self._arrays_digested[1])
    return {**meta, "digests": rec}

  def save(self, step: int, state: Any, data_iter, meta: dict[str, Any]) -> None:
    meta = self._with_digests(step, state, data_iter, meta)
    try:
      self.latest.save(
          step,
          args=ocp.args.Composite(
              state=ocp.args.StandardSave(state),
              data=grain.checkpoint.CheckpointSave(data_iter),
              meta=ocp.args.JsonSave(meta),
          ),
          force=True,
      )
    except Exception as e:  # pylint: disable=broad-except
      self._raise_io(e, self.latest_dir)
      raise

  def save_best(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    meta = self._with_digests(step, state, None, meta)
    try:
      if step in self.best.all_steps():  # from a run resumed before it: replaced
        self.best.delete(step)
      self.best.save(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
          force=True,
      )
    except Exception as e:  # pylint: disable=broad-except
      self._raise_io(e, self.best_dir)
      raise

  def wait(self) -> None:
    for m, directory in ((self.latest, self.latest_dir), (self.best, self.best_dir)):
      if m is not None:
        try:
          m.wait_until_finished()
        except Exception as e:  # pylint: disable=broad-except
          self._raise_io(e, directory)
          raise

  def close(self) -> None:
    """Closes both managers (waits for a save in flight); never raises a save's error twice:
    call ``wait`` first to see it."""
    managers = [m for m in (self.latest, self.best) if m is not None]
    self.latest = self.best = None
    self.writable = False
    for m in managers:
      try:
        m.close()
      except Exception:  # pylint: disable=broad-except
        logging.debug("closing a checkpoint manager", exc_info=True)
