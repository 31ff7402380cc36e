"""The loss of process 0, which starts the distributed service, as a user meets it: two real
train.py processes; process 0 is killed (SIGKILL) or frozen (SIGSTOP) mid-run, and process 1
must stop by itself with ``EXIT_PEER_LOST`` and one line: no traceback, no C++ abort.

Also, without training: the service process starts, says why when it cannot, stops on ``stop``
and outlives a process 0 that died just long enough for the others to learn of it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from fastpos.train import coordinator_service, distributed, errors
from tests.train import test_multiprocess as mp

HEARTBEAT_S = 5
ABORT_SIGNS = ("Traceback", "Check failure", "terminate called", "*** ", "Fatal Python error")


def _one_line_exit(out: str, proc: subprocess.Popen) -> None:
  assert proc.returncode == errors.EXIT_PEER_LOST, out[-4000:]
  assert out.rstrip().splitlines()[-1] == "train.py: " + distributed.peer_lost_message(
      [0], 2, HEARTBEAT_S
  ), out[-4000:]
  for sign in ABORT_SIGNS:
    assert sign not in out, (sign, out[-4000:])


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_losing_process_0_stops_the_other_with_its_code_and_one_line(tmp_path, sig):
  address = f"--coordinator_address=localhost:{mp._free_port()}"
  workdir = tmp_path / "run"
  procs = [
      mp._start(
          "train.py",
          1,
          *mp.ARGS,
          f"--workdir={workdir}",
          address,
          "--num_processes=2",
          f"--process_id={i}",
          "--config.num_train_steps=100000",
          f"--heartbeat_timeout={HEARTBEAT_S}",
      )
      for i in (0, 1)
  ]
  try:
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + mp.TIMEOUT_S
    while time.time() < deadline and procs[1].poll() is None:
      if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
        break
      time.sleep(0.2)
    assert procs[1].poll() is None, procs[1].communicate()[0][-4000:]
    os.kill(procs[0].pid, sig)
    lost = time.time()
    out, _ = procs[1].communicate(timeout=mp.KILL_BOUND_S)
    took = time.time() - lost
  finally:
    for proc in procs:
      if proc.poll() is None:
        mp._kill(proc)
  _one_line_exit(out, procs[1])
  assert took < mp.KILL_BOUND_S


def _service(port: int, heartbeat_s: int = 1) -> subprocess.Popen:
  proc = subprocess.Popen(
      [sys.executable, coordinator_service.__file__, f"[::]:{port}", "2", str(heartbeat_s), "5"],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,
      text=True,
  )
  assert proc.stdout.readline().strip() == coordinator_service.READY
  return proc


# Slow (processes); the default run keeps a lost peer (test_a_broken_collective_waits_for_the_...).
@pytest.mark.slow
def test_service_process_stops_on_stop_and_lingers_when_process_0_dies():
  port = mp._free_port()
  proc = _service(port)
  proc.stdin.write(coordinator_service.STOP + "\n")
  proc.stdin.close()
  assert proc.wait(timeout=30) == 0
  proc = _service(port)
  start = time.monotonic()
  proc.stdin.close()  # process 0 died: no "stop"
  assert proc.wait(timeout=60) == 0
  assert time.monotonic() - start >= 1 + coordinator_service.LINGER_AFTER_HEARTBEAT_S - 0.5


def test_service_process_says_why_it_cannot_start():
  taken = socket.socket()
  taken.bind(("", 0))
  taken.listen()
  with (
      taken,
      subprocess.Popen(
          [
              sys.executable,
              coordinator_service.__file__,
              f"[::]:{taken.getsockname()[1]}",
              "2",
              "1",
              "5",
          ],
          stdin=subprocess.PIPE,
          stdout=subprocess.PIPE,
          stderr=subprocess.DEVNULL,
          text=True,
      ) as proc,
  ):
    line = proc.stdout.readline()
    assert proc.wait(timeout=60) == 1
  assert line.startswith("error: ") and "RPC server" in line, line


def test_a_broken_collective_waits_for_the_watcher_then_is_a_lost_peer(monkeypatch):
  plain = ValueError("bad value")
  assert distributed.as_peer_lost(plain) is plain  # no run of several processes
  monkeypatch.setattr(distributed, "_WATCHED", (2, 1))
  monkeypatch.setattr(coordinator_service, "LINGER_AFTER_HEARTBEAT_S", 0)
  assert distributed.as_peer_lost(plain) is plain  # not a collective
  gloo = ValueError("UNKNOWN: Gloo AllReduce failed: Read error: Connection reset by peer")
  start = time.monotonic()
  lost = distributed.as_peer_lost(gloo)
  assert time.monotonic() - start >= 0.9  # the watcher had its heartbeat to name the process
  assert isinstance(lost, errors.PeerLostError) and lost.exit_code == errors.EXIT_PEER_LOST
  assert "Gloo AllReduce failed" in str(lost) and "all 2" in str(lost)
