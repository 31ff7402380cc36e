"""Running a command-line program (``train.py``, ``eval.py``, ``scripts/generate.py``) under absl.

``run(main, prog)`` runs ``main``; a failure that is the user's (a bad config, flag, data file or
workdir: ``RunError`` and the errors listed in ``user_exit_code``) prints one line,
``<prog>: <message>``, to stderr and exits with its code from ``fastpos.train.errors``; nothing
is printed at shutdown after it (no traceback from background threads). Any other exception is
a bug: its traceback is printed, exit 1. SIGINT and SIGTERM are ``fastpos.interrupts``'s (one
line, exit 130 / 75, at any instant); ``run`` installs it if the program has not already.
"""

from __future__ import annotations

import errno
import logging as py_logging
import os
import sys
import threading
import warnings
from typing import Any, Callable, Sequence

from absl import app, flags, logging

from fastpos import interrupts
from fastpos.train import checkpoint, distributed, errors


def user_exit_code(e: BaseException) -> int | None:
  """The exit code of a failure that is the user's (bad config, flag, data or workdir), or
  None for a bug (its traceback is shown)."""
  if isinstance(e, errors.RunError):
    return e.exit_code
  if isinstance(e, (ValueError, NotImplementedError, OSError, flags.Error)):
    return errors.EXIT_BAD_INPUT
  return None


_OS_HINTS = {
    errno.EROFS: "the file system is read-only: use a --workdir on a writable disk",
    errno.EACCES: "use a --workdir you can write to (or fix its " "permissions)",
    errno.EPERM: "use a --workdir you can write to",
    errno.ENOSPC: "the disk is full: free space there or use a --workdir on another disk",
    errno.EDQUOT: "the disk quota is exceeded: free space or use a --workdir elsewhere",
    errno.ENOTDIR: "a part of the path is a file, not a folder: use another --workdir",
    errno.EEXIST: "a file is in the way: remove it or use another --workdir",
    errno.EISDIR: "a folder is where a file should be: remove it or use another path",
    errno.ENAMETOOLONG: "the path is too long: use a shorter --workdir",
}


def message(e: BaseException) -> str:
  """The one line printed for a user error."""
  if isinstance(e, OSError) and e.strerror and not isinstance(e, errors.RunError):
    where = " -> ".join(repr(os.fspath(p)) for p in (e.filename, e.filename2) if p)
    hint = _OS_HINTS.get(e.errno, "check the path and run again")
    text = f"{e.strerror}{': ' + where if where else ''}; {hint}."
  elif "No space left on device" in str(e) and not isinstance(e, errors.RunError):
    # tensorstore's write errors (orbax saves); a RunError already says the fix
    text = f"{e}; {_OS_HINTS[errno.ENOSPC]}."
  elif isinstance(e, (errors.RunError, FileNotFoundError, flags.Error)) or type(e) in (
      ValueError,
      NotImplementedError,
  ):
    text = str(e) or type(e).__name__
  else:
    text = f"{type(e).__name__}: {e}"
  # One line: a message split over lines (or carrying a nested error) is joined.
  return " ".join(line.strip() for line in text.splitlines() if line.strip())


class _OneLineBackgroundErrors(py_logging.Filter):
  """Log records of background threads and of orbax without their traceback: a failed save
  reaches the main thread as an exception too, and dozens of tracebacks (one per thread and
  array) would bury that one line."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.exc_info and (
        record.thread != threading.main_thread().ident
        or f"{os.sep}orbax{os.sep}" in record.pathname
    ):
      exc = record.exc_info[1]
      record.msg = f"{record.getMessage()} ({type(exc).__name__}: {exc})"
      record.args, record.exc_info, record.exc_text = None, None, None
    return True


_SEEN_BACKGROUND: set[tuple[str, str]] = set()


def _first_line(exc) -> str:
  """An exception's message up to its first line break (tensorstore appends its spec, a JSON
  dump over many lines)."""
  text = str(exc).strip()
  return text.split("\n", 1)[0].split(" See full TensorStore details", 1)[0]


def _log_background(where: str, exc_type, exc) -> None:
  """One line per distinct background error (an event loop closed under a failed save is
  reported once per array otherwise)."""
  key = (exc_type.__name__, _first_line(exc))
  if key not in _SEEN_BACKGROUND:
    _SEEN_BACKGROUND.add(key)
    logging.error("%s: %s: %s", where, exc_type.__name__, key[1])


def _thread_hook(args) -> None:
  if args.exc_type is not SystemExit:
    _log_background(
        f"background thread {getattr(args.thread, 'name', '?')}", args.exc_type, args.exc_value
    )


def _unraisable_hook(unraisable) -> None:
  if checkpoint.orbax_leftover(unraisable):
    logging.debug("after a failed checkpoint read: %s", _first_line(unraisable.exc_value))
    return
  # Native threads (tensorstore's callbacks into asyncio) report here, with no object.
  _log_background(
      unraisable.err_msg or "ignored exception", unraisable.exc_type, unraisable.exc_value
  )


def _background_errors_in_one_line() -> None:
  """Errors of background and native threads as one log line each, never a traceback; the
  main thread's uncaught exceptions (bugs) keep theirs."""
  threading.excepthook = _thread_hook
  sys.unraisablehook = _unraisable_hook
  handlers = [logging.get_absl_handler(), *py_logging.getLogger().handlers]
  for handler in dict.fromkeys(handlers):
    if not any(isinstance(f, _OneLineBackgroundErrors) for f in handler.filters):
      handler.addFilter(_OneLineBackgroundErrors())


def _quiet_shutdown() -> None:
  """After a user error: nothing more on stderr. Background threads (orbax's async savers)
  and finalizers can still fail while the interpreter exits; their tracebacks would bury the
  one message, so they are dropped, and library log lines with them, and warnings (a save
  cut short by a full disk leaves orbax coroutines that are never awaited, reported at exit)."""
  threading.excepthook = lambda args: None
  sys.unraisablehook = lambda unraisable: None
  warnings.simplefilter("ignore")
  logging.set_verbosity(logging.FATAL)
  py_logging.getLogger().setLevel(py_logging.CRITICAL)


def fail(prog: str, e: BaseException, code: int) -> int:
  _quiet_shutdown()
  sys.stdout.flush()
  print(f"{prog}: {message(e)}", file=sys.stderr, flush=True)
  return code


def _parse_flags(prog: str, argv: list[str], argv_hook) -> list[str]:
  try:
    return flags.FLAGS(argv_hook(argv) if argv_hook else argv)
  except (flags.Error, errors.RunError) as e:  # a bad flag or config file: one line
    sys.exit(fail(prog, e, user_exit_code(e) or errors.EXIT_BAD_INPUT))


def run(
    main: Callable[[list[str]], int | None],
    prog: str,
    argv_hook: Callable[[list[str]], list[str]] | None = None,
) -> None:
  """``app.run(main)`` with every user error as one line (module docstring); exits with
  ``main``'s return value. ``argv_hook`` may add default flags before they are parsed."""
  interrupts.install(prog)

  def wrapped(argv: list[str]) -> int | None:
    _background_errors_in_one_line()
    # JAX logs at INFO each accelerator plugin it probes and does not find (libtpu on every
    # CPU or GPU machine): noise before the one line a failed run prints.
    py_logging.getLogger("jax._src.xla_bridge").setLevel(py_logging.WARNING)
    try:
      return main(argv)
    except interrupts.Interrupted as e:  # a signal, honoured at a safe point
      interrupts.stop(e)
    except Exception as e:  # pylint: disable=broad-except
      e = distributed.as_peer_lost(e)  # a collective broken by a lost process: its own code
      code = user_exit_code(e)
      if code is None:
        raise  # a bug: the traceback is the report
      return fail(prog, e, code)

  app.run(wrapped, flags_parser=lambda argv: _parse_flags(prog, argv, argv_hook))


def require(name: str, value: Any, example: str) -> Any:
  if value in (None, ""):
    raise errors.RunError(f"--{name} is required, e.g. {example}.")
  return value


def no_extra_args(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise errors.RunError(
        f"unexpected arguments {list(argv[1:])}: every setting is a flag "
        "(--config=..., --workdir=..., --config.<field>=<value>)."
    )
