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

EXIT_OK = 0
EXIT_FAILED = 1  # an unexpected error (a bug): the traceback is printed
EXIT_BAD_INPUT = 2  # bad config, flag, data or workdir: fix the input and run again
EXIT_NONFINITE = 3  # the loss became NaN / Inf: the last good checkpoint is intact
EXIT_LOCKED = 4  # another trainer holds the workdir
EXIT_PEER_LOST = 5  # another process of a multi-process run died or froze: restart them all
EXIT_PREEMPTED = 75  # SIGTERM / SIGINT: a checkpoint was saved; restart to continue
# (75 = EX_TEMPFAIL of sysexits.h: "try again later")
EXIT_INTERRUPTED = 130  # a second Ctrl-C: stopped without saving (128 + SIGINT, as shells do)


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
