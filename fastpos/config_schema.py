"""What each config field may hold, and whether changing it changes a run's results.

A leaf module: it imports the standard library only (no jax, flax or numpy), so the experiment
files under ``configs/`` and the package can both use it. ``FIELDS`` declares every field of
the base config, ``TASK_FIELDS`` every field of each task's ``config.task`` block and
``KERNEL_OPTIONS`` the feature maps' options; a positional scheme's options are declared by its
``option_spec`` (``fastpos.positional``) and checked by ``fastpos.train.config.validate``.

Each ``Field`` says the type, the valid range or choices, and ``trajectory``: True when a new
value changes what a run computes (its parameters, its data order, which checkpoint is best),
False when it changes only how the run is carried out (log cadence, data threads, device
layout). A resumed run may change a field of the second kind freely; one of the first kind
only on request (``train.py --allow_config_change``), and the change is recorded.

``check(cfg)`` raises ``ConfigValueError`` with one line naming the first bad field, its value
and the valid values. Declaring a new field is one line beside its neighbours, e.g.
``"model.remat": Field("str", choices=("none", "block"), trajectory=False)``; the schema test
(tests/train/test_schema.py) fails for a config field that has no declaration.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator, Mapping

TYPES = ("bool", "int", "float", "str", "tuple", "block")
_SEED_HIGH = 2**32 - 1  # numpy's and grain's seeds are uint32
# model.kernel: "softmax" or a feature map of fastpos.ops.features (a test holds them equal).
KERNELS = ("softmax", "elu1", "relu", "sikf", "dpfp", "favor", "prf", "trf", "nprf", "orf")


class ConfigValueError(ValueError):
  """A config field holds a value outside its declared type, range or choices."""


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field: its type, valid values and whether it changes a run's results.

  Attributes:
    type: one of ``TYPES``; "float" takes ints too and must be finite; "block" is a group of
      fields not declared one by one (``open``), e.g. the paper's numbers.
    low, high: an inclusive range, unless ``low_open`` / ``high_open``.
    choices: the valid values (strings).
    valid: the valid values in words, for a field a type and range do not describe (a path).
    trajectory: whether a new value changes the run's results; a callable of the whole
      config for a field whose effect depends on another (``num_train_steps`` moves a
      decaying schedule only).
  """

  type: str
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  choices: tuple | None = None
  valid: str = ""
  trajectory: bool | Callable[[Any], bool] = True

  def __post_init__(self):
    if self.type not in TYPES:
      raise ValueError(f"Field type {self.type!r}; valid choices: {', '.join(TYPES)}.")

  def describe(self) -> str:
    """The valid values in words (the error's "must be ...")."""
    if self.choices is not None:
      return "one of " + ", ".join(map(str, self.choices))
    if self.valid:
      return self.valid
    words = {
        "bool": "true or false",
        "int": "an integer",
        "float": "a finite number",
        "str": "a string",
        "tuple": "a tuple",
        "block": "a block of fields",
    }[self.type]
    if self.low is not None and self.high is not None and self.type == "float":
      left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
      return f"{words} in {left}{_num(self.low)}, {_num(self.high)}{right}"
    if self.low is not None:
      words += f" {'>' if self.low_open else '>='} {_num(self.low)}"
    if self.high is not None:
      words += f"{' and' if self.low is not None else ''} {'<' if self.high_open else '<='} "
      words += _num(self.high)
    return words

  def is_valid(self, value: Any) -> bool:
    if not _TYPE_CHECKS[self.type](value):
      return False
    if self.choices is not None:
      return value in self.choices
    if self.low is not None and (value <= self.low if self.low_open else value < self.low):
      return False
    return self.high is None or (value < self.high if self.high_open else value <= self.high)

  def affects(self, cfg: Any) -> bool:
    """Whether a change of this field changes the results of a run with config ``cfg``."""
    return self.trajectory(cfg) if callable(self.trajectory) else bool(self.trajectory)


def _num(x: float) -> str:
  return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_float(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_TYPE_CHECKS = {
    "bool": lambda x: isinstance(x, bool),
    "int": _is_int,
    "float": _is_float,
    "str": lambda x: isinstance(x, str),
    "tuple": lambda x: isinstance(x, tuple),
    "block": lambda x: hasattr(x, "keys"),
}


def _decays(cfg) -> bool:
  """A schedule that decays towards num_train_steps moves when the number of steps does."""
  return cfg["schedule"]["name"] in ("cosine", "linear")


# Shorthands for the declarations below.
def _int(low=None, high=None, **kw) -> Field:
  return Field("int", low=low, high=high, **kw)


def _float(low=None, high=None, **kw) -> Field:
  return Field("float", low=low, high=high, **kw)


def _str(choices=None, valid="", **kw) -> Field:
  return Field("str", choices=tuple(choices) if choices is not None else None, valid=valid, **kw)


_BOOL = Field("bool")
_SEED = _int(0, _SEED_HIGH)
_PATH = _str(valid="a path ('' for the default)")
_FREE_PATH = _str(valid="a path ('' for the default)", trajectory=False)

# The base config (fastpos.train.config.base_config, configs/common.base_config).
FIELDS: dict[str, Field] = {
    "seed": _SEED,
    "task": Field("block"),  # its fields: TASK_FIELDS[config.task.name]
    "model": Field("block"),
    "model.kernel": _str(KERNELS),
    "model.kernel_options": Field("block"),  # its fields: KERNEL_OPTIONS
    "model.positional": _str(valid="scheme names of fastpos.positional joined by '+' or ','"),
    # Its blocks, by scheme name: each scheme's option_spec.
    "model.positional_options": Field("block"),
    "model.num_layers": _int(1),
    "model.embed_dim": _int(1),
    "model.num_heads": _int(1),
    "model.head_dim": _int(0),
    "model.mlp_dim": _int(1),
    "model.dropout_rate": _float(0, 1, high_open=True),
    "model.norm": _str(("post", "pre", "batch")),
    "model.pooling": _str(("mean", "cls")),
    "model.max_length": _int(0),
    "model.dtype": _str(("float32", "bfloat16")),
    "model.tie_embeddings": _BOOL,
    "model.memory_length": _int(0),
    "model.chunk_size": _int(0),
    "model.use_grid": _BOOL,
    # What a block keeps for its backward pass: the same numbers, less memory, more compute.
    "model.remat": _str(("none", "block", "save_matmuls", "save_dots"), trajectory=False),
    # Stacks the layers' parameters on one axis: a checkpoint of the other layout won't load.
    "model.scan_layers": _BOOL,
    # Chunks each block's token-wise part: the same function, less memory, more compute.
    "model.mlp_chunk": _int(0, trajectory=False),
    "batch_size": _int(1),
    "eval_batch_size": _int(0),  # the order of an LM's evaluation streams follows it
    "grad_accum_steps": _int(1),
    "num_train_steps": _int(1, trajectory=_decays),
    "optimizer": Field("block"),
    "optimizer.learning_rate": _float(0, low_open=True),
    "optimizer.b1": _float(0, 1, high_open=True),
    "optimizer.b2": _float(0, 1, high_open=True),
    "optimizer.eps": _float(0, low_open=True),
    "optimizer.weight_decay": _float(0),
    "optimizer.no_decay": _str(valid="comma-separated fnmatch patterns"),
    "optimizer.grad_clip_norm": _float(0),
    "schedule": Field("block"),
    "schedule.name": _str(("cosine", "linear", "constant", "rsqrt")),
    "schedule.warmup_steps": _int(0),
    "schedule.end_factor": _float(0, 1),
    "log_every_steps": _int(1, trajectory=False),
    "eval_every_steps": _int(1, trajectory=False),
    "num_eval_batches": _int(0),  # the validation set the best checkpoint is chosen on
    "checkpoint_every_steps": _int(1, trajectory=False),
    "keep_checkpoints": _int(1, trajectory=False),
    "async_checkpoints": Field("bool", trajectory=False),
    "precision": _str(("default", "high", "highest")),
    "mesh": Field("block", trajectory=False),
    "mesh.model": _int(1, trajectory=False),
    "mesh.seq": _int(1, trajectory=False),
    "mesh.rules": Field("tuple", valid="a tuple of (regex, spec) pairs", trajectory=False),
    "data": Field("block", trajectory=False),
    "data.num_threads": _int(1, trajectory=False),
    "data.prefetch": _int(0, trajectory=False),
    # Bucketing and packing regroup examples into batches: they change the data order.
    "data.bucket_lengths": Field(
        "tuple", valid="a tuple of increasing lengths in " "[1, task.max_length] (() = off)"
    ),
    "data.bucket_window": _int(1),
    "data.pack": _BOOL,
    # The paper's cell and numbers (configs/common.set_paper): a record, read by the tables.
    "experiment": Field("block", trajectory=False),
    "experiment.row": _str(valid="a row label", trajectory=False),
    "experiment.col": _str(valid="a column label", trajectory=False),
    "paper": Field("block", trajectory=False),
    "paper.table": _str(valid="a table label", trajectory=False),
    "paper.metric": _str(valid="a metric name", trajectory=False),
    "paper.results": Field("block", trajectory=False),  # "<row>|<col>" -> number
}
# Blocks whose fields are not declared one by one.
OPEN_BLOCKS = ("paper.results",)

# model.kernel_options (fastpos.ops.features.OPTION_DEFAULTS).
KERNEL_OPTIONS: dict[str, Field] = {
    "num_features": _int(1),
    "nu": _int(1),
    "eps": _float(0, low_open=True),
    "redraw": _BOOL,
    "seed": _SEED,
}

_SPLIT_SIZES = {"num_train": _int(0), "num_validation": _int(0), "num_test": _int(0)}
_TFDS = {
    "data_dir": _PATH,
    "cache_dir": _FREE_PATH,
    "validation_fraction": _float(0, 1, low_open=True, high_open=True),
    "validation_seed": _SEED,
}
_OVERFLOW = _str(("truncate", "error"))

# config.task, by task name (each task module's default_config()); "name" is every task's.
TASK_FIELDS: dict[str, dict[str, Field]] = {
    "synthetic": {
        "vocab_size": _int(4),
        "num_classes": _int(2),
        "min_length": _int(1),
        "max_length": _int(1),
        "num_train": _int(1),
        "num_validation": _int(1),
        "num_test": _int(1),
        "seed": _SEED,
    },
    "listops": {
        "source": _str(("generated", "tsv")),
        "data_dir": _PATH,
        "cache_dir": _FREE_PATH,
        "max_length": _int(1),
        "min_length": _int(1),
        **_SPLIT_SIZES,
        "seed": _SEED,
        "on_overflow": _OVERFLOW,
        "parens": _BOOL,
    },
    "lra_text": {**_TFDS, "max_length": _int(1), "on_overflow": _OVERFLOW},
    "lra_image": dict(_TFDS),
    "mnist": dict(_TFDS),
    "wikitext103": {
        "data_dir": _PATH,
        "cache_dir": _FREE_PATH,
        "segment_length": _int(1),
        "vocab_size": _int(4),
        "eval_stride": _int(0),
    },
    "lra_retrieval": {
        "data_dir": _PATH,
        "cache_dir": _FREE_PATH,
        "max_length": _int(1),
        "on_overflow": _OVERFLOW,
        **_SPLIT_SIZES,
    },
    "pathfinder": {
        "data_dir": _PATH,
        "cache_dir": _FREE_PATH,
        "resolution": Field("int", choices=(32, 64, 128, 256)),
        "difficulty": _str(("easy", "intermediate", "hard")),
        "split_order": _str(("lra", "metadata")),
        "num_threads": _int(1, trajectory=False),
    },
    "mqar": {
        "variant": _str(("mqar", "copy")),
        "vocab_size": _int(5),
        "seq_len": _int(4),
        "num_pairs": _int(1),
        "num_queries": _int(0),
        "copy_length": _int(0),
        "num_train": _int(1),
        "num_validation": _int(1),
        "num_test": _int(1),
        "seed": _SEED,
    },
    "text_lm": {
        "paths": _str(valid="UTF-8 text files and / or folders, comma-separated"),
        "include": _str(valid="comma-separated fnmatch patterns"),
        "level": _str(("byte", "word")),
        "vocab_size": _int(0),
        "validation_fraction": _float(0, 1, low_open=True, high_open=True),
        "test_fraction": _float(0, 1, high_open=True),
        "cache_dir": _FREE_PATH,
        "segment_length": _int(1),
        "eval_stride": _int(0),
    },
}
_TASK_NAME = _str(tuple(TASK_FIELDS))


def field(path: str, task: str | None = None) -> Field | None:
  """The declaration of the field at dotted ``path`` (``task.<x>`` by ``task``'s name);
  None for an undeclared one. Options of positional schemes are not declared here."""
  if path in FIELDS:
    return FIELDS[path]
  head, _, rest = path.partition(".")
  if head == "task" and rest:
    return _TASK_NAME if rest == "name" else TASK_FIELDS.get(task or "", {}).get(rest)
  if path.startswith("model.kernel_options."):
    return KERNEL_OPTIONS.get(path.split(".", 2)[2])
  if path.startswith("model.positional_options."):
    return None
  if any(path.startswith(b + ".") for b in OPEN_BLOCKS):
    return FIELDS[next(b for b in OPEN_BLOCKS if path.startswith(b + "."))]
  return None


def leaves(cfg: Mapping, prefix: str = "") -> Iterator[tuple[str, Any]]:
  """(dotted path, value) of every field of ``cfg`` that is not a declared block; the
  fields of open blocks and of ``model.positional_options`` come as one value each."""
  for key in cfg.keys():
    path = f"{prefix}{key}"
    value = cfg[key]
    if hasattr(value, "keys") and path not in OPEN_BLOCKS and path != "model.positional_options":
      yield from leaves(value, path + ".")
    else:
      yield path, value


def _shown(value: Any) -> str:
  return repr(value) if isinstance(value, str) else str(value)


def error(path: str, decl: Field, value: Any) -> str:
  """One line: the field, the valid values, the value."""
  return f"config.{path} must be {decl.describe()}; got {_shown(value)}."


def check(cfg: Mapping) -> None:
  """Raises ConfigValueError for the first field of ``cfg`` (a ConfigDict or nested dict,
  task block complete) that is undeclared or outside its declaration."""
  block = cfg["task"] if "task" in cfg else {}
  if not hasattr(block, "keys"):
    raise ConfigValueError(error("task", FIELDS["task"], block))
  task = block["name"] if "name" in block else None
  if not _TASK_NAME.is_valid(task):
    raise ConfigValueError(error("task.name", _TASK_NAME, task))
  for path, value in leaves(cfg):
    decl = field(path, task)
    if decl is None:
      raise ConfigValueError(_undeclared(path, task))
    if not decl.is_valid(value):
      raise ConfigValueError(error(path, decl, value))


def _undeclared(path: str, task: str | None) -> str:
  parent = path.rsplit(".", 1)[0] if "." in path else ""
  if parent == "task":
    valid = ", ".join(["name", *TASK_FIELDS[task]])
    return f"config.{path} is not a field of task {task!r}; its fields: {valid}."
  if parent == "model.kernel_options":
    return f"config.{path} is not a kernel option; the options: " f"{', '.join(KERNEL_OPTIONS)}."
  beside = [p for p in FIELDS if (p.rsplit(".", 1)[0] if "." in p else "") == parent]
  where = f"config.{parent}" if parent else "the config"
  return (
      f"config.{path} is not a field of {where}; its fields: "
      f"{', '.join(p.rsplit('.', 1)[-1] for p in beside)}."
  )


def check_flags(values: Mapping[str, Any], decls: Mapping[str, Field]) -> None:
  """A program's own flags by the same rule: raises ConfigValueError with one line,
  "--<flag> must be <valid values>; got <value>.", for the first flag outside its declaration."""
  for name, decl in decls.items():
    if name in values and not decl.is_valid(values[name]):
      raise ConfigValueError(f"--{name} must be {decl.describe()}; got {_shown(values[name])}.")


def is_trajectory(path: str, cfg: Mapping) -> bool:
  """Whether a change of field ``path`` changes the results of a run with config ``cfg``
  (undeclared fields and positional-scheme options: yes)."""
  block = cfg["task"] if "task" in cfg else {}
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
