"""scripts/sweep.sh, make_tables.py (fastpos.sweep.tables) and plot_positional.py
(fastpos.plots.positional).

Fast tests check the pieces in this process: grid parsing and run names, override validation,
the tables from fixture results (exact numbers, "missing" cells, paper columns, LaTeX) and the
2D pixel slice against the library's dense Toeplitz matrix. The end-to-end tests run a 2 x 1
grid (seed=0,1 x one model with FastRPB, kernelized RPE and LRPE) of the tiny ListOps config
for 2 steps through sweep.sh in subprocesses, once per module; a persistent compilation cache
shared by the subprocesses compiles each step function once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.ops import toeplitz
from fastpos.plots import positional as plot_positional
from fastpos.sweep import cli as sweep_cli
from fastpos.sweep import plan, runner, stats
from fastpos.sweep import tables as make_tables
from fastpos.train import config_record
from fastpos.train.workdir import Workdir
from tests.helpers import FAST_COMPILE_FLAGS

ROOT = Path(__file__).resolve().parents[2]

CONFIG = "configs/listops_generated.py:tiny"
MODEL = "absolute+fastrpb+kernelized_rpe+lrpe"  # every plotted table in one tiny model
GRID = ["seed=0,1", f"model.positional={MODEL}", "model.kernel=elu1", "num_train_steps=2"]
NAMES = [
    f"seed={s}__model.positional=absolute+fastrpb+kernelized_rpe+lrpe__model.kernel=elu1"
    f"__num_train_steps=2"
    for s in (0, 1)
]


# ---------------------------------------------------------------------------------------------
# Grid, names, validation
# ---------------------------------------------------------------------------------------------
def test_parse_grid_splits_on_bar_when_values_hold_commas():
  grid = plan.parse_grid(
      ["model.kernel=elu1,sikf", "model.positional=absolute|absolute,fastrpb", "--config.seed=0"]
  )
  assert plan.parse_grid(["model.positional=absolute,fastrpb|"]) == [
      ("model.positional", ["absolute,fastrpb"])
  ]
  assert grid == [
      ("model.kernel", ["elu1", "sikf"]),
      ("model.positional", ["absolute", "absolute,fastrpb"]),
      ("seed", ["0"]),
  ]
  combos = plan.combinations(grid)
  assert [tuple(c.values()) for c in combos] == [
      ("elu1", "absolute", "0"),
      ("elu1", "absolute,fastrpb", "0"),
      ("sikf", "absolute", "0"),
      ("sikf", "absolute,fastrpb", "0"),
  ]
  assert plan.run_name(combos[1]) == (
      "model.kernel=elu1__model.positional=absolute+fastrpb__seed=0"
  )
  assert plan.run_name({"task.data_dir": "/a b/c"}) == "task.data_dir=_a-b_c"
  for bad in (["seed"], ["seed=0,,1"], ["seed=0,0"], ["seed=0", "seed=1"]):
    with pytest.raises(ValueError):
      plan.parse_grid(bad)


def test_a_sweep_needs_the_checkouts_entry_points(monkeypatch, tmp_path):
  runner.check_checkout()  # this checkout has train.py and eval.py
  (tmp_path / "train.py").write_text("")
  monkeypatch.setattr(runner, "REPO", tmp_path)
  with pytest.raises(ValueError, match=rf"{tmp_path} has no eval\.py: .*pip install -e \."):
    runner.check_checkout()


def test_validate_resolves_each_combination_like_train_py():
  path, arg = plan.split_config_spec(str(ROOT / CONFIG))
  runs = plan.validate(path, arg, plan.parse_grid(["model.kernel=elu1,sikf", "seed=3"]))
  assert list(runs) == ["model.kernel=elu1__seed=3", "model.kernel=sikf__seed=3"]
  overrides, resolved = runs["model.kernel=sikf__seed=3"]
  assert overrides == {"model.kernel": "sikf", "seed": "3"}
  assert resolved["model"]["kernel"] == "sikf" and resolved["seed"] == 3  # typed, like absl
  assert resolved["task"]["max_length"] == 32  # the :tiny variant


def test_arg_keys_go_into_the_config_argument():
  # The papers' experiment files pick a table cell by their argument (kernel=..., pos=...).
  path, arg = plan.split_config_spec(str(ROOT / "configs/listops_generated.py:tiny"))
  assert arg == "tiny"
  runs = plan.validate(
      path, arg, plan.parse_grid(["arg.kernel=elu1,sikf", "arg.pos=none", "seed=1"])
  )
  assert list(runs) == [
      "arg.kernel=elu1__arg.pos=none__seed=1",
      "arg.kernel=sikf__arg.pos=none__seed=1",
  ]
  overrides, resolved = runs["arg.kernel=sikf__arg.pos=none__seed=1"]
  assert resolved["experiment"] == {"row": "Linear, SIKF", "col": "None"}
  assert resolved["model"]["kernel"] == "sikf" and resolved["model"]["positional"] == "absolute"
  assert resolved["task"]["max_length"] == 32 and resolved["seed"] == 1
  assert plan.config_argv(path, arg, overrides) == [
      f"--config={path}:tiny,kernel=sikf,pos=none",
      "--config.seed=1",
  ]
  assert plan.merge_arg("tiny,kernel=dpfp", {"kernel": "sikf"}) == "tiny,kernel=sikf"
  with pytest.raises(ValueError, match="unknown config argument 'kernl'; valid: kernel, pos, tiny"):
    plan.validate(path, arg, plan.parse_grid(["arg.kernl=sikf"]))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("model.kernl=elu1", "unknown override key 'model.kernl'"),
        ("sed=1", "Nearby valid keys: seed"),
        ("model=elu1", "is a block of the config"),
        ("model.dropout_rate=high", "could not convert string to float: 'high'"),
    ],
)
def test_validate_rejects_bad_overrides_before_running(spec, message):
  path, arg = plan.split_config_spec(str(ROOT / CONFIG))
  with pytest.raises(ValueError, match=message) as e:
    plan.validate(path, arg, plan.parse_grid([spec]))
  if spec.startswith("model.kernl"):
    assert "model.kernel" in str(e.value)  # the nearby valid key is named


# ---------------------------------------------------------------------------------------------
# make_tables from fixture results
# ---------------------------------------------------------------------------------------------
LABELS = {
    "elu1": "Linear, ELU + 1",
    "sikf": "Linear, SIKF",
    "absolute": "None",
    "absolute+fastrpb": "FastRPB",
}
PAPER = {
    "table": "FastRPB Table 1 (ListOps)",
    "metric": "accuracy",
    "results": {"Linear, SIKF|None": 12.55, "Linear, SIKF|FastRPB": [11.47, 4.79]},
}


def _fixture_run(
    d: Path,
    kernel: str,
    positional: str,
    seed: int,
    acc: float | None,
    task: str = "listops",
    lr: float = 1e-3,
    paper: dict | None = PAPER,
) -> None:
  run = d / f"{kernel}_{positional}_{seed}_{task}_{lr}"
  run.mkdir(parents=True)
  config = {
      "seed": seed,
      "task": {"name": task, "max_length": 100},
      "model": {"kernel": kernel, "positional": positional, "kernel_options": {"nu": 1}},
      "optimizer": {"learning_rate": lr},
      "num_train_steps": 600,
  }
  if paper:  # what configs/common.py set_paper records
    config["experiment"] = {"row": LABELS[kernel], "col": LABELS[positional]}
    config["paper"] = paper
  (run / "config.json").write_text(json.dumps(config))
  if acc is not None:
    (run / "results_test.json").write_text(
        json.dumps(
            {
                "split": "test",
                "step": 600,
                "checkpoint": "best",
                "task": task,
                "accuracy": acc,
                "loss": 1.0,
                "num_examples": 1000.0,
            }
        )
    )


@pytest.fixture
def fixture_sweep(tmp_path):
  d = tmp_path / "sweep"
  for seed, acc in ((0, 0.30), (1, 0.34), (2, 0.35)):  # mean 33.00, std 2.65
    _fixture_run(d, "elu1", "absolute", seed, acc)
  for seed, acc in ((0, 0.40), (1, 0.44), (2, 0.42)):  # mean 42.00, std 2.00
    _fixture_run(d, "elu1", "absolute+fastrpb", seed, acc)
  _fixture_run(d, "sikf", "absolute", 0, 0.25)  # one seed of three
  _fixture_run(d, "sikf", "absolute", 1, None)  # started, no results
  # (sikf, absolute+fastrpb): no run at all -> missing
  return d


def test_make_tables_markdown_from_fixture_results(fixture_sweep, tmp_path, capsys):
  other = tmp_path / "other_task"  # a second sweep folder (another table): its own block
  _fixture_run(
      other,
      "sikf",
      "absolute",
      0,
      0.5,
      task="lra_text",
      paper={
          "table": "FastRPB Table 1 (Text)",
          "metric": "accuracy",
          "results": {"Linear, SIKF|None": 61.64},
      },
  )
  assert make_tables.main([str(fixture_sweep), str(other)]) == 0
  out = capsys.readouterr().out
  expected_listops = "\n".join(
      [
          "### FastRPB Table 1 (ListOps): test accuracy (%)",
          "",
          "| model | None | None (paper) | FastRPB | FastRPB (paper) |",  # the paper's order
          "|---|---|---|---|---|",
          "| Linear, SIKF | 25.00 (n=1 of 3) | 12.55 | missing | 11.47 ± 4.79 |",
          "| Linear, ELU + 1 | 33.00 ± 2.65 (n=3) | – | 42.00 ± 2.00 (n=3) | – |",
          "",
          "mean ± sample std over seeds; n = runs with results. (paper): FastRPB Table 1"
          " (ListOps).",
      ]
  )
  assert expected_listops in out
  assert "### FastRPB Table 1 (Text): test accuracy (%)" in out
  assert "| Linear, SIKF | 50.00 (n=1) | 61.64 |" in out
  assert " 0.00" not in out  # missing runs never read as zero


def test_make_tables_claim_layout_pairs_seeds_and_gives_verdicts(fixture_sweep, capsys):
  assert make_tables.main([str(fixture_sweep), "--compare=FastRPB>None"]) == 0
  out = capsys.readouterr().out
  assert "### FastRPB Table 1 (ListOps): test accuracy (%), higher is better" in out
  # None: 30, 34, 35 -> 33 ± t(0.975, 2) 4.3027 * 2.6458 / sqrt(3); FastRPB: 40, 44, 42.
  assert "| Linear, ELU + 1 | None | 33.00 [26.43, 39.57] (n=3) |  |  |  |" in out
  # Paired by seed: 10, 10, 7 -> 9 ± 4.3027 * sqrt(3) / sqrt(3) = [4.70, 13.30]: holds.
  assert (
      "| Linear, ELU + 1 | FastRPB | 42.00 [37.03, 46.97] (n=3) | None | 9.00 [4.70, 13.30] "
      "(n=3) | holds |" in out
  )
  # SIKF + FastRPB has no run: no pair, no verdict but "missing"; the paper's numbers stand
  # beside it: 11.47 against 12.55, FastRPB 1.08 points worse in the paper.
  assert (
      "| Linear, SIKF | FastRPB | missing | None |  | missing | 11.47 ± 4.79 | -1.08 (worse) |"
      in out
  )
  # A row the paper's table lacks: "–" for its number and its difference.
  assert "13.30] (n=3) | holds | – | – |" in out
  # The other way round the same interval says the claim does not hold.
  assert make_tables.main([str(fixture_sweep), "--compare=None>FastRPB"]) == 0
  assert "| FastRPB | -9.00 [-13.30, -4.70] (n=3) | does not hold |" in capsys.readouterr().out
  # --stat=ci in the paper's layout; a column no block has is one line, exit 2.
  assert make_tables.main([str(fixture_sweep), "--stat=ci"]) == 0
  assert "| 33.00 [26.43, 39.57] (n=3) |" in capsys.readouterr().out
  assert make_tables.main([str(fixture_sweep), "--compare=FastRPB>Nope"]) == 2
  err = capsys.readouterr().err
  assert "'Nope'" in err and "its columns: None, FastRPB" in err


@pytest.mark.parametrize(
    "df, quantile",  # Student-t 0.975 quantiles (printed tables, 6 digits)
    [(1, 12.706205), (2, 4.302653), (3, 3.182446), (4, 2.776445), (9, 2.262157), (29, 2.045230)],
)
def test_t_quantile_matches_table_values(df, quantile):
  assert abs(stats.t_quantile(0.975, df) - quantile) < 1e-5
  assert abs(stats.t_quantile(0.025, df) + quantile) < 1e-5
  assert abs(stats.t_cdf(quantile, df) - 0.975) < 1e-6


def test_mean_interval_paired_difference_and_verdict_by_hand():
  iv = stats.mean_interval([0.36, 0.38, 0.40])  # s = 0.02, half = 4.302653 * 0.02 / sqrt(3)
  assert iv.n == 3 and abs(iv.mean - 0.38) < 1e-12
  assert abs(iv.hi - iv.mean - 4.302653 * 0.02 / 3**0.5) < 1e-7
  assert stats.mean_interval([2.0]) == stats.Interval(2.0, None, None, 1)
  # Seeds 0..2 of both, seed 3 only in the claim (not paired): differences 0.03, 0.02, 0.03.
  d = stats.paired_difference({0: 0.40, 1: 0.41, 2: 0.43, 3: 0.9}, {0: 0.37, 1: 0.39, 2: 0.40})
  assert d.n == 3 and abs(d.mean - 0.08 / 3) < 1e-12
  assert abs(d.lo - (0.08 / 3 - 4.302653 * 0.0057735 / 3**0.5)) < 1e-6
  assert stats.verdict(d, higher_is_better=True) == stats.HOLDS
  assert stats.verdict(d, higher_is_better=False) == stats.DOES_NOT_HOLD
  assert stats.verdict(stats.Interval(0.1, -0.2, 0.4, 3), higher_is_better=True) == "inconclusive"
  assert stats.verdict(stats.Interval(0.1, None, None, 1), higher_is_better=True) == "inconclusive"
  with pytest.raises(ValueError, match="no seed in common"):
    stats.paired_difference({0: 1.0}, {1: 1.0})
  with pytest.raises(ValueError, match="not finite"):
    stats.mean_interval([1.0, float("nan")])


def test_make_tables_without_labels_uses_kernel_and_positional(tmp_path, capsys):
  d = tmp_path / "plain"
  for kernel, positional, seed, acc in (
      ("elu1", "absolute", 0, 0.2),
      ("elu1", "absolute", 1, 0.3),
      ("sikf", "absolute+fastrpb", 0, 0.4),
  ):
    _fixture_run(d, kernel, positional, seed, acc, paper=None)
  assert make_tables.main([str(d)]) == 0
  out = capsys.readouterr().out
  assert "| kernel | absolute | absolute+fastrpb |" in out
  assert "| elu1 | 25.00 ± 7.07 (n=2) | missing |" in out
  assert "| sikf | missing | 40.00 (n=1 of 2) |" in out


def test_make_tables_latex_and_blocks_per_varying_field(fixture_sweep, capsys):
  d = fixture_sweep
  _fixture_run(d, "elu1", "absolute", 0, 0.6, lr=3e-3)  # another rate in a cell: its own block
  assert make_tables.main([str(d), "--format=latex"]) == 0
  out = capsys.readouterr().out
  assert r"\begin{tabular}{lcccc}" in out and r"\end{tabular}" in out
  assert (
      r"\textbf{FastRPB Table 1 (ListOps) (optimizer.learning\_rate=0.001)}: " r"test accuracy (\%)"
  ) in out
  assert r"Linear, ELU + 1 & $33.00 \pm 2.65$ (n=3) & -- & $42.00 \pm 2.00$ (n=3) & -- \\" in out
  assert r"Linear, SIKF & 25.00 (n=1 of 3) & 12.55 & missing & $11.47 \pm 4.79$ \\" in out
  assert r"(optimizer.learning\_rate=0.003)" in out
  assert r"Linear, ELU + 1 & 60.00 (n=1) & --" in out
  assert "±" not in out


def test_make_tables_one_block_for_a_table_whose_columns_are_tasks(tmp_path, capsys):
  # LRPE Table 4: rows are encodings, columns are tasks; one sweep folder per task.
  paper = {
      "table": "LRPE Table 4",
      "metric": "accuracy",
      "results": {"Type1|Text": 66.80, "Type1|ListOps": 39.84},
  }
  dirs = []
  for task, label, acc in (("lra_text", "Text", 0.6), ("listops", "ListOps", 0.4)):
    d = tmp_path / task
    run = d / "arg.pe=type1__seed=0"
    run.mkdir(parents=True)
    (run / "config.json").write_text(
        json.dumps(
            {
                "seed": 0,
                "task": {"name": task},
                "model": {"kernel": "elu1"},
                "experiment": {"row": "Type1", "col": label},
                "paper": paper,
            }
        )
    )
    (run / "results_test.json").write_text(json.dumps({"accuracy": acc}))
    dirs.append(str(d))
  assert make_tables.main(dirs) == 0
  out = capsys.readouterr().out
  assert out.count("### ") == 1 and "### LRPE Table 4: test accuracy (%)" in out
  assert "| model | Text | Text (paper) | ListOps | ListOps (paper) |" in out
  assert "| Type1 | 60.00 (n=1) | 66.80 | 40.00 (n=1) | 39.84 |" in out


def test_make_tables_rejects_unknown_row_key(fixture_sweep, capsys):
  assert make_tables.main([str(fixture_sweep), "--rows=model.kernl"]) == 2
  assert "'model.kernl' is not in the config" in capsys.readouterr().err


def _record_change(workdir: Path, field: str, old, new, at: int = 300) -> None:
  """A resume's change of ``field``, recorded as train.py records it."""
  change = config_record.Change(field, old, new, affects_results=True)
  config_record.record(workdir, at, [change])


def test_make_tables_reads_the_config_a_run_last_ran_with(tmp_path, capsys):
  # A run resumed with another kernel (train.py --allow_config_change): its config.json still
  # says elu1, its recorded change says sikf; the table places it by what it last ran with.
  d = tmp_path / "sweep"
  for kernel, acc in (("elu1", 0.30), ("dpfp", 0.40)):
    _fixture_run(d, kernel, "absolute", 0, acc, paper=None)
  _record_change(d / "dpfp_absolute_0_listops_0.001", "model.kernel", "dpfp", "sikf")
  _, runs = make_tables.read_sweep(d, "test")
  assert sorted(r["flat"]["model.kernel"] for r in runs) == ["elu1", "sikf"]
  assert make_tables.main([str(d)]) == 0
  out = capsys.readouterr().out
  assert "| sikf | 40.00 (n=1) |" in out and "dpfp" not in out, out


def test_make_tables_names_a_damaged_change_record(tmp_path, capsys):
  d = tmp_path / "sweep"
  _fixture_run(d, "elu1", "absolute", 0, 0.30, paper=None)
  changes = Workdir(d / "elu1_absolute_0_listops_0.001").changes_file
  changes.write_text("{not json\n")
  assert make_tables.main([str(d)]) == 2
  err = capsys.readouterr().err
  assert err.startswith("make_tables: ") and f"{changes}:1 is not a config change" in err, err


def test_a_run_is_finished_by_its_effective_config(tmp_path):
  # finished() holds the sweep's config against config.json with the recorded changes, and
  # wants results newer than the last of those records.
  run = tmp_path / "run"
  _fixture_run(tmp_path, "elu1", "absolute", 0, 0.30, paper=None)
  (tmp_path / "elu1_absolute_0_listops_0.001").rename(run)
  resolved = json.loads(Workdir(run).config_file.read_text())
  (Workdir(run).checkpoints_dir / "1200").mkdir(parents=True)
  results = Workdir(run).results_file("test")
  os.utime(results, (time.time() + 5, time.time() + 5))
  assert plan.finished(run, resolved) == (True, "done")
  _record_change(run, "num_train_steps", 600, 1200)
  os.utime(Workdir(run).changes_file, (time.time() + 10, time.time() + 10))
  done, why = plan.finished(run, resolved)
  assert not done and "differs from the sweep's config in num_train_steps" in why, why
  longer = {**resolved, "num_train_steps": 1200}
  assert plan.finished(run, longer) == (
      False,
      "results_test.json is older than config_changes.jsonl",
  )
  os.utime(results, (time.time() + 20, time.time() + 20))
  assert plan.finished(run, longer) == (True, "done")


# ---------------------------------------------------------------------------------------------
# plot_positional pieces
# ---------------------------------------------------------------------------------------------
def test_pixel_bias_2d_is_a_row_of_the_dense_toeplitz_matrix():
  rng = np.random.default_rng(0)
  grid, pixel = (5, 4), (3, 1)
  full = rng.normal(size=(9, 7))
  rows, cols = rng.normal(size=9), rng.normal(size=7)
  p = pixel[0] * grid[1] + pixel[1]  # raster index of the query pixel
  dense = np.asarray(toeplitz.dense_toeplitz_2d(jnp.asarray(full), grid))
  np.testing.assert_allclose(
      plot_positional.pixel_bias_2d(full, grid, pixel),
      dense[p].reshape(grid),
      rtol=1e-12,
      atol=1e-12,
  )
  axial = rows[:, None] + cols[None, :]  # FastRPB's W2d = X + Y as one offset table
  dense = np.asarray(toeplitz.dense_toeplitz_2d(jnp.asarray(axial), grid))
  np.testing.assert_allclose(
      plot_positional.pixel_bias_2d(None, grid, pixel, rows=rows, cols=cols),
      dense[p].reshape(grid),
      rtol=1e-12,
      atol=1e-12,
  )
  assert plot_positional.default_pixel((28, 28)) == (12, 10)
  assert plot_positional.default_pixel((4, 6)) == (2, 3)
  np.testing.assert_array_equal(plot_positional.offsets(7), np.arange(-3, 4))
  with pytest.raises(ValueError, match="outside the grid"):
    plot_positional.pixel_bias_2d(full, grid, (5, 0))


def test_fastrpb_2d_figures_from_a_parameter_tree(tmp_path):
  entries = [
      {
          "scheme": "fastrpb",
          "layer": "block_0",
          "path": "encoder/block_0/attention/" "pos_fastrpb",
          "arrays": {"w_rows": np.linspace(-1, 1, 7), "w_cols": np.linspace(1, -1, 9)},
      }
  ]
  written = []
  plot_positional.plot_fastrpb_2d(entries, (4, 5), {}, (1, 2), tmp_path, written)
  assert [p.name for p in written] == ["fastrpb_2d_pixel_1_2.png", "fastrpb_2d_tables.png"]
  full = [{**entries[0], "arrays": {"w": np.arange(2 * 7 * 9.0).reshape(2, 7, 9)}}]
  plot_positional.plot_fastrpb_2d(
      full, (4, 5), {"mode_2d": "full", "per_head": True}, (0, 0), tmp_path / "full", written
  )
  krpe = [
      {
          "scheme": "kernelized_rpe",
          "layer": "block_0",
          "path": "",
          "arrays": {"b": np.ones((2, 7, 9))},
      }
  ]
  plot_positional.plot_kernelized_rpe_2d(krpe, (4, 5), tmp_path, written)
  assert len(written) == 5
  assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)
  tree = {
      "encoder": {
          "block_1": {"attention": {"pos_fastrpb": {"w": np.zeros(3)}}},
          "block_0": {
              "attention": {
                  "pos_lrpe": {"theta": np.ones((1, 2))},
                  "query": {"kernel": np.zeros(2)},
              }
          },
          "pos_kernelized_rpe_shared": {"b": np.zeros((2, 3))},
      }
  }
  found = plot_positional.find_schemes(tree)
  assert [(e["scheme"], e["layer"]) for e in found] == [
      ("lrpe", "block_0"),
      ("fastrpb", "block_1"),
      ("kernelized_rpe", "shared"),
  ]


# ---------------------------------------------------------------------------------------------
# End to end: sweep.sh -> make_tables.py -> plot_positional.py
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def env(tmp_path_factory):
  cache = tmp_path_factory.mktemp("jax_cache")
  return {
      **os.environ,
      "JAX_COMPILATION_CACHE_DIR": str(cache),
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
      "PYTHON": sys.executable,
      # The runs are about the sweep, not the model: XLA's CPU backend compiles these tiny steps
      # about a quarter faster without its LLVM optimisations.
      "XLA_FLAGS": FAST_COMPILE_FLAGS,
  }


def _sweep(sweep_dir: Path, grid: list[str], env: dict, *extra: str):
  return subprocess.run(
      [
          str(ROOT / "scripts" / "sweep.sh"),
          f"--config={CONFIG}",
          f"--sweep_dir={sweep_dir}",
          *extra,
          *grid,
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      env=env,
      timeout=900,
  )


@pytest.fixture(scope="module")
def swept(tmp_path_factory, env):
  d = tmp_path_factory.mktemp("sweep")
  proc = _sweep(d, GRID, env)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  # The manifest as this sweep left it: later tests re-run other modes and splits on the same
  # directory, which rewrite it.
  return d, proc, json.loads((d / "sweep.json").read_text())


def test_sweep_runs_every_combination(swept):
  d, proc, manifest = swept
  assert manifest["config"] == f"{ROOT / CONFIG}"
  assert manifest["grid"] == {
      "seed": ["0", "1"],
      "model.positional": [MODEL],
      "model.kernel": ["elu1"],
      "num_train_steps": ["2"],
  }
  assert sorted(manifest["runs"]) == sorted(NAMES)
  for seed, name in enumerate(NAMES):
    run = manifest["runs"][name]
    assert run["status"] == "done" and run["returncode"] == 0, run
    assert run["overrides"]["seed"] == str(seed) and run["config"]["seed"] == seed
    results = json.loads((d / name / "results_test.json").read_text())
    assert results["split"] == "test" and results["step"] == 2
    assert run["results"]["accuracy"] == results["accuracy"]
    saved = json.loads((d / name / "config.json").read_text())
    assert saved["model"]["positional"] == MODEL and saved["num_train_steps"] == 2
    log = (d / name / "sweep.log").read_text()
    assert log.count("=== ") == 2 and "train.py" in log and "--split=test" in log
  assert "2 done, 0 failed" in proc.stdout


def _sweep_here(monkeypatch, capsys, sweep_dir: Path, grid: list[str], *extra: str):
  """sweep.py's main in this process, for the modes that start no run (print, --dry_run):
  (exit code, stdout, stderr). sweep.sh itself runs in the fixture and the other tests."""
  # main sets JAX_PLATFORMS=cpu for its own process unless set: set through monkeypatch.
  monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
  capsys.readouterr()
  code = sweep_cli.main([f"--config={ROOT / CONFIG}", f"--sweep_dir={sweep_dir}", *extra, *grid])
  out = capsys.readouterr()
  return code, out.out, out.err


def test_rerun_skips_finished_runs(swept, env, tmp_path, monkeypatch, capsys):
  d, _, _ = swept
  stamps = {
      n: ((d / n / "results_test.json").stat().st_mtime_ns, (d / n / "sweep.log").stat().st_size)
      for n in NAMES
  }
  proc = _sweep(d, GRID, env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stderr.count("[skip]") == 2 and "[run]" not in proc.stdout
  assert "2 skipped (finished before), 0 done" in proc.stdout
  for n in NAMES:  # nothing ran: results and logs untouched
    assert (
        (d / n / "results_test.json").stat().st_mtime_ns,
        (d / n / "sweep.log").stat().st_size,
    ) == stamps[n]
  # --mode=print lists only unfinished runs: none here, both in a fresh sweep directory.
  code, out, err = _sweep_here(monkeypatch, capsys, d, GRID, "--mode=print")
  assert code == 0 and out == "", err
  code, out, err = _sweep_here(monkeypatch, capsys, tmp_path / "fresh", GRID, "--mode=print")
  lines = out.strip().splitlines()
  assert code == 0 and len(lines) == 2, err
  assert all(
      "/train.py --config=" in l and "/eval.py --config=" in l and "--config.seed=" in l
      for l in lines
  )
  assert not (tmp_path / "fresh" / NAMES[0]).exists()  # printed, not run
  # A workdir whose config.json differs from the combination's config is not finished.
  resolved = json.loads((d / "sweep.json").read_text())["runs"][NAMES[0]]["config"]
  assert plan.finished(d / NAMES[0], resolved) == (True, "done")
  done, why = plan.finished(d / NAMES[0], {**resolved, "num_train_steps": 3})
  assert not done and "differs from the sweep's config in num_train_steps" in why
  # Scoring another split: the runs are trained, not yet evaluated on it.
  assert plan.finished(d / NAMES[0], resolved, "validation") == (False, "trained, not evaluated")
  code, out, err = _sweep_here(monkeypatch, capsys, d, GRID, "--mode=print", "--split=validation")
  lines = out.strip().splitlines()
  assert code == 0 and len(lines) == 2, err
  assert all("--split=validation" in l for l in lines)


def test_make_tables_from_the_sweep(swept, capsys):
  d, _, _ = swept
  accs = [json.loads((d / n / "results_test.json").read_text())["accuracy"] * 100 for n in NAMES]
  mean, std = float(np.mean(accs)), float(np.std(accs, ddof=1))
  # The grid overrides model fields, so the table cell that listops_generated.py records
  # (experiment.row / .col) is not the run's: lay the table out by the model fields.
  assert make_tables.main([str(d), "--rows=model.kernel", "--cols=model.positional"]) == 0
  out = capsys.readouterr().out
  assert f"| kernel | {MODEL} |" in out
  assert f"| elu1 | {mean:.2f} ± {std:.2f} (n=2) |" in out


@pytest.mark.slow
def test_failed_run_is_reported_and_others_continue(swept, env, tmp_path, capsys):
  d = tmp_path / "with_failure"
  # elu1 x t5_bias is incompatible (a logits bias needs softmax): train.py exits 2.
  grid = [f"model.positional=t5_bias,{MODEL}", "model.kernel=elu1", "num_train_steps=2"]
  proc = _sweep(d, grid, env)
  assert proc.returncode == 1
  bad = "model.positional=t5_bias__model.kernel=elu1__num_train_steps=2"
  good = f"model.positional={MODEL}__model.kernel=elu1__num_train_steps=2"
  assert f"BAD_INPUT {bad}: train exited with status 2 (bad config" in proc.stdout
  assert f"log: {d / bad / 'sweep.log'}" in proc.stdout
  assert "'t5_bias' adds a bias to the attention logits" in proc.stdout
  assert "1 done, 0 failed, 1 bad_input" in proc.stdout
  assert (d / good / "results_test.json").exists()  # the run after the failure went on
  manifest = json.loads((d / "sweep.json").read_text())
  assert manifest["runs"][bad]["status"] == "bad_input"
  assert manifest["runs"][bad]["returncode"] == 2
  # Rows by kernel, columns by scheme (by default the swept paper config's own labels lay it out).
  assert make_tables.main([str(d), "--rows=model.kernel", "--cols=model.positional"]) == 0
  rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| elu1 |")]
  assert len(rows) == 1 and "missing (1 failed)" in rows[0], rows


def _plot_script():
  """scripts/plot_positional.py, loaded from its file (its main and its checkpoint reader)."""
  spec = importlib.util.spec_from_file_location(
      "plot_positional", ROOT / "scripts" / "plot_positional.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_plot_positional_writes_pngs_from_a_checkpoint(swept, tmp_path, capsys, monkeypatch):
  d, _, _ = swept
  script = _plot_script()
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # main sets it when unset (restored afterwards)
  assert script.main([str(d / NAMES[0]), "--out", str(tmp_path)]) == 0
  written = [Path(line) for line in capsys.readouterr().out.split()]
  assert sorted(p.name for p in written) == [
      "fastrpb_1d.png",
      "kernelized_rpe.png",
      "lrpe_theta.png",
  ]
  for p in written:
    assert p.parent == tmp_path
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
  params, meta = script.load_checkpoint(d / NAMES[0], "best")
  assert meta["step"] == 2 and meta["which"] == "best"
  found = {e["scheme"]: e["arrays"] for e in plot_positional.find_schemes(params)}
  assert found["fastrpb"]["w"].shape == (63,)  # 2 * max_length - 1, max_length 32
  assert found["kernelized_rpe"]["b"].shape == (2, 63)  # [heads, 2N-1]
  assert np.any(found["fastrpb"]["w"] != 0)  # trained away from the zero init


# Slow; the default run keeps the sweep (test_sweep_runs_every_combination) and its dry-run plan
# (test_gpus_dry_run_shows_the_plan_without_gpus).
@pytest.mark.slow
def test_gpus_mode_runs_one_run_per_device_in_parallel(env, tmp_path):
  # Two runs that fail at the config check (no compilation): each gets its own device id.
  d = tmp_path / "gpus"
  proc = _sweep(
      d,
      ["model.positional=t5_bias", "model.kernel=elu1", "seed=0,1"],
      env,
      "--mode=gpus",
      "--gpus=3,5",
  )
  assert proc.returncode == 1 and "0 done, 0 failed, 2 bad_input" in proc.stdout, proc.stdout
  runs = json.loads((d / "sweep.json").read_text())["runs"]
  assert sorted(r["gpu"] for r in runs.values()) == ["3", "5"]
  assert {r["status"] for r in runs.values()} == {"bad_input"}
  for r in runs.values():
    assert "is incompatible" in (d / r["log"]).read_text()


# ---------------------------------------------------------------------------------------------
# GPU mode without GPUs, and the trainer's exit codes (no training: a stand-in interpreter)
# ---------------------------------------------------------------------------------------------
def _sweep_py(sweep_dir: Path, grid: list[str], *extra: str, path: str = ""):
  """sweep.py as a user runs it, with ``PATH`` = ``path`` (an empty folder: no nvidia-smi)."""
  env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
  env["PATH"] = path or env.get("PATH", "")
  return subprocess.run(
      [
          sys.executable,
          str(ROOT / "scripts" / "sweep.py"),
          f"--config={CONFIG}",
          f"--sweep_dir={sweep_dir}",
          *extra,
          *grid,
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      env=env,
      timeout=300,
  )


def test_gpus_dry_run_shows_the_plan_without_gpus(tmp_path, monkeypatch, capsys):
  no_gpu = tmp_path / "bin"  # PATH without nvidia-smi, no CUDA_VISIBLE_DEVICES
  no_gpu.mkdir()
  d = tmp_path / "sweep"
  # The dry runs in this process (they start nothing); the real run below as a user runs it.
  with monkeypatch.context() as mp:
    mp.setenv("PATH", str(no_gpu))
    mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    code, _, err = _sweep_here(mp, capsys, d, ["seed=0,1,2"], "--mode=gpus", "--dry_run")
    assert code == 0, err
    assert [l for l in err.splitlines() if l.startswith("[plan]")] == [
        f"[plan] seed={s}: run" for s in range(3)
    ]
    assert "no GPU found on this machine (nvidia-smi is not installed)" in err
    assert "Traceback" not in err and not d.exists()
    # With the GPUs named, the plan says which run starts where.
    code, _, err = _sweep_here(
        mp, capsys, d, ["seed=0,1,2"], "--mode=gpus", "--dry_run", "--gpus=3,5"
    )
    assert code == 0, err
    assert "[plan] seed=0: run on GPU 3" in err
    assert "[plan] seed=1: run on GPU 5" in err
    assert "[plan] seed=2: run queued for the next free GPU" in err
    assert not d.exists()
  # A real run stops with one message before creating anything.
  proc = _sweep_py(d, ["seed=0,1,2"], "--mode=gpus", path=str(no_gpu))
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.startswith(
      "sweep: --mode=gpus: no GPU found on this machine " "(nvidia-smi is not installed)."
  )
  assert proc.stderr.count("\n") == 1 and "--mode=sequential" in proc.stderr
  assert not d.exists()


FAKE_TRAINER = """#!{python}
# Stands in for the interpreter: "train.py" / "eval.py" exit with the code given as the seed;
# code 0 leaves what a finished run leaves (config.json, a last checkpoint, results).
import json, os, sys
script, args = os.path.basename(sys.argv[1]), sys.argv[2:]
workdir = next(a.split("=", 1)[1] for a in args if a.startswith("--workdir="))
code = int(next(a.split("=", 1)[1] for a in args if a.startswith("--config.seed=")))
if code == 0 and script == "train.py":
  manifest = json.load(open(os.path.join(os.path.dirname(workdir), "sweep.json")))
  config = manifest["runs"][os.path.basename(workdir)]["config"]
  json.dump(config, open(os.path.join(workdir, "config.json"), "w"))
  os.makedirs(os.path.join(workdir, "checkpoints", str(config["num_train_steps"])))
if code == 0 and script == "eval.py":
  open(os.path.join(workdir, "results_test.json"), "w").write('{{"accuracy": 0.5}}')
if script == "train.py" and os.environ.get("FAKE_RENDEZVOUS"):  # waits for a second run
  import time
  meet = os.environ["FAKE_RENDEZVOUS"]
  open(os.path.join(meet, os.path.basename(workdir)), "w").write(os.environ.get("XLA_FLAGS", ""))
  deadline = time.time() + 60
  while len(os.listdir(meet)) < 2 and time.time() < deadline:
    time.sleep(0.05)
  if len(os.listdir(meet)) < 2:
    sys.exit(1)  # ran alone
if code == 99:  # a long training: waits for SIGTERM, then "saves" and exits as preempted
  import signal, time
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
  print("training", flush=True)
  time.sleep(60)
print(script, "exits with", code)
sys.exit(code)
"""


@pytest.fixture
def fake_python(tmp_path):
  path = tmp_path / "fake_python"
  path.write_text(FAKE_TRAINER.format(python=sys.executable))
  path.chmod(0o755)
  return str(path)


def test_exit_codes_are_reported_apart(tmp_path, fake_python):
  from fastpos.train import errors  # pylint: disable=import-outside-toplevel

  codes = {
      0: "done",
      1: "failed",
      errors.EXIT_BAD_INPUT: "bad_input",
      errors.EXIT_NONFINITE: "nonfinite",
      errors.EXIT_LOCKED: "locked",
      errors.EXIT_PREEMPTED: "preempted",
  }
  d = tmp_path / "sweep"
  proc = _sweep_py(d, [f"seed={','.join(map(str, codes))}"], f"--python={fake_python}")
  assert proc.returncode == 1, proc.stdout + proc.stderr  # some runs need a fix
  assert (
      "6 runs" in proc.stdout
      and "1 done, 1 failed, 1 bad_input, 1 nonfinite, 1 locked, "
      "1 preempted, 0 interrupted / not started." in proc.stdout
  ), proc.stdout
  runs = json.loads((d / "sweep.json").read_text())["runs"]
  assert {n: r["status"] for n, r in runs.items()} == {f"seed={c}": s for c, s in codes.items()}
  assert "FAILED seed=1: train exited with status 1\n" in proc.stdout
  assert "BAD_INPUT seed=2: train exited with status 2 (bad config" in proc.stdout
  assert "NONFINITE seed=3: train exited with status 3 (the loss became NaN" in proc.stdout
  assert "LOCKED seed=4: train exited with status 4 (another trainer holds" in proc.stdout
  assert "PREEMPTED seed=75: re-run the same command to resume it" in proc.stdout
  assert "train.py exits with 3" in (d / "seed=3" / "sweep.log").read_text()
  assert set(make_tables.FAILED) == set(runner.NEEDS_FIX)  # the tables count them as failed
  # Only preempted runs left: the sweep itself says "try again" (75), and a re-run resumes
  # the preempted run (the finished one is skipped).
  proc = _sweep_py(d, ["seed=0,75"], f"--python={fake_python}")
  assert proc.returncode == errors.EXIT_PREEMPTED, proc.stdout + proc.stderr
  assert "[run] seed=75" in proc.stdout and "[run] seed=0" not in proc.stdout
  assert "1 preempted" in proc.stdout


def test_ctrl_c_stops_the_runs_and_says_how_to_resume(tmp_path, fake_python):
  import signal  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  d = tmp_path / "sweep"
  env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
  p = subprocess.Popen(
      [
          sys.executable,
          str(ROOT / "scripts" / "sweep.py"),
          f"--config={CONFIG}",
          f"--sweep_dir={d}",
          f"--python={fake_python}",
          "seed=99,0",
      ],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
  )
  log = d / "seed=99" / "sweep.log"
  deadline = time.time() + 120
  while not (log.exists() and "training" in log.read_text()) and time.time() < deadline:
    time.sleep(0.1)
  p.send_signal(signal.SIGINT)
  out, err = p.communicate(timeout=120)
  assert p.returncode == 75, out + err  # EXIT_PREEMPTED: re-run to continue
  assert "Traceback" not in out + err
  assert "INTERRUPTED seed=99: re-run the same command to resume it." in out
  assert "NOT STARTED seed=0: re-run the same command to run it." in out
  runs = json.loads((d / "sweep.json").read_text())["runs"]
  assert runs["seed=99"]["status"] == "interrupted" and runs["seed=99"]["returncode"] == 75


# Slow; the default run keeps the sweep (test_sweep_runs_every_combination).
@pytest.mark.slow
def test_parallel_mode_runs_two_at_a_time_with_a_share_of_the_cores(tmp_path, fake_python):
  d, meet = tmp_path / "sweep", tmp_path / "meet"
  meet.mkdir()
  env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
  env.update(FAKE_RENDEZVOUS=str(meet), XLA_FLAGS="--xla_dump_to=/nowhere")
  argv = [
      sys.executable,
      str(ROOT / "scripts" / "sweep.py"),
      f"--config={CONFIG}",
      f"--sweep_dir={d}",
      f"--python={fake_python}",
      "--mode=parallel",
      "--jobs=2",
      "seed=0",
      "num_train_steps=2,3",
  ]
  # Each stand-in training waits until the other has started: only runs at the same time
  # both finish.
  proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "2 done, 0 failed" in proc.stdout
  threads = max(1, runner.host_cpus() // 2)
  for name in ("seed=0__num_train_steps=2", "seed=0__num_train_steps=3"):
    flags = (meet / name).read_text()  # the user's flags kept, the thread limits added
    assert flags == (
        "--xla_dump_to=/nowhere --xla_cpu_multi_thread_eigen=false "
        f"intra_op_parallelism_threads={threads}"
    )
  progress = [l for l in proc.stdout.splitlines() if l.startswith("[progress]")]
  assert len(progress) == 2
  assert progress[0].startswith("[progress] 1/2 cells done, 1 to run: about ")
  assert progress[1].startswith("[progress] 2/2 cells done, 0 to run: none left to run, mean ")
  # A re-run skips both; the dry run says how many at a time.
  for f in meet.iterdir():
    f.unlink()
  proc = subprocess.run(
      argv + ["--dry_run"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300
  )
  assert proc.returncode == 0 and "2 finished, 0 to run, 2 at a time" in proc.stderr, proc.stderr
  # A bad --jobs stops before anything runs.
  proc = subprocess.run(
      argv[:-2] + ["--jobs=0", "seed=5"], cwd=ROOT, capture_output=True, text=True, env=env
  )
  assert proc.returncode == 2 and "--jobs=0: give at least 1" in proc.stderr
  assert not (d / "seed=5").exists()
