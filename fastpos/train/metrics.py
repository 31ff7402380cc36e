"""Metrics as (sum, count) pairs, and where they are written.

A step's metrics are ``{name: (sum, count)}`` of float32 scalars: sums over the examples (or
tokens) of a batch, weighted by ``weight`` so that padded examples count for nothing. They
add across steps, micro-batches and devices, and ``summarize`` divides at the end.

``MetricWriter`` writes one JSON line per record to ``metrics.jsonl``, the same scalars to
TensorBoard event files under ``tensorboard/`` and a progress line to the log. Only process 0
writes.
"""

from __future__ import annotations

import json
import logging as std_logging
import math
import time
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
from absl import logging

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


class _LibraryInfoFilter(std_logging.Filter):
  """Drops the per-save INFO chatter of orbax and grain (their warnings still show)."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    path = record.pathname.replace("\\", "/")
    return record.levelno >= std_logging.WARNING or not ("/orbax/" in path or "/grain/" in path)


_FILTER = _LibraryInfoFilter()


def quiet_library_logs() -> None:
  """Keeps the log readable: progress lines, not checkpoint-library internals."""
  logger = logging.get_absl_logger()
  if _FILTER not in logger.filters:
    logger.addFilter(_FILTER)


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


class MetricWriter:
  """metrics.jsonl + TensorBoard + progress line, written by process 0 only."""

  def __init__(self, workdir: str | Path, total_steps: int):
    self.active = jax.process_index() == 0
    self.total_steps = total_steps
    self._last_time = None
    self._last_step = None
    if self.active:
      Path(workdir).mkdir(parents=True, exist_ok=True)
      self._jsonl = open(Path(workdir) / "metrics.jsonl", "a")
      self._tb = EventWriter(Path(workdir) / "tensorboard")

  def write(self, step: int, split: str, values: Mapping[str, float], **extra) -> None:
    if not self.active:
      return
    record = {"step": step, "split": split, "time": time.time(), **extra,
              **{k: float(v) for k, v in values.items()}}
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    self._tb.scalars(step, {f"{split}/{k}": float(v) for k, v in values.items()})

  def start_timer(self, step: int) -> None:
    self._last_time, self._last_step = time.time(), step

  def steps_per_second(self, step: int) -> float:
    """Steps per second since the last call (or start_timer)."""
    now = time.time()
    rate = (step - self._last_step) / max(now - self._last_time, 1e-9)
    self._last_time, self._last_step = now, step
    return rate

  def progress(self, step: int, values: Mapping[str, float], rate: float) -> None:
    if not self.active:
      return
    eta = (self.total_steps - step) / rate if rate > 0 else float("inf")
    shown = " ".join(f"{k}={v:.4g}" for k, v in values.items() if k != "perplexity")
    logging.info("step %d/%d  %s  %.2f steps/s  ETA %s", step, self.total_steps, shown, rate,
                 _duration(eta))

  def close(self) -> None:
    if self.active:
      self._jsonl.close()
      self._tb.close()


def _duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(seconds)
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
