"""The distributed service of a multi-process run, in a process of its own.

JAX hosts the service inside process 0, so when process 0 dies or freezes the others lose the
service itself and end in jaxlib's fatal error (a C++ abort, exit 134), with no Python hook
before it. Run beside process 0 instead, the service outlives it: it reports process 0 lost
like any other process, and the others' watchers stop them with one line and
``EXIT_PEER_LOST`` (``fastpos.train.distributed``).

Process 0 starts this file as a script (``python coordinator_service.py BIND_ADDRESS
NUM_PROCESSES HEARTBEAT_S SHUTDOWN_S``), in its own session (a Ctrl-C or a kill of process 0's
group must not take the service from a run that is saving), and talks to it over stdin/stdout:

* the service prints ``ready`` once it listens, or ``error: <why>`` and exits 1;
* a ``stop`` line on stdin (process 0 shuts down in order): the service stops at once;
* stdin closed without ``stop`` (process 0 died): the service lives ``HEARTBEAT_S + 10`` s more,
  so that the others see process 0 missed and stop with their one line, then exits.

It imports jaxlib alone (no fastpos, no jax) to start fast.
"""

from __future__ import annotations

import signal
import socket
import sys
import time

LINGER_AFTER_HEARTBEAT_S = 10  # the others' watchers poll about once a second
READY, STOP = "ready", "stop"


def _bind_problem(bind_address: str) -> str | None:
  """Why ``bind_address`` ("host:port", "[::]:port") cannot be listened on, or None: checked
  with a plain socket first, because jaxlib's service can crash (SIGSEGV) on a failed bind."""
  host, _, port = bind_address.rpartition(":")
  host = host.strip("[]") or "::"
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
      probe.bind((host, int(port)))
  except (OSError, ValueError) as e:
    return f"cannot bind RPC server on {bind_address}: {getattr(e, 'strerror', None) or e}"
  return None


def serve(bind_address: str, num_processes: int, heartbeat_s: int, shutdown_s: int) -> int:
  """Runs the service until ``stop`` or until stdin closes (module docstring); the exit code."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # process 0 decides when the service ends
  problem = _bind_problem(bind_address)
  if problem:
    print(f"error: {problem}", flush=True)
    return 1
  try:
    from jaxlib import _jax  # pylint: disable=import-outside-toplevel

    service = _jax.get_distributed_runtime_service(
        bind_address,
        num_processes,
        heartbeat_timeout=heartbeat_s,
        shutdown_timeout=shutdown_s,
        recoverable=True,
    )
  except Exception as e:  # pylint: disable=broad-except  # e.g. the port is taken
    print(f"error: {' '.join(str(e).split())[:300]}", flush=True)
    return 1
  print(READY, flush=True)
  line = sys.stdin.readline()
  if line.strip() != STOP:  # process 0 is gone: the others must learn it from the service
    time.sleep(heartbeat_s + LINGER_AFTER_HEARTBEAT_S)
  service.shutdown()
  return 0


if __name__ == "__main__":
  address, count, heartbeat, shutdown = sys.argv[1:5]
  sys.exit(serve(address, int(count), int(heartbeat), int(shutdown)))
