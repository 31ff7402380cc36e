"""The run's last line: what it reached, beside a baseline, and where its outputs are."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from fastpos.tasks.info import TaskInfo
from fastpos.train import config_record
from fastpos.train.workdir import Workdir


def summary_line(
    workdir: Path,
    task,
    info: TaskInfo,
    result: dict[str, Any],
    train_src,
    val_src,
    *,
    positional: str,
    changes: Sequence[Mapping[str, Any]],
) -> str:
  """The run's last line: the validation metric (and the test one when eval.py scored this
  workdir) beside the accuracy of always answering the training split's majority class, the
  mean training tokens/s (``result["tokens_per_second"]``, from the metric writer), the config
  changes of its resumes and where the outputs are.

  The trainer hands over what it holds: ``result`` (the loop's and the writer's figures), the
  run's ``model.positional`` and ``changes``, the entries of ``config_changes.jsonl`` as it
  read and appended them. Only eval.py's ``results_test.json`` is read here.
  """
  parts = [f"{task.task_name}: step {result['step']}", *_metric_parts(workdir, task, result)]
  baseline = _majority_baseline(info, train_src, val_src)
  if baseline:
    parts.append(baseline)
  if result.get("tokens_per_second") is not None:  # the metric writer's running mean
    parts.append(f"{result['tokens_per_second']:,.0f} tokens/s")
  changed = config_record.describe(changes)
  if changed:
    parts.append(changed)
  parts.append(f"workdir {workdir}: metrics.jsonl, tensorboard/, config.json")
  if task.has_split("test"):  # only commands that will produce something
    parts[-1] += f"; test: python eval.py --workdir={workdir} --split=test"
  if _plotted_schemes(positional):
    parts.append(f"plots: python scripts/plot_positional.py {workdir}")
  return "; ".join(parts)


def _metric_parts(workdir: Path, task, result: dict[str, Any]) -> list[str]:
  """The validation metric (with the best one when it was another step) and the test metric
  when eval.py scored this workdir before (a finished run resumed)."""
  metric, parts = task.metric, []

  def shown(value: float) -> str:
    return f"{100 * value:.2f}%" if metric in ("accuracy", "f1") else f"{value:.4g}"

  val, best = result.get("validation", {}), result.get("best", {})
  if metric in val:
    at = (
        f" (best {shown(best[metric])} at step {best['step']})"
        if best.get(metric) is not None and best.get("step") != result["step"]
        else ""
    )
    parts.append(f"validation {metric} {shown(val[metric])}{at}")
  test_file = Workdir(workdir).results_file("test")
  if test_file.is_file():
    test = json.loads(test_file.read_text())
    if metric in test:
      parts.append(f"test {metric} {shown(test[metric])} (step {test.get('step')})")
  return parts


def _majority_baseline(info: TaskInfo, train_src, val_src) -> str | None:
  """The validation accuracy of always answering the training split's majority class (None
  for language models, or without integer class targets)."""
  train_y, val_y = (getattr(src, "arrays", {}).get("targets") for src in (train_src, val_src))
  if info.kind == "lm" or train_y is None or val_y is None or train_y.ndim != 1:
    return None
  if not (len(train_y) and len(val_y)):
    return None
  majority = int(np.bincount(train_y).argmax())
  return f"majority-class baseline {100 * np.mean(val_y == majority):.2f}% (always {majority})"


PLOTTED_SCHEMES = ("fastrpb", "kernelized_rpe", "lrpe")  # what scripts/plot_positional.py draws


def _plotted_schemes(positional: str) -> list[str]:
  """The schemes of ``model.positional`` that ``scripts/plot_positional.py`` can plot."""
  return [n for n in re.split(r"[,+]", str(positional)) if n.strip() in PLOTTED_SCHEMES]
