"""Generated recall tasks for causal LMs: multi-query associative recall and copying.

``variant="mqar"`` (Zoology, Arora et al. 2023, Sec. 3): ``num_pairs`` key-value pairs
``k1 v1 k2 v2 ...`` (distinct keys, distinct values), then a query region of blank tokens in
which ``num_queries`` of the keys reappear at random even offsets, each followed by its value.
The answer is the value that follows a query key: the model must recall, from the pairs seen
earlier, the value bound to the key it has just read.

``variant="copy"`` (induction / copying): a random segment of ``copy_length`` tokens, a marker,
then the segment again; the answers are the repeated tokens. Predicting the j-th repeated token
needs the token ``copy_length`` positions back: relative position matters.

Every example is a causal LM sequence: ``inputs`` int32 ``[seq_len]``, ``targets`` the next
token at each position (0 after the last), ``mask`` True for real tokens (padding after a copy
example is 0 and masked) and ``score`` True exactly at the positions whose target is an answer,
so the loss and the accuracy (``fastpos.train.steps``) are taken on answer tokens only.

Token ids: 0 padding, 1 blank (the MQAR query region's filler), 2 the copy marker; MQAR keys
are ids ``3 .. 3 + K - 1`` and values the rest, ``K = (vocab_size - 3) // 2``; copy tokens are
all ids from 3. Chance accuracy on answers: 1 / (number of values) (MQAR), 1 / (vocab_size - 3)
(copy).

Deterministic: example i of split s is drawn from ``SeedSequence([seed, s, i])``, so it is the
same whatever the split size or the order batches are read in.
"""

from __future__ import annotations

import ml_collections
import numpy as np

from fastpos import fields
from fastpos.tasks import base
from fastpos.tasks.info import TaskInfo

VARIANTS = ("mqar", "copy")
PAD, BLANK, MARKER, FIRST = 0, 1, 2, 3


class MqarTask(base.Task):
  """Multi-query associative recall or copying (see the module docstring)."""

  generated = True
  task_name = "mqar"
  config_fields = {
      "variant": fields.string("mqar", VARIANTS),  # associative recall, or segment-marker-copy
      # Token ids 0..vocab_size-1 (0 pad, 1 blank, 2 marker; 32 keys, 32 values).
      "vocab_size": fields.integer(67, 5),
      "seq_len": fields.integer(64, 4),  # tokens per example (the padded length)
      "num_pairs": fields.integer(8, 1),  # mqar: key-value pairs at the start
      "num_queries": fields.integer(0, 0),  # mqar: queries in the query region; 0 = num_pairs
      # copy: segment length; 0 means the longest that fits, (seq_len - 1) // 2.
      "copy_length": fields.integer(0, 0),
      "num_train": fields.integer(20_000, 1),  # examples per split
      "num_validation": fields.integer(1000, 1),
      "num_test": fields.integer(1000, 1),
      "seed": fields.seed(),  # data seed (independent of the training seed)
  }

  @classmethod
  def info_from_config(cls, cfg: ml_collections.ConfigDict) -> TaskInfo:
    check_options(**options(cfg))
    return TaskInfo(kind="lm", vocab_size=cfg.vocab_size, max_length=cfg.seq_len)

  def load_split(self, split: str) -> dict[str, np.ndarray]:
    cfg = self.cfg
    n = {"train": cfg.num_train, "validation": cfg.num_validation, "test": cfg.num_test}[split]
    if n < 1:
      raise ValueError(f"mqar task: num_{split} must be >= 1; got {n}.")
    return generate(n, seed=cfg.seed, split=split, **options(cfg))


def options(cfg) -> dict:
  """The generator's options of a ``config.task`` block (defaults resolved)."""
  return dict(
      variant=cfg.variant,
      vocab_size=cfg.vocab_size,
      seq_len=cfg.seq_len,
      num_pairs=cfg.num_pairs,
      num_queries=cfg.num_queries or cfg.num_pairs,
      copy_length=cfg.copy_length or (cfg.seq_len - 1) // 2,
  )


def check_options(
    *,
    variant: str,
    vocab_size: int,
    seq_len: int,
    num_pairs: int,
    num_queries: int,
    copy_length: int,
) -> None:
  """Raises ValueError naming the bad option and its valid range."""
  if variant not in VARIANTS:
    raise ValueError(
        f"mqar task: unknown variant {variant!r}; valid variants: " f"{', '.join(VARIANTS)}."
    )
  if seq_len < 4:
    raise ValueError(f"mqar task: seq_len must be >= 4; got {seq_len}.")
  if variant == "copy":
    if vocab_size < FIRST + 2:
      raise ValueError(
          f"mqar task (copy): vocab_size must be >= {FIRST + 2} (pad, blank, "
          f"marker and two tokens); got {vocab_size}."
      )
    if not 1 <= copy_length <= (seq_len - 1) // 2:
      raise ValueError(
          f"mqar task (copy): copy_length must be in [1, {(seq_len - 1) // 2}] "
          f"(segment, marker and repeat fit in seq_len={seq_len}); got "
          f"{copy_length}."
      )
    return
  num_keys = (vocab_size - FIRST) // 2
  if num_pairs < 1 or num_pairs > num_keys:
    raise ValueError(
        f"mqar task: num_pairs must be in [1, {num_keys}] (keys and values are "
        f"distinct: (vocab_size - 3) // 2 of each at vocab_size={vocab_size}); "
        f"got {num_pairs}."
    )
  if not 1 <= num_queries <= num_pairs:
    raise ValueError(
        f"mqar task: num_queries must be in [1, num_pairs={num_pairs}] (0 means "
        f"num_pairs); got {num_queries}."
    )
  if seq_len < 2 * num_pairs + 2 * num_queries:
    raise ValueError(
        f"mqar task: seq_len={seq_len} is too short for {num_pairs} pairs and "
        f"{num_queries} queries; need seq_len >= 2 * (num_pairs + num_queries) = "
        f"{2 * (num_pairs + num_queries)}."
    )


def generate(
    n: int,
    *,
    seed: int,
    split: str,
    variant: str,
    vocab_size: int,
    seq_len: int,
    num_pairs: int,
    num_queries: int,
    copy_length: int,
) -> dict[str, np.ndarray]:
  """n examples of one split: ``inputs``, ``targets`` int32 and ``mask``, ``score`` bool, all
  ``[n, seq_len]`` (see the module docstring)."""
  check_options(
      variant=variant,
      vocab_size=vocab_size,
      seq_len=seq_len,
      num_pairs=num_pairs,
      num_queries=num_queries,
      copy_length=copy_length,
  )
  inputs = np.zeros((n, seq_len), np.int32)
  answer_at = np.zeros((n, seq_len), bool)  # positions that hold an answer token
  for i in range(n):
    rng = np.random.default_rng(np.random.SeedSequence([seed, base.SPLITS.index(split), i]))
    if variant == "copy":
      inputs[i], answer_at[i] = _copy(rng, vocab_size, seq_len, copy_length)
    else:
      inputs[i], answer_at[i] = _mqar(rng, vocab_size, seq_len, num_pairs, num_queries)
  targets = np.zeros_like(inputs)
  targets[:, :-1] = inputs[:, 1:]
  score = np.zeros_like(answer_at)
  score[:, :-1] = answer_at[:, 1:]  # the target at position t is the token at t + 1
  return {"inputs": inputs, "targets": targets, "mask": inputs != PAD, "score": score}


def _mqar(rng, vocab_size, seq_len, num_pairs, num_queries):
  num_keys = (vocab_size - FIRST) // 2
  keys = FIRST + rng.choice(num_keys, num_pairs, replace=False)
  values = FIRST + num_keys + rng.choice(vocab_size - FIRST - num_keys, num_pairs, replace=False)
  seq = np.full(seq_len, BLANK, np.int32)
  seq[0 : 2 * num_pairs : 2], seq[1 : 2 * num_pairs : 2] = keys, values
  asked = rng.choice(num_pairs, num_queries, replace=False)
  slots = (seq_len - 2 * num_pairs) // 2  # (key, value) slots in the query region
  at = 2 * num_pairs + 2 * np.sort(rng.choice(slots, num_queries, replace=False))
  seq[at], seq[at + 1] = keys[asked], values[asked]
  answer = np.zeros(seq_len, bool)
  answer[at + 1] = True
  return seq, answer


def _copy(rng, vocab_size, seq_len, copy_length):
  segment = rng.integers(FIRST, vocab_size, size=copy_length)
  seq = np.zeros(seq_len, np.int32)
  seq[:copy_length] = segment
  seq[copy_length] = MARKER
  seq[copy_length + 1 : 2 * copy_length + 1] = segment
  answer = np.zeros(seq_len, bool)
  answer[copy_length + 1 : 2 * copy_length + 1] = True
  return seq, answer
