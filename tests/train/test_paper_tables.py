"""The papers' table configs: every cell builds its model and records its place in the
paper's table and the paper's number; each configs file that this layout replaced has an
equivalent spec with the same key settings."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from fastpos import tasks
from fastpos.models import build_model
from fastpos.train import cli, config_files

ROOT = Path(__file__).resolve().parents[2]
TABLES = (
    "fastrpb_table1",
    "fastrpb_table2",
    "permuteformer_table1",
    "lrpe_table4",
    "wikitext103_permuteformer_table4",
    "wikitext103_nprf_table2",
    "listops_generated",
    "lra_text_fastrpb",
)
FIELDS = (
    "task.name",
    "model.kernel",
    "model.positional",
    "model.norm",
    "model.num_layers",
    "model.embed_dim",
    "model.pooling",
    "model.use_grid",
    "batch_size",
    "num_train_steps",
    "optimizer.learning_rate",
    "optimizer.weight_decay",
    "schedule.name",
    "schedule.warmup_steps",
    "experiment.row",
    "experiment.col",
)
# The default config of each file of the earlier layout (one file per task and table) -> its
# spec now and the values of FIELDS it had (written from those files' resolved configs; the
# full configs of every cell were compared field by field when the layout changed: equal
# except listops_generated, whose default model is now SIKF + FastRPB and which records
# FastRPB Table 1 (ListOps), and the PermuteFormer WikiText rows, which now score the paper's
# sliding window, task.eval_stride=256).
OLD_SPECS = {
    "listops_generated": (
        "configs/listops_generated.py:kernel=softmax,pos=none",
        (
            "listops",
            "softmax",
            "absolute",
            "post",
            2,
            64,
            "mean",
            True,
            32,
            600,
            0.001,
            0.01,
            "cosine",
            60,
            "Original",
            "None",
        ),
    ),  # it recorded no table cell then
    "listops_sweep": (
        "configs/listops_generated.py",
        (
            "listops",
            "sikf",
            "absolute+fastrpb",
            "post",
            2,
            64,
            "mean",
            True,
            32,
            600,
            0.001,
            0.01,
            "cosine",
            60,
            "Linear, SIKF",
            "FastRPB",
        ),
    ),
    "lra_image_fastrpb": (
        "configs/fastrpb_table1.py:task=image",
        (
            "lra_image",
            "sikf",
            "absolute+fastrpb",
            "post",
            1,
            32,
            "mean",
            True,
            256,
            35000,
            0.0005,
            0.0,
            "cosine",
            175,
            "Linear, SIKF",
            "FastRPB",
        ),
    ),
    "lra_image_lrpe": (
        "configs/lrpe_table4.py:task=image",
        (
            "lra_image",
            "elu1",
            "lrpe",
            "batch",
            1,
            32,
            "mean",
            True,
            256,
            35000,
            0.0005,
            0.0,
            "cosine",
            175,
            "Type2",
            "Image",
        ),
    ),
    "lra_image_permuteformer": (
        "configs/permuteformer_table1.py:task=image",
        (
            "lra_image",
            "relu",
            "permuteformer",
            "post",
            1,
            32,
            "mean",
            True,
            256,
            35000,
            0.0005,
            0.0,
            "cosine",
            175,
            "PermuteFormer",
            "Image",
        ),
    ),
    "lra_listops_fastrpb": (
        "configs/fastrpb_table1.py:task=listops",
        (
            "listops",
            "sikf",
            "absolute+fastrpb",
            "post",
            6,
            512,
            "cls",
            True,
            32,
            5000,
            0.0015811388300841897,
            0.1,
            "cosine",
            1000,
            "Linear, SIKF",
            "FastRPB",
        ),
    ),
    "lra_listops_lrpe": (
        "configs/lrpe_table4.py:task=listops",
        (
            "listops",
            "elu1",
            "lrpe",
            "batch",
            6,
            512,
            "cls",
            True,
            32,
            5000,
            0.0015811388300841897,
            0.1,
            "cosine",
            1000,
            "Type2",
            "ListOps",
        ),
    ),
    "lra_pathfinder_lrpe": (
        "configs/lrpe_table4.py:task=pathfinder",
        (
            "pathfinder",
            "elu1",
            "lrpe",
            "batch",
            1,
            32,
            "mean",
            True,
            512,
            62400,
            0.001,
            0.0,
            "cosine",
            312,
            "Type2",
            "Pathfinder",
        ),
    ),
    "lra_pathfinder_permuteformer": (
        "configs/permuteformer_table1.py:task=pathfinder",
        (
            "pathfinder",
            "relu",
            "permuteformer",
            "post",
            1,
            32,
            "mean",
            True,
            512,
            62400,
            0.001,
            0.0,
            "cosine",
            312,
            "PermuteFormer",
            "Pathfinder",
        ),
    ),
    "lra_retrieval_fastrpb": (
        "configs/fastrpb_table1.py:task=retrieval",
        (
            "lra_retrieval",
            "sikf",
            "absolute+fastrpb",
            "post",
            4,
            128,
            "cls",
            True,
            32,
            5000,
            0.00034938562148434214,
            0.1,
            "cosine",
            1000,
            "Linear, SIKF",
            "FastRPB",
        ),
    ),
    "lra_retrieval_lrpe": (
        "configs/lrpe_table4.py:task=retrieval",
        (
            "lra_retrieval",
            "elu1",
            "lrpe",
            "batch",
            4,
            128,
            "cls",
            True,
            32,
            5000,
            0.00034938562148434214,
            0.1,
            "cosine",
            1000,
            "Type2",
            "Retrieval",
        ),
    ),
    "lra_retrieval_permuteformer": (
        "configs/permuteformer_table1.py:task=retrieval",
        (
            "lra_retrieval",
            "relu",
            "permuteformer",
            "post",
            4,
            128,
            "cls",
            True,
            32,
            5000,
            0.00034938562148434214,
            0.1,
            "cosine",
            1000,
            "PermuteFormer",
            "Retrieval",
        ),
    ),
    "lra_text_fastrpb": (
        "configs/fastrpb_table1.py:task=text",
        (
            "lra_text",
            "sikf",
            "absolute+fastrpb",
            "post",
            4,
            256,
            "cls",
            True,
            32,
            20000,
            0.0005590169943749475,
            0.1,
            "cosine",
            8000,
            "Linear, SIKF",
            "FastRPB",
        ),
    ),
    "lra_text_lrpe": (
        "configs/lrpe_table4.py:task=text",
        (
            "lra_text",
            "elu1",
            "lrpe",
            "batch",
            4,
            256,
            "cls",
            True,
            32,
            20000,
            0.0005590169943749475,
            0.1,
            "cosine",
            8000,
            "Type2",
            "Text",
        ),
    ),
    "lra_text_permuteformer": (
        "configs/permuteformer_table1.py:task=text",
        (
            "lra_text",
            "relu",
            "permuteformer",
            "post",
            4,
            256,
            "cls",
            True,
            32,
            20000,
            0.0005590169943749475,
            0.1,
            "cosine",
            8000,
            "PermuteFormer",
            "Text",
        ),
    ),
    "mnist_fastrpb": (
        "configs/fastrpb_table2.py",
        (
            "mnist",
            "sikf",
            "absolute+fastrpb",
            "post",
            8,
            256,
            "mean",
            True,
            64,
            21075,
            0.000145,
            0.01,
            "linear",
            500,
            "Linear, SIKF",
            "w/ FastRPB",
        ),
    ),
    "synthetic": (
        "configs/synthetic.py",
        (
            "synthetic",
            "softmax",
            "none",
            "post",
            2,
            32,
            "mean",
            True,
            32,
            300,
            0.003,
            0.01,
            "cosine",
            20,
            None,
            None,
        ),
    ),
    "wikitext103_nprf_rpe": (
        "configs/wikitext103_nprf_table2.py",
        (
            "wikitext103",
            "nprf",
            "absolute+kernelized_rpe",
            "post",
            6,
            512,
            "mean",
            True,
            64,
            150000,
            0.002,
            0.01,
            "rsqrt",
            6000,
            "NPRF-Transformer w/ RPE",
            "WikiText-103",
        ),
    ),
    "wikitext103_permuteformer": (
        "configs/wikitext103_permuteformer_table4.py",
        (
            "wikitext103",
            "relu",
            "permuteformer",
            "post",
            6,
            512,
            "mean",
            True,
            64,
            50000,
            0.0005,
            0.01,
            "rsqrt",
            4000,
            "PermuteFormer",
            "WikiText-103",
        ),
    ),
}


def _config(spec: str):
  path, _, arg = spec.partition(":")
  return cli.load_config(f"{ROOT / path}:{arg}" if arg else str(ROOT / path))


def _get(cfg, field: str):
  for k in field.split("."):
    if k not in cfg:
      return None
    cfg = cfg[k]
  return cfg


@pytest.mark.parametrize("old", OLD_SPECS)
def test_every_earlier_config_has_an_equivalent(old):
  spec, values = OLD_SPECS[old]
  cfg = _config(spec)
  assert tuple(_get(cfg, f) for f in FIELDS) == values


def _cells():
  for stem in TABLES:
    module = config_files.load_module(str(ROOT / "configs" / f"{stem}.py"))
    names = list(module.CHOICES)
    for values in itertools.product(*(module.CHOICES[n] for n in names)):
      arg = ",".join(f"{n}={v}" for n, v in zip(names, values))
      yield pytest.param(stem, arg, id=f"{stem}:{arg}")


@pytest.mark.parametrize("stem, arg", list(_cells()))
def test_every_cell_builds(stem, arg):
  for a in (arg, arg + ",tiny"):
    cfg = _config(f"configs/{stem}.py:{a}")
    build_model(cfg.model, tasks.task_info(cfg.task))
    assert cfg.experiment.row and cfg.experiment.col
    assert cfg.paper.table and cfg.paper.metric in ("accuracy", "perplexity")


def test_paper_numbers_reach_the_config():
  cfg = _config("configs/lra_text_fastrpb.py")
  table_cell = _config("configs/fastrpb_table1.py:task=text,kernel=sikf,pos=fastrpb")
  # The headline file is the table's cell run lean (scanned layers, block remat, chunked MLP).
  assert (cfg.model.remat, cfg.model.scan_layers, cfg.model.mlp_chunk) == ("block", True, 2048)
  table_cell.model.update(remat="block", scan_layers=True, mlp_chunk=2048)
  assert cfg == table_cell
  assert (cfg.model.kernel, cfg.model.positional) == ("sikf", "absolute+fastrpb")
  key = f"{cfg.experiment.row}|{cfg.experiment.col}"
  assert key == "Linear, SIKF|FastRPB" and cfg.paper.results[key] == 62.35
  cfg = _config("configs/permuteformer_table1.py:task=image,model=permuteformer_1d")
  assert cfg.model.use_grid is False
  assert cfg.paper.results[f"{cfg.experiment.row}|{cfg.experiment.col}"] == 36.10
  cfg = _config("configs/fastrpb_table2.py:kernel=dpfp,pos=fastrpb")
  assert cfg.optimizer.learning_rate == 0.7e-4
  assert cfg.paper.results["Linear, DPFP|w/ FastRPB"] == 97.66
  cfg = _config("configs/wikitext103_permuteformer_table4.py:model=no_perm")
  assert cfg.model.positional_options.permuteformer.permute is False
  assert cfg.paper.metric == "perplexity" and cfg.schedule.name == "rsqrt"
  assert cfg.paper.results[f"{cfg.experiment.row}|{cfg.experiment.col}"] == 33.08
  cfg = _config("configs/wikitext103_nprf_table2.py")
  assert (cfg.model.kernel, cfg.model.positional) == ("nprf", "absolute+kernelized_rpe")
  assert cfg.model.kernel_options.num_features == 64 and cfg.optimizer.eps == 1e-6
  assert cfg.paper.results["NPRF-Transformer w/ RPE|WikiText-103"] == 30.6
  cfg = _config("configs/lrpe_table4.py:task=listops,pe=type1")
  assert cfg.model.norm == "batch" and cfg.paper.results["Type1|ListOps"] == 39.84


def test_wikitext_configs_state_their_evaluation_protocol():
  # PermuteFormer Table 4 scores the last 256 tokens of each 512-token window.
  cfg = _config("configs/wikitext103_permuteformer_table4.py")
  assert (cfg.task.segment_length, cfg.task.eval_stride) == (512, 256)
  tiny = _config("configs/wikitext103_permuteformer_table4.py:tiny")
  assert 0 < tiny.task.eval_stride < tiny.task.segment_length
  assert _config("configs/wikitext103_nprf_table2.py").task.eval_stride == 0
  for stem in ("wikitext103_permuteformer_table4", "wikitext103_nprf_table2"):
    assert (
        "Evaluation protocol:"
        in config_files.load_module(str(ROOT / "configs" / f"{stem}.py")).__doc__
    )


def test_the_main_job_is_a_fastpos_model():
  cfg = _config("configs/listops_generated.py")
  assert (cfg.model.kernel, cfg.model.positional) == ("sikf", "absolute+fastrpb")
  assert (cfg.model.pooling, cfg.optimizer.weight_decay, cfg.num_train_steps) == ("mean", 0.01, 600)


def test_not_reported_cells_have_no_paper_number():
  cfg = _config("configs/fastrpb_table1.py:task=retrieval,kernel=softmax,pos=none")  # OOM
  assert f"{cfg.experiment.row}|{cfg.experiment.col}" not in cfg.paper.results
