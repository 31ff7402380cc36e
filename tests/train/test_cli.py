"""train.py and eval.py as a user runs them: SIGTERM saves and exits cleanly, eval.py scores
the saved workdir and writes results_test.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import FAST_COMPILE_FLAGS
from tests.train import forked

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "--config=configs/synthetic.py:tiny"
# The runs compile a tiny model: the fast compile flags (the test is about signals and files).
ENV = {**os.environ, "XLA_FLAGS": FAST_COMPILE_FLAGS}


# Slow; the default run keeps a signal stop (tests/train/test_signals.py) and eval.py
# (tests/train/test_eval_program.py).
@pytest.mark.slow
def test_sigterm_saves_and_eval_scores_the_workdir(tmp_path):
  workdir = tmp_path / "run"
  train = subprocess.Popen(
      [
          sys.executable,
          "train.py",
          CONFIG,
          f"--workdir={workdir}",
          "--config.num_train_steps=100000",
          "--config.log_every_steps=1",
          "--config.eval_every_steps=100000",
          "--config.checkpoint_every_steps=100000",
      ],
      cwd=ROOT,
      env=ENV,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
  )
  metrics = workdir / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and train.poll() is None:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
      break
    time.sleep(0.2)
  assert train.poll() is None, train.communicate()[0][-3000:]
  train.send_signal(signal.SIGTERM)
  log, _ = train.communicate(timeout=300)
  assert train.returncode == 75, log[-3000:]  # errors.EXIT_PREEMPTED: restart to continue
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert len(steps) == 1 and 3 <= steps[0] < 100000, steps
  step = steps[0]
  assert f"preempted at step {step} (SIGTERM): saved" in log
  assert "restart to continue" in log and "Traceback" not in log
  (data,) = (workdir / "checkpoints" / str(step) / "data").glob("*.json")
  assert json.loads(data.read_text()) == {"next_index": step}  # the data position
  assert json.loads((workdir / "config.json").read_text())["task"]["name"] == "synthetic"
  assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))

  ev = subprocess.run(
      [sys.executable, "eval.py", CONFIG, f"--workdir={workdir}"],
      cwd=ROOT,
      env=ENV,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert ev.returncode == 0, ev.stderr[-3000:]
  results = json.loads((workdir / "results_test.json").read_text())
  # No evaluation ran before SIGTERM, so there is no best checkpoint: the latest is scored.
  assert results["split"] == "test" and results["step"] == step
  assert results["checkpoint"] == "latest" and results["num_examples"] == 50
  assert 0.0 <= results["accuracy"] <= 1.0


@pytest.fixture(scope="module")
def startups(tmp_path_factory):
  """train.py command lines that stop at start-up, run in one driver (tests/train/forked.py):
  {name: (result, workdir)}."""
  base = tmp_path_factory.mktemp("cli")
  commands = {
      "print_config": (
          [CONFIG, "--config.seed=1234", "--config.model.kernel=sikf", "--print_config"],
          base / "run",
      ),
      # No --workdir needed; a bad override still fails with its message.
      "print_config_bad": ([CONFIG, "--config.no_such_field=1", "--print_config"], None),
      "bad_config": ([CONFIG, "--config.task.name=cifar"], base / "bad"),
  }
  runs = [
      forked.Command("train.py", args + ([f"--workdir={w}"] if w else []))
      for args, w in commands.values()
  ]
  results = forked.run_all(runs, base / "outputs", {})
  return {name: (r, w) for (name, (_, w)), r in zip(commands.items(), results)}


def test_print_config_prints_the_resolved_config_and_writes_nothing(startups):
  proc, workdir = startups["print_config"]
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "seed: 1234" in proc.stdout.splitlines()
  assert "  kernel: sikf" in proc.stdout.splitlines() and "name: synthetic" in proc.stdout
  assert not workdir.exists()
  proc, _ = startups["print_config_bad"]
  assert proc.returncode == 2 and "no_such_field" in proc.stderr


def test_train_cli_stops_on_bad_config(startups):
  proc, _ = startups["bad_config"]
  assert proc.returncode != 0
  assert "config.task.name must be one of synthetic, listops" in proc.stderr
