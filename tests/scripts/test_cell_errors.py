"""scripts/cell_errors.py reads the per-cell errors recorded by tests/models/test_cells.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cell_errors.py"
spec = importlib.util.spec_from_file_location("cell_errors", SCRIPT)
cell_errors = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cell_errors)

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.models.test_cells" name="test_fast_equals_dense[elu1-fastrpb-bidir-1d]">
<properties><property name="rel_err" value="2e-16"/></properties></testcase>
<testcase classname="tests.models.test_cells" name="test_fast_equals_dense[elu1-fastrpb[mode_2d=full,per_head=True]-causal-2d]">
<properties><property name="rel_err" value="3e-15"/></properties></testcase>
<testcase classname="tests.models.test_cells" name="test_fast_equals_dense[softmax-rope+fastrpb-bidir-1d]">
<properties><property name="rel_err" value="1e-16"/></properties></testcase>
<testcase classname="tests.models.test_cells" name="test_causal_cells_never_look_ahead[elu1-none-causal-1d]"/>
</testsuite></testsuites>"""  # noqa: E501 (pytest's XML, one element a line)


def test_worst_error_per_cell(tmp_path):
  path = tmp_path / "run.xml"
  path.write_text(XML)
  rows = cell_errors.read_junit(str(path))
  assert sorted(rows) == sorted(
      [
          ("elu1", "fastrpb", "bidir-1d", 2e-16),
          ("elu1", "fastrpb", "causal-2d", 3e-15),
          ("softmax", "rope+fastrpb", "bidir-1d", 1e-16),
      ]
  )
  out = cell_errors.table(rows)
  assert "| elu1 | 3.0e-15 (2) | - |" in out
  assert "| softmax | - | 1.0e-16 (1) |" in out
  assert "worst overall 3.0e-15" in out
