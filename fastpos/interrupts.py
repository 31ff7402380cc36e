"""SIGINT (Ctrl-C) and SIGTERM (preemption) in the command-line programs, at every instant.

``train.py``, ``eval.py`` and ``scripts/generate.py`` call ``install(prog)`` on their first
line, before the heavy imports. From then on a signal never raises into the program (no
``KeyboardInterrupt`` inside a native callback, a ``finally`` or the interpreter's shutdown:
the old source of segmentation faults and of swallowed Ctrl-Cs); the C-level handler writes
the signal's number to a pipe and a watcher thread acts on it, even while the main thread is
inside a long native call (an XLA compile):

* Outside a ``deferred`` stretch (imports, config and data checks, the restore, all of
  ``eval.py``) the first signal stops the program at once: nothing is being written that a
  later run needs (``exit_hook``s run first: the trainer releases the workdir's lock).
* Inside one (``train_and_evaluate`` from the moment it starts writing the workdir) the first
  signal is a request: the training loop saves the step it is on and stops, and the stretches
  before and after the loop stop at their next ``check``; a second signal stops at once,
  without saving.

Either way the program exits with ``EXIT_CODES`` (130 for SIGINT, as shells report a Ctrl-C;
75 for SIGTERM, ``EX_TEMPFAIL``: preempted, run again later) and one line on stderr, e.g.
``train.py: stopped at step 7 after saving it (SIGTERM); the newest checkpoint is step 7 in
<folder>; run the same command again to continue.`` (or ``no checkpoint yet in <folder>``),
read from the folder when the line is written (``describe_checkpoints`` names it; a step
folder exists there only once orbax has renamed it complete), and no Python shutdown after
it. A signal that arrives after the program's result was printed may leave the exit code 0;
from the last exit hook on (the threads joined) signals are ignored. Before the interpreter
runs the program's first line (about 0.1 s) the operating system's defaults apply.

A library call (no ``install``) keeps Python's behaviour, except in the training loop, where
``stop_requests`` turns the first signal into a request as above and a second SIGINT raises
``KeyboardInterrupt``.

This module imports only the standard library: ``install`` runs before JAX is imported.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The exit code of a program stopped by each signal (fastpos.train.errors names them).
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 75}


def newest_step(folder: str | os.PathLike | None) -> int | None:
  """The newest complete checkpoint step in ``folder`` (orbax renames a step's temporary
  folder to ``<step>`` once it is complete), or None."""
  if folder is None:
    return None
  try:
    names = os.listdir(folder)
  except OSError:
    return None
  steps = [int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(folder, n))]
  return max(steps, default=None)


def checkpoint_state(folder: str | os.PathLike) -> str:
  """``the newest checkpoint is step N in <folder>`` or ``no checkpoint yet in <folder>``,
  as the folder is now."""
  step = newest_step(folder)
  if step is None:
    return f"no checkpoint yet in {folder}"
  return f"the newest checkpoint is step {step} in {folder}"


class Interrupted(Exception):
  """The program stopped on a signal at a safe point. Its message is composed when it is
  read (as the program prints it, after in-flight saves completed), so that what it says of
  the checkpoints is true then."""

  def __init__(self, signal_name: str, where: str):
    super().__init__(signal_name, where)
    self.signal_name, self.where = signal_name, where
    self.exit_code = EXIT_CODES[signal_name]
    self.checkpoints = _WATCH.checkpoints if _WATCH is not None else None

  def __str__(self) -> str:
    return _line(self.signal_name, f"stopped {self.where}", self.checkpoints)


def _line(signal_name: str, what: str, checkpoints: Path | None) -> str:
  """The one line a program stops with on ``signal_name``."""
  text = f"{what} ({signal_name})"
  if checkpoints is not None:
    text += f"; {checkpoint_state(checkpoints)}; run the same command again to continue"
  return text + "."


class _Watch:
  """The program's signal state and the thread that acts on signals (module docstring)."""

  def __init__(self, prog: str):
    self.prog = prog
    self.signals: list[str] = []  # names, in order of arrival
    self.deferring: list[str] = []  # what the first signal does, innermost stretch last
    self.checkpoints: Path | None = None
    self.exit_hooks: list[Callable[[], None]] = []
    self._lock = threading.Lock()
    self._exiting = threading.Lock()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    for s in SIGNALS:
      signal.signal(s, _record_only)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    # A forked child (a fork-started worker) must not report its signals to this watcher.
    os.register_at_fork(after_in_child=_uninstall_in_child)
    # The watcher serves until the last exit hook (after the program's threads were joined);
    # past it Python stops its threads and then restores the default handlers, which would
    # end a finished program by the signal: it exits with its own code instead.
    atexit.register(_ignore_signals)
    threading.Thread(
        target=self._watch, args=(read_fd,), name="fastpos-signals", daemon=True
    ).start()

  def _watch(self, fd: int) -> None:
    while True:
      try:
        data = os.read(fd, 64)
      except InterruptedError:
        continue
      for number in data:
        if number in SIGNALS:
          self._on_signal(signal.Signals(number).name)

  def _on_signal(self, name: str) -> None:
    with self._lock:
      self.signals.append(name)
      first = len(self.signals) == 1
      deferring = self.deferring[-1] if self.deferring else None
    if first and deferring is not None:
      _notice(f"{name}: {deferring}; {name} again stops at once, without saving.")
      return
    what = "stopped at once, without saving" if deferring is not None else "stopped"
    twice = " twice" if not first else ""
    self.exit_now(_line(self.signals[0] + twice, what, self.checkpoints), self.signals[0])

  def exit_now(self, line: str, signal_name: str) -> None:
    """Ends the process now: the hooks, ``line`` on stderr, ``signal_name``'s exit code; no
    Python shutdown (live orbax, grain and XLA threads). The first thread here prints the one
    line; another one (the watcher on a second signal, or the main thread) waits for the end."""
    self._exiting.acquire()  # never released: the process ends below
    for hook in reversed(list(self.exit_hooks)):
      with contextlib.suppress(Exception):
        hook()
    for stream in (sys.stdout, sys.stderr):
      with contextlib.suppress(Exception):
        stream.flush()
    with contextlib.suppress(OSError):
      os.write(2, f"{self.prog}: {line}\n".encode(errors="replace"))
    os._exit(EXIT_CODES[signal_name])


_WATCH: _Watch | None = None


def _record_only(signum, frame) -> None:
  """The Python-level handler: does nothing (the C-level handler has woken the watcher)."""
  del signum, frame


def _ignore_signals() -> None:
  for s in SIGNALS:
    signal.signal(s, signal.SIG_IGN)


def _uninstall_in_child() -> None:
  global _WATCH
  _WATCH = None
  signal.set_wakeup_fd(-1)
  for s in SIGNALS:
    signal.signal(s, signal.SIG_DFL if s == signal.SIGTERM else signal.default_int_handler)


def _notice(text: str) -> None:
  """A log line from the watcher thread (absl's handler when it is set up, else stderr)."""
  from absl import logging  # pylint: disable=import-outside-toplevel  (installed before absl)

  logging.warning("%s", text)


def install(prog: str) -> None:
  """Takes over SIGINT and SIGTERM for the program ``prog`` (module docstring). Call it from
  the main thread, first thing; a second call does nothing."""
  global _WATCH
  if _WATCH is None:
    _WATCH = _Watch(prog)


def installed() -> bool:
  return _WATCH is not None


def describe_checkpoints(folder: str | os.PathLike) -> None:
  """The folder the stop line describes (its newest complete step)."""
  if _WATCH is not None:
    _WATCH.checkpoints = Path(folder).absolute()


def requested() -> str | None:
  """The first signal's name since ``install``, or None."""
  return _WATCH.signals[0] if _WATCH is not None and _WATCH.signals else None


@contextlib.contextmanager
def deferred(what: str) -> Iterator[None]:
  """Within: the first signal is a request (``what`` it does, for the log line) that the
  program honours at its next ``check`` or loop step. Nothing without ``install``."""
  if _WATCH is None:
    yield
    return
  with _WATCH._lock:
    _WATCH.deferring.append(what)
  try:
    yield
  finally:
    with _WATCH._lock:
      _WATCH.deferring.pop()


@contextlib.contextmanager
def exit_hook(hook: Callable[[], None]) -> Iterator[None]:
  """Within: ``hook`` runs if a signal stops the process at once (e.g. releasing the
  workdir's lock). Nothing without ``install``."""
  if _WATCH is None:
    yield
    return
  with _WATCH._lock:
    _WATCH.exit_hooks.append(hook)
  try:
    yield
  finally:
    with _WATCH._lock:
      _WATCH.exit_hooks.remove(hook)


def stop(exc: Interrupted) -> None:
  """Ends the program on ``exc`` (raised by ``check`` and caught by the program): its line
  on stderr, its exit code, no Python shutdown."""
  assert _WATCH is not None, "Interrupted is raised only under install()"
  _WATCH.exit_now(str(exc), exc.signal_name)


def check(where: str) -> None:
  """Raises ``Interrupted`` (stopped ``where``) when a signal was received; a safe point."""
  name = requested()
  if name is not None:
    raise Interrupted(name, where)


class StopRequests:
  """What the training loop polls: ``requested``, the first signal's name (or another
  process's request, set by the loop) or None."""

  def __init__(self):
    self._own: str | None = None

  @property
  def requested(self) -> str | None:
    return self._own or requested()

  @requested.setter
  def requested(self, name: str) -> None:
    self._own = name

  def _handle(self, signum, frame) -> None:
    """The loop's handler in a library call: the first signal asks, a second SIGINT raises."""
    del frame
    if signum == signal.SIGINT and self._own == "SIGINT":
      raise KeyboardInterrupt
    if self._own is None:
      self._own = signal.Signals(signum).name
      _notice(f"{self._own}: saving after this step (Ctrl-C again to abort without saving).")


@contextlib.contextmanager
def stop_requests() -> Iterator[StopRequests]:
  """Within (the training loop): the first SIGINT / SIGTERM asks the loop to save and stop.
  Under ``install`` the program's watcher serves (a second signal stops at once); in a
  library call, handlers for the stretch (a second SIGINT raises KeyboardInterrupt)."""
  requests = StopRequests()
  if _WATCH is not None:
    with deferred("saving after this step, then stopping"):
      yield requests
    return
  previous = {}
  if threading.current_thread() is threading.main_thread():
    for s in SIGNALS:
      previous[s] = signal.signal(s, requests._handle)
  try:
    yield requests
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
