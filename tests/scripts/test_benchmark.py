"""Smoke test of scripts/benchmark.py: every mode runs at tiny sizes and writes its outputs.

No timing is asserted (timing lives in the benchmark, never in tests); the test checks that
each mode produces its tables, JSON files with numbers in them, a README section and a
verdict for each of its targets.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts")
sys.path.insert(0, SCRIPTS)

import benchmark  # noqa: E402

# One length for ops, two for the layer sweep, three cells, one model besides the baseline:
# the smallest run that still goes through every code path of each mode.
MODES = {
    "ops": ["--lengths", "16"],
    "layer": ["--lengths", "16", "--cells", "softmax:none,elu1:fastrpb,nprf:kernelized_rpe"],
    "train_step": ["--train-rows", "Linear ELU+1 + FastRPB"],
}
TABLES = {"ops": ["toeplitz_matmul", "toeplitz_matmul_2d", "fastrpb_2d_matmul",
                  "linear_attention"],
          "layer": ["layer_sweep", "layer_cells"], "train_step": ["train_step"]}


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("bench"))


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_runs_and_writes(mode, out_dir, capsys):
  assert benchmark.main([mode, "--smoke", "--out", out_dir] + MODES[mode]) == 0
  printed = capsys.readouterr().out
  platform = benchmark.jax.devices()[0].platform
  for name in TABLES[mode]:
    with open(os.path.join(out_dir, platform, f"{mode}_{name}.json")) as f:
      doc = json.load(f)
    assert doc["rows"], f"{mode}/{name}: empty table"
    assert doc["targets"], f"{mode}/{name}: no targets"
    times = [r["time_s"] for r in _results(doc["data"])]
    assert any(t is not None and t > 0 for t in times), f"{mode}/{name}: nothing was timed"
    mems = [r["memory_bytes"] for r in _results(doc["data"])]
    assert all(m is None or m > 0 for m in mems)
  assert any(f"{verdict}: " in printed for verdict in ("PASS", "FAIL", "NOT MEASURED"))
  with open(os.path.join(out_dir, "README.md")) as f:
    readme = f.read()
  assert f"<!-- benchmark:{platform}:{mode}:start -->" in readme
  assert f"<!-- benchmark:{platform}:{mode}:end -->" in readme


def test_bad_cell_is_refused():
  args = benchmark.resolve(benchmark.parse_args(["layer", "--smoke", "--cells", "elu1:t5_bias"]))
  import bench_models
  with pytest.raises(ValueError, match="not compatible"):
    bench_models.all_cells(args.cells)


def _results(tree):
  """Every Result dict (those with a ``time_s`` key) inside a nested JSON tree."""
  if isinstance(tree, dict):
    if "time_s" in tree:
      yield tree
      return
    for v in tree.values():
      yield from _results(v)
