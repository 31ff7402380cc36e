"""The papers' experiments: task settings, table rows and columns, in one place.

An experiment file ``configs/<task>_<model>.py`` names one paper table (a family of rows and
columns) and calls ``experiment_config``; its ``get_config(arg)`` takes ``kernel=<row>``,
``pos=<column>`` and ``tiny`` so that one file covers the whole table for its task:

    python train.py --config=configs/lra_text_fastrpb.py:kernel=dpfp,pos=sinspe --workdir=...

and a sweep varies the argument (``scripts/sweep.sh ... arg.kernel=dpfp,sikf arg.pos=none,
fastrpb``). The resolved config records where the run sits in the paper's table
(``config.experiment.row`` / ``.col``) and the paper's numbers (``config.paper``), so that
``scripts/make_tables.py`` can print ours beside theirs from the runs' ``config.json`` alone.

Settings. The LRA sizes (layers, width, heads, MLP, pooling, batch, steps, warmup) are those of
google-research/long-range-arena's base configs for each task. LRA's learning-rate rule
``0.05 * linear_warmup * rsqrt_decay`` (ListOps, Text, Retrieval) peaks at
``0.05 / sqrt(warmup)``; here that peak is the AdamW learning rate with a cosine decay, an
approximation stated in each file. Image and Pathfinder use LRA's own AdamW + cosine values.
"""

from __future__ import annotations

import math
from typing import Mapping

import ml_collections

from fastpos.positional.permuteformer import PAPER_DECAY
from fastpos.train.config import base_config, parse_arg

# LRA's base settings per task (google-research/long-range-arena, lra_benchmarks/*/configs).
LRA_TASKS: dict[str, dict] = {
    "listops": dict(
        task="listops", task_fields=dict(source="tsv", max_length=2000),
        model=dict(num_layers=6, embed_dim=512, num_heads=8, mlp_dim=2048, pooling="cls",
                   dropout_rate=0.1),
        batch_size=32, num_train_steps=5000, warmup_steps=1000,
        learning_rate=0.05 / math.sqrt(1000), weight_decay=0.1, eval_every_steps=500),
    "text": dict(
        task="lra_text", task_fields=dict(max_length=4000),
        model=dict(num_layers=4, embed_dim=256, num_heads=4, mlp_dim=1024, pooling="cls",
                   dropout_rate=0.1),
        batch_size=32, num_train_steps=20_000, warmup_steps=8000,
        learning_rate=0.05 / math.sqrt(8000), weight_decay=0.1, eval_every_steps=1000),
    "retrieval": dict(
        task="lra_retrieval", task_fields=dict(max_length=4000),
        model=dict(num_layers=4, embed_dim=128, num_heads=4, mlp_dim=512, pooling="cls",
                   dropout_rate=0.1),
        # LRA: warmup 8000 > 5000 steps (the peak is never reached); here warmup 1000 to a
        # peak of LRA's learning rate at step 5000, then cosine.
        batch_size=32, num_train_steps=5000, warmup_steps=1000,
        learning_rate=0.05 * 5000 / 8000 / math.sqrt(8000), weight_decay=0.1,
        eval_every_steps=500),
    "image": dict(
        task="lra_image", task_fields=dict(),
        model=dict(num_layers=1, embed_dim=32, num_heads=1, mlp_dim=64, pooling="mean",
                   dropout_rate=0.3),
        batch_size=256, num_train_steps=175 * 200, warmup_steps=175,
        learning_rate=5e-4, weight_decay=0.0, grad_clip_norm=0.0, eval_every_steps=175),
    "pathfinder": dict(
        task="pathfinder", task_fields=dict(),
        model=dict(num_layers=1, embed_dim=32, num_heads=2, head_dim=8, mlp_dim=32,
                   pooling="mean", dropout_rate=0.1),
        batch_size=512, num_train_steps=312 * 200, warmup_steps=312,
        learning_rate=1e-3, weight_decay=0.0, grad_clip_norm=0.0, eval_every_steps=312),
}

# Rows and columns of the tables: argument value -> (model fields, the paper's label). Model
# fields may set kernel, positional (names joined by "+"), positional_options (scheme ->
# options), use_grid and any other config.model field.
Cells = Mapping[str, tuple[dict, str]]

KERNEL_ROWS: dict[str, tuple[dict, str]] = {
    "softmax": (dict(kernel="softmax"), "Original"),
    "dpfp": (dict(kernel="dpfp"), "Linear, DPFP"),
    "sikf": (dict(kernel="sikf"), "Linear, SIKF"),
    "relu": (dict(kernel="relu"), "Linear, ReLU"),
    "elu1": (dict(kernel="elu1"), "Linear, ELU + 1"),
    "favor": (dict(kernel="favor"), "Performer"),
}

# FastRPB Tables 1-2 columns. The models "also used trainable absolute positional encodings"
# (FastRPB Sec. 4). SPE is 1D: on images it sees the raster sequence (use_grid=False).
FASTRPB_COLUMNS: dict[str, tuple[dict, str]] = {
    "none": (dict(positional="absolute"), "None"),
    "fastrpb": (dict(positional="absolute+fastrpb"), "FastRPB"),
    "sinspe": (dict(positional="absolute+spe", positional_options={"spe": {"kind": "sine"}},
                    use_grid=False), "sinSPE"),
    "convspe": (dict(positional="absolute+spe", positional_options={"spe": {"kind": "conv"}},
                     use_grid=False), "convSPE"),
    # The paper's RPE column (softmax only): a learned per-offset logits bias b_{j-i}. With a
    # linear kernel the same table mixes keys by FFT (Luo et al.), a cell the paper lacks.
    "rpe": (dict(positional="absolute+kernelized_rpe"), "RPE"),
}


def experiment_config(lra_task: str, arg: str | None, *, rows: Cells, columns: Cells,
                      paper_table: str, paper_results: Mapping[str, float],
                      default_row: str, default_col: str, row_arg: str = "kernel",
                      col_arg: str = "pos", metric: str = "accuracy",
                      settings: Mapping | None = None) -> ml_collections.ConfigDict:
  """The config of one cell (``<row_arg>=<row>``, ``<col_arg>=<col>``) of a paper table.

  Args:
    lra_task: a key of ``LRA_TASKS`` (or any name when ``settings`` are given).
    arg: the ``get_config`` argument, e.g. ``"kernel=sikf,pos=fastrpb,tiny"``.
    rows, columns: argument value -> (model fields, label). Column fields are applied after
      the row's.
    paper_table: e.g. "FastRPB Table 1 (Text)".
    paper_results: "<row label>|<column label>" -> the paper's number.
    default_row, default_col: the cell a bare ``get_config()`` gives.
    row_arg, col_arg: the argument names that pick the row and the column.
    metric: the results key the paper's numbers compare with.
    settings: the task's settings (the format of ``LRA_TASKS`` values) instead of LRA's.
  """
  a = parse_arg(arg, tiny=False, **{row_arg: default_row, col_arg: default_col})
  for name, table in ((row_arg, rows), (col_arg, columns)):
    if a[name] not in table:
      raise ValueError(f"unknown {name}={a[name]!r} for {paper_table}; valid: "
                       f"{', '.join(table)}.")
  s = dict(settings or LRA_TASKS[lra_task])
  c = base_config(s["task"])
  c.task.update(s["task_fields"])
  c.model.update(s["model"])
  row_fields, row_label = rows[a[row_arg]]
  col_fields, col_label = columns[a[col_arg]]
  for fields in (row_fields, col_fields):
    fields = dict(fields)
    for name, opts in fields.pop("positional_options", {}).items():
      c.model.positional_options[name] = ml_collections.ConfigDict(opts)
    c.model.update(fields)
  c.batch_size = s["batch_size"]
  c.num_train_steps = s["num_train_steps"]
  c.schedule.warmup_steps = s["warmup_steps"]
  c.schedule.name = s.get("schedule", "cosine")
  c.optimizer.learning_rate = s["learning_rate"]
  c.optimizer.weight_decay = s["weight_decay"]
  if "grad_clip_norm" in s:
    c.optimizer.grad_clip_norm = s["grad_clip_norm"]
  c.optimizer.update(s.get("optimizer", {}))  # other AdamW fields (b1, b2, eps)
  c.model.kernel_options.update(s.get("kernel_options", {}))
  c.eval_every_steps = c.checkpoint_every_steps = s["eval_every_steps"]
  set_paper(c, row=row_label, col=col_label, table=paper_table, results=paper_results,
            metric=metric)
  if a.tiny:
    make_tiny(c)
  return c


def set_paper(c: ml_collections.ConfigDict, *, row: str, col: str, table: str,
              results: Mapping[str, float], metric: str) -> None:
  """Records the run's place in the paper's table and the paper's numbers in the config."""
  c.experiment = ml_collections.ConfigDict(dict(row=row, col=col))
  c.paper = ml_collections.ConfigDict(dict(table=table, metric=metric))
  c.paper.results = ml_collections.ConfigDict(dict(results))


def make_tiny(c: ml_collections.ConfigDict) -> None:
  """The ``tiny`` variant: a model and a run that fit a 2-core CPU in minutes (image tasks
  keep their grid: their length is the image's)."""
  if "max_length" in c.task:
    c.task.max_length = min(c.task.max_length, 128)
  if "segment_length" in c.task:  # WikiText-103: short segments, a small vocabulary
    c.task.segment_length = min(c.task.segment_length, 64)
    c.task.vocab_size = min(c.task.vocab_size, 1000)
  c.model.update(num_layers=1, embed_dim=16, num_heads=2, head_dim=0, mlp_dim=32)
  c.model.kernel_options.num_features = 16
  c.batch_size = 8
  c.num_train_steps = 20
  c.schedule.warmup_steps = 5
  c.log_every_steps = c.eval_every_steps = c.checkpoint_every_steps = 10


def _results(row_labels, col_labels, table) -> dict[str, float]:
  """{"<row>|<col>": value} from a printed table (None = not reported: OOM, "-", N/A)."""
  out = {}
  for r, values in zip(row_labels, table):
    for col, v in zip(col_labels, values):
      if v is not None:
        out[f"{r}|{col}"] = v
  return out


_FASTRPB_ROWS = ("Original", "Linear, DPFP", "Linear, SIKF", "Linear, ReLU", "Performer")
_FASTRPB_COLS = ("None", "FastRPB", "sinSPE", "convSPE", "RPE")

# FastRPB Table 1 (test accuracy %, mean of the paper's runs; Performer and ReLU without
# FastRPB copied there from SPE). None marks OOM, "-" (too long) and N/A.
FASTRPB_TABLE1: dict[str, dict[str, float]] = {
    "listops": _results(_FASTRPB_ROWS, _FASTRPB_COLS, [
        (14.43, 14.6, None, None, None),
        (20.67, 17.97, 17.57, 16.17, None),
        (12.55, 11.47, 15.25, 17.8, None),
        (17.58, 17.67, 17.80, 9.50, None),
        (17.80, 17.75, 17.43, 17.80, None)]),
    "text": _results(_FASTRPB_ROWS, _FASTRPB_COLS, [
        (62.27, 62.02, None, None, 55.7),
        (62.78, 63.05, 62.76, 62.78, None),
        (61.64, 62.35, 63.37, 62.24, None),
        (58.78, 63.95, 62.39, 61.00, None),
        (59.84, 62.66, 60.00, 57.22, None)]),
    "retrieval": _results(_FASTRPB_ROWS, _FASTRPB_COLS, [
        (None, None, None, None, None),
        (61.01, 64.79, 61.53, 63.52, None),
        (59.51, 67.19, 62.0, 58.93, None),
        (58.78, 64.94, 62.39, 61.00, None),
        (59.84, 66.65, 60.00, 57.22, None)]),
    "image": _results(_FASTRPB_ROWS, _FASTRPB_COLS, [
        (41.88, 39.02, None, None, None),
        (41.79, 38.73, 41.97, 41.33, None),
        (41.96, 38.89, 40.73, 42.94, None),
        (42.25, 38.44, 41.21, 39.96, None),
        (41.81, 32.26, 41.12, 40.06, None)]),
}
FASTRPB_KERNELS = {k: KERNEL_ROWS[k] for k in ("softmax", "dpfp", "sikf", "relu", "favor")}

# FastRPB Table 2: MNIST F1 (%), w/o and w/ FastRPB; Table 4: the learning rates found by the
# paper's search for each cell.
MNIST_ROWS = {k: KERNEL_ROWS[k] for k in ("softmax", "dpfp", "sikf", "elu1", "favor")}
MNIST_COLUMNS = {"none": (dict(positional="absolute"), "w/o FastRPB"),
                 "fastrpb": (dict(positional="absolute+fastrpb"), "w/ FastRPB")}
FASTRPB_TABLE2 = _results(
    ("Original", "Linear, DPFP", "Linear, SIKF", "Linear, ELU + 1", "Performer"),
    ("w/o FastRPB", "w/ FastRPB"),
    [(97.34, 98.27), (97.09, 97.66), (96.49, 97.37), (94.01, 96.71), (96.6, 97.52)])
MNIST_LEARNING_RATES = {
    ("softmax", "none"): 1.05e-4, ("softmax", "fastrpb"): 1.35e-4,
    ("dpfp", "none"): 1.3e-4, ("dpfp", "fastrpb"): 0.7e-4,
    ("sikf", "none"): 1.25e-4, ("sikf", "fastrpb"): 1.45e-4,
    ("elu1", "none"): 1.3e-4, ("elu1", "fastrpb"): 1.25e-4,
    ("favor", "none"): 1.2e-4, ("favor", "fastrpb"): 1.0e-4,
}
# FastRPB Sec. 4: 8 layers, 8 heads, hidden 256, 25 epochs, learning rate decayed linearly to
# 0. The batch size is not given: 64 is this file's choice (54k training images: 10% of the
# 60k are held out for validation).
MNIST_SETTINGS = dict(
    task="mnist", task_fields=dict(),
    model=dict(num_layers=8, embed_dim=256, num_heads=8, mlp_dim=1024, pooling="mean",
               dropout_rate=0.1),
    batch_size=64, num_train_steps=(54_000 // 64) * 25, warmup_steps=500, schedule="linear",
    learning_rate=1.3e-4, weight_decay=0.01, eval_every_steps=54_000 // 64)

# PermuteFormer Table 1 (LRA accuracy %, mean of 5 runs). PermuteFormer is built on Performer
# (Sec. 5: ReLU random features keep the features non-negative); RoFormer here is Performer
# with RoPE on the features. "w/o 2D rel pos" treats images as sequences.
PERMUTEFORMER_ROWS: dict[str, tuple[dict, str]] = {
    "transformer": (dict(kernel="softmax", positional="absolute"), "Transformer"),
    "sinusoidal": (dict(kernel="softmax", positional="absolute",
                        positional_options={"absolute": {"kind": "sinusoidal"}}),
                   "w/ sinusoidal pos emb"),
    "performer": (dict(kernel="favor", positional="absolute"), "Performer"),
    "roformer": (dict(kernel="favor", positional="rope"), "RoFormer"),
    "permuteformer": (dict(kernel="relu", positional="permuteformer"), "PermuteFormer"),
    "permuteformer_1d": (dict(kernel="relu", positional="permuteformer", use_grid=False),
                         "w/o 2D rel pos"),
}
PERMUTEFORMER_TABLE1 = _results(
    ("Transformer", "w/ sinusoidal pos emb", "Performer", "RoFormer", "PermuteFormer",
     "w/o 2D rel pos"),
    ("Text", "Retrieval", "Image", "Pathfinder"),
    [(63.99, 80.02, 42.83, 72.40), (64.06, 79.81, 43.30, 73.00),
     (63.95, 79.82, 43.08, 72.63), (66.00, 75.27, 26.16, 58.87),
     (65.95, 80.66, 43.02, 72.91), (65.95, 80.66, 36.10, 65.72)])

# LRPE Table 4 (LRA accuracy %): linear attention (ELU+1 here; the paper's LRA code base uses
# BatchNorm blocks, model.norm="batch") with each encoding.
LRPE_ROWS: dict[str, tuple[dict, str]] = {
    "base": (dict(kernel="elu1", positional="none"), "Base"),
    "rope": (dict(kernel="elu1", positional="rope"), "RoPE"),
    "per": (dict(kernel="elu1", positional="permuteformer"), "Per"),
    "type1": (dict(kernel="elu1", positional="lrpe",
                   positional_options={"lrpe": {"type": 1}}), "Type1"),
    "type2": (dict(kernel="elu1", positional="lrpe",
                   positional_options={"lrpe": {"type": 2}}), "Type2"),
    "type3": (dict(kernel="elu1", positional="lrpe",
                   positional_options={"lrpe": {"type": 3}}), "Type3"),
}
LRPE_TABLE4 = _results(
    ("Base", "RoPE", "Per", "Type1", "Type2", "Type3"),
    ("Text", "ListOps", "Retrieval", "Pathfinder", "Image"),
    [(64.81, 39.17, 84.71, 71.61, 41.21), (66.53, 40.57, 78.75, 72.68, 62.50),
     (65.50, 39.17, 83.40, 69.55, 42.03), (66.80, 39.84, 82.13, 73.79, 63.43),
     (66.52, 39.79, 81.55, 73.46, 62.35), (64.94, 39.56, 83.86, 70.78, 45.15)])

TASK_LABELS = {"listops": "ListOps", "text": "Text", "retrieval": "Retrieval",
               "image": "Image", "pathfinder": "Pathfinder"}


def fastrpb_table1(lra_task: str, arg: str | None) -> ml_collections.ConfigDict:
  """A cell of FastRPB Table 1 on ``lra_task`` (``kernel=<row>,pos=<col>``)."""
  return experiment_config(
      lra_task, arg, rows=FASTRPB_KERNELS, columns=FASTRPB_COLUMNS,
      paper_table=f"FastRPB Table 1 ({TASK_LABELS[lra_task]})",
      paper_results=FASTRPB_TABLE1[lra_task], default_row="sikf", default_col="fastrpb")


def permuteformer_table1(lra_task: str, arg: str | None) -> ml_collections.ConfigDict:
  """A row of PermuteFormer Table 1 on ``lra_task`` (``model=<row>``)."""
  label = TASK_LABELS[lra_task]
  return experiment_config(
      lra_task, arg, rows=PERMUTEFORMER_ROWS, columns={lra_task: ({}, label)},
      paper_table="PermuteFormer Table 1", paper_results=PERMUTEFORMER_TABLE1,
      default_row="permuteformer", default_col=lra_task, row_arg="model", col_arg="task")


def lrpe_table4(lra_task: str, arg: str | None) -> ml_collections.ConfigDict:
  """A row of LRPE Table 4 on ``lra_task`` (``pe=<row>``), with BatchNorm blocks."""
  c = experiment_config(
      lra_task, arg, rows=LRPE_ROWS, columns={lra_task: (dict(norm="batch"),
                                                         TASK_LABELS[lra_task])},
      paper_table="LRPE Table 4", paper_results=LRPE_TABLE4, default_row="type2",
      default_col=lra_task, row_arg="pe", col_arg="task")
  return c


def mnist_table2(arg: str | None) -> ml_collections.ConfigDict:
  """A cell of FastRPB Table 2 (MNIST, ``kernel=<row>,pos=none|fastrpb``) with the learning
  rate the paper's search found for it (Table 4)."""
  c = experiment_config(
      "mnist", arg, rows=MNIST_ROWS, columns=MNIST_COLUMNS,
      paper_table="FastRPB Table 2 (MNIST)", paper_results=FASTRPB_TABLE2,
      default_row="sikf", default_col="fastrpb", settings=MNIST_SETTINGS)
  a = parse_arg(arg, tiny=False, kernel="sikf", pos="fastrpb")
  c.optimizer.learning_rate = MNIST_LEARNING_RATES[(a.kernel, a.pos)]
  return c


# ---------------------------------------------------------------------------------------------
# WikiText-103 (causal language modelling)
# ---------------------------------------------------------------------------------------------
# PermuteFormer Sec. 4.2.1: fairseq's transformer_lm recipe (examples/language_model) with 6
# layers, width 512, FFN 1024, 8 heads, segments of 512; r in [0.88, 0.99] per head
# (decay="paper": permuteformer.paper_decays). fairseq's command: Adam (0.9, 0.98), lr 5e-4,
# inverse-sqrt after 4000 warmup steps, weight decay 0.01, no clipping, dropout 0.1, 50k updates of
# 2048 tokens x 16 (update-freq) = 64 segments. Sinusoidal absolute positions (fairseq's
# default) except for PermuteFormer ("Absolute position embedding is disabled").
WIKITEXT_PERMUTEFORMER_SETTINGS = dict(
    task="wikitext103", task_fields=dict(segment_length=512),
    model=dict(num_layers=6, embed_dim=512, num_heads=8, mlp_dim=1024, dropout_rate=0.1,
               norm="post", tie_embeddings=True),
    batch_size=64, num_train_steps=50_000, warmup_steps=4000, schedule="rsqrt",
    learning_rate=5e-4, weight_decay=0.01, grad_clip_norm=0.0, eval_every_steps=2000)

_SINUSOIDAL = {"absolute": {"kind": "sinusoidal"}}


def _permuteformer_rows() -> dict[str, tuple[dict, str]]:
  r = PAPER_DECAY  # per-head r = paper_decays(num_heads), in [0.88, 0.99]
  return {
      "transformer": (dict(kernel="softmax", positional="absolute",
                           positional_options=_SINUSOIDAL), "Transformer"),
      "performer": (dict(kernel="favor", positional="absolute",
                         positional_options=_SINUSOIDAL), "Performer"),
      "permuteformer": (dict(kernel="relu", positional="permuteformer",
                             positional_options={"permuteformer": {"decay": r}}),
                        "PermuteFormer"),
      "no_r": (dict(kernel="relu", positional="permuteformer"), "PermuteFormer w/o r"),
      "no_perm": (dict(kernel="relu", positional="permuteformer",
                       positional_options={"permuteformer": {"decay": r, "permute": False}}),
                  "PermuteFormer w/o Ppi"),
  }


WIKITEXT_PERMUTEFORMER_ROWS = _permuteformer_rows()
# PermuteFormer Table 4: test perplexity (the paper counts only the last 256 tokens of each
# 512-token segment; eval.py here scores every token of non-overlapping segments).
PERMUTEFORMER_TABLE4 = _results(
    ("Transformer", "Performer", "PermuteFormer", "PermuteFormer w/o r",
     "PermuteFormer w/o Ppi"), ("WikiText-103",),
    [(30.18,), (36.87,), (32.49,), (35.76,), (33.08,)])

# Luo et al. Sec. 4.2: 6 layers, 8 heads, width 512, FFN 2048, dropout 0.1, weight decay 0.01,
# batch 64 x 512 tokens, m = 64 features, Adam eps 1e-6 (0.9, 0.98), peak lr 2e-3, 150k steps,
# 6k warmup then inverse square root. No context from earlier segments.
WIKITEXT_NPRF_SETTINGS = dict(
    task="wikitext103", task_fields=dict(segment_length=512),
    model=dict(num_layers=6, embed_dim=512, num_heads=8, mlp_dim=2048, dropout_rate=0.1,
               norm="post", tie_embeddings=True),
    kernel_options=dict(num_features=64), optimizer=dict(eps=1e-6),
    batch_size=64, num_train_steps=150_000, warmup_steps=6000, schedule="rsqrt",
    learning_rate=2e-3, weight_decay=0.01, grad_clip_norm=0.0, eval_every_steps=5000)
WIKITEXT_NPRF_ROWS: dict[str, tuple[dict, str]] = {
    "vanilla": (dict(kernel="softmax", positional="absolute",
                     positional_options=_SINUSOIDAL), "Vanilla Transformer"),
    "linear": (dict(kernel="elu1", positional="absolute", positional_options=_SINUSOIDAL),
               "Linear Transformer"),
    "trf": (dict(kernel="trf", positional="absolute", positional_options=_SINUSOIDAL),
            "TRF-Transformer"),
    "nprf_rpe": (dict(kernel="nprf", positional="absolute+kernelized_rpe",
                      positional_options=_SINUSOIDAL), "NPRF-Transformer w/ RPE"),
}
# Luo et al. Table 2: validation perplexity (TRF-Transformer-GATE, 31.3, is not built here).
LUO_TABLE2 = _results(
    ("Vanilla Transformer", "Linear Transformer", "TRF-Transformer",
     "NPRF-Transformer w/ RPE"), ("WikiText-103",), [(33.0,), (38.4,), (33.6,), (30.6,)])

_WIKITEXT_COLUMN = {"wikitext103": ({}, "WikiText-103")}


def wikitext_permuteformer_table4(arg: str | None) -> ml_collections.ConfigDict:
  """A row of PermuteFormer Table 4 (``model=<row>``): causal LM on WikiText-103."""
  return experiment_config(
      "wikitext103", arg, rows=WIKITEXT_PERMUTEFORMER_ROWS, columns=_WIKITEXT_COLUMN,
      paper_table="PermuteFormer Table 4 (test perplexity)",
      paper_results=PERMUTEFORMER_TABLE4, default_row="permuteformer",
      default_col="wikitext103", row_arg="model", col_arg="task", metric="perplexity",
      settings=WIKITEXT_PERMUTEFORMER_SETTINGS)


def wikitext_nprf_table2(arg: str | None) -> ml_collections.ConfigDict:
  """A row of Luo et al. Table 2 (``model=<row>``): causal LM on WikiText-103."""
  return experiment_config(
      "wikitext103", arg, rows=WIKITEXT_NPRF_ROWS, columns=_WIKITEXT_COLUMN,
      paper_table="Luo et al. Table 2 (validation perplexity)", paper_results=LUO_TABLE2,
      default_row="nprf_rpe", default_col="wikitext103", row_arg="model", col_arg="task",
      metric="perplexity", settings=WIKITEXT_NPRF_SETTINGS)
