"""End to end on a tiny model and generated data: exact resume, evaluation, NaN stop, outputs,
and bad input stopping before anything is compiled."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fastpos import tasks
from fastpos.models import build_model
from fastpos.train import RunError, evaluate, train_and_evaluate
from fastpos.train.checkpoint import Checkpoints
from fastpos.train.tensorboard import read_scalars
from tests.helpers import rel_err
from tests.train.common import assert_trees_equal, tiny_config


def _jsonl(path):
  return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """An uninterrupted 4-step run, and a 2-step run resumed to 4 in its own workdir."""
  root = tmp_path_factory.mktemp("trainer")
  full = train_and_evaluate(tiny_config(), root / "full")
  first = train_and_evaluate(tiny_config(num_train_steps=2), root / "split")
  second = train_and_evaluate(tiny_config(), root / "split")
  return {"root": root, "full": full, "first": first, "second": second}


def test_resume_is_bitwise_exact(runs):
  assert runs["first"]["step"] == 2 and runs["second"]["step"] == 4
  full, resumed = runs["full"]["state"], runs["second"]["state"]
  assert "batch_stats" in full.collections  # a non-param collection is carried and resumed
  assert_trees_equal(full, resumed)  # params, Adam moments, counts, batch stats, step

  # The losses of steps 3 and 4 (after the resume) are the uninterrupted run's, bit for bit.
  def train_losses(name):
    return {
        r["step"]: r["loss"]
        for r in _jsonl(runs["root"] / name / "metrics.jsonl")
        if r["split"] == "train"
    }

  full_losses, split_losses = train_losses("full"), train_losses("split")
  assert sorted(full_losses) == [1, 2, 3, 4]
  assert all(split_losses[s] == full_losses[s] for s in (1, 2, 3, 4))
  assert len(set(full_losses.values())) == 4  # the steps saw different data / parameters


# Slow; the default run keeps test_resume_is_bitwise_exact (a resume from the mid-run checkpoint).
@pytest.mark.slow
def test_mid_run_checkpoint_is_intact(runs):
  """The step-2 checkpoint written asynchronously while the uninterrupted run went on (and
  donated its buffers) equals the one the stopped run wrote last; so does the data position."""
  ckpt = ocp.StandardCheckpointer()
  a = ckpt.restore(runs["root"] / "full" / "checkpoints" / "2" / "state")
  b = ckpt.restore(runs["root"] / "split" / "checkpoints" / "2" / "state")
  assert_trees_equal(a, b)
  for name in ("full", "split"):
    data = glob.glob(str(runs["root"] / name / "checkpoints" / "2" / "data" / "*.json"))
    assert json.loads(Path(data[0]).read_text()) == {"next_index": 2}


def test_workdir_outputs(runs):
  workdir = runs["root"] / "full"
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["model"]["embed_dim"] == 16 and saved["task"]["name"] == "synthetic"
  records = _jsonl(workdir / "metrics.jsonl")
  assert [r["step"] for r in records if r["split"] == "validation"] == [2, 4]
  assert all(r["num_examples"] == 10 for r in records if r["split"] == "validation")
  train = {r["step"]: r for r in records if r["split"] == "train"}
  assert all(r["steps_per_second"] >= 0 for r in train.values())
  # TensorBoard event files hold the same scalars.
  scalars = {(step, tag): value for step, tag, value in read_scalars(workdir / "tensorboard")}
  for step, r in train.items():
    assert scalars[(step, "train/loss")] == np.float32(r["loss"])
  # Checkpoints: the last 3 kept (2 and 4 here); best/ holds one, chosen on validation.
  ckpts = Checkpoints(workdir, tiny_config(), read_only=True)
  assert ckpts.latest_step() == 4
  best = ckpts.read_meta("best")
  val = {r["step"]: r["accuracy"] for r in records if r["split"] == "validation"}
  assert best["metrics"]["accuracy"] == max(val.values())
  assert best["step"] == min(s for s in val if val[s] == max(val.values()))


def test_partial_save_is_ignored(runs, tmp_path):
  """A crash mid-save leaves orbax's temporary folder; the newest complete step is used."""
  workdir = runs["root"] / "split"
  (workdir / "checkpoints" / "6.orbax-checkpoint-tmp").mkdir()
  try:
    assert Checkpoints(workdir, tiny_config(), read_only=True).latest_step() == 4
  finally:
    (workdir / "checkpoints" / "6.orbax-checkpoint-tmp").rmdir()


def test_evaluate_pads_and_masks_the_last_batch(runs):
  """13 test examples in batches of 4: the last batch has 3 padded rows that count for
  nothing; metrics equal a direct computation over the 13 examples."""
  cfg = tiny_config()
  workdir = runs["root"] / "full"
  res = evaluate(cfg, workdir, "test", checkpoint="latest")
  assert res["num_examples"] == 13 and res["step"] == 4 and res["checkpoint"] == "latest"
  assert json.loads((workdir / "results_test.json").read_text()) == res
  task = tasks.make_task(cfg.task)
  test = task.source("test").arrays
  state = runs["full"]["state"]
  logits = build_model(cfg.model, task.info).apply(
      {"params": state.params, **state.collections},
      {"inputs": test["inputs"], "mask": test["mask"]},
      train=False,
  )
  logits = np.asarray(logits, np.float64)
  log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  loss = np.mean(log_z - logits[np.arange(13), test["targets"]])
  accuracy = np.mean(logits.argmax(-1) == test["targets"])
  assert rel_err(res["loss"], loss) < 1e-5
  assert res["accuracy"] == pytest.approx(accuracy, abs=1e-6)
  best = evaluate(cfg, workdir, "validation")
  assert best["checkpoint"] == "best" and best["num_examples"] == 10


def test_checkpoint_of_another_model_stops(runs):
  workdir = runs["root"] / "full"
  with pytest.raises(RunError, match=r"change its results: model.embed_dim 16 -> 32\. "):
    train_and_evaluate(tiny_config(**{"model.embed_dim": 32}), workdir)
  with pytest.raises(ValueError, match=r"different model .*embed_dim: 16 -> 32"):
    train_and_evaluate(tiny_config(**{"model.embed_dim": 32}), workdir, allow_config_change=True)
  with pytest.raises(ValueError, match=r"different task .*vocab_size: 16 -> 20"):
    evaluate(tiny_config(**{"task.vocab_size": 20}), workdir)
  assert Checkpoints(workdir, tiny_config(), read_only=True).latest_step() == 4


@pytest.mark.parametrize(
    "override, error, match",
    [
        (
            {"task.name": "imagenet"},
            ValueError,
            r"task.name must be one of synthetic, .*'imagenet'",
        ),
        ({"model.kernel": "cosine"}, ValueError, r"config.model.kernel must be one of softmax, "),
        ({"model.positional": "fastrpb,rope9"}, ValueError, r"rope9"),
        (
            {"schedule.name": "step"},
            ValueError,
            r"schedule.name must be one of cosine, linear, " r"constant, rsqrt; got 'step'",
        ),
        ({"grad_accum_steps": 3}, ValueError, r"grad_accum_steps=3 must divide"),
    ],
)
def test_bad_input_stops_with_one_message(tmp_path, override, error, match):
  with pytest.raises(error, match=match):
    train_and_evaluate(tiny_config(**override), tmp_path)
  assert not (tmp_path / "checkpoints").exists()  # stopped before the run started


def test_evaluate_without_checkpoint(tmp_path):
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    evaluate(tiny_config(), tmp_path)


# Slow; the default run keeps micro-batches in tests/train/test_memory.py
# (test_micro_batches_take_memory_rows_like_batch_rows).
@pytest.mark.slow
def test_gradient_accumulation_matches_the_full_batch(tmp_path):
  """2 micro-batches of 2 give the update of one batch of 4 (no dropout; LayerNorm, whose
  statistics are per example, so the split changes nothing but round-off)."""
  cfg = dict(num_train_steps=2, **{"model.dropout_rate": 0.0, "model.norm": "pre"})
  one = train_and_evaluate(tiny_config(**cfg), tmp_path / "one")
  two = train_and_evaluate(tiny_config(grad_accum_steps=2, **cfg), tmp_path / "two")
  # The key bias adds q . b_k to every logit of a query alike, which softmax cancels: its
  # gradient is exactly 0 up to round-off, and Adam scales round-off up to +-lr. Every other
  # parameter has a real gradient.
  leaves = jax.tree_util.tree_leaves_with_path(one["state"].params)
  compared = 0
  for (path, a), b in zip(leaves, jax.tree.leaves(two["state"].params)):
    if "['key']['bias']" in jax.tree_util.keystr(path):
      continue
    assert rel_err(b, a) < 1e-5, jax.tree_util.keystr(path)
    compared += 1
  assert compared == len(leaves) - 1
  # Adam hides a wrong gradient scale in the update; the logged loss and norm of the
  # averaged gradient do not.
  for name in ("loss", "grad_norm"):
    assert two["train"][name] == pytest.approx(one["train"][name], rel=1e-5)
