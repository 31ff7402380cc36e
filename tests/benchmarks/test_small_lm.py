"""benchmarks.small_lm: the smoke run writes its table and record; bad flags stop first."""

from __future__ import annotations

import json

import pytest

from benchmarks import small_lm


@pytest.mark.slow  # compiles five tiny programs: tens of seconds, minutes under load
def test_smoke_run_writes_table_and_record(tmp_path):
  assert small_lm.main(["--smoke", "--out", str(tmp_path)]) == 0
  record = json.loads((tmp_path / "small_lm.json").read_text())
  s = record["summary"]
  assert set(s["steps"]) == {"fastpos", "fastpos model, plain step", small_lm.PLAIN, small_lm.DPA}
  assert s["steps"][small_lm.PLAIN]["ratio"] == 1.0
  assert all(r["ms_per_step"] > 0 for r in s["steps"].values())
  assert s["loop_over_step"] > 0 and 0 < s["evaluation_share"] < 1
  assert set(s["evaluation_by_batch"]) == {"3"}  # the smoke run's other evaluation batch
  assert record["eval_tokens"] == 72  # the tiny text's validation bytes, each scored once
  table = (tmp_path / "small_lm.md").read_text()
  assert "| fastpos |" in table and "evaluation is" in table


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--steps=0", "--steps must be >= 1; got 0"),
        ("--rounds=0", "--rounds must be >= 1; got 0"),
        ("--eval-batches=48,x", "--eval-batches must be comma-separated integers >= 1"),
    ],
)
def test_bad_flags_stop_before_compute(flag, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    small_lm.main([flag])
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err
