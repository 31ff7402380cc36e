"""The GPU check (benchmarks.gpu, scripts/gpu_check.sh): bad flags are refused in one line,
the predicted longest N and the goals are computed from what was measured, and ``--smoke``
runs every part on the CPU and writes gpu.md / gpu.json (slow: it compiles the LRA Text step
16 times). No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bad_part_is_refused_in_one_line(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    gpu.main(["--out", str(tmp_path), "--parts", "memory,speed"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "speed" in err and "train_step" in err
  assert not os.listdir(tmp_path)


def test_smoke_never_writes_the_committed_tables(capsys):
  with pytest.raises(SystemExit) as e:
    gpu.main(["--out", gpu.COMMITTED, "--smoke"])
  assert e.value.code == 2
  assert "--smoke" in capsys.readouterr().err


def test_affine_longest():
  # 1 GB at 1000 tokens, 3 GB at 3000: 1 MB per token, so a 10 GB budget holds 10,000 tokens.
  assert gpu._affine_longest((1000, 1e9), (3000, 3e9), 10e9, 1000) == 10_000
  assert gpu._affine_longest((1000, 1e9), (3000, 3e9), 10.5e9, 1000) == 10_000
  assert gpu._affine_longest((1000, 1e9), (3000, 1e9), 10e9, 1000) is None


def _row(remat, scan, chunk, paper_temp, paper_total):
  return {
      "remat": remat,
      "scan_layers": scan,
      "mlp_chunk": chunk,
      "paper_temp_bytes": paper_temp,
      "paper_bytes": paper_total,
  }


def test_memory_goals_read_the_measured_rows():
  part = {
      "paper": (32, 4000),
      "settings": [
          _row("none", False, 0, 20e9, 21e9),
          _row("block", False, 0, 20e9, 21e9),  # not realised: FAIL
          _row("block", True, 2048, 4e9, 5e9),
          {"remat": "none", "scan_layers": True, "mlp_chunk": 0},  # not compiled in time
      ],
  }
  paper, realised = gpu.memory_goals(part)
  assert paper["pass"] and "5.00 GB" in paper["measured"] and "mlp_chunk=2048" in paper["measured"]
  assert not realised["pass"] and realised["measured"].startswith("1.00x")
  part["settings"][1] = _row("block", False, 0, 8e9, 9e9)
  assert gpu.memory_goals(part)[1]["pass"]
  text = gpu.markdown(
      {
          "command": "x",
          "machine": {k: "?" for k in ("device", "host", "python", "jax", "jaxlib")}
          | {"flax": "?", "optax": "?"},
          "date": "today",
          "parts": {"memory": part | {"length": 16384}},
          "goals": gpu.memory_goals(part),
      }
  )
  assert "| none | True | 0 | - |" in text and "| PASS |" in text


@pytest.mark.slow
def test_smoke_runs_every_part(tmp_path):
  out = tmp_path / "gpu"
  proc = subprocess.run(
      ["bash", "scripts/gpu_check.sh", str(out), "--smoke"],
      cwd=ROOT,
      env=os.environ | {"PYTHON": sys.executable, "BUDGET_S": "0"},
      capture_output=True,
      text=True,
      timeout=900,
  )
  assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
  assert sorted(os.listdir(out)) == ["gpu.json", "gpu.md", "gpu_log.txt"]
  result = json.loads((out / "gpu.json").read_text())
  assert set(result["parts"]) == set(gpu.PARTS)
  for name, part in result["parts"].items():
    assert "error" not in part, (name, part)
    # A row that raised is recorded and the part goes on: none may have (a budget may skip).
    raised = {k: e for k, e in part.get("errors", {}).items() if not e.startswith("skipped")}
    assert not raised, (name, raised)
  assert any("paper_bytes" in r for r in result["parts"]["memory"]["settings"])
  assert all(r["time_s"] > 0 for r in result["parts"]["train_step"]["rows"])
  assert "toeplitz (FastRPB product)" in result["parts"]["rpe"]["time"]["32"]
  assert set(result["parts"]["linear"]["batches"]) == {"1", "2"}
  assert result["goals"] and "## Goals" in (out / "gpu.md").read_text()


def test_render_rewrites_the_table_from_the_json(tmp_path):
  # JSON turns the lengths and batches into strings; --render reads them back as ints, so the
  # table and the goals come out as the run wrote them.
  timing = {"kRPE auto": {"ms": 2.0, "vs_softmax": 0.5}, "softmax + bias": {"ms": 4.0}}
  timing["softmax + bias"]["vs_softmax"] = 1.0
  rows = {
      k: {"ms": ms, "gflops": 10.0, "fraction_of_peak": 0.6, "temp_mib": 1.0}
      for k, ms in (("bidirectional", 1.0), ("causal", 2.0), ("causal Performer scan", 4.0))
  }
  result = {
      "command": "x",
      "machine": {k: "?" for k in ("device", "host", "python", "jax", "jaxlib", "flax", "optax")},
      "date": "today",
      "parts": {
          "rpe": {"time": {16384: timing, 2048: timing}, "memory": {}, "errors": {}},
          "linear": {"peak": None, "batches": {8: {4096: {"peak_gflops": 20.0, "rows": rows}}}},
      },
  }
  gpu.write(str(tmp_path), result)
  written = (tmp_path / "gpu.md").read_text()
  (tmp_path / "gpu.md").unlink()
  assert gpu.main(["--render", str(tmp_path / "gpu.json")]) == 0
  assert (tmp_path / "gpu.md").read_text() == written
  assert written.index("| 2048 | kRPE auto") < written.index("| 16384 | kRPE auto")
  assert gpu.load(str(tmp_path / "gpu.json"))["goals"] == result["goals"]


def _rpe_row(auto, fft):
  return {
      "kRPE auto": {"ms": auto, "vs_softmax": auto},
      "kRPE fft": {"ms": fft, "vs_softmax": fft},
      "kRPE dense": {"ms": 0.5, "vs_softmax": 0.5},
      "softmax + bias": {"ms": 1.0, "vs_softmax": 1.0},
  }


def test_rpe_goals_hold_every_n_from_2k_and_a_quarter_at_16k():
  part = {"time": {1024: _rpe_row(3.0, 3.0), 2048: _rpe_row(0.9, 1.1)}, "memory": {}}
  part["time"][16384] = _rpe_row(0.3, 0.2)
  got = {g["goal"]: g for g in gpu.rpe_goals(part)}
  every = [g for k, g in got.items() if "every N >= 2K" in k]
  quarter = [g for k, g in got.items() if "at N = 16K" in k]
  assert [g["pass"] for g in every] == [True, False]  # auto; the FFT path is 1.1x at 2K
  assert [g["pass"] for g in quarter] == [False, True]  # auto 0.30x; FFT 0.20x
  assert "1024" not in every[0]["measured"]  # below 2K: not a goal
  assert gpu.dense_limit_text(part) == "Dense beat the FFT path at N = 1024, 2048."  # not 16K


def test_rpe_memory_goals_by_step_policy():
  lean = {"krpe_mib": 3.0, "toeplitz_mib": 2.0, "ratio": 1.5, "step_channel_mib": 1.0}
  batch = {"krpe_mib": 900.0, "toeplitz_mib": 2.0, "ratio": 450.0, "step_channel_mib": 100.0}
  part = {"time": {}, "memory": {4096: {"causal, CPU steps": lean, "causal, one batch": batch}}}
  steps, one = gpu.rpe_goals(part)
  assert steps["pass"] and "1.50x" in steps["measured"]
  assert not one["pass"] and "9.0x" in one["measured"]  # 900 MiB over 100 MiB of channels


def test_rpe_steps_forces_the_policy_and_restores_it():
  real = gpu.attention._rpe_group
  with gpu.rpe_steps("gpu"):
    assert gpu.attention._rpe_group(1, 4096, 8, 32, 64, 4) == (8, 32)
  assert gpu.attention._rpe_group is real


@pytest.mark.parametrize("flag", ("--rpe-steps", "--softmax-impls"))
def test_measure_only_flags_refuse_bad_lengths(tmp_path, capsys, flag):
  with pytest.raises(SystemExit) as e:
    gpu.main(["--out", str(tmp_path), flag, "2048,x"])
  assert e.value.code == 2
  assert flag in capsys.readouterr().err
  assert not os.listdir(tmp_path)
