"""``TaskInfo``: what a task tells the model builder (kind, vocabulary, classes, length, grid).

The one fact about tasks that ``fastpos.models`` reads, kept here with no fastpos imports so
that models and tasks both import it without either importing the other.
"""

from __future__ import annotations

import dataclasses

TASK_KINDS = ("classify", "retrieval", "lm")


@dataclasses.dataclass(frozen=True)
class TaskInfo:
  """What the model needs to know of its task.

  Attributes:
    kind: ``"classify"`` (encoder -> pooled logits ``[b, num_classes]``), ``"retrieval"``
      (dual encoder over ``inputs`` / ``inputs2`` -> ``[b, num_classes]``) or ``"lm"``
      (causal decoder -> ``[b, L, vocab_size]``).
    vocab_size: number of token ids (ids are in [0, vocab_size); 0 is padding).
    num_classes: classes of a classify / retrieval task (ignored for lm).
    max_length: the longest sequence the task hands out.
    grid: (H, W) for image tasks (max_length == H * W), else None.
  """

  kind: str
  vocab_size: int
  num_classes: int = 0
  max_length: int = 0
  grid: tuple[int, int] | None = None

  def __post_init__(self):
    if self.kind not in TASK_KINDS:
      raise ValueError(f"TaskInfo.kind must be one of {TASK_KINDS}; got {self.kind!r}.")
    if self.grid is not None and self.grid[0] * self.grid[1] != self.max_length:
      raise ValueError(f"TaskInfo.grid {self.grid} must cover max_length={self.max_length} tokens.")
