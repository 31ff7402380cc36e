"""Metrics as (sum, count) pairs, and where they are written.

A step's metrics are ``{name: (sum, count)}`` of float32 scalars: sums over the examples (or
tokens) of a batch, weighted by ``weight`` so that padded examples count for nothing. They
add across steps, micro-batches and devices, and ``summarize`` divides at the end.

``MetricWriter`` writes one JSON line per record to ``metrics.jsonl``, the same scalars (with
steps/s and tokens/s for training rows) to a TensorBoard event file under ``tensorboard/`` and
a progress line to the log; the resolved config goes to TensorBoard once, as text and
hyperparameters. Only process 0 writes. A resumed run first drops the records past
the step it resumes from (written after that checkpoint by the run that stopped), in both
files, so that its logs are those of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import logging as std_logging
import math
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import numpy as np
from absl import logging

from fastpos.train import workdir as workdir_lib
from fastpos.train.tensorboard import EventWriter


def add(a: Mapping | None, b: Mapping) -> dict:
  """Elementwise sum of two metric dicts (``a`` may be None)."""
  if a is None:
    return dict(b)
  return jax.tree.map(lambda x, y: x + y, dict(a), dict(b))


def summarize(metrics: Mapping[str, Any], *, perplexity: bool = False) -> dict[str, float]:
  """{name: sum / count} as Python floats (+ ``perplexity`` = exp(loss) if asked: lm tasks)."""
  metrics = jax.device_get(metrics)
  out = {}
  for name, (total, count) in metrics.items():
    out[name] = float(total) / float(count) if float(count) > 0 else float("nan")
  if perplexity and "loss" in out:
    out["perplexity"] = math.exp(min(out["loss"], 700.0))
  return out


# Orbax logs an error of a background save thread with its traceback, once per thread, and
# then raises it in the main thread, where the trainer turns it into one message.
_REPORTED_AGAIN = ("raised an exception", "Failed to run", "Save Finalize thread")


class _LibraryFilter(std_logging.Filter):
  """Drops the per-save INFO chatter of orbax and grain (their warnings still show), and
  orbax's logs of background save errors that the main thread raises again."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    path = record.pathname.replace("\\", "/")
    if not ("/orbax/" in path or "/grain/" in path):
      return True
    if record.levelno < std_logging.WARNING or "Given directory is read only" in str(record.msg):
      return False  # the trainer opens checkpoints read-only on purpose
    return not (
        "/orbax/" in path
        and record.levelno >= std_logging.ERROR
        and any(s in record.getMessage() for s in _REPORTED_AGAIN)
    )


@contextlib.contextmanager
def quiet_library_logs() -> Iterator[None]:
  """Keeps the log readable while it is entered: progress lines, not checkpoint-library
  internals. The process's logging is as it was afterwards."""
  logger, quiet = logging.get_absl_logger(), _LibraryFilter()
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)


def first_nonfinite(steps: list[int], metrics: list[Mapping[str, Any]]) -> int | None:
  """The first step whose loss or gradient norm is NaN / Inf (None when all are finite)."""
  if not metrics:
    return None
  host = jax.device_get(metrics)
  for step, m in zip(steps, host):
    for name in ("loss", "grad_norm"):
      if name in m and not np.all(np.isfinite(np.asarray(m[name][0]))):
        return step
  return None


def _read_jsonl(path: Path, after_step: float) -> tuple[list[str], list[dict], int]:
  """(lines, records) of ``path`` with ``step <= after_step``, and how many other lines it
  has (later records, and a line cut off by a crash)."""
  keep, records, dropped = [], [], 0
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
        step = int(record["step"])
      except (ValueError, KeyError, TypeError):
        dropped += 1  # a line cut off by a crash
        continue
      if step > after_step:
        dropped += 1
      else:
        keep.append(line if line.endswith("\n") else line + "\n")
        records.append(record)
  return keep, records, dropped


def truncate_jsonl(path: Path, after_step: int) -> int:
  """Drops the records of ``path`` with ``step > after_step`` (and a torn last line), by
  writing the rest to a temporary file renamed over it; returns how many were dropped."""
  return _truncate(path, after_step)[1]


def _truncate(path: Path, after_step: int | None) -> tuple[list[dict], int]:
  """(the records kept, how many were dropped); nothing is dropped when ``after_step`` is
  None."""
  if not path.exists():
    return [], 0
  keep, records, dropped = _read_jsonl(path, math.inf if after_step is None else after_step)
  if dropped and after_step is not None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)
  return records, dropped if after_step is not None else 0


class MetricWriter:
  """metrics.jsonl + TensorBoard + progress line, written by process 0 only.

  ``resume_step``: the step a resumed run starts from; records past it are dropped first.
  The writer keeps the run's running figures (``mean_tokens_per_second``), counting the
  training rows the file already holds (those of the run that stopped).
  """

  def __init__(self, workdir: str | Path, total_steps: int, resume_step: int | None = None):
    self.active = jax.process_index() == 0
    self.total_steps = total_steps
    self._last_time = None
    self._last_step = None
    self._tokens_rates: list[float] = []
    if self.active:
      run = workdir_lib.Workdir(workdir)
      path = run.metrics_file
      records, dropped = _truncate(path, resume_step)
      if dropped:
        logging.info(
            "%s: dropped %d record(s) written after step %d by the run that stopped",
            path,
            dropped,
            resume_step,
        )
      for record in records:
        self._keep_figures(record)
      self._path = path
      # Held open for the writer's lifetime (closed by close()), so no `with` block.
      self._jsonl = open(path, "a")  # noqa: SIM115
      self._tb = EventWriter(run.tensorboard_dir, resume_step=resume_step)

  def _keep_figures(self, record: Mapping[str, Any]) -> None:
    if record.get("split") == "train" and "tokens_per_second" in record:
      self._tokens_rates.append(float(record["tokens_per_second"]))

  def mean_tokens_per_second(self) -> float | None:
    """The mean real tokens/s of the run's training rows (None before the first)."""
    return float(np.mean(self._tokens_rates)) if self._tokens_rates else None

  def write(self, step: int, split: str, values: Mapping[str, float], **extra) -> None:
    if not self.active:
      return
    record = {
        "step": step,
        "split": split,
        "time": time.time(),
        **extra,
        **{k: float(v) for k, v in values.items()},
    }
    try:
      self._jsonl.write(json.dumps(record) + "\n")
      self._jsonl.flush()
    except OSError as e:  # a full disk: the file's name goes with the error
      raise OSError(e.errno, e.strerror, str(self._path)) from None
    self._keep_figures(record)
    scalars = {**extra, **values}
    self._tb.scalars(step, {f"{split}/{k}": float(v) for k, v in scalars.items()})

  def config(self, config: Mapping[str, Any], text: str, metrics: list[str]) -> None:
    """The resolved config to TensorBoard (text and hyperparameters), at a run's start."""
    if self.active:
      self._tb.config(config, text, metrics)

  def text(self, tag: str, step: int, text: str) -> None:
    """A text summary to TensorBoard (a recorded config change)."""
    if self.active:
      self._tb.text(tag, step, text)

  def start_timer(self, step: int) -> None:
    self._last_time, self._last_step = time.time(), step

  def steps_per_second(self, step: int) -> float:
    """Steps per second since the last call (or start_timer)."""
    now = time.time()
    rate = (step - self._last_step) / max(now - self._last_time, 1e-9)
    self._last_time, self._last_step = now, step
    return rate

  def progress(
      self, step: int, values: Mapping[str, float], rate: float, tokens_rate: float
  ) -> None:
    if not self.active:
      return
    eta = (self.total_steps - step) / rate if rate > 0 else float("inf")
    shown = " ".join(
        f"{k}={v:.4g}" for k, v in values.items() if k not in ("perplexity", "tokens_per_step")
    )
    logging.info(
        "step %d/%d  %s  %.2f steps/s  %s tokens/s  ETA %s",
        step,
        self.total_steps,
        shown,
        rate,
        _count(tokens_rate),
        _duration(eta),
    )

  def close(self) -> None:
    if self.active:
      with contextlib.suppress(OSError):  # each write flushes: a failed one raised already
        self._jsonl.close()
      self._tb.close()


def tokens_per_second(steps_per_second: float, values: Mapping[str, float]) -> float:
  """Real (unpadded) tokens per second: the steps/s times the window's mean tokens per step
  (the ``tokens_per_step`` metric of the train step, summed on device with the others)."""
  return steps_per_second * values["tokens_per_step"]


def _count(n: float) -> str:
  """1234 -> '1234', 56789 -> '56.8k', 1.2e6 -> '1.20M'."""
  if not math.isfinite(n):
    return "?"
  if n >= 1e6:
    return f"{n / 1e6:.2f}M"
  return f"{n / 1e3:.1f}k" if n >= 1e4 else f"{n:.0f}"


def _duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(seconds)
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
