"""Smoke test of ``python -m benchmarks speed`` (benchmarks.speed): every speed mode runs at
tiny sizes and writes its outputs; a run without --out leaves the committed tables in
benchmarks/ untouched; its figures name batch, dtype and machine.

No timing is asserted (timing lives in the benchmark, never in tests); the test checks that
each mode produces its tables, JSON files with numbers in them, a README section and a
verdict for each of its targets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import pytest

from benchmarks import measure as bm
from benchmarks import models as bench_models
from benchmarks import speed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One length for ops, two for the layer sweep, three cells, one model besides the baseline:
# the smallest run that still goes through every code path of each mode.
MODES = {
    "ops": ["--lengths", "16"],
    "layer": ["--lengths", "16", "--cells", "softmax:none,elu1:fastrpb,nprf:kernelized_rpe"],
    "train_step": ["--train-rows", "Linear ELU+1 + FastRPB"],
}
TABLES = {
    "ops": ["toeplitz_matmul", "toeplitz_matmul_2d", "fastrpb_2d_matmul", "linear_attention"],
    "layer": ["layer_sweep", "layer_cells"],
    "train_step": ["train_step"],
}


def _snapshot(folder):
  """{relative path: bytes} of every file under ``folder``."""
  out = {}
  for dirpath, _, files in os.walk(folder):
    for name in files:
      path = os.path.join(dirpath, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, folder)] = f.read()
  return out


# Slow (a benchmark program per mode); the default run keeps its flag checks
# (test_bad_input_is_one_message_before_any_compute).
@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_mode_runs_and_writes(mode, tmp_path, monkeypatch, capsys):
  # ops runs as a user types it, without --out: the output goes to a new temporary folder
  # (printed) and the committed tables stay as they are. The committed folder is stood in for
  # by a copy, so a regression cannot touch the real one; the real one is checked too.
  if mode == "ops":
    real = _snapshot(speed.COMMITTED)
    assert "README.md" in real
    committed = tmp_path / "committed"
    shutil.copytree(speed.COMMITTED, committed)
    monkeypatch.setattr(speed, "COMMITTED", str(committed))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.mkdir(tmp_path / "tmp")
    assert speed.main(["--mode", mode, "--smoke"] + MODES[mode]) == 0
    assert _snapshot(committed) == real and _snapshot(speed.COMMITTED) == real
    (name,) = os.listdir(tmp_path / "tmp")
    out_dir = str(tmp_path / "tmp" / name)
  else:
    out_dir = str(tmp_path)
    assert speed.main(["--mode", mode, "--smoke", "--out", out_dir] + MODES[mode]) == 0
  printed = capsys.readouterr().out
  platform = speed.jax.devices()[0].platform
  assert f"output under {os.path.join(out_dir, platform)}" in printed
  for name in TABLES[mode]:
    with open(os.path.join(out_dir, platform, f"{mode}_{name}.json")) as f:
      doc = json.load(f)
    with open(os.path.join(out_dir, platform, f"{mode}_{name}.md")) as f:
      assert f.read().startswith(f"#### {doc['title']}\n\n| ")
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


def test_committed_tables_only_on_request(monkeypatch, capsys):
  monkeypatch.setattr(speed, "COMMITTED", "/nonexistent/benchmarks")
  assert speed.parse_args(["--mode=ops"]).out == ""  # main() makes a temporary folder
  args = speed.parse_args(["--mode=ops", "--update_committed"])
  assert args.out == "/nonexistent/benchmarks"
  # Smoke numbers never go into the committed tables, however asked for.
  for flags in (["--update_committed"], ["--out", "/nonexistent/benchmarks"]):
    with pytest.raises(SystemExit) as e:
      speed.parse_args(["--mode=ops", "--smoke", *flags])
    assert e.value.code == 2
    assert "do not go into the committed tables" in capsys.readouterr().err


def test_bad_input_is_one_message_before_any_compute(capsys):
  assert speed.main(["--mode=ops", "--smoke", "--lengths", "1,x"]) == 2
  assert capsys.readouterr().err == (
      "benchmark: --lengths must be comma-separated integers " ">= 2; got '1,x'.\n"
  )
  assert speed.main(["--mode=train_step", "--smoke", "--train-rows", "Nope"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("benchmark: --train-rows: unknown rows ['Nope']; valid: 'all', 'core'")


def test_bad_cell_is_refused():
  args = speed.resolve(speed.parse_args(["--mode=layer", "--smoke", "--cells", "elu1:t5_bias"]))
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


def test_memory_mode_refuses_a_bad_setting_in_one_line(capsys):
  from benchmarks import memory

  assert memory.main(["--settings=none:0,full:1"]) == 2
  assert capsys.readouterr().err == (
      "benchmark memory: --settings: bad setting 'full:1'; give remat:scan[:mlp_chunk] with "
      "remat in none, block, save_matmuls, save_dots, scan 0 or 1 and mlp_chunk an int >= 0.\n"
  )


def test_benchmark_figure(tmp_path):
  lengths = [256, 1024, 4096]
  series = {f"row {i}": [(n, (i + 1) * n * 1e-3) for n in lengths] for i in range(12)}
  table = bm.Table(
      "layer_sweep",
      "Attention layer fwd+bwd against N",
      ["N"],
      [["1"]],
      [],
      {},
      [
          bm.Panel("time", "N", "median ms", series),
          bm.Panel("memory (compiled)", "N", "MiB", series),
      ],
  )
  subtitle = speed.plot_subtitle("layer", argparse.Namespace(train_batch=32, dtype="bfloat16"))
  assert subtitle.startswith("batch 1, bfloat16; ") and " cores)" in subtitle
  fig = speed.plot_table(table, str(tmp_path / "t.png"), subtitle)
  assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
  assert fig._suptitle.get_text() == f"Attention layer fwd+bwd against N\n{subtitle}"
  for ax in fig.axes:
    colors = [line.get_color() for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert len(colors) == 12 and len(set(map(str, colors))) == 12  # no two rows share a colour
    assert sorted(ax.xaxis.get_ticklocs()) == lengths
    assert [t.get_text() for t in ax.get_xticklabels()] == ["256", "1024", "4096"]
  assert "batch 32, " in speed.plot_subtitle(
      "train_step", argparse.Namespace(train_batch=32, dtype="float32")
  )
