"""Why a run stops, and the exit codes the command-line tools use for each reason.

Every error here carries a message that names the bad value or file and the fix; ``train.py``
and ``eval.py`` print that message alone (no traceback) and exit with the code below.
``scripts/sweep.sh`` (``fastpos.sweep``) reads the codes (e.g. a preempted run is restarted,
a bad config is not).

``EXIT_PEER_LOST``: in a run of several processes, the distributed service lost another process
(it died, or froze past ``--heartbeat_timeout``), process 0 included (the service runs in a
process of its own beside it); each surviving process prints one line naming the lost
process(es) and exits with it. A collective that fails because its connection to another
process broke (gloo, mid-allreduce) waits for that line and exits with the same code. Nothing
was saved since the last checkpoint: read the lost process's log for the cause, then start all
processes again to resume.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Iterator

from fastpos.interrupts import EXIT_CODES

EXIT_OK = 0
EXIT_FAILED = 1  # an unexpected error (a bug): the traceback is printed
EXIT_BAD_INPUT = 2  # bad config, flag, data or workdir: fix the input and run again
EXIT_NONFINITE = 3  # the loss became NaN / Inf: the last good checkpoint is intact
EXIT_LOCKED = 4  # another trainer holds the workdir
EXIT_PEER_LOST = 5  # another process of a multi-process run died or froze: restart them all
# Stopped by a signal (fastpos.interrupts): run the same command again to continue.
EXIT_PREEMPTED = EXIT_CODES["SIGTERM"]  # 75 = EX_TEMPFAIL of sysexits.h: "try again later"
EXIT_INTERRUPTED = EXIT_CODES["SIGINT"]  # 130 = 128 + SIGINT, as shells report a Ctrl-C


class RunError(Exception):
  """A run cannot proceed; the message says what is wrong and how to fix it."""

  exit_code = EXIT_BAD_INPUT


class NonFiniteLossError(RunError, FloatingPointError):
  """The training loss or gradient became NaN / Inf; the last good checkpoint is intact."""

  exit_code = EXIT_NONFINITE


class WorkdirLockedError(RunError):
  """Another trainer (named in the message) holds the workdir's lock."""

  exit_code = EXIT_LOCKED


class PeerLostError(RunError):
  """Another process of a multi-process run died or froze (the distributed service lost it)."""

  exit_code = EXIT_PEER_LOST


@contextlib.contextmanager
def names_file(path: str | os.PathLike) -> Iterator[None]:
  """An OSError raised inside (a write that failed) names ``path``: the error a full disk
  gives names no file, and the one line a run stops with must say which."""
  try:
    yield
  except OSError as e:
    if e.filename is not None or e.errno is None:
      raise
    raise OSError(e.errno, e.strerror, os.fspath(path)) from None


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../fastpos


class LogFileHandler(logging.FileHandler):
  """A log file (appending, UTF-8) whose failed write stops the run once, naming the file,
  rather than print a traceback per record and lose the log silently.

  After the first failed write the handler drops every record. The OSError is raised once,
  from the first record that fastpos itself logs in the main thread (a point of the run's own
  code, never inside a library or a background thread, whose records are only dropped).
  """

  def __init__(self, path: str | os.PathLike):
    super().__init__(path, mode="a", encoding="utf-8")
    self.failed: OSError | None = None
    self._raised = False

  def emit(self, record: logging.LogRecord) -> None:
    if self.failed is None:
      super().emit(record)  # a failed write calls handleError
    else:
      self._raise_once(record)

  def handleError(self, record: logging.LogRecord) -> None:
    e = sys.exc_info()[1]  # logging calls this inside its except
    if not isinstance(e, OSError):
      super().handleError(record)
      return
    self.failed = OSError(e.errno, e.strerror, self.baseFilename)
    self._raise_once(record)

  def close(self) -> None:
    # Every record is flushed as it is written: a failure here repeats one already handled.
    with contextlib.suppress(OSError):
      super().close()

  def _raise_once(self, record: logging.LogRecord) -> None:
    own = os.path.abspath(record.pathname).startswith(_PACKAGE + os.sep)
    if self._raised or not own or threading.current_thread() is not threading.main_thread():
      return
    self._raised = True
    raise self.failed from None
