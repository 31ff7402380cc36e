"""The workdir of a run: its one owner (``Workdir``), and the checks before a run touches it.

``Workdir(path)`` is the only code that knows where a run keeps what (every record name is
declared here, and nowhere else), and the one reader of a run for every program that is not
the trainer: ``eval.py``, ``fastpos.load``, ``scripts/generate.py``, the plot scripts::

  <workdir>/config.json            the config the run started with (``config_record``)
           config_changes.jsonl    the changes its resumes made to it (``config_record``)
           run.json                its identity (``identity``)
           launches.jsonl          one line per start of the trainer (``launches``)
           metrics.jsonl           training and validation metrics (``metrics``)
           tensorboard/            the same for TensorBoard (``tensorboard``)
           checkpoints/<step>/     the last checkpoints; best/<step>/ the best on validation
                                   (``checkpoint``)
           results_<split>.json    what eval.py scored
           train.log, train.lock   process 0's log; the lock of the trainer that holds it
           previous/<UTC time>/    the records an earlier run left (``train.py --fresh``)

It says whether a folder is a run (``require_run``: one message for every program), gives
the run's effective config (``config``: config.json with the recorded changes applied), its
records (``record``, ``launches``), its checkpoints (``latest_step``, ``best_step``) and
restores one (``restore``: "best", "latest" or a step, into an abstract tree, through the
digest-verified ``fastpos.train.checkpoint`` code, refusing another run's). The record
modules (``config_record``, ``identity``, ``launches``, ``checkpoint``, ``metrics``) keep
their formats and take their file names from here.

``check_usable(path)`` refuses a workdir that is a file or lies under one, and one where no
file can be created: it creates and deletes a probe file there (or in its nearest existing
parent), so the answer is the file system's own (permission bits say nothing to root).

``WorkdirLock(path)`` keeps a second trainer out: ``<workdir>/train.lock`` names the holder
(host, pid, start time), which keeps an exclusive ``flock`` on it that the kernel drops when
the holder dies. A lock whose flock is free is taken over with a warning, unless it names a
live process on this host (a file system where flock does nothing).

``leftover_records(path)`` names the records an earlier run left in a workdir (a start from
scratch refuses them); ``move_previous(path)`` (``train.py --fresh``) moves everything in a
workdir but its lock into ``<workdir>/previous/<UTC time>/``: nothing is ever deleted.

``os_error_reason(exc)`` finds the OS's reason (``No space left on device``) in an exception
or its causes, tensorstore's ``[os_error_code='28']`` messages included.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_collections
from absl import logging

# The record modules read and write the files this module names (they import it in turn and
# read its names when called, never while importing). The checkpoint module (orbax, grain:
# seconds to import) is imported where checkpoints are read: reading records needs neither.
from fastpos.train import config_record
from fastpos.train import identity as identity_lib
from fastpos.train import launches as launches_lib
from fastpos.train.errors import RunError, WorkdirLockedError

if TYPE_CHECKING:
  from fastpos.train import checkpoint as checkpoint_lib

# The workdir's layout (the module docstring): these names are written nowhere else.
CONFIG_NAME = "config.json"
CHANGES_NAME = "config_changes.jsonl"
RUN_NAME = "run.json"
LAUNCHES_NAME = "launches.jsonl"
METRICS_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
LATEST_DIR, BEST_DIR = "checkpoints", "best"
LOG_NAME = "train.log"
LOCK_NAME = "train.lock"
PREVIOUS_DIR = "previous"
RESULTS_PATTERN = "results_{split}.json"
# What a run writes in its workdir besides checkpoints/ (and results, the log, the lock).
RECORD_NAMES = (
    CONFIG_NAME,
    CHANGES_NAME,
    RUN_NAME,
    LAUNCHES_NAME,
    METRICS_NAME,
    BEST_DIR,
    TENSORBOARD_DIR,
)
# What a restore may be asked for: a step, or one of these.
CHECKPOINTS = ("best", "latest")

_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def os_error_reason(exc: BaseException) -> str | None:
  """``strerror`` of the first OS error in ``exc``, its causes or its message; else None."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno:
      return os.strerror(exc.errno)
    match = _OS_ERROR_CODE.search(str(exc))
    if match:
      return os.strerror(int(match.group(1)))
    exc = exc.__cause__ or exc.__context__
  return None


def check_usable(path: str | os.PathLike) -> None:
  """Raises RunError when ``path`` cannot be a workdir; creates nothing that stays."""
  path = Path(path).absolute()
  probe_dir = path
  while not probe_dir.exists():
    if is_symlink_loop(probe_dir):
      while is_symlink_loop(probe_dir.parent):
        probe_dir = probe_dir.parent
      raise RunError(
          f"--workdir={path}: {probe_dir} is a symlink loop (its links point at "
          "each other); remove it or use another --workdir."
      )
    if probe_dir.is_symlink():  # a dangling link: mkdir would fail
      raise RunError(
          f"--workdir={path}: {probe_dir} is a broken symbolic link; remove it or "
          "use another --workdir."
      )
    probe_dir = probe_dir.parent
  if not probe_dir.is_dir():
    what = "is a file" if probe_dir == path else f"lies under {probe_dir}, which is a file"
    raise RunError(f"--workdir={path} {what}, not a directory; use another --workdir.")
  probe = probe_dir / f".fastpos-probe-{os.getpid()}"
  try:
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    raise RunError(
        f"--workdir={path}: cannot create files in {probe_dir} "
        f"({os.strerror(e.errno) if e.errno else e}); make it writable or use "
        "another --workdir."
    ) from None


def leftover_records(path: str | os.PathLike) -> list[str]:
  """The names of the records (``RECORD_NAMES``, ``results_*.json``) in ``path``."""
  path = Path(path)
  found = [n for n in RECORD_NAMES if os.path.lexists(path / n)]
  return found + sorted(p.name for p in path.glob(RESULTS_PATTERN.format(split="*")))


def move_previous(path: str | os.PathLike) -> Path | None:
  """Moves everything in workdir ``path`` but its lock and ``previous/`` into
  ``path/previous/<UTC time>/`` (renames, within the folder: nothing is copied or deleted);
  returns that folder, or None when there was nothing to move."""
  path = Path(path).absolute()
  items = sorted(p for p in path.iterdir() if p.name not in (LOCK_NAME, PREVIOUS_DIR))
  if not items:
    return None
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
  target, n = path / PREVIOUS_DIR / now, 1
  while target.exists():
    target, n = path / PREVIOUS_DIR / f"{now}.{n}", n + 1
  try:
    target.mkdir(parents=True)
    for item in items:
      item.rename(target / item.name)
  except OSError as e:
    raise RunError(
        f"--fresh: cannot move the records of {path} to {target} "
        f"({os.strerror(e.errno) if e.errno else e}); move them by hand."
    ) from None
  return target


def is_symlink_loop(path: str | os.PathLike) -> bool:
  """Whether resolving ``path`` runs in circles (os.stat's ELOOP)."""
  try:
    os.stat(path)
  except OSError as e:
    return e.errno == errno.ELOOP
  return False


def _start_time(pid: int) -> str | None:
  """The process's start (clock ticks since boot, /proc/<pid>/stat field 22), to tell a live
  holder from a new process that reuses its pid; None where /proc has no answer."""
  try:
    stat = Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return None
  return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by another user
    return True
  return True


def _describe(holder: dict) -> str:
  started = holder.get("started")
  when = (
      time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started))
      if isinstance(started, (int, float))
      else "?"
  )
  return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when}"


class WorkdirLock:
  """An exclusive lock on a workdir for one trainer (see the module docstring)."""

  def __init__(self, workdir: str | os.PathLike):
    self.path = Path(workdir).absolute() / LOCK_NAME
    self._fd = None

  def acquire(self) -> None:
    """Takes the lock or raises WorkdirLockedError naming the holder."""
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),
        "pid_start": _start_time(os.getpid()),
    }
    for _ in range(10):
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES):
          raise RunError(
              f"cannot lock {self.path} ({os.strerror(e.errno)}); use another " "--workdir."
          ) from None
        raise WorkdirLockedError(self._held_message(self._read())) from None
      # The file may have been released (unlinked) between open and flock: then the lock
      # is on a file nobody else will see; start again on the current one.
      try:
        same = os.path.samestat(os.fstat(fd), os.stat(self.path))
      except FileNotFoundError:
        same = False
      if not same:
        os.close(fd)
        continue
      previous = self._read(fd)
      if previous and previous.get("pid") != me["pid"]:
        if (
            previous.get("host") == me["host"]
            and isinstance(previous.get("pid"), int)
            and _alive(previous["pid"])
            and previous.get("pid_start") in (None, _start_time(previous["pid"]))
        ):
          os.close(fd)
          raise WorkdirLockedError(self._held_message(previous))
        logging.warning(
            "%s was left by a trainer that is gone (%s); taking it over.",
            self.path,
            _describe(previous),
        )
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps(me).encode(), 0)
      os.fsync(fd)
      self._fd = fd
      return
    raise WorkdirLockedError(
        f"{self.path} keeps changing: another trainer is starting in "
        "this workdir; use another --workdir."
    )

  def _read(self, fd: int | None = None) -> dict:
    try:
      text = self.path.read_text() if fd is None else os.pread(fd, 4096, 0).decode()
      holder = json.loads(text)
      return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
      return {}

  def _held_message(self, holder: dict) -> str:
    who = _describe(holder) if holder else "another process"
    return (
        f"{self.path.parent} is in use by another trainer ({who}). Wait for it to finish "
        f"or stop it, or use another --workdir; if no such process runs, delete "
        f"{self.path}."
    )

  def release(self) -> None:
    if self._fd is None:
      return
    # Unlink while still holding the flock, so that nobody takes a lock on a file about to go.
    try:
      self.path.unlink()
    except FileNotFoundError:
      pass
    os.close(self._fd)
    self._fd = None

  def __enter__(self) -> WorkdirLock:
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


class NoCheckpointError(RunError, FileNotFoundError):
  """A workdir holds no checkpoint of the kind (or at the step) asked for."""


class Workdir:
  """A ``train.py`` workdir: where each record lives, what the run's records say, and its
  checkpoints (the module docstring). Reading creates nothing.

  Example::

      from fastpos.train.workdir import Workdir

      run = Workdir(workdir)
      run.config_file.name, run.checkpoints_dir.name      # ('config.json', 'checkpoints')
      run.require_run()                                   # None
      config = run.config()          # config.json with the changes its resumes recorded
      found = run.restore(None, "latest")     # the tree as saved, digest-verified
      found.step == run.latest_step(), run.which(found)   # (True, 'latest')
  """

  def __init__(self, path: str | os.PathLike):
    self.path = Path(path)

  def __fspath__(self) -> str:
    return os.fspath(self.path)

  def __repr__(self) -> str:
    return f"Workdir({os.fspath(self.path)!r})"

  # The layout.
  @property
  def config_file(self) -> Path:
    return self.path / CONFIG_NAME

  @property
  def changes_file(self) -> Path:
    return self.path / CHANGES_NAME

  @property
  def run_file(self) -> Path:
    return self.path / RUN_NAME

  @property
  def launches_file(self) -> Path:
    return self.path / LAUNCHES_NAME

  @property
  def metrics_file(self) -> Path:
    return self.path / METRICS_NAME

  @property
  def tensorboard_dir(self) -> Path:
    return self.path / TENSORBOARD_DIR

  @property
  def checkpoints_dir(self) -> Path:
    return self.path / LATEST_DIR

  @property
  def best_dir(self) -> Path:
    return self.path / BEST_DIR

  @property
  def log_file(self) -> Path:
    return self.path / LOG_NAME

  @property
  def lock_file(self) -> Path:
    return self.path / LOCK_NAME

  @property
  def previous_dir(self) -> Path:
    return self.path / PREVIOUS_DIR

  def results_file(self, split: str) -> Path:
    """What ``eval.py --split=<split>`` wrote."""
    return self.path / RESULTS_PATTERN.format(split=split)

  # Is it a run?
  def require_run(self, *, config_given: bool = False) -> None:
    """Raises RunError (one line: what the folder is, and the fix) unless it is a folder that
    a run wrote: one that holds config.json, or any folder when ``config_given`` (the caller
    has the run's config from elsewhere)."""
    if not self.path.is_dir():
      what = (
          "is a symlink loop"
          if is_symlink_loop(self.path)
          else "is a file"
          if self.path.exists()
          else "does not exist"
      )
      raise RunError(f"workdir {self.path} {what}; give the folder a train.py run wrote.")
    if not config_given and not self.config_file.is_file():
      raise RunError(
          f"workdir {self.path} has no {CONFIG_NAME} (train.py writes it when a run starts); "
          "give the workdir of a run, or its config (--config=configs/<experiment>.py; "
          "fastpos.load: config=)."
      )

  # The records.
  def config_values(self) -> dict[str, Any] | None:
    """The config the run last ran with, as JSON values: config.json with the changes of
    config_changes.jsonl applied in order; None without config.json. A damaged record
    raises RunError naming the file."""
    return config_record.effective_config(self.path)

  def config(self) -> ml_collections.ConfigDict:
    """``config_values`` as the ConfigDict the run ran with (unlocked, not yet checked
    against the schema); the ``require_run`` message when there is none."""
    values = self.config_values()
    if values is None:
      self.require_run()
    return config_record.from_json(values)

  def record(self) -> identity_lib.Record:
    """The run's record (``identity.read_record``): its id, config history and data."""
    return identity_lib.read_record(self.path)

  def launches(self) -> list[dict]:
    """The lines of launches.jsonl, oldest first (``launches.read``)."""
    return launches_lib.read(self.path)

  def check_format(self, cfg: ml_collections.ConfigDict, doing: str, meta: dict) -> int:
    """The oldest model format the checkpoint whose record is ``meta`` was trained under,
    after refusing one that computes another function here (``launches.check_format``;
    ``doing``: "resume", "evaluate", "load")."""
    trained = launches_lib.checkpoint_format(self.path, meta)
    launches_lib.check_format(self.path, cfg, doing, trained=trained)
    return trained

  def lock(self) -> WorkdirLock:
    """The trainer's lock of this workdir (not taken: ``acquire`` or ``with``)."""
    return WorkdirLock(self.path)

  # The checkpoints.
  def checkpoints(
      self, cfg: ml_collections.ConfigDict | None = None, *, read_only: bool = True
  ) -> checkpoint_lib.Checkpoints:
    """The managers of checkpoints/ and best/ (``checkpoint.Checkpoints``; the caller closes
    them). Writing (the trainer, lock held) needs ``cfg`` and ``read_only=False``."""
    from fastpos.train import checkpoint as checkpoint_lib  # pylint: disable=import-outside-toplevel

    return checkpoint_lib.Checkpoints(self.path, cfg, read_only=read_only)

  def latest_step(self) -> int | None:
    """The newest step in checkpoints/ (None: none)."""
    ckpts = self.checkpoints()
    try:
      return ckpts.latest_step()
    finally:
      ckpts.close()

  def best_step(self) -> int | None:
    """The step of the checkpoint in best/ (None: none)."""
    ckpts = self.checkpoints()
    try:
      return ckpts.best_step()
    finally:
      ckpts.close()

  def restore(
      self,
      abstract_state: Any = None,
      checkpoint: str | int = "best",
      *,
      expect: dict[str, Any] | None = None,
  ) -> checkpoint_lib.Restored:
    """Restores a checkpoint, read-only, digest-verified (``checkpoint.Checkpoints``).

    Args:
      abstract_state: the tree to restore into (``state.checkpoint_tree`` of
        ``jax.ShapeDtypeStruct``s with shardings); None: the tree as saved, nested dicts of
        arrays (``{"step", "params", "opt_state", "collections", "memory"}``).
      checkpoint: "best" (best/, the best on validation; the newest of checkpoints/ when no
        evaluation has run), "latest" (the newest of checkpoints/): the newest that loads and
        matches its digests (a damaged one is reported and skipped, never moved); or a step
        (checkpoints/, else best/; no fallback).
      expect: what the checkpoint must belong to (``checkpoint.config_meta`` of the config);
        then the run's record must account for it too (``identity.Record.check``). None:
        restored as found.

    Returns:
      ``checkpoint.Restored``; ``which(found)`` says whether it came from best/.

    Raises:
      NoCheckpointError: none there (or none at that step: the steps there are named).
      CheckpointLoadError: none loads (each one listed with its reason). DigestMismatch: the
      step asked for does not match its digests. ValueError / RunError: a checkpoint of
      another model, task or run.
    """
    if checkpoint not in CHECKPOINTS and (
        not isinstance(checkpoint, int) or isinstance(checkpoint, bool) or checkpoint < 0
    ):
      raise ValueError(
          f"checkpoint must be one of {', '.join(CHECKPOINTS)} or a step (an int >= 0); got "
          f"{checkpoint!r}."
      )
    if expect is not None:  # a checkpoint of another run, or one the record lacks: refused
      expect = {**expect, "run": self.record().check}
    from fastpos.train import checkpoint as checkpoint_lib  # pylint: disable=import-outside-toplevel

    ckpts = self.checkpoints()
    try:
      if isinstance(checkpoint, int):
        return self._restore_step(ckpts, abstract_state, checkpoint, expect)
      which = "best" if checkpoint == "best" and ckpts.best_step() is not None else "latest"
      found = None
      if ckpts.steps(which):
        try:
          found = ckpts.restore_newest(abstract_state, which, expect=expect)
        except checkpoint_lib.CheckpointLoadError as e:
          if which != "best":
            raise
          raise checkpoint_lib.CheckpointLoadError(
              f"{e} Or use the newest checkpoint: --checkpoint=latest (fastpos.load: "
              "checkpoint='latest')."
          ) from None
      if found is None:
        raise NoCheckpointError(
            f"no checkpoint in {self.path} ({LATEST_DIR}/ and {BEST_DIR}/ are empty or "
            f"missing); train first: python train.py --config=... --workdir={self.path}"
        )
      return found
    finally:
      ckpts.close()

  def which(self, found: checkpoint_lib.Restored) -> str:
    """ "best" when ``found`` (a ``restore``'s) came from best/, else "latest"."""
    return "best" if found.path.parent.name == BEST_DIR else "latest"

  def _restore_step(self, ckpts, abstract_state, step: int, expect) -> checkpoint_lib.Restored:
    """The checkpoint at ``step`` (checkpoints/, else best/), verified; no fallback."""
    from fastpos.train import checkpoint as checkpoint_lib  # pylint: disable=import-outside-toplevel

    for which, folder in (("latest", ckpts.latest_dir), ("best", ckpts.best_dir)):
      if step in ckpts.steps(which):
        path = folder / str(step)
        if expect is not None:
          checkpoint_lib.check_expected(
              ckpts.read_meta(which, step), expect, ckpts.latest_dir, path
          )
        state, meta = ckpts.restore(abstract_state, which=which, step=step)
        return checkpoint_lib.Restored(state, meta, step, path, "digests" in meta)
    have = sorted(set(ckpts.steps("latest")) | set(ckpts.steps("best")))
    raise NoCheckpointError(
        f"no checkpoint at step {step} in {self.path}; its steps: "
        f"{', '.join(map(str, have)) or '(none)'}."
    )
