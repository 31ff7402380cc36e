"""train.py stopped by SIGINT / SIGTERM at any instant (``fastpos.interrupts``).

Each case starts ``train.py`` on a tiny run (a checkpoint every step, an evaluation every three)
and sends one signal, or two 50 ms apart, a random time after a moment of the run: the program
having taken over the signals (its first line), the task line (the workdir held), the train
step's compilation, its end, a training step, the eval step's compilation, a validation line,
the run's last line. The instants come from a seeded RNG; the default run holds two of the three
cases a reviewer saw go wrong, the ``slow`` run the third and 24 more.

Each case asserts: the exit code is 130 for SIGINT, 75 for SIGTERM (or 0 when the run's last
line was printed before: the signal came after the end); never a crash (-11, 139, "Fatal Python
error"), never a traceback; the last line on stderr is the program's one message, and what it
says of the checkpoints is true (``no checkpoint yet``: none there; ``the newest checkpoint is
step N``: N is the newest step folder, and it restores and matches its digests).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fastpos import interrupts
from fastpos.train import errors
from fastpos.train.workdir import Workdir

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "--config=configs/synthetic.py:tiny",
    "--config.num_train_steps=6",
    "--config.eval_every_steps=3",
    "--config.checkpoint_every_steps=1",
    "--config.log_every_steps=1",
    "--config.keep_checkpoints=2",
]
# Moments of a run, as the text of the stderr line that marks them ("" for the program's first
# line: its signal handlers are in place).
MOMENTS = (
    "",
    "] task synthetic:",
    "compiling the train step",
    "compiled the train step",
    "] step 2/6",
    "] step 4/6",
    "compiling the eval step",
    "step 3 validation:",
    "; test: python eval.py",
)
LAST_LINE = "; test: python eval.py"  # in the run's last line (trainer.summary_line)
NEWEST = re.compile(r"the newest checkpoint is step (\d+) in (\S+);")
NONE_YET = re.compile(r"no checkpoint yet in (\S+);")


def _catches_sigterm(pid: int) -> bool:
  """Whether the process has a handler for SIGTERM (``interrupts.install`` has run)."""
  try:
    status = Path(f"/proc/{pid}/status").read_text()
  except OSError:
    return False
  caught = int(re.search(r"SigCgt:\s*([0-9a-f]+)", status).group(1), 16)
  return bool(caught & (1 << (signal.SIGTERM - 1)))


class _Run:
  """``train.py`` in a subprocess, its stderr read line by line as it comes."""

  def __init__(self, workdir: Path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    self.proc = subprocess.Popen(
        [sys.executable, "train.py", *ARGS, f"--workdir={workdir}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    self.lines: list[str] = []
    self.changed = threading.Condition()
    self.stdout = ""
    self._readers = [
        threading.Thread(target=self._read_stderr, daemon=True),
        threading.Thread(target=self._read_stdout, daemon=True),
    ]
    for t in self._readers:
      t.start()

  def _read_stderr(self) -> None:
    for line in self.proc.stderr:
      with self.changed:
        self.lines.append(line.rstrip("\n"))
        self.changed.notify_all()
    with self.changed:
      self.changed.notify_all()

  def _read_stdout(self) -> None:
    self.stdout = self.proc.stdout.read()

  def wait_for(self, moment: str, timeout: float = 300) -> bool:
    """Waits until ``moment`` (MOMENTS); False when the run ended before it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        return False
      if moment == "":
        if _catches_sigterm(self.proc.pid):
          return True
        time.sleep(0.005)
        continue
      with self.changed:
        if any(moment in line for line in self.lines):
          return True
        self.changed.wait(0.05)
    raise AssertionError(f"no {moment!r} within {timeout} s:\n" + "\n".join(self.lines[-20:]))

  def finish(self) -> tuple[int, str]:
    code = self.proc.wait(timeout=300)
    for t in self._readers:
      t.join(timeout=60)
    return code, "\n".join(self.lines)


def _check_claim(line: str, workdir: Path) -> None:
  """What the stop line says of the checkpoints holds on disk (a line written before the
  program read --workdir says nothing of them)."""
  if "checkpoint" not in line:
    return
  folder = workdir.absolute() / "checkpoints"
  steps = (
      sorted(int(p.name) for p in folder.glob("*") if p.name.isdigit()) if folder.is_dir() else []
  )
  newest, none_yet = NEWEST.search(line), NONE_YET.search(line)
  assert newest or none_yet, line
  if none_yet:
    assert Path(none_yet.group(1)) == folder, line
    assert steps == [], (line, steps)
    return
  step = int(newest.group(1))
  assert Path(newest.group(2)) == folder, line
  assert steps and steps[-1] == step, (line, steps)
  restored = Workdir(workdir).restore(None, step)
  assert restored.verified and restored.step == step


def _case(tmp_path: Path, signum: int, times: int, moment: str, delay: float) -> None:
  workdir = tmp_path / "run"
  run = _Run(workdir)
  try:
    sent = run.wait_for(moment)
    if sent:
      time.sleep(delay)
      for i in range(times):
        if i:
          time.sleep(0.05)
        run.proc.send_signal(signum)
  finally:
    if run.proc.poll() is None and not sent:
      run.proc.kill()
  code, err = run.finish()
  case = f"{signal.Signals(signum).name} x{times}, {delay:.2f} s after {moment!r}"
  out = f"{case}: exit {code}\n{err[-5000:]}"
  assert sent, out
  assert "Traceback" not in err and "Fatal Python error" not in err, out
  assert code not in (-11, 139, 1), out
  finished = any(LAST_LINE in line for line in err.splitlines())
  name = signal.Signals(signum).name
  # After the run's last line the signal may come too late to matter: exit 0.
  assert code in ((errors.EXIT_OK,) if finished else ()) + (interrupts.EXIT_CODES[name],), out
  lines = [line for line in err.splitlines() if line.strip()]
  messages = [line for line in lines if line.startswith("train.py: ")]
  if code == errors.EXIT_OK:
    assert not messages, out
    return
  assert len(messages) == 1 and lines[-1] == messages[0], out
  assert name in messages[0], out
  _check_claim(messages[0], workdir)


# (signal, how many, moment, delay in s): the cases seen to go wrong before (a second Ctrl-C just
# after compilation crashed; a Ctrl-C after the task line was swallowed; SIGTERM before training
# exited 143).
DEFAULT_CASES = [
    (signal.SIGINT, 2, "compiled the train step", 0.05),
    (signal.SIGINT, 1, "] task synthetic:", 0.0),
    (signal.SIGTERM, 1, "", 0.2),
]


def _random_cases(n: int, seed: int = 0) -> list[tuple[int, int, str, float]]:
  rng = random.Random(seed)
  return [
      (
          rng.choice((signal.SIGINT, signal.SIGTERM)),
          rng.choice((1, 2)),
          rng.choice(MOMENTS),
          round(rng.uniform(0.0, 0.8), 2),
      )
      for _ in range(n)
  ]


def _id(case) -> str:
  signum, times, moment, delay = case
  return f"{signal.Signals(signum).name}x{times}-{delay}s-after-{moment.strip('] ;') or 'start'}"


pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads signal masks from /proc"
)


# The second Ctrl-C runs with `-m slow`; the default run keeps one Ctrl-C and a SIGTERM.
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=_id(c), marks=pytest.mark.slow if c[1] == 2 else ())
        for c in DEFAULT_CASES
    ],
)
def test_a_signal_stops_train_py_with_its_code_and_one_true_line(case, tmp_path):
  _case(tmp_path, *case)


@pytest.mark.slow
@pytest.mark.parametrize("case", _random_cases(24), ids=map(_id, _random_cases(24)))
def test_signals_at_random_instants(case, tmp_path):
  _case(tmp_path, *case)
