"""scripts/claims.sh: the claims' pipeline (sweeps, tables, figures, README) at tiny scale.

The smoke mode runs two claims' smallest grids (FastRPB on ListOps: ELU+1 without and with
FastRPB; the Transformer-XL memory at context 16: without and with), 2 seeds x 2 training
steps each, in subprocesses two at a time; the checks read the tables, the README and the
manifests it leaves. The registry's grids are checked against their configs without running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastpos.sweep import claims, plan
from tests.helpers import FAST_COMPILE_FLAGS

ROOT = Path(__file__).resolve().parents[2]


def test_every_claim_grid_resolves_against_its_config():
  """Each sweep of each claim (full and tiny) names fields and arguments its config has, and
  every compared column is a column some run of the claim gets."""
  for claim in claims.CLAIMS:
    labels = set()
    for spec in claim.sweeps:
      if not (ROOT / spec.config).is_file():
        continue  # a config another part of the project adds (the sweep is skipped)
      for grid, arg in ((spec.grid, None), (spec.tiny, "tiny")):
        if grid is None:
          continue
        runs = plan.validate(ROOT / spec.config, arg, plan.parse_grid([*grid, "seed=0,1,2"]))
        labels |= {r["experiment"]["col"] for _, r in runs.values()}
    for pair in claim.compare:
      assert set(pair.split(">")) <= labels, (claim.name, pair, labels)


def test_each_claims_paper_table_prints_the_papers_numbers():
  """A claim's paper table is read from the paper's config (one source of its numbers): every
  named column has numbers there, and the rendered rows carry them."""
  for claim in claims.CLAIMS:
    for paper in claim.papers:
      text = claims.paper_markdown(paper)
      lines = [l for l in text.splitlines() if l.startswith("| ") and "---" not in l]
      assert lines[0] == "| row | " + " | ".join(paper.columns) + " |", text
      assert len(lines) >= 3, text  # at least two of the paper's rows
      assert all(any(ch.isdigit() for ch in l.split("|", 2)[2]) for l in lines[1:]), text
  # Luo et al. report NPRF + RPE below the softmax Transformer: 30.6 against 33.0.
  luo = claims.paper_markdown(claims.BY_NAME["kernelized_rpe"].papers[0])
  assert "| Vanilla Transformer | 33.00 |" in luo and "| NPRF-Transformer w/ RPE | 30.60 |" in luo


def test_bad_claim_names_stop_before_anything_runs(tmp_path, capsys):
  assert claims.main([str(tmp_path / "out"), "--claims=fastrpb,nope"]) == 2
  assert "unknown claim nope; valid: fastrpb, kernelized_rpe" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


def test_a_skipped_sweep_runs_with_all_only_and_its_pages_say_why(tmp_path):
  """A sweep the default run skips (Pathfinder-32: measured at chance) gets no scripts/sweep.py
  call unless --all; the claim's page and the README say so, not a table of missing cells."""
  claim = claims.BY_NAME["fastrpb"]
  spec = next(s for s in claim.sweeps if s.skipped)
  assert "chance" in spec.skipped
  default = claims._parser().parse_args([str(tmp_path / "out"), f"--results={tmp_path / 'r'}"])
  every = claims._parser().parse_args([str(tmp_path / "out"), "--all"])
  assert claims.sweep_argv(default, claim, spec) is None
  argv = claims.sweep_argv(every, claim, spec)
  assert argv is not None and f"--config={ROOT / spec.config}" in argv
  # Left-over runs of the skipped sweep are not tabulated by the default mode.
  (tmp_path / "out" / "fastrpb" / spec.name).mkdir(parents=True)
  (tmp_path / "out" / "fastrpb" / spec.name / "sweep.json").write_text("not read")
  assert claims.claim_blocks(default, claim) == []
  claims.write_results(default, "scripts/claims.sh OUT")
  page = (tmp_path / "r" / "fastrpb.md").read_text()
  assert f"Not run: the {spec.name} sweep (`{spec.config}`): {spec.skipped}." in page
  readme = (tmp_path / "r" / "README.md").read_text()
  row = next(l for l in readme.splitlines() if f"| {spec.name} (`{spec.config}`) |" in l)
  assert row.endswith("| not run (its page) |"), row


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  out, results = tmp_path_factory.mktemp("claims"), tmp_path_factory.mktemp("results")
  env = {
      **os.environ,
      "PYTHON": sys.executable,
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      "XLA_FLAGS": FAST_COMPILE_FLAGS,
  }
  argv = [
      str(ROOT / "scripts" / "claims.sh"),
      str(out),
      f"--results={results}",
      "--tiny",
      "--claims=fastrpb,txl_memory",
      "--mode=parallel",
  ]
  proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return out, results, proc, argv, env


@pytest.mark.slow
def test_tiny_pipeline_writes_tables_with_intervals_and_verdicts(tiny_run):
  out, results, proc, _, _ = tiny_run
  table = (results / "fastrpb.md").read_text()
  assert "| setting | variant | test accuracy (%): mean [95% CI] | vs |" in table
  line = next(l for l in table.splitlines() if "| FastRPB | " in l and "| None |" in l)
  cells = [c.strip() for c in line.strip("|").split("|")]
  assert cells[2].endswith("(n=2)") and "[" in cells[2]  # mean [lo, hi] over 2 seeds
  assert cells[4].endswith("(n=2)") and "[" in cells[4]  # the paired difference
  assert cells[5] in ("holds", "does not hold", "inconclusive")
  txl = (results / "txl_memory.md").read_text()
  assert "test perplexity, lower is better" in txl
  assert "| context 16 | Transformer-XL rel. + memory |" in txl
  readme = (results / "README.md").read_text()
  assert "Smoke mode (--tiny)" in readme and "Status: 8 of 8 runs finished." in readme
  assert "scripts/claims.sh" in readme and "not yet run" in readme  # the claims not run
  assert (results / "fastrpb.png").stat().st_size > 0
  assert (results / "fastrpb_listops_curves.png").stat().st_size > 0
  runs = json.loads((out / "txl_memory" / "text_lm" / "sweep.json").read_text())["runs"]
  memory = [r for n, r in runs.items() if "arg.memory=true" in n]
  assert len(memory) == 2 and all(r["config"]["model"]["memory_length"] == 16 for r in memory)
  assert "[progress] 4/4 cells done" in proc.stdout


@pytest.mark.slow
def test_tiny_pipeline_rerun_skips_every_finished_run(tiny_run):
  out, results, _, argv, env = tiny_run
  proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "[run]" not in proc.stdout and proc.stderr.count("[skip]") == 8
