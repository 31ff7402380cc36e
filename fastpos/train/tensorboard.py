"""TensorBoard logs of a workdir, written with tensorboardX and read with TensorBoard's own
``EventAccumulator``.

``EventWriter`` writes under ``<workdir>/tensorboard/``: the scalars of ``metrics.jsonl``, and
once, at the start of a run from step 0, the resolved config as text (``config``) and the flat
fields of its ``HPARAM_BLOCKS`` (model, optimizer, task) as hyperparameters (the HParams
dashboard, with the validation metrics as its metrics; the rest, e.g. logging cadence or a
paper's reference numbers, stays in the text).

A resumed run starts a new event file that opens with a purge marker at ``resume_step + 1``
(``SummaryWriter(purge_step=...)``): TensorBoard drops the events of earlier files at that step
and later (written after the checkpoint by the run that stopped), so every step shows once. A
run that starts again from step 0 deletes the earlier files (none of it would be shown) and
writes the config again; a resumed run does not rewrite it. An evaluation adds its results in
a file of its own, purging nothing; that file carries the evaluation's key (split and step), and
an evaluation with the same key replaces it, so re-running ``eval.py`` keeps one point per step.
A resume that changes the config adds the changes as text (``config_changes``) at the first
step run with them.

Files are named ``events.out.tfevents.<seconds>.<host>.<n>`` with ``n`` the number of files
already there, so that the name order TensorBoard reads them in is the order they were written
in, also for two runs started within one second.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

from tensorboardX import SummaryWriter
from tensorboardX.summary import hparams as hparams_summaries

from fastpos.train.errors import names_file

EVENT_GLOB = "events.out.tfevents.*"
HPARAM_BLOCKS = ("model", "optimizer", "task")  # the config blocks the HParams dashboard shows


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
  """{"model.num_layers": 1, ...}: nested dicts flattened with dots; values the HParams
  dashboard cannot show (lists, None) as their text."""
  out = {}
  for key, value in config.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(flat_config(value, name + "."))
    elif isinstance(value, (bool, int, float, str)):
      out[name] = value
    else:
      out[name] = str(value)
  return out


class EventWriter:
  """Scalars, and the config once, to TensorBoard event files under ``logdir``.

  Args:
    logdir: the folder (created if missing).
    resume_step: the step a training run starts from (0: from scratch); what earlier files
      hold past it is purged. None: add to what is there (an evaluation's results).
    replaces: an evaluation's key (e.g. ``"test-400"``): the file of an earlier evaluation
      with the same key is deleted first.
  """

  def __init__(
      self, logdir: str | os.PathLike, resume_step: int | None = None, replaces: str | None = None
  ):
    self.logdir = Path(logdir)
    self.logdir.mkdir(parents=True, exist_ok=True)
    if replaces is not None:
      if not re.fullmatch(r"[\w.-]+", replaces):
        raise ValueError(
            f"EventWriter: replaces={replaces!r} must be letters, digits, '_', " f"'.' or '-'."
        )
      for path in self.logdir.glob(f"{EVENT_GLOB}.{replaces}"):
        path.unlink()
    self.from_scratch = resume_step == 0
    if self.from_scratch:  # nothing earlier attempts wrote survives (TensorBoard's purge
      for path in self.logdir.glob(EVENT_GLOB):  # would keep their text and hparams)
        path.unlink()
    existing = list(self.logdir.glob(EVENT_GLOB))
    purge_step = None
    if existing and resume_step:  # drop what was written past resume_step
      purge_step = resume_step + 1
    suffix = f".{len(existing):06d}" + (f".{replaces}" if replaces is not None else "")
    self._writer = SummaryWriter(
        str(self.logdir), purge_step=purge_step, flush_secs=10, filename_suffix=suffix
    )
    # Events are written in the caller's thread, not tensorboardX's: a failed write (a full
    # disk) then raises where the run can stop on it, and never blocks on a queue no one reads.
    events = self._writer.file_writer.event_writer
    events._worker.stop()  # pylint: disable=protected-access
    events.add_event = events._ev_writer.write_event  # pylint: disable=protected-access
    self.path = Path(events._ev_writer._file_name)  # pylint: disable=protected-access
    self.failed = False
    try:
      self._flush()  # the file (and its purge marker) exists from now on
    except OSError:
      self.close()  # no one else will
      raise

  @contextlib.contextmanager
  def _writing(self) -> Iterator[None]:
    """A failed write (a full disk) raises an OSError naming the event file, once: ``close``
    does not raise it again."""
    try:
      with names_file(self.path):
        yield
    except OSError:
      self.failed = True
      raise

  def _flush(self) -> None:
    with self._writing():
      self._writer.file_writer.flush()

  def config(self, config: Mapping[str, Any], text: str, metrics: list[str]) -> None:
    """The config as text and as hyperparameters, at step 0, by a run from scratch; nothing
    otherwise (a resumed run keeps the first run's). ``metrics``: scalar tags the HParams
    dashboard shows per run."""
    if not self.from_scratch:
      return
    with self._writing():
      self._writer.add_text("config", f"```\n{text}\n```", global_step=0)
    hparams = {k: v for k, v in flat_config(config).items() if k.split(".", 1)[0] in HPARAM_BLOCKS}
    experiment, start, end = hparams_summaries(hparams, dict.fromkeys(metrics, 0.0))
    with self._writing():
      for summary in (experiment, start, end):
        self._writer.file_writer.add_summary(summary, global_step=0)
    self._flush()

  def text(self, tag: str, step: int, text: str) -> None:
    """A text summary ``tag`` at ``step`` (e.g. the config changes of a resume)."""
    with self._writing():
      self._writer.add_text(tag, f"```\n{text}\n```", global_step=step)
    self._flush()

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    with self._writing():
      for tag, value in values.items():
        self._writer.add_scalar(tag, float(value), global_step=step)
    self._flush()

  def close(self) -> None:
    failed_before = self.failed
    try:
      with self._writing():
        self._writer.close()
    except OSError:
      events = self._writer.file_writer.event_writer
      events._closed = True  # pylint: disable=protected-access  # tensorboardX's exit hook
      if not failed_before:
        raise


def _accumulator(logdir: str | os.PathLike):
  from tensorboard.backend.event_processing import event_accumulator  # only readers need it

  if not Path(logdir).is_dir() or not list(Path(logdir).glob(EVENT_GLOB)):
    raise FileNotFoundError(f"no TensorBoard event files ({EVENT_GLOB}) in {logdir}.")
  acc = event_accumulator.EventAccumulator(
      str(logdir), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
  )
  return acc.Reload()


def read_scalars(logdir: str | os.PathLike) -> list[tuple[int, str, float]]:
  """(step, tag, value) of every scalar TensorBoard shows for ``logdir`` (purges applied),
  in step order per tag."""
  acc = _accumulator(logdir)
  return [(e.step, tag, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)]


def read_text(logdir: str | os.PathLike, tag: str = "config") -> list[tuple[int, str]]:
  """(step, text) of every text summary ``tag`` (the config: one, at step 0)."""
  acc = _accumulator(logdir)
  if f"{tag}/text_summary" not in acc.Tags()["tensors"]:
    return []
  out = []
  for e in acc.Tensors(f"{tag}/text_summary"):
    text = e.tensor_proto.string_val[0].decode()
    out.append((e.step, re.sub(r"^```\n|\n```$", "", text)))
  return out
