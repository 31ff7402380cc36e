"""The config's schema: every field's default, what it means, what it may hold, and whether
changing it changes a run's results; the one source of the base config.

The fields are declared by their owners with ``fastpos.fields`` and put together here:

- the trainer's own fields (the model's sizes and layout, optimizer, schedule, cadences, mesh,
  data pipeline): ``FIELDS`` below, in the base config's printed order, each with its comment;
- ``config.task``: each task's class declares its block (``Task.config_fields`` in
  ``fastpos/tasks/<module>.py``), found by name through ``fastpos.tasks.TASK_MODULES``;
- ``model.kernel`` (its choices) and ``model.kernel_options``: the kernel registry,
  ``fastpos.ops.features.KERNELS`` and the options it reads, ``fastpos.ops.kernel_options``;
- ``model.positional_options``: each scheme's ``option_spec`` (``fastpos.positional``), checked
  with the scheme names by ``fastpos.train.config.validate``.

The owners are read on use, so importing this module imports no jax, flax or numpy; building
a config imports the task's module (numpy) and the kernel options (no jax); checking one reads
the kernel names from the registry (jax). ``base_config(task)`` builds the complete config of a
run on ``task`` (``model_config()`` its model part); ``field(path, task)`` is the declaration
of one field; ``check(cfg)`` raises ``ConfigValueError`` with one line naming the first bad
field, its value and the valid values.

Each ``Field`` says the default, the type, the valid range or choices, and ``trajectory``: True
when a new value changes what a run computes (its parameters, its data order, which checkpoint
is best), False when it changes only how the run is carried out (log cadence, data threads,
device layout). A resumed run may change a field of the second kind freely; one of the first
kind only on request (``train.py --allow_config_change``), and the change is recorded.
docs/config.md says where each field lives and how to add one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

from fastpos import fields
from fastpos.fields import ConfigValueError, Field, check_flags, error

__all__ = [
    "FIELDS",
    "ConfigValueError",
    "Field",
    "base_config",
    "check",
    "check_flags",
    "error",
    "field",
    "is_trajectory",
    "kernel_options",
    "leaves",
    "model_config",
    "task_config",
    "task_fields",
]


def _decays(cfg) -> bool:
  """A schedule that decays towards num_train_steps moves when the number of steps does."""
  return cfg["schedule"]["name"] in ("cosine", "linear")


# Shorthands for the declarations below (fastpos.fields): the default first, then the valid
# values.
_int, _float, _str, _bool = fields.integer, fields.number, fields.string, fields.boolean
_block, _seed, _path = fields.block, fields.seed, fields.path


# The base config, in its printed order; each field's comment says what it does. A block's
# fields follow it ("model", then "model.<field>").
FIELDS: dict[str, Field] = {
    "seed": _seed(),  # seeds parameter init, dropout and the training data order (streams)
    # The task's block: config.task.name and the fields its Task class declares
    # (fastpos.tasks.<module>.<Task>.config_fields, found by name in fastpos.tasks.TASK_MODULES).
    "task": _block(),
    # The model (fastpos.models.build_model).
    "model": _block(),
    # Attention similarity: "softmax" or a feature map; the choices are the kernel registry's,
    # fastpos.ops.features.KERNELS (read there by ``field``).
    "model.kernel": _str("softmax", valid="a kernel of fastpos.ops.features.KERNELS"),
    # Feature-map options, declared by their owner (fastpos.ops.kernel_options.OPTIONS): random
    # features m, DPFP's nu, the denominator guard, whether random projections are redrawn
    # every training step, their seed.
    "model.kernel_options": _block(),
    # Positional schemes joined by "+" or ",", applied in this order at their hooks
    # (fastpos.positional.SCHEMES; "none" for no positional information). `python -m
    # fastpos.positional.compatibility` prints which kernels each works with.
    "model.positional": _str(
        "none", valid="scheme names of fastpos.positional joined by '+' or ','"
    ),
    # Per-scheme options, by scheme name: {scheme: {option: value}}, each scheme's
    # option_spec (fastpos.positional); unset options keep the scheme's defaults. In a config
    # file: c.model.positional_options.fastrpb = {"per_head": True}; on the command line one
    # option at a time: --config.model.positional_options.fastrpb.per_head=True.
    "model.positional_options": _block(),
    "model.num_layers": _int(4, 1),
    "model.embed_dim": _int(256, 1),  # D, the model width
    "model.num_heads": _int(4, 1),
    "model.head_dim": _int(0, 0),  # 0 means embed_dim // num_heads
    "model.mlp_dim": _int(1024, 1),
    "model.dropout_rate": _float(0.1, 0, 1, high_open=True),
    # "post" (LRA's layout) or "pre" LayerNorm; "batch" = post BatchNorm.
    "model.norm": _str("post", ("post", "pre", "batch")),
    # Encoder pooling: "mean" over real tokens or "cls" (a prepended token).
    "model.pooling": _str("mean", ("mean", "cls")),
    "model.max_length": _int(0, 0),  # longest sequence the positional tables serve; 0: task's
    "model.dtype": _str("float32", ("float32", "bfloat16")),  # activations; params float32
    "model.tie_embeddings": _bool(True),  # lm only: output projection = embedding transposed
    # lm only: Transformer-XL memory M (needs the transformer_xl scheme).
    "model.memory_length": _int(0, 0),
    # Causal linear attention chunk; 0 picks it: 32 on the plain causal path
    # (ops.attention.CAUSAL_PLAIN_CHUNK), else by feature and value sizes (causal_chunk_size).
    "model.chunk_size": _int(0, 0),
    # Image tasks: True gives the positional schemes the task's grid (2D positions); False
    # treats the image as its raster sequence (1D schemes, e.g. SPE, or PermuteFormer's
    # "w/o 2D rel. pos." ablation).
    "model.use_grid": _bool(True),
    # What each block keeps for its backward pass (fastpos.models.blocks.REMAT_POLICIES):
    # "none" (everything autodiff saves), "block" (only the block's input), "save_matmuls"
    # (the projections' / MLP's matmul outputs). The same numbers, less memory, more compute.
    "model.remat": _str("none", ("none", "block", "save_matmuls", "save_dots"), trajectory=False),
    # Run the layers as one nn.scan body (parameters stacked on a leading layer axis under
    # "layers"): compile time flat in depth. A checkpoint of the other layout won't load.
    "model.scan_layers": _bool(False),
    # Tokens per chunk of each block's token-wise part (dropout, residual, norms, MLP), run
    # chunk by chunk and rematerialised; 0: the whole sequence at once. Changes memory and
    # time, not the function (dropout masks included); not with norm="batch".
    "model.mlp_chunk": _int(0, 0, trajectory=False),
    # Tokens per chunk of each attention layer (projections, feature maps, outputs), run chunk
    # by chunk and rematerialised, with the key sums carried between two passes (causal: the
    # prefix state from chunk to chunk); 0: the whole sequence at once. Changes memory and
    # time, not the function (round-off only); for causal and bidirectional 1D linear layers
    # with output-hook schemes (fastpos.models.chunked_attention).
    "model.attn_chunk": _int(0, 0, trajectory=False),
    # The algorithm of causal linear attention (fastpos.ops.linear_attn): "chunk"
    # (chunkwise-parallel), "recurrent" (a serial scan over chunks), "fused" (one kernel,
    # where built) or "auto" (per backend, fastpos.ops.linear_attn.auto). The same function to
    # rounding; changes time and memory only.
    "model.attention_mode": _str("auto", ("auto", "chunk", "recurrent", "fused"), trajectory=False),
    # Batches and duration. Durations are in optimizer steps.
    "batch_size": _int(32, 1),  # global batch per optimizer step, over all devices and hosts
    # Global evaluation batch; 0 means batch_size (an LM's evaluation streams follow it).
    "eval_batch_size": _int(0, 0),
    "grad_accum_steps": _int(1, 1),  # split each batch into this many sequential micro-batches
    "num_train_steps": _int(5000, 1, trajectory=_decays),
    # AdamW (decoupled weight decay), global-norm gradient clipping.
    "optimizer": _block(),
    # Peak, after the warmup. The upper bounds here keep a typo (1e308 for 1e-3) from passing
    # the finite check and overflowing the first update.
    "optimizer.learning_rate": _float(1e-3, 0, 10, low_open=True),
    "optimizer.b1": _float(0.9, 0, 1, high_open=True),
    "optimizer.b2": _float(0.98, 0, 1, high_open=True),
    "optimizer.eps": _float(1e-9, 0, 1, low_open=True),
    "optimizer.weight_decay": _float(0.01, 0, 10),  # AdamW decay (times the learning rate)
    # Parameters whose path has a component matching one of these fnmatch patterns get no
    # weight decay (biases, norm scales, positional tables); 0-d / 1-d parameters never do.
    "optimizer.no_decay": _str(
        "*bias*,*scale*,pos_*,*positional*", valid="comma-separated fnmatch patterns"
    ),
    "optimizer.grad_clip_norm": _float(1.0, 0),  # clip the global gradient norm; 0: no clip
    # Learning-rate schedule: linear warmup from 0, then decay to end_factor * peak.
    "schedule": _block(),
    "schedule.name": _str("cosine", ("cosine", "linear", "constant", "rsqrt")),  # after warmup
    "schedule.warmup_steps": _int(500, 0),
    "schedule.end_factor": _float(0.0, 0, 1),  # final learning rate / peak learning rate
    # Cadences, in optimizer steps.
    "log_every_steps": _int(50, 1, trajectory=False),  # progress line, metrics, TensorBoard
    "eval_every_steps": _int(500, 1, trajectory=False),  # on the validation split (never test)
    # Validation batches per evaluation; 0 means the whole split (the best checkpoint is
    # chosen on it).
    "num_eval_batches": _int(0, 0),
    # Also saved at the end, on SIGTERM and at each evaluation.
    "checkpoint_every_steps": _int(500, 1, trajectory=False),
    "keep_checkpoints": _int(3, 1, trajectory=False),  # the last few (the best one apart)
    "async_checkpoints": _bool(True, trajectory=False),  # write them in a background thread
    # Precision of float32 matmuls on accelerators; the activation dtype is model.dtype.
    "precision": _str("default", ("default", "high", "highest")),
    # Device mesh: axes ("data", "model", "seq"). The data axis takes the devices the others
    # do not; batches are split over "data".
    "mesh": _block(trajectory=False),
    "mesh.model": _int(1, 1, trajectory=False),  # devices on the model axis (1: data parallel)
    # Devices each sequence is split over (context parallelism; linear kernels).
    "mesh.seq": _int(1, 1, trajectory=False),
    # Parameter sharding rules: ((regex over the "/"-joined parameter path, spec), ...) with
    # spec a tuple of mesh axis names or None per dimension, e.g. ((r"mlp/.*kernel",
    # (None, "model")),). The first matching rule wins; unmatched parameters are replicated.
    "mesh.rules": Field(
        "tuple",
        default=(),
        valid="a tuple of (regex, spec) pairs",
        trajectory=False,
        check=lambda rules: all(
            isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str) for r in rules
        ),
    ),
    # Host input pipeline (grain).
    "data": _block(trajectory=False),
    "data.num_threads": _int(2, 1, trajectory=False),  # threads reading examples
    "data.prefetch": _int(4, 0, trajectory=False),  # batches read ahead
    # Length bucketing (classify / retrieval tasks): increasing lengths in [1, task.max_length]
    # a batch is cut to (the shortest holding its longest example; max_length is added); ()
    # pads every batch to task.max_length. Regroups the examples: changes the results.
    "data.bucket_lengths": Field(
        "tuple",
        default=(),
        valid="a tuple of increasing lengths in [1, task.max_length] (() = off)",
        check=lambda lengths: all(fields.is_int(n) for n in lengths),
    ),
    "data.bucket_window": _int(16, 1),  # >= 1 global batches sorted (or packed) together
    # Sequence packing (lm and classify tasks, models that keep segments apart: softmax kernel,
    # schemes none / absolute / t5_bias / rope / kernelized_rpe): several examples per row.
    # Regroups the examples: changes the results.
    "data.pack": _bool(False),
    # Packed classification: at most this many examples per row (the model returns one logit
    # vector per slot). Changes the results (another grouping); unused for lm tasks.
    "data.pack_segments": _int(8, 1, 1024),
    # The paper's cell and numbers (configs/common.set_paper), read by the tables; only the
    # configs of a paper's table have them.
    "experiment": _block(trajectory=False, base=False),
    "experiment.row": _str("", valid="a row label", trajectory=False),
    "experiment.col": _str("", valid="a column label", trajectory=False),
    "paper": _block(trajectory=False, base=False),
    "paper.table": _str("", valid="a table label", trajectory=False),
    "paper.metric": _str("", valid="a metric name", trajectory=False),
    "paper.results": _block(trajectory=False),  # "<row>|<col>" -> number
}
# Blocks whose fields are not declared one by one.
OPEN_BLOCKS = ("paper.results",)


# ---------------------------------------------------------------------------------------------
# The owners' declarations, read on use
# ---------------------------------------------------------------------------------------------
def task_fields(name: str) -> Mapping[str, Field]:
  """The fields of task ``name``'s ``config.task`` block besides ``name`` (its class's
  ``config_fields``); ValueError naming the valid tasks for an unknown name."""
  from fastpos import tasks  # pylint: disable=import-outside-toplevel (numpy)

  return tasks.get_task_class(name).config_fields


def task_names() -> tuple[str, ...]:
  from fastpos import tasks  # pylint: disable=import-outside-toplevel (numpy)

  return tasks.task_names()


def kernel_options() -> Mapping[str, Field]:
  """``model.kernel_options``: every option a kernel may take (``features.OPTIONS``)."""
  from fastpos.ops import kernel_options as options  # pylint: disable=import-outside-toplevel

  return options.OPTIONS


def _kernel_field() -> Field:
  from fastpos.ops import features  # pylint: disable=import-outside-toplevel (jax)

  return dataclasses.replace(FIELDS["model.kernel"], choices=tuple(features.KERNELS), valid="")


def _task_name_field() -> Field:
  return fields.string("", task_names())


# ---------------------------------------------------------------------------------------------
# The configs built from the declarations
# ---------------------------------------------------------------------------------------------
def _config_dict(tree: dict):
  import ml_collections  # pylint: disable=import-outside-toplevel (a leaf at import)

  return ml_collections.ConfigDict(tree)


def task_config(name: str):
  """The default ``config.task`` block of task ``name`` (a ConfigDict, ``name`` first)."""
  from fastpos import tasks  # pylint: disable=import-outside-toplevel (numpy)

  return tasks.task_config(name)


def model_config():
  """The base ``config.model`` (LRA's small encoder: 4 layers, width 256, 4 heads)."""
  model = fields.defaults({k: v for k, v in FIELDS.items() if k.split(".")[0] == "model"})
  model = model["model"]
  model["kernel_options"] = fields.defaults(kernel_options())
  return _config_dict(model)


def base_config(task: str):
  """The complete base config of a run on task ``task``: every field of ``FIELDS`` at its
  default, ``config.task`` the task's block (``task_config``)."""
  skip = {p.split(".")[0] for p, d in FIELDS.items() if not d.base}
  root = fields.defaults({k: v for k, v in FIELDS.items() if k.split(".")[0] not in skip})
  root["model"]["kernel_options"] = fields.defaults(kernel_options())
  cfg = _config_dict(root)
  cfg.task = task_config(task)
  return cfg


# ---------------------------------------------------------------------------------------------
# Checking a config against the declarations
# ---------------------------------------------------------------------------------------------
def field(path: str, task: str | None = None) -> Field | None:
  """The declaration of the field at dotted ``path`` (``task.<x>`` by ``task``'s name);
  None for an undeclared one. Options of positional schemes are not declared here."""
  if path == "model.kernel":
    return _kernel_field()
  if path in FIELDS:
    return FIELDS[path]
  head, _, rest = path.partition(".")
  if head == "task" and rest:
    if rest == "name":
      return _task_name_field()
    return task_fields(task).get(rest) if task in task_names() else None
  if path.startswith("model.kernel_options."):
    return kernel_options().get(path.split(".", 2)[2])
  if path.startswith("model.positional_options."):
    return None
  if any(path.startswith(b + ".") for b in OPEN_BLOCKS):
    return FIELDS[next(b for b in OPEN_BLOCKS if path.startswith(b + "."))]
  return None


def leaves(cfg: Mapping, prefix: str = "") -> Iterator[tuple[str, Any]]:
  """(dotted path, value) of every field of ``cfg`` that is not a declared block; the
  fields of open blocks and of ``model.positional_options`` come as one value each."""
  for key in cfg:
    path = f"{prefix}{key}"
    value = cfg[key]
    if hasattr(value, "keys") and path not in OPEN_BLOCKS and path != "model.positional_options":
      yield from leaves(value, path + ".")
    else:
      yield path, value


def check(cfg: Mapping) -> None:
  """Raises ConfigValueError for the first field of ``cfg`` (a ConfigDict or nested dict,
  task block complete) that is undeclared or outside its declaration."""
  block = cfg.get("task", {})
  if not hasattr(block, "keys"):
    raise ConfigValueError(error("task", FIELDS["task"], block))
  task = block.get("name")
  name_field = _task_name_field()
  if not name_field.is_valid(task):
    raise ConfigValueError(error("task.name", name_field, task))
  missing = [k for k in task_fields(task) if k not in block]
  if missing:
    raise ConfigValueError(
        f"config.task lacks field(s) {', '.join(missing)} of task {task!r}; build the block "
        f"with fastpos.config_schema.task_config({task!r}) (base_config gives it)."
    )
  for path, value in leaves(cfg):
    decl = field(path, task)
    if decl is None:
      raise ConfigValueError(_undeclared(path, task))
    if not decl.is_valid(value):
      raise ConfigValueError(error(path, decl, value))


def _undeclared(path: str, task: str | None) -> str:
  parent = path.rsplit(".", 1)[0] if "." in path else ""
  if parent == "task":
    valid = ", ".join(["name", *task_fields(task)])
    return f"config.{path} is not a field of task {task!r}; its fields: {valid}."
  if parent == "model.kernel_options":
    return f"config.{path} is not a kernel option; the options: {', '.join(kernel_options())}."
  beside = [p for p in FIELDS if (p.rsplit(".", 1)[0] if "." in p else "") == parent]
  where = f"config.{parent}" if parent else "the config"
  return (
      f"config.{path} is not a field of {where}; its fields: "
      f"{', '.join(p.rsplit('.', 1)[-1] for p in beside)}."
  )


def is_trajectory(path: str, cfg: Mapping) -> bool:
  """Whether a change of field ``path`` changes the results of a run with config ``cfg``
  (undeclared fields and positional-scheme options: yes)."""
  block = cfg.get("task", {})
  task = block["name"] if hasattr(block, "keys") and "name" in block else None
  decl = field(path, task)
  if decl is None:
    return not _under_free_block(path)
  return decl.affects(cfg)


def _under_free_block(path: str) -> bool:
  parts = path.split(".")
  for i in range(1, len(parts)):
    decl = FIELDS.get(".".join(parts[:i]))
    if decl is not None and decl.type == "block" and not decl.affects({}):
      return True
  return False
