"""The papers' experiment configs: every cell of every table builds its model (names, options
and kernel x scheme compatibility are checked at build time), records its place in the paper's
table, and carries the paper's number where the paper printed one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fastpos import tasks
from fastpos.models import build_model
from fastpos.train import experiments as ex

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"

# file stem -> (row argument, rows, column argument, columns)
FAMILIES = {
    **{f"lra_{t}_fastrpb": ("kernel", ex.FASTRPB_KERNELS, "pos", ex.FASTRPB_COLUMNS)
       for t in ("listops", "text", "retrieval", "image")},
    **{f"lra_{t}_permuteformer": ("model", ex.PERMUTEFORMER_ROWS, "task", {t: None})
       for t in ("text", "retrieval", "image", "pathfinder")},
    **{f"lra_{t}_lrpe": ("pe", ex.LRPE_ROWS, "task", {t: None})
       for t in ("text", "listops", "retrieval", "pathfinder", "image")},
    "mnist_fastrpb": ("kernel", ex.MNIST_ROWS, "pos", ex.MNIST_COLUMNS),
    "wikitext103_permuteformer": ("model", ex.WIKITEXT_PERMUTEFORMER_ROWS, "task",
                                  {"wikitext103": None}),
    "wikitext103_nprf_rpe": ("model", ex.WIKITEXT_NPRF_ROWS, "task", {"wikitext103": None}),
}


def _load(stem):
  path = CONFIG_DIR / f"{stem}.py"
  spec = importlib.util.spec_from_file_location(f"configs_{stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _cells():
  for stem, (row_arg, rows, col_arg, cols) in FAMILIES.items():
    for r in rows:
      for c in cols:
        yield pytest.param(stem, f"{row_arg}={r},{col_arg}={c}", id=f"{stem}:{r},{c}")


@pytest.mark.parametrize("stem, arg", list(_cells()))
def test_every_cell_builds(stem, arg):
  module = _load(stem)
  for a in (arg, arg + ",tiny"):
    cfg = module.get_config(a)
    build_model(cfg.model, tasks.task_info(cfg.task))
    assert cfg.experiment.row and cfg.experiment.col
    assert cfg.paper.table and cfg.paper.metric in ("accuracy", "perplexity")


def test_paper_numbers_reach_the_config():
  cfg = _load("lra_text_fastrpb").get_config()
  assert (cfg.model.kernel, cfg.model.positional) == ("sikf", "absolute+fastrpb")
  key = f"{cfg.experiment.row}|{cfg.experiment.col}"
  assert key == "Linear, SIKF|FastRPB" and cfg.paper.results[key] == 62.35
  cfg = _load("lra_image_permuteformer").get_config("model=permuteformer_1d")
  assert cfg.model.use_grid is False
  assert cfg.paper.results[f"{cfg.experiment.row}|{cfg.experiment.col}"] == 36.10
  cfg = _load("mnist_fastrpb").get_config("kernel=dpfp,pos=fastrpb")
  assert cfg.optimizer.learning_rate == 0.7e-4
  assert cfg.paper.results["Linear, DPFP|w/ FastRPB"] == 97.66
  cfg = _load("wikitext103_permuteformer").get_config("model=no_perm")
  assert cfg.model.positional_options.permuteformer.permute is False
  assert cfg.paper.metric == "perplexity" and cfg.schedule.name == "rsqrt"
  assert cfg.paper.results[f"{cfg.experiment.row}|{cfg.experiment.col}"] == 33.08
  cfg = _load("wikitext103_nprf_rpe").get_config()
  assert (cfg.model.kernel, cfg.model.positional) == ("nprf", "absolute+kernelized_rpe")
  assert cfg.model.kernel_options.num_features == 64 and cfg.optimizer.eps == 1e-6
  assert cfg.paper.results["NPRF-Transformer w/ RPE|WikiText-103"] == 30.6


def test_not_reported_cells_have_no_paper_number():
  cfg = _load("lra_retrieval_fastrpb").get_config("kernel=softmax,pos=none")  # OOM
  assert f"{cfg.experiment.row}|{cfg.experiment.col}" not in cfg.paper.results


def test_bad_cell_names_the_choices():
  with pytest.raises(ValueError, match=r"kernel='nope'.*valid: softmax, dpfp"):
    _load("lra_text_fastrpb").get_config("kernel=nope")
  with pytest.raises(ValueError, match=r"unknown config argument 'kernal'"):
    _load("lra_text_fastrpb").get_config("kernal=sikf")
