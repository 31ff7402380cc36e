"""benchmarks.modes: the pick between the causal modes, and the rewrite of one backend's
entry of ``fastpos.ops.linear_attn.auto``'s table (the other entries kept as they are)."""

from __future__ import annotations

import importlib.util
import pathlib

from benchmarks import modes as bench_modes
from fastpos.ops.linear_attn import auto


def test_benchmark_rewrites_one_backend_entry_of_the_auto_table(tmp_path):
  path = tmp_path / "auto.py"
  path.write_text(pathlib.Path(auto.__file__).read_text(encoding="utf-8"), encoding="utf-8")
  rows = [{"chunk_over_recurrent": 0.4}, {"chunk_over_recurrent": 1.1}]
  assert bench_modes.choice(rows) == "recurrent"
  assert bench_modes.choice(rows[:1]) == "chunk"
  bench_modes.update_auto("gpu", "chunk", "benchmarks.modes on a test machine " * 4, str(path))
  spec = importlib.util.spec_from_file_location("auto_rewritten", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.TABLE["gpu"] == {
      "mode": "chunk",
      "source": "benchmarks.modes on a test machine " * 4,
  }
  assert {k: v for k, v in module.TABLE.items() if k != "gpu"} == {
      k: v for k, v in auto.TABLE.items() if k != "gpu"
  }
