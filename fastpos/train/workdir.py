"""The workdir before a run touches it: is it usable, and is it ours alone.

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

from absl import logging

from fastpos.train.errors import RunError, WorkdirLockedError

LOCK_NAME = "train.lock"
PREVIOUS_DIR = "previous"
# What a run writes in its workdir besides checkpoints/ (config_record, identity, launches,
# metrics, checkpoint.BEST_DIR, tensorboard, the trainer's log).
RECORD_NAMES = (
    "config.json",
    "config_changes.jsonl",
    "run.json",
    "launches.jsonl",
    "metrics.jsonl",
    "best",
    "tensorboard",
)

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
  return found + sorted(p.name for p in path.glob("results_*.json"))


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
