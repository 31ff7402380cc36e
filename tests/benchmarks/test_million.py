"""``python -m benchmarks million``: its flags, and its run path at a small N.

The slow test runs the benchmark as a user does (a subprocess: the simulated device count is
set before JAX starts) with ``--run=always`` at N = 256, on one device (``--seq=1``, the GPU
form) and over two simulated devices (the ring), and checks that the record holds what a run
at the full N reports: the device kind, the state's init time, the step time, the loss (finite)
and the peak resident memory. No timing or memory figure is asserted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import million
from tests.helpers import FAST_COMPILE_FLAGS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--seq=0"], "--seq=0 must be >= 1"),
        (["--length=1000", "--seq=3"], "--seq=3 must be >= 1 and divide --length=1000"),
        (["--positions=nope"], "unknown variant 'nope'"),
        (["--attn_chunk=a"], "--attn_chunk='a': give ints"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(argv, match, capsys):
  assert million.main(argv) == 2
  err = capsys.readouterr().err
  assert match in err and err.count("\n") == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("seq", [1, 2])
def test_run_always_records_time_loss_and_memory(seq, tmp_path):
  env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=FAST_COMPILE_FLAGS)
  env.pop("JAX_PLATFORMS", None)
  argv = [
      "--length=256",
      f"--seq={seq}",
      "--layers=2",
      "--positions=learned",
      "--remat=block",
      "--mlp_chunk=64",
      "--attn_chunk=64",
      "--breakdown=0",
      "--run=always",
      f"--out={tmp_path}",
  ]
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.million", *argv],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]  # 0: within the 2.5 GiB budget
  record = json.loads((tmp_path / "million.json").read_text())
  run = record["run"]
  assert run["init_s"] > 0 and run["step_s"] > 0 and run["peak_rss"] > 2**20
  assert math.isfinite(run["metrics"]["loss"]) and run["metrics"]["loss"] > 0
  assert record["device"] == {"platform": "cpu", "kind": "cpu"}
  table = (tmp_path / "million.md").read_text()
  where = "on one device (mesh.seq = 1, no ring)" if seq == 1 else "over mesh.seq = 2 devices"
  assert where in table and "ran once: step" in table and "loss" in table
