"""What the experiment files share: the base config, the argument parser, LRA's task settings,
the kernel rows of the papers' tables and the ``tiny`` shrink.

Imports ml_collections only, so that loading a config (``train.py --print_config``,
``--list_configs``) does not start the trainer. ``config.task`` holds the task's name and the
fields a file sets; train.py fills in the task's other fields from its class
(``fastpos.train.config.complete_task``) when it loads the file, before the ``--config.*``
overrides. ``tests/train/test_configs.py`` checks that ``base_config`` here, completed, equals
``fastpos.train.config.base_config`` for every task.

A config file defines ``ARGS`` (its arguments and their defaults), optionally ``CHOICES``
(argument -> valid values) and ``get_config(arg=None)``; ``arg`` is what follows the colon in
``--config=configs/x.py:task=text,tiny`` and is read by ``parse_arg``.

What each field may hold (type, range or choices) and whether changing it changes a run's
results is declared in ``fastpos.config_schema`` (a leaf module: no jax, flax or numpy), which
train.py checks every loaded config against; a new field needs a line there.
"""

from __future__ import annotations

import math
import os
from typing import Iterable, Mapping

import ml_collections


def base_config(task: str) -> ml_collections.ConfigDict:
  """The base config for a run on task ``task`` (``config.task`` holds only its name)."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # seeds parameter init, dropout and the training data order (separate streams)
  # The task's block: its name here; train.py adds the task's default fields
  # (fastpos.tasks.<task module>.default_config()) that the file does not set.
  c.task = ml_collections.ConfigDict(dict(name=task))

  # The model (fastpos.models.config.model_config, the same fields and defaults).
  c.model = ml_collections.ConfigDict()
  # Attention similarity: "softmax" or a feature map of fastpos.ops.features.FEATURE_MAPS
  # (elu1, relu, sikf, dpfp, favor, prf, trf, nprf, orf).
  c.model.kernel = "softmax"
  # Feature-map options: random features m (favor/prf/trf/nprf/orf), DPFP's nu, the
  # denominator guard, and whether random projections are redrawn every training step.
  c.model.kernel_options = ml_collections.ConfigDict(
      dict(num_features=64, nu=1, eps=1e-6, redraw=False, seed=0)
  )
  # Positional schemes joined by "+" or ",", applied in this order at their hooks
  # (fastpos.positional.SCHEMES; "none" for no positional information).
  c.model.positional = "none"
  # Per-scheme options, by scheme name: {scheme: {option: value}}; unset options keep the
  # scheme class's defaults. On the command line one option at a time:
  # --config.model.positional_options.fastrpb.per_head=True.
  c.model.positional_options = ml_collections.ConfigDict()
  c.model.num_layers = 4
  c.model.embed_dim = 256  # D, the model width
  c.model.num_heads = 4
  c.model.head_dim = 0  # 0 means embed_dim // num_heads
  c.model.mlp_dim = 1024
  c.model.dropout_rate = 0.1
  c.model.norm = "post"  # "post" (LRA's layout) or "pre" LayerNorm; "batch" = post BatchNorm
  c.model.pooling = "mean"  # encoder pooling: "mean" over real tokens or "cls" (a prepended token)
  c.model.max_length = 0  # longest sequence the positional tables serve; 0: the task's
  c.model.dtype = "float32"  # activations: "float32" or "bfloat16" (params stay float32)
  c.model.tie_embeddings = True  # lm only: output projection = input embedding transposed
  c.model.memory_length = 0  # lm only: Transformer-XL memory M (the transformer_xl scheme)
  c.model.chunk_size = 0  # causal linear attention chunk; 0 picks it from the shape
  # Image tasks: True gives the positional schemes the image grid (2D positions); False treats
  # the image as its raster sequence (1D schemes, e.g. SPE, or "w/o 2D rel. pos.").
  c.model.use_grid = True
  # What a block keeps for backward: "none", "block" (recompute all but its input) or
  # "save_matmuls" (keep the matmul outputs); changes memory and time, never the numbers.
  c.model.remat = "none"
  # nn.scan over the layers (one compiled body; parameters stacked under "layers").
  c.model.scan_layers = False
  # Chunk the blocks' token-wise part (norms, dropout, MLP) over the sequence; 0: off.
  c.model.mlp_chunk = 0

  # Batches and duration. Durations are in optimizer steps.
  c.batch_size = 32  # global batch per optimizer step, over all devices and hosts
  c.eval_batch_size = 0  # global evaluation batch; 0 means batch_size
  c.grad_accum_steps = 1  # split each batch into this many sequential micro-batches
  c.num_train_steps = 5000

  # AdamW (decoupled weight decay), global-norm gradient clipping.
  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.learning_rate = 1e-3  # peak learning rate, reached after the warmup
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.98
  c.optimizer.eps = 1e-9
  c.optimizer.weight_decay = 0.01  # AdamW decay (multiplied by the learning rate)
  # Parameters whose path has a component matching one of these fnmatch patterns get no
  # weight decay (biases, norm scales, positional tables); 0-d / 1-d parameters never do.
  c.optimizer.no_decay = "*bias*,*scale*,pos_*,*positional*"
  c.optimizer.grad_clip_norm = 1.0  # clip the global gradient norm; 0 disables clipping

  # Learning-rate schedule: linear warmup from 0, then decay to end_factor * peak.
  c.schedule = ml_collections.ConfigDict()
  c.schedule.name = "cosine"  # "cosine", "linear", "constant" or "rsqrt" (after the warmup)
  c.schedule.warmup_steps = 500
  c.schedule.end_factor = 0.0  # final learning rate / peak learning rate

  # Cadences, in optimizer steps.
  c.log_every_steps = 50  # progress line, metrics.jsonl and TensorBoard for training
  c.eval_every_steps = 500  # evaluate on the validation split (never test)
  c.num_eval_batches = 0  # validation batches per evaluation; 0 means the whole split
  c.checkpoint_every_steps = 500  # also saved at the end, on SIGTERM and at each evaluation
  c.keep_checkpoints = 3  # the last few checkpoints kept (the best one is kept apart)
  c.async_checkpoints = True  # write checkpoints in a background thread

  # Precision of float32 matmuls on accelerators ("default", "high", "highest"); the
  # activation dtype is config.model.dtype.
  c.precision = "default"

  # Device mesh: axes ("data", "model"). The data axis takes the devices that the model
  # axis does not; batches are split over "data".
  c.mesh = ml_collections.ConfigDict()
  c.mesh.model = 1  # devices on the model axis (1 = pure data parallelism)
  c.mesh.seq = 1  # devices each sequence is split over (context parallelism; linear kernels)
  # Parameter sharding rules: ((regex over the "/"-joined parameter path, spec), ...) with
  # spec a tuple of mesh axis names or None per dimension, e.g. ((r"mlp/.*kernel",
  # (None, "model")),). The first matching rule wins; unmatched parameters are replicated.
  c.mesh.rules = ()

  # Host input pipeline (grain).
  c.data = ml_collections.ConfigDict()
  c.data.num_threads = 2  # threads reading examples
  c.data.prefetch = 4  # batches read ahead
  # Length bucketing (classify / retrieval tasks): increasing lengths in [1, task.max_length]
  # a batch is cut to (the shortest holding its longest example; max_length is added); () pads
  # every batch to task.max_length. Changes the batches drawn, so a run's results.
  c.data.bucket_lengths = ()
  c.data.bucket_window = 16  # >= 1 global batches sorted (or packed) together
  # Sequence packing (lm tasks, models that keep segments apart: softmax kernel, schemes none /
  # absolute / t5_bias / rope / kernelized_rpe): several examples per row. Changes results.
  c.data.pack = False
  return c


def parse_arg(
    arg: str | None, *, choices: Mapping[str, Iterable[str]] | None = None, **defaults
) -> ml_collections.ConfigDict:
  """Parses a ``get_config`` argument (``"tiny"``, ``"task=text,kernel=elu1"``) into fields.

  Bare words set a boolean field to True; ``key=value`` pairs take the type of the default.
  Every key must be one of ``defaults`` and a key listed in ``choices`` must take one of its
  values: a typo fails with a ValueError naming the valid keys or values.
  """
  choices = {k: tuple(v) for k, v in (choices or {}).items()}
  out = ml_collections.ConfigDict(dict(defaults))
  for part in filter(None, (p.strip() for p in (arg or "").split(","))):
    key, eq, value = part.partition("=")
    key, value = key.strip(), value.strip()
    if key not in defaults:
      raise ValueError(f"unknown config argument {key!r}; valid: {', '.join(defaults)}.")
    default = defaults[key]
    if not eq:
      if not isinstance(default, bool):
        raise ValueError(f"config argument {key!r} needs a value ({key}=...).")
      out[key] = True
    elif isinstance(default, bool):
      if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise ValueError(
            f"config argument {key}={value!r} is not a boolean; valid: true, "
            "false (or the bare word for true)."
        )
      out[key] = value.lower() in ("1", "true", "yes")
    else:
      try:
        out[key] = type(default)(value)
      except ValueError:
        raise ValueError(
            f"config argument {key}={value!r} is not a {type(default).__name__} "
            f"(default {default!r})."
        ) from None
  for key, valid in choices.items():
    if out[key] not in valid:
      raise ValueError(f"unknown {key}={out[key]!r}; valid: {', '.join(map(str, valid))}.")
  return out


# ---------------------------------------------------------------------------------------------
# LRA (google-research/long-range-arena, lra_benchmarks/*/configs): each task's base settings.
# LRA's learning-rate rule 0.05 * linear_warmup * rsqrt_decay (ListOps, Text, Retrieval) peaks at
# 0.05 / sqrt(warmup); here that peak is the AdamW learning rate with a cosine decay (an
# approximation). Image and Pathfinder use LRA's own AdamW + cosine values.
# ---------------------------------------------------------------------------------------------
LRA_TASKS: dict[str, dict] = {
    "listops": dict(
        task="listops",
        task_fields=dict(source="tsv", max_length=2000),
        model=dict(
            num_layers=6, embed_dim=512, num_heads=8, mlp_dim=2048, pooling="cls", dropout_rate=0.1
        ),
        batch_size=32,
        num_train_steps=5000,
        warmup_steps=1000,
        learning_rate=0.05 / math.sqrt(1000),
        weight_decay=0.1,
        eval_every_steps=500,
    ),
    "text": dict(
        task="lra_text",
        task_fields=dict(max_length=4000),
        model=dict(
            num_layers=4, embed_dim=256, num_heads=4, mlp_dim=1024, pooling="cls", dropout_rate=0.1
        ),
        batch_size=32,
        num_train_steps=20_000,
        warmup_steps=8000,
        learning_rate=0.05 / math.sqrt(8000),
        weight_decay=0.1,
        eval_every_steps=1000,
    ),
    "retrieval": dict(
        task="lra_retrieval",
        task_fields=dict(max_length=4000),
        model=dict(
            num_layers=4, embed_dim=128, num_heads=4, mlp_dim=512, pooling="cls", dropout_rate=0.1
        ),
        # LRA: warmup 8000 > 5000 steps (the peak is never reached); here warmup 1000 to a
        # peak of LRA's learning rate at step 5000, then cosine.
        batch_size=32,
        num_train_steps=5000,
        warmup_steps=1000,
        learning_rate=0.05 * 5000 / 8000 / math.sqrt(8000),
        weight_decay=0.1,
        eval_every_steps=500,
    ),
    "image": dict(
        task="lra_image",
        task_fields=dict(),
        model=dict(
            num_layers=1, embed_dim=32, num_heads=1, mlp_dim=64, pooling="mean", dropout_rate=0.3
        ),
        batch_size=256,
        num_train_steps=175 * 200,
        warmup_steps=175,
        learning_rate=5e-4,
        weight_decay=0.0,
        grad_clip_norm=0.0,
        eval_every_steps=175,
    ),
    "pathfinder": dict(
        task="pathfinder",
        task_fields=dict(),
        model=dict(
            num_layers=1,
            embed_dim=32,
            num_heads=2,
            head_dim=8,
            mlp_dim=32,
            pooling="mean",
            dropout_rate=0.1,
        ),
        batch_size=512,
        num_train_steps=312 * 200,
        warmup_steps=312,
        learning_rate=1e-3,
        weight_decay=0.0,
        grad_clip_norm=0.0,
        eval_every_steps=312,
    ),
}
LRA_LABELS = {
    "listops": "ListOps",
    "text": "Text",
    "retrieval": "Retrieval",
    "image": "Image",
    "pathfinder": "Pathfinder",
}

# The kernel rows of the papers' tables: argument value -> (model fields, the paper's label).
KERNELS: dict[str, tuple[dict, str]] = {
    "softmax": (dict(kernel="softmax"), "Original"),
    "dpfp": (dict(kernel="dpfp"), "Linear, DPFP"),
    "sikf": (dict(kernel="sikf"), "Linear, SIKF"),
    "relu": (dict(kernel="relu"), "Linear, ReLU"),
    "elu1": (dict(kernel="elu1"), "Linear, ELU + 1"),
    "favor": (dict(kernel="favor"), "Performer"),
}
SINUSOIDAL = {"absolute": {"kind": "sinusoidal"}}  # positional_options: fixed sin/cos table


def config_from_settings(s: Mapping) -> ml_collections.ConfigDict:
  """The base config with a task's settings (the format of ``LRA_TASKS`` values: task,
  task_fields, model, batch_size, num_train_steps, warmup_steps, learning_rate, weight_decay,
  eval_every_steps and optionally schedule, grad_clip_norm, optimizer, kernel_options)."""
  c = base_config(s["task"])
  c.task.update(s["task_fields"])
  c.model.update(s["model"])
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
  return c


def set_model(c: ml_collections.ConfigDict, fields: Mapping) -> None:
  """Sets ``config.model`` fields; ``positional_options`` (scheme -> options) adds blocks."""
  fields = dict(fields)
  for name, opts in fields.pop("positional_options", {}).items():
    c.model.positional_options[name] = ml_collections.ConfigDict(opts)
  c.model.update(fields)


def set_paper(
    c: ml_collections.ConfigDict,
    *,
    row: str,
    col: str,
    table: str,
    results: Mapping[str, float],
    metric: str = "accuracy",
) -> None:
  """Records the run's cell in the paper's table (``config.experiment``) and the paper's
  numbers (``config.paper``) for scripts/make_tables.py."""
  c.experiment = ml_collections.ConfigDict(dict(row=row, col=col))
  c.paper = ml_collections.ConfigDict(dict(table=table, metric=metric))
  c.paper.results = ml_collections.ConfigDict(dict(results))


def results(row_labels: Iterable[str], col_labels: Iterable[str], table) -> dict[str, float]:
  """``{"<row>|<col>": value}`` from a printed table (None: not reported, OOM, "-", N/A)."""
  col_labels = tuple(col_labels)
  out = {}
  for r, values in zip(row_labels, table, strict=True):
    for col, v in zip(col_labels, values, strict=True):
      if v is not None:
        out[f"{r}|{col}"] = v
  return out


# The repository's own small copies of a task's data, in the data root's layout: a ``:tiny``
# run of these tasks reads them unless config.task.data_dir is set.
FIXTURES = {"wikitext103": "wikitext", "listops": "listops", "lra_retrieval": "retrieval"}
FIXTURES_ROOT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "testdata"
)


def make_tiny(c: ml_collections.ConfigDict) -> None:
  """The ``tiny`` variant: a model and a run that fit a 2-core CPU in seconds. WikiText-103,
  ListOps (from files) and Retrieval read the repository's fixtures (``FIXTURES``; set
  config.task.data_dir="" for the real data); the other tasks still need their datasets
  (image tasks keep their grid: their length is the image's)."""
  if "max_length" in c.task:
    c.task.max_length = min(c.task.max_length, 128)
  generated = c.task.get("source") == "generated"  # ListOps made in memory reads no files
  if c.task.name in FIXTURES and not generated and not c.task.get("data_dir"):
    c.task.data_dir = os.path.join(FIXTURES_ROOT, FIXTURES[c.task.name])
  if c.task.name == "wikitext103":  # short segments, a vocabulary the fixtures fill
    c.task.segment_length = min(c.task.get("segment_length", 512), 64)
    c.task.vocab_size = 100  # the fixtures hold about 140 word types
    if c.task.get("eval_stride", 0):
      c.task.eval_stride = c.task.segment_length // 2
  c.model.update(num_layers=1, embed_dim=16, num_heads=2, head_dim=0, mlp_dim=32)
  c.model.kernel_options.num_features = 16
  c.batch_size = 8
  c.num_train_steps = 20
  c.schedule.warmup_steps = 5
  c.log_every_steps = c.eval_every_steps = c.checkpoint_every_steps = 10
