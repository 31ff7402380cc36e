"""What the experiment files share: the base config, the argument parser, the typed builder of a
paper table's cell, LRA's task settings, the kernel rows of the papers' tables and the ``tiny``
shrink.

``base_config(task)`` is ``fastpos.config_schema.base_config``: the complete config of a run on
``task`` (every field, the task's block included), each field declared once by its owner with
its comment and valid values (docs/config.md), so that loading a config (``train.py
--print_config``, ``--list_configs``) starts no trainer and imports no jax. A file changes the fields
that differ; ``get_config`` returns the whole config and nothing completes it later.

A config file defines ``ARGS`` (its arguments and their defaults), optionally ``CHOICES``
(argument -> valid values) and ``get_config(arg=None)``; ``arg`` is what follows the colon in
``--config=configs/x.py:task=text,tiny`` and is read by ``parse_arg``. A table file builds its
cells with ``table_config`` from its ``Settings`` and ``Row`` s; another file reuses a table's
cell through the table's typed builder, never by rebuilding its argument string.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Iterable, Mapping, NamedTuple

import ml_collections

from fastpos.config_schema import base_config
from fastpos.tasks import paths

__all__ = ["Row", "Settings", "base_config", "parse_arg", "table_config"]


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
# The typed builder of a paper table's cell
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Settings:
  """A table's training settings on one task: what its cells change in ``base_config(task)``.

  Attributes:
    task: the task's name; ``task_fields`` the fields of its block that differ.
    model: ``config.model`` fields every cell shares (sizes, pooling, dropout).
    eval_every_steps: also the checkpoint cadence.
    grad_clip_norm: None keeps the base's.
    optimizer: other AdamW fields (b1, b2, eps); ``kernel_options`` feature-map options.
  """

  task: str
  model: Mapping[str, Any]
  batch_size: int
  num_train_steps: int
  warmup_steps: int
  learning_rate: float
  weight_decay: float
  eval_every_steps: int
  task_fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  schedule: str = "cosine"
  grad_clip_norm: float | None = None
  optimizer: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  kernel_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def config(self) -> ml_collections.ConfigDict:
    """The base config of ``task`` with these settings."""
    c = base_config(self.task)
    c.task.update(self.task_fields)
    c.model.update(self.model)
    c.model.kernel_options.update(self.kernel_options)
    c.batch_size = self.batch_size
    c.num_train_steps = self.num_train_steps
    c.schedule.update(name=self.schedule, warmup_steps=self.warmup_steps)
    c.optimizer.update(learning_rate=self.learning_rate, weight_decay=self.weight_decay)
    if self.grad_clip_norm is not None:
      c.optimizer.grad_clip_norm = self.grad_clip_norm
    c.optimizer.update(self.optimizer)
    c.eval_every_steps = c.checkpoint_every_steps = self.eval_every_steps
    return c


class Row(NamedTuple):
  """A row or column of a paper's table: its ``config.model`` fields (``positional_options``:
  scheme -> options) and the paper's label."""

  fields: Mapping[str, Any]
  label: str


def table_config(
    settings: Settings,
    *rows: Row,
    table: str,
    results: Mapping[str, float],
    col: str | None = None,
    metric: str = "accuracy",
    tiny: bool = False,
) -> ml_collections.ConfigDict:
  """The config of one cell of a paper's table: ``settings`` with the model fields of each of
  ``rows`` in order (a kernel row, then a positional column), the cell recorded by its labels
  (row: the first's; column: ``col``, else the second's) with the paper's ``results``, and the
  ``tiny`` variant on request."""
  c = settings.config()
  for row in rows:
    set_model(c, row.fields)
  col = col if col is not None else rows[1].label
  set_paper(c, row=rows[0].label, col=col, table=table, results=results, metric=metric)
  if tiny:
    make_tiny(c)
  return c


# ---------------------------------------------------------------------------------------------
# LRA (google-research/long-range-arena, lra_benchmarks/*/configs): each task's base settings.
# LRA's learning-rate rule 0.05 * linear_warmup * rsqrt_decay (ListOps, Text, Retrieval) peaks at
# 0.05 / sqrt(warmup); here that peak is the AdamW learning rate with a cosine decay (an
# approximation). Image and Pathfinder use LRA's own AdamW + cosine values.
# ---------------------------------------------------------------------------------------------
LRA_TASKS: dict[str, Settings] = {
    "listops": Settings(
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
    "text": Settings(
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
    "retrieval": Settings(
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
    "image": Settings(
        task="lra_image",
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
    "pathfinder": Settings(
        task="pathfinder",
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

# The kernel rows of the papers' tables, by argument value.
KERNELS: dict[str, Row] = {
    "softmax": Row(dict(kernel="softmax"), "Original"),
    "dpfp": Row(dict(kernel="dpfp"), "Linear, DPFP"),
    "sikf": Row(dict(kernel="sikf"), "Linear, SIKF"),
    "relu": Row(dict(kernel="relu"), "Linear, ReLU"),
    "elu1": Row(dict(kernel="elu1"), "Linear, ELU + 1"),
    "favor": Row(dict(kernel="favor"), "Performer"),
}
SINUSOIDAL = {"absolute": {"kind": "sinusoidal"}}  # positional_options: fixed sin/cos table


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


# The package's small samples of a task's data, each a data root (fastpos.tasks.paths.SAMPLES):
# a ``:tiny`` run of these tasks reads them unless config.task.data_dir is set.
FIXTURES = {"wikitext103": "wikitext", "listops": "listops", "lra_retrieval": "retrieval"}
FIXTURES_ROOT = paths.SAMPLES


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


PERMUTEFORMER_CLAIM = ("transformer", "performer", "permuteformer")


def pick(rows: dict[str, Row], names: tuple[str, ...]) -> dict[str, Row]:
  """The rows ``names`` of a table's ``rows``, in that order (a claim's subset of a table)."""
  return {name: rows[name] for name in names}
