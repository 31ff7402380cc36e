"""The config: every field's default, what it means, what it may hold, and whether changing it
changes a run's results. The one source of the base config.

A leaf module: it imports the standard library and ml_collections only (no jax, flax or
numpy), so that the experiment files under ``configs/`` and the package both build on it and a
config loads without starting the trainer. ``FIELDS`` declares every field of the base config
(in its printed order, each with its comment), ``TASK_FIELDS`` every field of each task's
``config.task`` block and ``KERNEL_OPTIONS`` the feature maps' options; a positional scheme's
options are declared by its ``option_spec`` (``fastpos.positional``) and checked by
``fastpos.train.config.validate``. ``base_config(task)`` builds the complete config of a run on
``task`` from the declarations (``task_config(name)`` and ``model_config()`` its parts).

Each ``Field`` says the default, the type, the valid range or choices, and ``trajectory``: True
when a new value changes what a run computes (its parameters, its data order, which checkpoint
is best), False when it changes only how the run is carried out (log cadence, data threads,
device layout). A resumed run may change a field of the second kind freely; one of the first
kind only on request (``train.py --allow_config_change``), and the change is recorded.

``check(cfg)`` raises ``ConfigValueError`` with one line naming the first bad field, its value
and the valid values. Declaring a new field is one line beside its neighbours, e.g.
``"model.remat": _str("none", ("none", "block"), trajectory=False)``; the schema test
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
    default: the value of the base config (``base_config``); blocks start empty.
    base: False for a block only some configs have (the paper's cell and numbers).
    check: a predicate for what a type and range cannot say (the items of a tuple).
  """

  type: str
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  choices: tuple | None = None
  valid: str = ""
  trajectory: bool | Callable[[Any], bool] = True
  default: Any = None
  base: bool = True
  check: Callable[[Any], bool] | None = None

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
    if self.check is not None and not self.check(value):
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


# Shorthands for the declarations below: the default first, then the valid values.
def _int(default: int, low=None, high=None, **kw) -> Field:
  return Field("int", default=default, low=low, high=high, **kw)


def _float(default: float, low=None, high=None, **kw) -> Field:
  return Field("float", default=default, low=low, high=high, **kw)


def _str(default: str, choices=None, valid="", **kw) -> Field:
  choices = tuple(choices) if choices is not None else None
  return Field("str", default=default, choices=choices, valid=valid, **kw)


def _bool(default: bool, **kw) -> Field:
  return Field("bool", default=default, **kw)


def _block(**kw) -> Field:
  return Field("block", **kw)


def _seed(default: int = 0) -> Field:
  return _int(default, 0, _SEED_HIGH)


def _path(**kw) -> Field:
  return _str("", valid="a path ('' for the default)", **kw)


# The base config, in its printed order; each field's comment says what it does. A block's
# fields follow it ("model", then "model.<field>").
FIELDS: dict[str, Field] = {
    "seed": _seed(),  # seeds parameter init, dropout and the training data order (streams)
    # The task's block: config.task.name and the fields of TASK_FIELDS[config.task.name].
    "task": _block(),
    # The model (fastpos.models.build_model).
    "model": _block(),
    # Attention similarity: "softmax" or a feature map of fastpos.ops.features.FEATURE_MAPS.
    "model.kernel": _str("softmax", KERNELS),
    # Feature-map options (KERNEL_OPTIONS): random features m, DPFP's nu, the denominator
    # guard, whether random projections are redrawn every training step, their seed.
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
        check=lambda lengths: all(_is_int(n) for n in lengths),
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

# model.kernel_options (fastpos.ops.features.OPTION_DEFAULTS, a test holds them equal).
KERNEL_OPTIONS: dict[str, Field] = {
    "num_features": _int(64, 1),  # m, the random features (favor, prf, trf, nprf, orf)
    "nu": _int(1, 1),  # DPFP's nu
    "eps": _float(1e-6, 0, low_open=True),  # the denominator guard
    "redraw": _bool(False),  # redraw the random projections every training step
    "seed": _seed(),  # seeds the random projections
}


def _splits() -> dict[str, Field]:
  """Examples per split, 0 meaning the loader's default (all of a file)."""
  return {k: _int(0, 0) for k in ("num_train", "num_validation", "num_test")}


def _tfds() -> dict[str, Field]:
  return {
      # Data root holding tfds/<dataset>/ ("": $FASTPOS_DATA_DIR, else ~/fastpos_data).
      "data_dir": _path(),
      "cache_dir": _path(trajectory=False),  # decoded splits are cached here ("": default)
      # Share of tfds train held out as the validation split (0.1: LRA's train[90%:]).
      "validation_fraction": _float(0.1, 0, 1, low_open=True, high_open=True),
      "validation_seed": _seed(),  # which train examples are held out (not the training seed)
  }


_OVERFLOW = ("truncate", "error")

# config.task, by task name (the block of fastpos.tasks.<module>.<Task>.default_config());
# "name" is every task's.
TASK_FIELDS: dict[str, dict[str, Field]] = {
    "synthetic": {
        "vocab_size": _int(16, 4),  # token ids 0..vocab_size-1; 0 is padding
        "num_classes": _int(4, 2),  # class tokens are ids 1..num_classes
        "min_length": _int(16, 1),  # shortest sequence (before padding)
        "max_length": _int(32, 1),  # longest sequence = padded length
        "num_train": _int(4096, 1),  # examples per split
        "num_validation": _int(512, 1),
        "num_test": _int(500, 1),
        "seed": _seed(),  # data seed (independent of the training seed)
    },
    "listops": {
        # "generated": the project's own generator (deterministic from `seed`); "tsv": the LRA
        # release (basic_train.tsv, basic_val.tsv, basic_test.tsv) under the data root.
        "source": _str("generated", ("generated", "tsv")),
        # Data root (fastpos.tasks.paths; "" = $FASTPOS_DATA_DIR, else ~/fastpos_data);
        # source="tsv" reads <root>/lra_release/listops-1000/basic_{train,val,test}.tsv.
        "data_dir": _path(),
        "cache_dir": _path(trajectory=False),  # generated / tokenised splits ("" = no cache)
        "max_length": _int(2000, 1),  # padded length (LRA: 2000)
        "min_length": _int(500, 1),  # shortest generated expression in tokens (LRA: 500)
        # Examples per split; 0 means the loader's default (LRA sizes: 96k / 2k / 2k).
        **_splits(),
        "seed": _seed(),  # generator seed (independent of the training seed)
        "on_overflow": _str("truncate", _OVERFLOW),  # longer expressions: truncate or error
        # Keep the parentheses of the LRA release format (False: the fixed LRA task, where `]`
        # is a token and the parentheses are dropped).
        "parens": _bool(False),
    },
    "lra_text": {
        **_tfds(),
        "max_length": _int(4000, 1),  # bytes per review, padded / truncated (LRA: 4000)
        "on_overflow": _str("truncate", _OVERFLOW),  # longer reviews: "truncate" (LRA) or error
    },
    "lra_image": _tfds(),
    "mnist": _tfds(),
    "wikitext103": {
        "data_dir": _path(),  # data root holding wikitext-103/wiki.*.tokens ("": default)
        "cache_dir": _path(trajectory=False),  # vocabulary + id streams ("" = paths.cache_dir)
        # Tokens per example (the model's max_length; Transformer-XL's tgt_len). 512 as in the
        # PermuteFormer and LRPE WikiText-103 runs (fairseq tokens_per_sample).
        "segment_length": _int(512, 1),
        # Ids: padding, <unk>, <eos> and the vocab_size - 3 most frequent train words (the
        # rest -> <unk>). 267_737 keeps every word of the release; it must not exceed what the
        # train file gives (the error names that number).
        "vocab_size": _int(267_737, 4),
        # Validation / test: 0 = non-overlapping segments; S in (0, segment_length) = windows
        # every S tokens, each scoring its last S (every token once, >= L - S of context).
        "eval_stride": _int(0, 0),
    },
    "lra_retrieval": {
        # Data root (fastpos.tasks.paths; "" = $FASTPOS_DATA_DIR, else ~/fastpos_data): reads
        # <root>/lra_release/tsv_data/new_aan_pairs.{train,eval,test}.tsv.
        "data_dir": _path(),
        "cache_dir": _path(trajectory=False),  # tokenised splits ("" = paths.cache_dir)
        "max_length": _int(4000, 1),  # bytes kept per document (LRA: 4000)
        # Longer documents: "truncate" (counted warning) or "error".
        "on_overflow": _str("truncate", _OVERFLOW),
        # Pairs per split: the first n lines of the file; 0 = all (LRA: ~147K / 18K / 17K).
        **_splits(),
    },
    "pathfinder": {
        # Data root (fastpos.tasks.paths; "" = $FASTPOS_DATA_DIR, else ~/fastpos_data): reads
        # <root>/lra_release/pathfinder<resolution>/<difficulty folder>/.
        "data_dir": _path(),
        "cache_dir": _path(trajectory=False),  # decoded images ("" = paths.cache_dir)
        # 32 (LRA Pathfinder), 64, 128 (Path-X) or 256.
        "resolution": Field("int", default=32, choices=(32, 64, 128, 256)),
        # "easy" (curv_baseline), "intermediate" (curv_contour_length_9) or "hard"
        # (curv_contour_length_14, LRA's choice for Pathfinder and Path-X).
        "difficulty": _str("hard", ("easy", "intermediate", "hard")),
        # "lra": LRA's tfds order and 80/10/10 slices; "metadata": file order, same slices.
        "split_order": _str("lra", ("lra", "metadata")),
        "num_threads": _int(8, 1, trajectory=False),  # PNG decoding threads (first load only)
    },
    "pathfinder_generated": {
        # The project's Pathfinder generator (fastpos.tasks.pathfinder_generator), LRA's
        # settings: 32 (LRA Pathfinder) or 64.
        "resolution": Field("int", default=32, choices=(32, 64)),
        # Target path of 6 ("easy", LRA's curv_baseline), 9 ("intermediate",
        # curv_contour_length_9) or 14 paddles ("hard", curv_contour_length_14, LRA's choice).
        "difficulty": _str("hard", ("easy", "intermediate", "hard")),
        "num_train": _int(20_000, 1),  # images per split (LRA: 160k / 20k / 20k)
        "num_validation": _int(2000, 1),
        "num_test": _int(2000, 1),
        "seed": _seed(),  # data seed (independent of the training seed); splits never share
        "cache_dir": _path(trajectory=False),  # generated splits ("" = paths.cache_dir)
        # Processes generating a split (first use only; the images do not depend on it).
        "num_workers": _int(2, 1, trajectory=False),
    },
    "mqar": {
        "variant": _str("mqar", ("mqar", "copy")),  # associative recall, or segment-marker-copy
        # Token ids 0..vocab_size-1 (0 pad, 1 blank, 2 marker; 32 keys, 32 values).
        "vocab_size": _int(67, 5),
        "seq_len": _int(64, 4),  # tokens per example (the padded length)
        "num_pairs": _int(8, 1),  # mqar: key-value pairs at the start
        "num_queries": _int(0, 0),  # mqar: queries in the query region; 0 means num_pairs
        # copy: segment length; 0 means the longest that fits, (seq_len - 1) // 2.
        "copy_length": _int(0, 0),
        "num_train": _int(20_000, 1),  # examples per split
        "num_validation": _int(1000, 1),
        "num_test": _int(1000, 1),
        "seed": _seed(),  # data seed (independent of the training seed)
    },
    "text_lm": {
        # UTF-8 text files and / or folders, comma-separated, read in this order (required).
        "paths": _str("", valid="UTF-8 text files and / or folders, comma-separated"),
        # In folders: file-name patterns, comma-separated ("*": every file).
        "include": _str("*.txt", valid="comma-separated fnmatch patterns"),
        # "byte" (UTF-8 bytes + 1, 257 ids) or "word" (WikiText-103's rules).
        "level": _str("byte", ("byte", "word")),
        # Ids. byte: 0 (= 257). word: padding, <unk>, <eos> and the vocab_size - 3 most
        # frequent train words (the rest -> <unk>); above what the train text gives is an
        # error naming it.
        "vocab_size": _int(0, 0),
        # Contiguous byte fractions of the text (train first), cut at line starts; test may
        # be 0; validation_fraction + test_fraction < 1.
        "validation_fraction": _float(0.1, 0, 1, low_open=True, high_open=True),
        "test_fraction": _float(0.1, 0, 1, high_open=True),
        "cache_dir": _path(trajectory=False),  # word level: vocabulary + id streams
        "segment_length": _int(256, 1),  # tokens per example (the model's max_length)
        # Validation / test: 0 = non-overlapping segments; S in (0, segment_length) = windows
        # every S tokens, each scoring its last S (every token once, >= L - S of context).
        "eval_stride": _int(0, 0),
    },
}
_TASK_NAME = _str("", tuple(TASK_FIELDS))


# ---------------------------------------------------------------------------------------------
# The configs built from the declarations
# ---------------------------------------------------------------------------------------------
def _tree(decls: Mapping[str, Field]) -> dict:
  """Nested dicts of the declarations' defaults (blocks empty), in declaration order."""
  root: dict = {}
  for path, decl in decls.items():
    *parents, last = path.split(".")
    node = root
    for part in parents:
      node = node[part]
    node[last] = {} if decl.type == "block" else decl.default
  return root


def _config_dict(tree: dict):
  # Imported on use: fastpos.tasks (numpy only) imports this module for its declarations.
  import ml_collections  # pylint: disable=import-outside-toplevel

  return ml_collections.ConfigDict(tree)


def task_config(name: str):
  """The default ``config.task`` block of task ``name`` (a ConfigDict, ``name`` first)."""
  if name not in TASK_FIELDS:
    raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASK_FIELDS)}.")
  return _config_dict({"name": name, **_tree(TASK_FIELDS[name])})


def model_config():
  """The base ``config.model`` (LRA's small encoder: 4 layers, width 256, 4 heads)."""
  model = _tree({k: v for k, v in FIELDS.items() if k.split(".")[0] == "model"})["model"]
  model["kernel_options"] = _tree(KERNEL_OPTIONS)
  return _config_dict(model)


def base_config(task: str):
  """The complete base config of a run on task ``task``: every field of ``FIELDS`` at its
  default, ``config.task`` the task's block (``task_config``)."""
  skip = {p.split(".")[0] for p, d in FIELDS.items() if not d.base}
  root = _tree({k: v for k, v in FIELDS.items() if k.split(".")[0] not in skip})
  root["model"]["kernel_options"] = _tree(KERNEL_OPTIONS)
  cfg = _config_dict(root)
  cfg.task = task_config(task)
  return cfg


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
  for key in cfg:
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
  block = cfg.get("task", {})
  if not hasattr(block, "keys"):
    raise ConfigValueError(error("task", FIELDS["task"], block))
  task = block.get("name")
  if not _TASK_NAME.is_valid(task):
    raise ConfigValueError(error("task.name", _TASK_NAME, task))
  missing = [k for k in TASK_FIELDS[task] if k not in block]
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
