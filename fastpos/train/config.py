"""The trainer's base config (every field commented) and the completion of a config file's
task block.

The experiment files (``configs/*.py``) build on ``configs/common.py``, which restates
``base_config`` without importing fastpos (tests/train/test_configs.py checks the two are
equal) and leaves ``config.task`` holding only the fields the file sets; ``complete_task``
adds the task's other fields from its class when train.py loads the file (and again in the
trainer, for a config built in Python). The config alone defines a run; only ``--workdir`` is
outside it.

``validate`` checks every value against its declaration (``fastpos.config_schema``, and each
positional scheme's ``option_spec``) before anything is built.
"""

from __future__ import annotations

import ml_collections

from fastpos import config_schema
from fastpos.models.config import model_config
from fastpos.tasks import get_task_class, task_config, task_info
from fastpos.train.errors import RunError


def base_config(task: str) -> ml_collections.ConfigDict:
  """The base config for a run on task ``task`` (its ``config.task`` block from the task)."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # seeds parameter init, dropout and the training data order (separate streams)
  c.task = task_config(task)  # the task's block: fastpos.tasks.<task module>.default_config()
  c.model = model_config()  # fastpos.models.config.model_config(): kernel, schemes, sizes

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


def complete_task(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """``cfg`` with ``config.task`` completed from the task's ``default_config()``: the fields the
  config sets keep their values, the others get the task's defaults (in place; idempotent).

  Raises:
    ValueError: no ``config.task.name``, an unknown task, or a field the task does not have
      (naming the valid fields).
  """
  name = cfg.task.get("name") if "task" in cfg else None
  if not name:
    raise ValueError(
        "the config has no config.task.name; set it to one of the tasks (e.g. "
        "base_config('listops') in configs/common.py)."
    )
  block = get_task_class(name).default_config()  # raises naming the valid tasks
  unknown = sorted(set(cfg.task.keys()) - set(block.keys()))
  if unknown:
    raise ValueError(
        f"unknown field(s) {unknown} in config.task for task {name!r}; valid "
        f"fields: {', '.join(sorted(block.keys()))}."
    )
  block.update(cfg.task)
  with cfg.unlocked():
    cfg.task = block
  return cfg


class InvalidConfigError(RunError, ValueError):
  """A config value outside its declaration (exit code 2; a ValueError for library callers)."""


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Checks ``cfg`` (task block complete) before anything is built: every field against its
  declared type and range (``fastpos.config_schema``), the positional scheme names and each
  scheme's options against its ``option_spec``, and the rules between a task's fields.

  Raises:
    InvalidConfigError: one line naming the field, its value and the valid values (exit code 2).
  """
  try:
    config_schema.check(cfg)
  except config_schema.ConfigValueError as e:
    raise InvalidConfigError(str(e)) from None
  _check_positional(cfg.model)
  try:
    task_info(cfg.task)  # the rules between the task's fields (no data read)
  except (ValueError, TypeError) as e:
    raise InvalidConfigError(f"config.task: {e}") from None


def _check_positional(model: ml_collections.ConfigDict) -> None:
  from fastpos import positional  # pylint: disable=import-outside-toplevel (flax)

  try:
    positional.parse_names(model.positional)
  except ValueError as e:
    raise InvalidConfigError(f"config.model.positional={model.positional!r}: {e}") from None
  for scheme, options in model.positional_options.items():
    where = f"config.model.positional_options.{scheme}"
    if scheme not in positional.SCHEMES:
      raise InvalidConfigError(
          f"{where}: unknown positional scheme {scheme!r}; valid schemes: "
          f"{', '.join(positional.SCHEMES)}."
      )
    if not hasattr(options, "keys"):
      raise InvalidConfigError(f"{where} must be a block of options; got {options!r}.")
    spec = positional.get_class(scheme).option_spec
    for name, value in options.items():
      if name not in spec:
        raise InvalidConfigError(
            f"{where} has no option {name!r}; its options: " f"{', '.join(spec) or '(none)'}."
        )
      value = tuple(value) if isinstance(value, list) else value
      if not spec[name].is_valid(value):
        note = f" ({spec[name].note})" if spec[name].note else ""
        raise InvalidConfigError(
            f"{where}.{name} must be {spec[name].describe()}{note}; got " f"{value!r}."
        )
    try:
      positional.get_class(scheme).resolve_options(dict(options))
    except ValueError as e:
      raise InvalidConfigError(f"{where}: {e}") from None
