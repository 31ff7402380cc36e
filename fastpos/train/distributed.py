"""Starting one run as several processes (``jax.distributed``), before anything touches the
devices.

Where the processes learn of each other, first that is set:

1. the flags ``--coordinator_address=HOST:PORT --num_processes=N --process_id=I`` (every
   process gets the same address and count, and its own id; process 0 hosts the
   coordinator at that address);
2. the environment variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
   ``JAX_PROCESS_ID`` (what ``scripts/launch_local.sh`` sets), one by one under the flags;
3. a cluster that JAX detects itself (SLURM, Open MPI, Cloud TPU) with more than one process:
   ``jax.distributed.initialize()`` reads the rest from it;
4. else a single process (nothing is initialized).

A partial setting (an address without a process count, an id out of range, an address that is
not ``host:port``) stops with one message naming the value and the fix, before any compute.
``--initialization_timeout`` bounds the wait for the other processes at start-up,
``--heartbeat_timeout`` how long the others take to notice a process that died, and
``--shutdown_timeout`` how long a process that is done waits for the others at exit. On CPU the
processes' collectives go over gloo (TCP).

A lost process: when the distributed service misses another process (it died, or froze for
``--heartbeat_timeout``), every other process prints one line naming it and exits with
``EXIT_PEER_LOST`` (``fastpos.train.errors``), no traceback. The service runs in JAX's
recoverable mode, so that a lost task is reported to the others' watchers instead of aborting
them; that mode skips JAX's shutdown barrier, so at exit every process waits for the others
(``--shutdown_timeout``) and process 0, which starts the service, leaves last. The service runs
in a process of its own beside process 0 (``fastpos.train.coordinator_service``), so that the
loss of process 0 too is reported (JAX would host it inside process 0, whose death then aborts
the others in C++). A collective that fails in the main thread because a process is gone (a
gloo connection reset mid-allreduce) waits for the watcher's line, and exits with the same code.

``train.py`` and ``eval.py`` call ``define_flags()`` at import and ``initialize(flags)`` first
thing in ``main``; other programs may call ``initialize()`` for the environment variables
and the cluster detection alone.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Mapping

import jax
from absl import flags, logging

from fastpos.train import coordinator_service
from fastpos.train.errors import EXIT_BAD_INPUT, EXIT_PEER_LOST, PeerLostError, RunError

ADDRESS_ENV, COUNT_ENV, ID_ENV = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
DEFAULT_INITIALIZATION_TIMEOUT_S = 300  # jax's own default
DEFAULT_HEARTBEAT_TIMEOUT_S = 100  # jax's own default
DEFAULT_SHUTDOWN_TIMEOUT_S = 300  # jax's own default

_LAUNCH = (
    "start every process with the same --coordinator_address=HOST:PORT (process 0's "
    "host, a free port) and --num_processes=N, and its own --process_id in 0..N-1 (or "
    f"set {ADDRESS_ENV}, {COUNT_ENV} and {ID_ENV}; scripts/launch_local.sh does this "
    "on one machine)"
)


class DistributedError(RunError):
  """The processes of a run cannot find each other (bad settings or a missing peer)."""


@dataclasses.dataclass(frozen=True)
class Settings:
  """How this process joins the run; ``num_processes`` None: single process or a cluster
  JAX detects."""

  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  initialization_timeout_s: int = DEFAULT_INITIALIZATION_TIMEOUT_S
  heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S
  shutdown_timeout_s: int = DEFAULT_SHUTDOWN_TIMEOUT_S
  # Where each of address, count and id came from ("--flag" or "$VAR"), for the messages.
  names: tuple[str, str, str] = ("--coordinator_address", "--num_processes", "--process_id")


@dataclasses.dataclass(frozen=True)
class Flags:
  """The flag holders ``define_flags`` returns."""

  coordinator_address: flags.FlagHolder
  num_processes: flags.FlagHolder
  process_id: flags.FlagHolder
  initialization_timeout: flags.FlagHolder
  heartbeat_timeout: flags.FlagHolder
  shutdown_timeout: flags.FlagHolder


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> Flags:
  """Defines ``--coordinator_address``, ``--num_processes``, ``--process_id``,
  ``--initialization_timeout`` and ``--heartbeat_timeout`` (a program's module level)."""
  d = lambda define, *args: define(*args, flag_values=flag_values)
  return Flags(
      coordinator_address=d(
          flags.DEFINE_string,
          "coordinator_address",
          None,
          f"HOST:PORT of process 0's coordinator, the same for every process "
          f"of a multi-process run (default: ${ADDRESS_ENV})",
      ),
      num_processes=d(
          flags.DEFINE_integer,
          "num_processes",
          None,
          f"processes of the run (default: ${COUNT_ENV}; unset: a cluster JAX "
          "detects, SLURM / Open MPI / Cloud TPU, else 1)",
      ),
      process_id=d(
          flags.DEFINE_integer,
          "process_id",
          None,
          f"this process's id in 0..num_processes-1 (default: ${ID_ENV})",
      ),
      initialization_timeout=d(
          flags.DEFINE_integer,
          "initialization_timeout",
          DEFAULT_INITIALIZATION_TIMEOUT_S,
          "seconds to wait at start-up for every process to join",
      ),
      heartbeat_timeout=d(
          flags.DEFINE_integer,
          "heartbeat_timeout",
          DEFAULT_HEARTBEAT_TIMEOUT_S,
          "seconds after which a silent process counts as dead and the run " "stops",
      ),
      shutdown_timeout=d(
          flags.DEFINE_integer,
          "shutdown_timeout",
          DEFAULT_SHUTDOWN_TIMEOUT_S,
          "seconds a finished (or failed) process waits for the others at exit",
      ),
  )


def _int_env(environ: Mapping[str, str], name: str) -> int | None:
  raw = environ.get(name, "").strip()
  if not raw:
    return None
  try:
    return int(raw)
  except ValueError:
    raise DistributedError(f"{name}={raw!r} is not an integer; {_LAUNCH}.") from None


def settings(holders: Flags | None = None, environ: Mapping[str, str] | None = None) -> Settings:
  """The settings from the flags (when defined), each unset one from its environment
  variable; checked (``check``)."""
  environ = os.environ if environ is None else environ
  value = (
      (lambda name: getattr(holders, name).value) if holders is not None else (lambda name: None)
  )
  fields = (
      ("coordinator_address", ADDRESS_ENV),
      ("num_processes", COUNT_ENV),
      ("process_id", ID_ENV),
  )
  values, names = [], []
  for field, env in fields:
    v = value(field)
    if v is not None and v != "":
      values.append(v)
      names.append(f"--{field}")
    else:
      raw = environ.get(env, "").strip()
      values.append(
          None if not raw else raw if field == "coordinator_address" else _int_env(environ, env)
      )
      names.append(env if raw else f"--{field} (or {env})")
  timeouts = (
      (value("initialization_timeout"), value("heartbeat_timeout"), value("shutdown_timeout"))
      if holders is not None
      else (
          DEFAULT_INITIALIZATION_TIMEOUT_S,
          DEFAULT_HEARTBEAT_TIMEOUT_S,
          DEFAULT_SHUTDOWN_TIMEOUT_S,
      )
  )
  out = Settings(*values, *timeouts, names=tuple(names))
  check(out)
  return out


def check(s: Settings) -> None:
  """Raises DistributedError naming the bad or missing value and the fix."""
  address_name, count_name, id_name = s.names
  for name, t in (
      ("--initialization_timeout", s.initialization_timeout_s),
      ("--heartbeat_timeout", s.heartbeat_timeout_s),
      ("--shutdown_timeout", s.shutdown_timeout_s),
  ):
    if t < 1:
      raise DistributedError(f"{name}={t}: give a number of seconds >= 1.")
  if s.num_processes is None:
    if s.coordinator_address is not None or s.process_id is not None:
      given = (
          f"{address_name}={s.coordinator_address}"
          if s.coordinator_address is not None
          else f"{id_name}={s.process_id}"
      )
      raise DistributedError(f"{given} is set but {count_name} is not; {_LAUNCH}.")
    return
  if s.num_processes < 1:
    raise DistributedError(
        f"{count_name}={s.num_processes}: the number of processes must be " ">= 1."
    )
  if s.num_processes == 1 and s.coordinator_address is None:
    if s.process_id not in (None, 0):
      raise DistributedError(
          f"{id_name}={s.process_id} is out of range for " f"{count_name}=1; the only process is 0."
      )
    return
  if s.coordinator_address is None:
    raise DistributedError(
        f"{count_name}={s.num_processes} is set but {address_name} is not; " f"{_LAUNCH}."
    )
  if s.process_id is None:
    raise DistributedError(
        f"{count_name}={s.num_processes} is set but {id_name} is not; " f"{_LAUNCH}."
    )
  if not 0 <= s.process_id < s.num_processes:
    raise DistributedError(
        f"{id_name}={s.process_id} is out of range for {count_name}="
        f"{s.num_processes}; give each process its own id in 0.."
        f"{s.num_processes - 1}."
    )
  _check_address(s.coordinator_address, address_name)


def _check_address(address: str, name: str) -> None:
  host, sep, port = address.rpartition(":")
  host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:1234
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise DistributedError(
        f"{name}={address!r} is not HOST:PORT (e.g. 10.0.0.1:1234 or "
        "localhost:1234, a port in 1..65535); give process 0's host and a "
        "free port."
    )
  try:
    socket.getaddrinfo(host, int(port))
  except (socket.gaierror, UnicodeError) as e:
    raise DistributedError(
        f"{name}={address!r}: host {host!r} is unknown ({e}); give process "
        "0's host name or IP address."
    ) from None


def detected_cluster() -> str | None:
  """The name of a multi-process cluster JAX detects itself (SLURM, Open MPI, Cloud TPU) that
  this process is part of, else None. A cluster of one process (an interactive SLURM job)
  counts as none: the run stays a plain single process."""
  # jax keeps its cluster detectors private; the same ones ``jax.distributed.initialize()``
  # with no arguments uses (opt-in methods such as mpi4py excluded, as it excludes them).
  try:
    from jax._src import clusters  # pylint: disable=import-outside-toplevel

    envs = [
        e
        for e in clusters.ClusterEnv._cluster_types  # pylint: disable=protected-access
        if not e.opt_in_only_method and e.__name__ != "K8sCluster"
    ]
  except (ImportError, AttributeError) as e:
    logging.warning(
        "jax's cluster detection is not available (%s): running as one process "
        "unless --num_processes says otherwise.",
        e,
    )
    return None
  for env in envs:
    try:
      if env.is_env_present() and env.get_process_count() > 1:
        return env.__name__
    except Exception as e:  # pylint: disable=broad-except  # a half-set cluster environment
      logging.warning("cluster detection %s failed (%s); ignoring it.", env.__name__, e)
  return None


def _stop(message: str, code: int = EXIT_BAD_INPUT) -> None:
  """Ends the process at once with ``message`` (the main thread is blocked in jax)."""
  prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "fastpos"
  sys.stdout.flush()
  print(f"{prog}: {message}", file=sys.stderr, flush=True)
  os._exit(code)


_WATCH_STOP = threading.Event()


def peer_lost_message(missing: list[int], num_processes: int, heartbeat_timeout_s: int) -> str:
  """The one line a surviving process prints (``EXIT_PEER_LOST``)."""
  who = ", ".join(str(i) for i in missing)
  return (
      f"process(es) {who} of {num_processes} stopped answering the distributed service "
      f"(died, or froze for --heartbeat_timeout={heartbeat_timeout_s} s); stopping this "
      f"process too (exit code {EXIT_PEER_LOST}). Their logs say why; start all "
      f"{num_processes} processes again to resume from the last checkpoint."
  )


def _watch_peers(client, num_processes: int, heartbeat_timeout_s: int) -> None:
  """Background: ends this process with one line once the service has lost another one."""
  nodes = list(range(num_processes))
  interval = min(1.0, heartbeat_timeout_s / 4)
  while not _WATCH_STOP.wait(interval):
    try:
      live = client.get_live_nodes(nodes)
    except Exception:  # pylint: disable=broad-except  # the service itself (process 0) is gone
      live = {i: 0 for i in nodes if i}
    missing = [i for i in nodes if i not in live]
    if missing and not _WATCH_STOP.is_set():
      _stop(peer_lost_message(missing, num_processes, heartbeat_timeout_s), EXIT_PEER_LOST)


def _exit_together(client, num_processes: int, shutdown_timeout_s: int) -> None:
  """At exit, before jax's own shutdown: every process waits for the others to reach their exit
  (the recoverable service skips jax's shutdown barrier), still watched (a peer lost meanwhile
  is one line); then process 0, which hosts the service, waits for the others to disconnect."""
  try:
    client.wait_at_barrier("fastpos_exit", shutdown_timeout_s * 1000)
  except Exception as e:  # pylint: disable=broad-except  # a peer late past the timeout
    _WATCH_STOP.set()
    logging.warning(
        "jax.distributed: the other processes did not reach their exit within "
        "--shutdown_timeout=%d s (%s)",
        shutdown_timeout_s,
        " ".join(str(e).split()),
    )
    return
  _WATCH_STOP.set()
  if jax.process_index() != 0:
    return
  nodes, deadline = list(range(num_processes)), time.monotonic() + shutdown_timeout_s
  with contextlib.suppress(Exception):
    while len(client.get_live_nodes(nodes)) > 1 and time.monotonic() < deadline:
      time.sleep(0.05)


class _ServiceProcess:
  """The distributed service in its own process (``coordinator_service``); jax holds this as
  its ``service`` and calls ``shutdown`` at exit."""

  def __init__(self, bind_address: str, num_processes: int, heartbeat_s: int, shutdown_s: int):
    self._shutdown_s = shutdown_s
    self._proc = subprocess.Popen(
        [
            sys.executable,
            str(Path(coordinator_service.__file__)),
            bind_address,
            str(num_processes),
            str(heartbeat_s),
            str(shutdown_s),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a signal to process 0's group must not end the service
    )
    line = self._proc.stdout.readline().strip()
    if line != coordinator_service.READY:
      self._proc.wait()
      raise RuntimeError(
          line.removeprefix("error: ") or f"the service exited with code {self._proc.returncode}"
      )

  def shutdown(self) -> None:
    with contextlib.suppress(OSError, ValueError):  # already gone
      self._proc.stdin.write(coordinator_service.STOP + "\n")
      self._proc.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
      self._proc.wait(self._shutdown_s)


@contextlib.contextmanager
def _service_in_own_process(s: Settings) -> Iterator[None]:
  """While entered, the service jax starts in process 0 is a ``_ServiceProcess``."""
  # jax keeps its service private; without this hook the service stays inside process 0.
  from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel

  native = getattr(jax_distributed, "_jax", None)
  if native is None or not hasattr(native, "get_distributed_runtime_service"):
    logging.warning(
        "jax's distributed service cannot be started apart: the loss of process 0 ends "
        "the others through jax's own fatal error."
    )
    yield
    return

  class Native:

    def __getattr__(self, name):
      return getattr(native, name)

    @staticmethod
    def get_distributed_runtime_service(address, num_processes, **_):
      return _ServiceProcess(address, num_processes, s.heartbeat_timeout_s, s.shutdown_timeout_s)

  jax_distributed._jax = Native()  # pylint: disable=protected-access
  try:
    yield
  finally:
    jax_distributed._jax = native  # pylint: disable=protected-access


# (num_processes, heartbeat_timeout_s) of the watched run; None: no watcher runs.
_WATCHED: tuple[int, int] | None = None
# What a collective says when the connection to another process broke (gloo over TCP).
_LOST_CONNECTION = ("Gloo", "gloo", "Connection reset by peer", "Connection closed by peer")


def as_peer_lost(e: BaseException) -> BaseException:
  """``e`` itself, or, when it is a collective that failed because another process is gone, a
  ``PeerLostError``: first the main thread waits for the watcher, which ends the process with
  its one line naming the lost process (exit ``EXIT_PEER_LOST``)."""
  if _WATCHED is None or not any(t in str(e) for t in _LOST_CONNECTION):
    return e
  num_processes, heartbeat_s = _WATCHED
  _WATCH_STOP.wait(heartbeat_s + coordinator_service.LINGER_AFTER_HEARTBEAT_S)
  text = " ".join(str(e).split())[:200]
  return PeerLostError(
      f"a collective with the other processes failed ({text}) but the distributed "
      f"service still lists all {num_processes}; stopping this process too (exit code "
      f"{EXIT_PEER_LOST}). Check the others' logs and the network, then start all "
      f"{num_processes} processes again to resume from the last checkpoint."
  )


def _start_watch(num_processes: int, s: Settings) -> None:
  # jax keeps its client private; without it the run keeps jax's own fatal error.
  from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel

  client = getattr(getattr(jax_distributed, "global_state", None), "client", None)
  if client is None or not all(hasattr(client, m) for m in ("get_live_nodes", "wait_at_barrier")):
    logging.warning(
        "jax's distributed client is not reachable: a lost process ends the others "
        "through jax's own fatal error."
    )
    return
  global _WATCHED
  _WATCHED = (num_processes, s.heartbeat_timeout_s)
  _WATCH_STOP.clear()
  # Runs before jax's own exit handler (registered earlier, so run later) shuts down.
  atexit.register(_exit_together, client, num_processes, s.shutdown_timeout_s)
  threading.Thread(
      target=_watch_peers,
      args=(client, num_processes, s.heartbeat_timeout_s),
      name="fastpos-peer-watch",
      daemon=True,
  ).start()


def initialize(holders: Flags | None = None, environ: Mapping[str, str] | None = None) -> None:
  """Joins the run's other processes (module docstring); a single process does nothing.
  Must run before anything touches the devices."""
  s = settings(holders, environ)
  if jax.distributed.is_initialized():
    return
  cluster = None
  if s.num_processes is None:
    cluster = detected_cluster()
    if cluster is None:
      return
  elif s.num_processes == 1 and s.coordinator_address is None:
    return
  # CPU collectives across processes need an implementation (jax's default is gloo; an
  # explicit "none" would make every cross-process step fail).
  if jax.config.jax_cpu_collectives_implementation is None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # A lost task is then reported to the watchers (``_watch_peers``) rather than aborting all.
  jax.config.update("jax_enable_recoverability", True)
  what = (
      f"{cluster} cluster"
      if cluster
      else f"process {s.process_id} of {s.num_processes}, coordinator {s.coordinator_address}"
  )
  logging.info(
      "jax.distributed: joining (%s; waiting up to %d s for the others)",
      what,
      s.initialization_timeout_s,
  )
  # jax aborts the process (a C++ fatal error and a dump of every thread) when the others do
  # not join in time; this says why in one line, first.
  message = (
      f"{what}: the processes did not all join within --initialization_timeout="
      f"{s.initialization_timeout_s} s. Start all {s.num_processes or 'of the'} "
      "processes with the same coordinator address and process count, each with its "
      "own process id (0 hosts the coordinator), and check that the address is "
      "reachable and its port free."
  )
  watchdog = threading.Timer(s.initialization_timeout_s, _stop, (message,))
  watchdog.daemon = True
  watchdog.start()
  try:
    with _service_in_own_process(s):
      _initialize(s, cluster)
  except Exception as e:  # pylint: disable=broad-except  # e.g. the port is taken
    text = " ".join(str(e).split())[:300]
    raise DistributedError(
        f"{what}: jax.distributed.initialize failed ({text}); check the "
        "coordinator address and that its port is free."
    ) from None
  finally:
    watchdog.cancel()
  logging.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
  _start_watch(jax.process_count(), s)


def _initialize(s: Settings, cluster: str | None) -> None:
  if cluster:
    jax.distributed.initialize(
        initialization_timeout=s.initialization_timeout_s + 5,
        heartbeat_timeout_seconds=s.heartbeat_timeout_s,
        shutdown_timeout_seconds=s.shutdown_timeout_s,
    )
  else:
    jax.distributed.initialize(
        s.coordinator_address,
        s.num_processes,
        s.process_id,
        initialization_timeout=s.initialization_timeout_s + 5,
        heartbeat_timeout_seconds=s.heartbeat_timeout_s,
        shutdown_timeout_seconds=s.shutdown_timeout_s,
    )
