"""One run as several processes (``scripts/launch_local.sh``, ``fastpos.train.distributed``),
as a user starts it: real train.py / eval.py processes on simulated CPU devices.

* 2 processes x 2 devices log the metrics of 1 process x 4 devices, row by row;
* their checkpoint resumes on 1 process with 1 device (2 and 4 devices: slow), and on 2
  processes again, to the rows of the uninterrupted run, and eval.py on 1 device scores it as
  the run did;
* a process killed with SIGKILL mid-run stops the other within a bounded time;
* bad launch settings stop with one line before any compute; the launcher stops the rest when
  one process fails and forwards signals.

Every run is the tiny ListOps config for 6 steps with a constant learning rate, so that a run
stopped at step 4 and resumed to 6 follows the uninterrupted run's schedule.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastpos.train import distributed, errors, launches

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = str(ROOT / "scripts" / "launch_local.sh")
STEPS = 6
# Adam's eps is raised from 1e-9: a zero-gradient bias gets round-off that depends on the
# reduction order (the device count), which a tiny eps turns into full-size updates.
ARGS = (
    "--config=configs/listops_generated.py:tiny",
    f"--config.num_train_steps={STEPS}",
    "--config.log_every_steps=1",
    "--config.eval_every_steps=2",
    "--config.checkpoint_every_steps=2",
    "--config.schedule.name=constant",
    "--config.optimizer.eps=1e-4",
    "--heartbeat_timeout=10",
    "--shutdown_timeout=30",
)
TIMEOUT_S = 420  # any one run; nothing here may hang
TIMING = ("time", "steps_per_second", "tokens_per_second")
# XLA's CPU backend compiles these tiny programs faster without its LLVM optimizations;
# every run here uses the same flags, and the comparisons allow for round-off.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _env(devices: int | None = None, **extra: str) -> dict[str, str]:
  # No JAX_ settings from the caller but the shared compilation cache (tests/conftest.py).
  env = {
      k: v
      for k, v in os.environ.items()
      if not k.startswith("JAX_") or k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
  }
  env.update(PYTHONPATH=str(ROOT), PYTHON=sys.executable, XLA_FLAGS=FAST_COMPILE, **extra)
  if devices is not None:
    env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
  return env


def _start_launch(n: int, devices: int, *args: str, grace_s: int = 10) -> subprocess.Popen:
  return subprocess.Popen(
      [LAUNCH, str(n), "--", "train.py", *args],
      cwd=ROOT,
      env=_env(DEVICES_PER_PROCESS=str(devices), GRACE_S=str(grace_s)),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True,
  )


def _start(script: str, devices: int, *args: str) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, script, *args],
      cwd=ROOT,
      env=_env(devices),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True,
  )


def _kill(proc: subprocess.Popen) -> str:
  """Kills ``proc`` and, for the launcher, its processes (each leads its own group)."""
  for pid in _children(proc.pid, all_children=True).values():
    with contextlib.suppress(ProcessLookupError):
      os.killpg(pid, signal.SIGKILL)
  with contextlib.suppress(ProcessLookupError):
    os.killpg(proc.pid, signal.SIGKILL)
  return proc.communicate()[0]


def _finish(proc: subprocess.Popen, what: str, code: int = 0) -> str:
  try:
    out, _ = proc.communicate(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    out = _kill(proc)
    pytest.fail(f"{what} still running after {TIMEOUT_S} s:\n{out[-4000:]}")
  assert proc.returncode == code, f"{what}: exit {proc.returncode}\n{out[-4000:]}"
  return out


def _rows(workdir: Path) -> dict[tuple[int, str], dict[str, float]]:
  rows = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    key = (row.pop("step"), row.pop("split"))
    rows[key] = {k: v for k, v in row.items() if k not in TIMING}
  return rows


def _assert_rows_close(got: dict, want: dict, keys) -> None:
  for key in keys:
    assert key in got and key in want, (key, sorted(got), sorted(want))
    assert got[key].keys() == want[key].keys(), key
    for name, value in want[key].items():
      assert got[key][name] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A run of 2 processes x 2 devices stopped at step 4 ("two_proc"), and the uninterrupted
  6-step run of 1 process x 4 devices ("reference"), started together."""
  root = tmp_path_factory.mktemp("multiprocess")
  two, ref = root / "two_proc", root / "reference"
  launch = _start_launch(2, 2, *ARGS, f"--workdir={two}", "--config.num_train_steps=4")
  single = _start("train.py", 4, *ARGS, f"--workdir={ref}")
  log = _finish(launch, "2-process run")
  _finish(single, "1-process reference run")
  return {"root": root, "two_proc": two, "reference": ref, "log": log}


def test_two_processes_log_what_one_process_logs(runs):
  got, want = _rows(runs["two_proc"]), _rows(runs["reference"])
  keys = [(s, "train") for s in range(1, 5)] + [(2, "validation"), (4, "validation")]
  assert sorted(got) == sorted(keys)
  _assert_rows_close(got, want, keys)
  config = json.loads((runs["two_proc"] / "config.json").read_text())
  assert config["num_train_steps"] == 4
  # Process 0 writes the logs; every process writes its own log file through the launcher.
  logs = runs["two_proc"] / "launch_logs"
  assert sorted(p.name for p in logs.iterdir()) == ["process_0.log", "process_1.log"]
  assert (
      "4 devices (mesh {'data': 4, 'model': 1}), 2 process(es)"
      in (runs["two_proc"] / "train.log").read_text()
  )
  (launch,) = launches.read(runs["two_proc"])  # one line for the run, not one per process
  assert launch["processes"] == 2 and launch["devices"]["count"] == 4
  assert launch["mesh"] == {"data": 4, "model": 1} and launch["first_step"] == 1


def _resume_rows(runs, name: str, proc: subprocess.Popen, what: str) -> None:
  out = _finish(proc, what)
  workdir = runs["root"] / name
  assert "resumed from" in (workdir / "train.log").read_text(), out[-3000:]
  keys = [(5, "train"), (6, "train"), (6, "validation")]
  got = _rows(workdir)
  assert sorted(k for k in got if k[0] > 4) == sorted(keys)
  _assert_rows_close(got, _rows(runs["reference"]), keys)


# The default run resumes on one device (every array gathered from two processes onto one) and
# scores the checkpoint with eval.py there; 2 and 4 devices are the same path with other meshes.
@pytest.mark.parametrize(
    "devices", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)]
)
def test_two_process_checkpoint_resumes_on_another_layout(runs, devices):
  workdir = runs["root"] / f"resume_{devices}"
  shutil.copytree(runs["two_proc"], workdir)
  proc = _start("train.py", devices, *ARGS, f"--workdir={workdir}")
  evaluation = None
  if devices == 1:
    evaluation = _start(
        "eval.py", 1, f"--workdir={runs['two_proc']}", "--split=validation", "--checkpoint=latest"
    )
  _resume_rows(runs, f"resume_{devices}", proc, f"resume on 1 process x {devices} devices")
  if evaluation is None:
    return
  out = _finish(evaluation, "eval.py on 1 device")
  results = json.loads(out[out.index("{") : out.rindex("}") + 1])
  own = _rows(runs["two_proc"])[(4, "validation")]
  assert results["step"] == 4 and results["split"] == "validation"
  for name in ("loss", "accuracy", "num_examples"):
    assert results[name] == pytest.approx(own[name], rel=1e-5, abs=1e-6), name


# `-m slow`: the default run resumes the two processes' checkpoint on one process
# (test_two_process_checkpoint_resumes_on_another_layout) and runs two processes (the fixture).
@pytest.mark.slow
def test_restarting_both_processes_resumes_exactly(runs):
  # Started by hand with the flags (the launcher uses the environment variables).
  workdir = runs["root"] / "restart_two"
  shutil.copytree(runs["two_proc"], workdir)
  address = f"--coordinator_address=localhost:{_free_port()}"
  procs = [
      _start(
          "train.py",
          2,
          *ARGS,
          f"--workdir={workdir}",
          address,
          "--num_processes=2",
          f"--process_id={i}",
      )
      for i in (0, 1)
  ]
  try:
    assert "resumed from" in _finish(procs[1], "process 1 of the restart")
    _resume_rows(runs, "restart_two", procs[0], "process 0 of the restart")
  finally:
    for proc in procs:
      if proc.poll() is None:
        _kill(proc)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("", 0))
    return s.getsockname()[1]


def _children(pid: int, all_children: bool = False) -> dict[int, int]:
  """{JAX_PROCESS_ID: pid} of the launcher's processes ({pid: pid} of every child of ``pid``
  with ``all_children``)."""
  out = {}
  for child in subprocess.run(
      ["pgrep", "-P", str(pid)], capture_output=True, text=True
  ).stdout.split():
    if all_children:
      out[int(child)] = int(child)
      continue
    try:
      environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
    except OSError:
      continue
    for item in environ:
      if item.startswith(b"JAX_PROCESS_ID="):
        out[int(item.split(b"=", 1)[1])] = int(child)
  return out


HEARTBEAT_S = 5
KILL_BOUND_S = 60  # the survivor stops HEARTBEAT_S after its peer dies, plus a loaded machine


# Slow; the default run keeps two processes (the `runs` fixture) and a missing peer stopping
# in bounded time (test_bad_flags_stop_before_compute_and_a_missing_peer_in_bounded_time).
@pytest.mark.slow
def test_a_killed_process_stops_the_other_in_bounded_time(tmp_path):
  workdir = tmp_path / "killed"
  # A long run; the launcher's grace (GRACE_S) is longer than the bound, so the survivor
  # must stop by itself (the distributed service misses the dead process's heartbeats).
  launch = _start_launch(
      2,
      2,
      *ARGS,
      f"--workdir={workdir}",
      "--config.num_train_steps=100000",
      f"--heartbeat_timeout={HEARTBEAT_S}",
      "--shutdown_timeout=5",
      grace_s=KILL_BOUND_S * 2,
  )
  try:
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + TIMEOUT_S
    while time.time() < deadline and launch.poll() is None:
      if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
        break
      time.sleep(0.2)
    assert launch.poll() is None, launch.communicate()[0][-4000:]
    pids = _children(launch.pid)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[1], signal.SIGKILL)
    killed = time.time()
    out, _ = launch.communicate(timeout=KILL_BOUND_S)
    took = time.time() - killed
  finally:
    if launch.poll() is None:
      _kill(launch)
  assert launch.returncode == 128 + signal.SIGKILL, out[-4000:]
  assert "process 1 was killed by signal KILL" in out
  assert "stopped: process 1 failed with code 137" in out
  survivor = (workdir / "launch_logs" / "process_0.log").read_text()
  assert "process(es) 1 of 2 stopped answering the distributed service" in survivor, survivor[
      -4000:
  ]
  assert "Traceback" not in survivor and "Check failure" not in survivor, survivor[-4000:]
  assert took < KILL_BOUND_S
  assert subprocess.run(["kill", "-0", str(pids[0])], capture_output=True).returncode != 0


@pytest.mark.slow
def test_a_frozen_process_stops_the_other_with_its_code_and_one_line(tmp_path):
  # Started by hand, so that the survivor's own exit code is seen (not the launcher's).
  address = f"--coordinator_address=localhost:{_free_port()}"
  procs = [
      _start(
          "train.py",
          1,
          *ARGS,
          f"--workdir={tmp_path / 'frozen'}",
          address,
          "--num_processes=2",
          f"--process_id={i}",
          "--config.num_train_steps=100000",
          f"--heartbeat_timeout={HEARTBEAT_S}",
      )
      for i in (0, 1)
  ]
  try:
    metrics = tmp_path / "frozen" / "metrics.jsonl"
    deadline = time.time() + TIMEOUT_S
    while time.time() < deadline and procs[0].poll() is None:
      if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
        break
      time.sleep(0.2)
    assert procs[0].poll() is None, procs[0].communicate()[0][-4000:]
    os.kill(procs[1].pid, signal.SIGSTOP)  # frozen: alive, but no more heartbeats
    frozen = time.time()
    out, _ = procs[0].communicate(timeout=KILL_BOUND_S)
    took = time.time() - frozen
  finally:
    for proc in procs:
      if proc.poll() is None:
        _kill(proc)
  assert procs[0].returncode == errors.EXIT_PEER_LOST, out[-4000:]
  assert out.rstrip().splitlines()[-1] == "train.py: " + distributed.peer_lost_message(
      [1], 2, HEARTBEAT_S
  )
  assert "Traceback" not in out and "Check failure" not in out, out[-4000:]
  assert took < KILL_BOUND_S


# ---------------------------------------------------------------------------------------------
# Settings and the launcher alone (no training)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "environ, needles",
    [
        (
            {"JAX_COORDINATOR_ADDRESS": "localhost:1234"},
            [
                "JAX_COORDINATOR_ADDRESS=localhost:1234 is set",
                "--num_processes (or JAX_NUM_PROCESSES)",
            ],
        ),
        (
            {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
            ["JAX_NUM_PROCESSES=2 is set", "--coordinator_address (or JAX_COORDINATOR_ADDRESS)"],
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "localhost:1234", "JAX_NUM_PROCESSES": "2"},
            ["JAX_NUM_PROCESSES=2 is set", "--process_id (or JAX_PROCESS_ID) is not"],
        ),
        (
            {
                "JAX_COORDINATOR_ADDRESS": "localhost:1234",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": "2",
            },
            ["JAX_PROCESS_ID=2 is out of range", "0..1"],
        ),
        (
            {
                "JAX_COORDINATOR_ADDRESS": "localhost",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": "0",
            },
            ["JAX_COORDINATOR_ADDRESS='localhost' is not HOST:PORT"],
        ),
        (
            {
                "JAX_COORDINATOR_ADDRESS": "localhost:99999",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": "0",
            },
            ["'localhost:99999' is not HOST:PORT", "1..65535"],
        ),
        (
            {
                "JAX_COORDINATOR_ADDRESS": "no-such-host.invalid:1234",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": "0",
            },
            ["host 'no-such-host.invalid' is unknown"],
        ),
        ({"JAX_NUM_PROCESSES": "two"}, ["JAX_NUM_PROCESSES='two' is not an integer"]),
        ({"JAX_NUM_PROCESSES": "0"}, ["JAX_NUM_PROCESSES=0", ">= 1"]),
    ],
)
def test_partial_or_bad_settings_name_the_value(environ, needles):
  with pytest.raises(distributed.DistributedError) as e:
    distributed.settings(environ=environ)
  for needle in needles:
    assert needle in str(e.value)


SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}


def test_clusters_of_several_processes_are_detected(monkeypatch):
  for name in (
      "SLURM_JOB_ID",
      "SLURM_STEP_NODELIST",
      "SLURM_NTASKS",
      "SLURM_PROCID",
      "SLURM_LOCALID",
      "OMPI_MCA_orte_hnp_uri",
  ):
    monkeypatch.delenv(name, raising=False)
  assert distributed.detected_cluster() is None
  for name, value in SLURM.items():
    monkeypatch.setenv(name, value)
  monkeypatch.setenv("SLURM_NTASKS", "1")  # an interactive job: stays one plain process
  assert distributed.detected_cluster() is None
  monkeypatch.setenv("SLURM_NTASKS", "2")
  assert distributed.detected_cluster() == "SlurmCluster"


def test_complete_settings_and_single_process():
  s = distributed.settings(
      environ={
          "JAX_COORDINATOR_ADDRESS": "localhost:1234",
          "JAX_NUM_PROCESSES": "2",
          "JAX_PROCESS_ID": "1",
      }
  )
  assert (s.coordinator_address, s.num_processes, s.process_id) == ("localhost:1234", 2, 1)
  assert distributed.settings(environ={}).num_processes is None
  assert distributed.settings(environ={"JAX_NUM_PROCESSES": "1"}).num_processes == 1


def test_bad_flags_stop_before_compute_and_a_missing_peer_in_bounded_time(tmp_path):
  common = [
      "train.py",
      "--config=configs/listops_generated.py:tiny",
      f"--workdir={tmp_path / 'run'}",
  ]
  bad = subprocess.run(
      [
          sys.executable,
          *common,
          "--num_processes=2",
          "--process_id=2",
          "--coordinator_address=localhost:1234",
      ],
      cwd=ROOT,
      env=_env(),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert bad.returncode == 2, bad.stderr[-3000:]
  assert bad.stderr.strip().splitlines()[-1] == (
      "train.py: --process_id=2 is out of range for --num_processes=2; give each process its "
      "own id in 0..1."
  )
  assert not (tmp_path / "run").exists()
  start = time.time()
  alone = subprocess.run(
      [
          sys.executable,
          *common,
          "--num_processes=2",
          "--process_id=1",
          f"--coordinator_address=localhost:{_free_port()}",
          "--initialization_timeout=3",
      ],
      cwd=ROOT,
      env=_env(),
      capture_output=True,
      text=True,
      timeout=120,
  )
  took = time.time() - start
  assert alone.returncode == 2, alone.stderr[-3000:]
  last = alone.stderr.strip().splitlines()[-1]
  assert last.startswith("train.py: process 1 of 2, coordinator localhost:")
  assert "did not all join within --initialization_timeout=3 s" in last
  assert "Traceback" not in alone.stderr and "Fatal" not in alone.stderr
  assert took < 60  # 3 s of waiting after start-up (imports, config)
  assert not (tmp_path / "run").exists()


def test_launcher_stops_the_rest_when_one_fails_and_forwards_signals(tmp_path):
  # Process 1 fails after 2 s (the others have set their trap by then); the others would run
  # for 100 s.
  script = (
      'trap "echo got $0; exit 75" TERM; echo "$JAX_PROCESS_ID/$JAX_NUM_PROCESSES '
      '$JAX_COORDINATOR_ADDRESS $XLA_FLAGS"; [ "$JAX_PROCESS_ID" = 1 ] && sleep 2 && '
      "exit 3; sleep 100 & wait"
  )
  start = time.time()
  failed = subprocess.run(
      [LAUNCH, "3", f"--log_dir={tmp_path / 'a'}", "--", "bash", "-c", script, "TERM"],
      env=_env(DEVICES_PER_PROCESS="3"),
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert time.time() - start < 30
  assert failed.returncode == 3, failed.stderr
  assert "process 1 exited with code 3; stopping the others" in failed.stderr
  logs = {p.name: p.read_text() for p in (tmp_path / "a").iterdir()}
  assert sorted(logs) == ["process_0.log", "process_1.log", "process_2.log"]
  first = logs["process_2.log"].splitlines()[0]
  assert first.startswith("2/3 localhost:")
  assert first.endswith("--xla_force_host_platform_device_count=3")
  assert "got TERM" in logs["process_0.log"] and "got TERM" in logs["process_2.log"]
  # SIGTERM to the launcher reaches every process; their code (75: saved) is the launcher's.
  launch = subprocess.Popen(
      [
          LAUNCH,
          "2",
          f"--log_dir={tmp_path / 'b'}",
          "--",
          "bash",
          "-c",
          script.replace('[ "$JAX_PROCESS_ID" = 1 ] && sleep 2 && exit 3; ', ""),
          "TERM",
      ],
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
  )
  deadline = time.time() + 30  # until both have set their trap (and said so)
  while (
      time.time() < deadline
      and sum(bool(p.read_text()) for p in (tmp_path / "b").glob("*.log")) < 2
  ):
    time.sleep(0.1)
  launch.send_signal(signal.SIGTERM)
  launch.communicate(timeout=30)
  assert launch.returncode == 75
  for i in (0, 1):
    assert "got TERM" in (tmp_path / "b" / f"process_{i}.log").read_text()


def test_launcher_refuses_bad_arguments():
  for args, needle in (
      (["0", "--", "train.py"], "N=0 is not a number of processes"),
      (["2", "--bogus", "--", "train.py"], "unknown option --bogus"),
      (["2", "train.py"], "then -- and the command (e.g."),
  ):
    proc = subprocess.run([LAUNCH, *args], env=_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and needle in proc.stderr, (args, proc.stderr)


def test_launcher_runs_python_files_with_the_projects_environment(tmp_path):
  venv = ROOT / ".venv" / "bin" / "python"
  if not venv.exists():
    pytest.skip("no .venv in the repository (the launcher then runs python3 from PATH)")
  script = tmp_path / "which.py"
  script.write_text("import sys; print('python:', sys.executable)\n")
  env = {k: v for k, v in _env().items() if k != "PYTHON"}
  proc = subprocess.run(
      [LAUNCH, "1", f"--log_dir={tmp_path / 'logs'}", "--", str(script)],
      env=env,
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert proc.returncode == 0, proc.stderr
  log = (tmp_path / "logs" / "process_0.log").read_text()
  assert f"python: {venv}" in log, log
