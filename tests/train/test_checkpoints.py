"""Checkpoints that survive misuse: a run stopped by SIGINT resumes to the uninterrupted run's
state and logs; a damaged newest checkpoint (one that does not load, or whose contents differ
from its digests) falls back to the previous one; a checkpoint without digests loads with a
warning; a NaN stop keeps a checkpoint that evaluates and names only a verified one; a
non-finite first step after a restore blames the checkpoint; one trainer per workdir; a bad
workdir or a full disk stops with one message and creates nothing; another batch size resumes
at the same example."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fastpos import config_schema, tasks
from fastpos.train import (
    NonFiniteLossError,
    RunError,
    WorkdirLockedError,
    evaluate,
    train_and_evaluate,
)
from fastpos.train import data as data_lib
from fastpos.train import metrics as metrics_lib
from fastpos.train import resume as resume_lib
from fastpos.train import run as run_lib
from fastpos.train import workdir as workdir_lib
from fastpos.train.checkpoint import CheckpointLoadError, Checkpoints
from fastpos.train.state import from_checkpoint_tree
from fastpos.train.tensorboard import read_scalars
from fastpos.train.workdir import Workdir
from tests.train.common import assert_trees_equal, tiny_config
from tests.train.faults import edit_json, rewrite_state

ROOT = Path(__file__).resolve().parents[2]
# Rows at steps 2, 4, 6; validation at 3 and 6; checkpoints at 2, 3, 4, 6 (the last 3 kept).
SETTINGS = {
    "num_train_steps": 6,
    "log_every_steps": 2,
    "eval_every_steps": 3,
    "checkpoint_every_steps": 2,
}


def config(**overrides):
  return tiny_config(**{**SETTINGS, **overrides})


TIME_DEPENDENT = ("time", "steps_per_second", "tokens_per_second")


def _rows(workdir):
  """metrics.jsonl without the fields that depend on time."""
  with open(Path(workdir) / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if k not in TIME_DEPENDENT} for r in rows]


def _events(workdir):
  # As TensorBoard shows them: a resumed run's file purges what followed its checkpoint.
  return read_scalars(Path(workdir) / "tensorboard")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """An uninterrupted 6-step run, and the same run stopped by SIGINT (raised while step 4's
  row is written, so it stops after step 5: mid log window), kept as a template."""
  root = tmp_path_factory.mktemp("ckpts")
  full = train_and_evaluate(config(), root / "full")
  write = metrics_lib.MetricWriter.write

  def write_then_interrupt(self, step, split, values, **extra):
    write(self, step, split, values, **extra)
    if split == "train" and step == 4:
      os.kill(os.getpid(), signal.SIGINT)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(metrics_lib.MetricWriter, "write", write_then_interrupt)
    handler = logging.Handler()
    messages = []
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("absl")
    logger.addHandler(handler)
    try:
      stopped = train_and_evaluate(config(), root / "stopped")
    finally:
      logger.removeHandler(handler)
  return {"root": root, "full": full, "stopped": stopped, "messages": messages}


def _copy(runs, tmp_path, name="stopped"):
  dst = tmp_path / name
  shutil.copytree(runs["root"] / name, dst)
  return dst


def test_sigint_saves_and_the_resumed_run_equals_the_uninterrupted_one(runs, tmp_path):
  stopped = runs["stopped"]
  assert stopped["stopped_early"] and stopped["signal"] == "SIGINT" and stopped["step"] == 5
  assert any(
      m.startswith("preempted at step 5 (SIGINT): saved ")
      and m.endswith("checkpoints/5; restart to continue.")
      for m in runs["messages"]
  )
  workdir = _copy(runs, tmp_path)
  assert not (workdir / workdir_lib.LOCK_NAME).exists()  # released on the way out
  resumed = train_and_evaluate(config(), workdir)
  assert resumed["step"] == 6 and not resumed["stopped_early"]
  assert_trees_equal(runs["full"]["state"], resumed["state"])
  # The same rows: none twice, and the row of step 6 averages steps 5 and 6 although the
  # stopped run saved after step 5 (its window travels in the checkpoint).
  full_rows = _rows(runs["root"] / "full")
  assert [(r["step"], r["split"]) for r in full_rows] == [
      (2, "train"),
      (3, "validation"),
      (4, "train"),
      (6, "train"),
      (6, "validation"),
  ]
  assert _rows(workdir) == full_rows
  strip = lambda events: sorted(
      (s, t, v) for s, t, v in events if t.split("/")[-1] not in TIME_DEPENDENT  # noqa: E731
  )
  assert strip(_events(workdir)) == strip(_events(runs["root"] / "full"))


# Each item of a checkpoint (state, meta, data) damaged once, and a weight that only its digest
# catches, in the default run; the other ways of damaging an item take the same path.
@pytest.mark.parametrize(
    "damage",
    [
        "truncate_state",
        pytest.param("remove_state_data", marks=pytest.mark.slow),
        "bad_meta_json",
        pytest.param("remove_meta", marks=pytest.mark.slow),
        "remove_data",
        "weight_changed",
    ],
)
def test_damaged_newest_checkpoint_falls_back_and_the_run_continues(runs, tmp_path, damage, caplog):
  workdir = _copy(runs, tmp_path)
  _damage(workdir / "checkpoints" / "5", damage)
  with caplog.at_level(logging.WARNING):
    resumed = train_and_evaluate(config(), workdir)
  assert resumed["step"] == 6
  assert_trees_equal(runs["full"]["state"], resumed["state"])  # replayed 5 and 6 exactly
  assert _rows(workdir) == _rows(runs["root"] / "full")
  assert (workdir / "checkpoints" / "5.corrupt").is_dir()  # kept, moved aside
  assert any(
      "checkpoints/5 does not load" in r.getMessage() and "5.corrupt" in r.getMessage()
      for r in caplog.records
  )
  if damage == "weight_changed":  # the report names the array
    assert any(
        "DigestMismatch: 1 of " in r.getMessage()
        and "arrays differ from their digests: params/embed/embedding" in r.getMessage()
        for r in caplog.records
    )


def _damage(step_dir: Path, how: str) -> None:
  state = step_dir / "state"
  if how == "truncate_state":
    for f in state.rglob("*"):
      if f.is_file() and f.name != "commit_success.txt":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  elif how == "remove_state_data":
    for d in state.rglob("d"):
      shutil.rmtree(d)
  elif how == "bad_meta_json":
    (step_dir / "meta" / "metadata").write_text('{"step": 5, "rng": [')
  elif how == "meta_not_a_record":
    (step_dir / "meta" / "metadata").write_text("[]")
  elif how == "remove_meta":
    shutil.rmtree(step_dir / "meta")
  elif how == "remove_data":
    shutil.rmtree(step_dir / "data")
  elif how == "empty_folder":
    for child in step_dir.iterdir():
      shutil.rmtree(child) if child.is_dir() else child.unlink()
  elif how == "remove_checkpoint_metadata":
    (step_dir / "_CHECKPOINT_METADATA").unlink()
    shutil.rmtree(state)
  elif how == "remove_state_metadata":
    (state / "_METADATA").unlink()
  else:
    _change_contents(step_dir, how)


def _change_contents(step_dir: Path, how: str) -> None:
  """Well-formed checkpoints whose contents differ from what was saved: only digests see them."""
  if how == "weight_changed":  # one flipped bit, as in an array chunk (no checksum)

    def change(tree):
      tree["params"]["embed"]["embedding"].view(np.uint32)[3, 2] ^= np.uint32(1 << 22)

    rewrite_state(step_dir, change)
  elif how == "rng_edited":
    edit_json(step_dir / "meta" / "metadata", lambda m: m["rng"].__setitem__(0, 12345))
  elif how == "data_position_edited":
    edit_json(step_dir / "data" / "process_0-of-1.json", lambda d: d.update(next_index=2))
  else:
    raise ValueError(how)


# In the default run: a damaged state, a damaged meta record, an empty folder, orbax's own
# metadata gone, and each kind of digest mismatch (an array, the meta record's RNG).
@pytest.mark.parametrize(
    "damage",
    [
        "truncate_state",
        pytest.param("remove_state_data", marks=pytest.mark.slow),
        "bad_meta_json",
        pytest.param("meta_not_a_record", marks=pytest.mark.slow),
        pytest.param("remove_meta", marks=pytest.mark.slow),
        "empty_folder",
        "remove_checkpoint_metadata",
        pytest.param("remove_state_metadata", marks=pytest.mark.slow),
        "weight_changed",
        "rng_edited",
    ],
)
def test_evaluate_skips_a_damaged_checkpoint_and_changes_nothing(runs, tmp_path, damage, caplog):
  workdir = _copy(runs, tmp_path)
  _damage(workdir / "checkpoints" / "5", damage)
  before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
  with caplog.at_level(logging.WARNING):
    res = evaluate(config(), workdir, "validation", checkpoint="latest")
  assert res["step"] == 4 and np.isfinite(res["loss"])
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before
  if damage != "empty_folder" and "5" in before:
    assert any("checkpoints/5 does not load" in r.getMessage() for r in caplog.records)


def _restore_latest(workdir: Path):
  """(step, data iterator state) of the newest checkpoint that verifies, as a resume finds
  it (read-only here)."""
  run = run_lib.build_run(config(), workdir)
  src = run.task.source("train")
  ckpts = Checkpoints(workdir, run.cfg, read_only=True)
  try:
    found = ckpts.restore_newest(run.checkpoint_abstract, expect=run.expect)
  finally:
    ckpts.close()
  it, _ = resume_lib.resume_data(run, src, found)
  return found.step, it.get_state()


def test_an_edited_data_position_is_caught(runs, tmp_path, caplog):
  workdir = _copy(runs, tmp_path)
  _damage(workdir / "checkpoints" / "5", "data_position_edited")
  with caplog.at_level(logging.WARNING):
    assert _restore_latest(workdir) == (4, {"next_index": 4})
  assert any(
      "checkpoints/5 does not load (DigestMismatch: the data-iterator state "
      "process_0-of-1.json differs from its digest)" in r.getMessage()
      for r in caplog.records
  )


def test_best_with_a_changed_weight_is_refused_by_evaluate(runs, tmp_path):
  workdir = _copy(runs, tmp_path)
  (step,) = [p for p in (workdir / "best").iterdir()]
  _damage(step, "weight_changed")
  with pytest.raises(
      CheckpointLoadError,
      match=r"no checkpoint in .*best loads: .*best/\d+ "
      r"\(DigestMismatch: 1 of \d+ arrays differ from their digests: "
      r"params/embed/embedding\).*--checkpoint=latest",
  ):
    evaluate(config(), workdir, "validation")


def test_a_checkpoint_without_digests_loads_with_a_warning(runs, tmp_path, caplog):
  workdir = _copy(runs, tmp_path)
  for step in (workdir / "checkpoints").iterdir():
    # As written before checkpoints recorded digests (or their run: fastpos.train.identity).
    edit_json(step / "meta" / "metadata", lambda m: [m.pop("digests"), m.pop("run")])
  with caplog.at_level(logging.WARNING):
    res = evaluate(config(), workdir, "validation", checkpoint="latest")
  assert res["step"] == 5
  warned = [r.getMessage() for r in caplog.records if "without digests" in r.getMessage()]
  assert len(warned) == 1 and warned[0].endswith(
      "checkpoints/5 was written without digests "
      "(before checkpoints recorded them): loaded "
      "unverified."
  ), warned


def test_newest_verified_skips_a_damaged_checkpoint(runs, tmp_path):
  workdir = _copy(runs, tmp_path)
  _damage(workdir / "checkpoints" / "5", "weight_changed")
  run = run_lib.build_run(config(), workdir)
  ckpts = Checkpoints(workdir, run.cfg, read_only=True)
  try:
    good, skipped = ckpts.newest_verified(run.checkpoint_abstract, 5)
    assert ckpts.newest_verified(run.checkpoint_abstract, 3) == (3, [])
  finally:
    ckpts.close()
  assert good == 4 and len(skipped) == 1
  assert skipped[0].endswith(
      "checkpoints/5 (DigestMismatch: 1 of 70 arrays differ from their "
      "digests: params/embed/embedding)"
  )
  assert (workdir / "checkpoints" / "5").is_dir()  # named, not moved


@pytest.mark.parametrize("verified", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_non_finite_first_step_after_a_restore_blames_the_checkpoint(runs, tmp_path, verified):
  """A huge weight saved with matching digests (or in a checkpoint without digests): the
  checkpoint, not the learning rate, is named."""
  workdir = _copy(runs, tmp_path)
  step_dir = workdir / "checkpoints" / "5"

  def huge(tree):
    tree["params"]["embed"]["embedding"][:] = 1e29

  rewrite_state(step_dir, huge, redigest=verified)
  if not verified:
    edit_json(step_dir / "meta" / "metadata", lambda m: m.pop("digests"))
  how = (
      r"its digests verify, so it is as it was saved"
      if verified
      else r"it was written without digests, so it is unverified"
  )
  with pytest.raises(
      NonFiniteLossError,
      match=rf"at step 6, the first step after restoring "
      rf".*checkpoints/5; training stopped. Suspect that checkpoint, not the "
      rf"learning rate \({how}",
  ):
    train_and_evaluate(config(), workdir)


def test_no_checkpoint_loads_lists_them(runs, tmp_path):
  workdir = _copy(runs, tmp_path)
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [3, 4, 5]
  for s in steps:
    _damage(workdir / "checkpoints" / str(s), "bad_meta_json")
  with pytest.raises(
      CheckpointLoadError, match=r"no checkpoint in .*checkpoints loads: " r".*/5 \(.*/4 \(.*/3 \("
  ):
    evaluate(config(), workdir, "validation", checkpoint="latest")
  with pytest.raises(CheckpointLoadError, match=r"moved to 5.corrupt.*moved to 3.corrupt"):
    train_and_evaluate(config(), workdir)
  assert not (workdir / workdir_lib.LOCK_NAME).exists()


# Slow; the default run keeps checkpoint checks (test_damaged_newest_checkpoint_falls_back_...).
@pytest.mark.slow
def test_nan_stop_keeps_a_checkpoint_that_evaluates_and_trains(tmp_path, monkeypatch):
  """lr 1e30 after a warmup from 0: step 1 leaves the parameters unchanged (lr 0), step 2
  sends them to ~1e29 (finite, but their loss is not): checkpoint 1 is the last good one.
  (The schema caps learning rates at 10; this test lifts the cap to make a run diverge.)"""
  lr = config_schema.FIELDS["optimizer.learning_rate"]
  monkeypatch.setitem(
      config_schema.FIELDS, "optimizer.learning_rate", dataclasses.replace(lr, high=None)
  )
  bad = {
      "optimizer.learning_rate": 1e30,
      "optimizer.grad_clip_norm": 0.0,
      "schedule.warmup_steps": 2,
      "checkpoint_every_steps": 1,
      "eval_every_steps": 100,
      "log_every_steps": 100,
      "num_train_steps": 6,
  }
  with pytest.raises(
      NonFiniteLossError,
      match=r"at step 2;.*last good checkpoint is step 1 "
      r"in .*checkpoints \(verified, left intact\)",
  ):
    train_and_evaluate(tiny_config(**bad), tmp_path)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]
  state = ocp.StandardCheckpointer().restore(tmp_path / "checkpoints" / "1" / "state")
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
  res = evaluate(tiny_config(**bad), tmp_path, "validation", checkpoint="latest")
  assert res["step"] == 1 and np.isfinite(res["loss"])
  sane = train_and_evaluate(
      tiny_config(**{**bad, "optimizer.learning_rate": 1e-2, "num_train_steps": 3}),
      tmp_path,
      allow_config_change=True,
  )
  assert sane["step"] == 3 and np.isfinite(sane["train"]["loss"])


# Slow; the default run keeps exact resume (test_trainer.py::test_resume_is_bitwise_exact).
@pytest.mark.slow
def test_batch_size_change_resumes_at_the_same_example(runs, tmp_path, caplog):
  workdir = _copy(runs, tmp_path)
  with caplog.at_level(logging.WARNING):
    res = train_and_evaluate(config(batch_size=2), workdir, allow_config_change=True)
  assert res["step"] == 6
  assert any(
      "batch_size changed from 4 to 2: resuming at example 20" in r.getMessage()
      for r in caplog.records
  )
  meta = json.loads((workdir / "checkpoints" / "6" / "meta" / "metadata").read_text())
  assert meta["data"] == {
      "examples": 22,
      "start": 20,
      "start_step": 5,
      "batch_size": 2,
      "num_examples": 12,
  }
  # Batch 0 of the new iterator is examples 20, 21: the first half of the old batch 5.
  src = tasks.make_task(config().task).source("train")
  old = data_lib.train_iterator(src, config())
  for _ in range(5):
    next(old)
  want = next(old)
  got = next(data_lib.train_iterator(src, config(batch_size=2), start=20))
  for k in want:
    np.testing.assert_array_equal(got[k], want[k][:2])


def test_training_split_size_change_is_refused(runs, tmp_path):
  workdir = _copy(runs, tmp_path)
  before = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*"))
  with pytest.raises(RunError, match=r"training split of 12 examples; it now has 16"):
    train_and_evaluate(config(**{"task.num_train": 16}), workdir, allow_config_change=True)
  assert sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*")) == before


def test_a_live_holder_keeps_the_workdir(runs, tmp_path):
  """A lock naming a live process of this host (the test's parent, as a file system without
  flock would leave it): refused, and the orbax leftovers of that trainer are not touched."""
  workdir = _copy(runs, tmp_path)
  holder = {"host": socket.gethostname(), "pid": os.getppid(), "started": 0}
  (workdir / workdir_lib.LOCK_NAME).write_text(json.dumps(holder))
  (workdir / "checkpoints" / "6.orbax-checkpoint-tmp").mkdir()
  with pytest.raises(
      WorkdirLockedError,
      match=rf"in use by another trainer \(pid "
      rf"{os.getppid()} on host {socket.gethostname()}.*delete .*train.lock",
  ):
    train_and_evaluate(config(), workdir)
  assert (workdir / "checkpoints" / "6.orbax-checkpoint-tmp").is_dir()
  assert json.loads((workdir / workdir_lib.LOCK_NAME).read_text()) == holder


_HOLD = """
import sys
from fastpos.train.workdir import WorkdirLock
lock = WorkdirLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


def test_a_second_process_holding_the_lock_stops_the_trainer(tmp_path):
  workdir = tmp_path / "w"
  workdir.mkdir()
  proc = subprocess.Popen(
      [sys.executable, "-c", _HOLD, str(workdir)],
      cwd=ROOT,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      env=dict(os.environ, PYTHONPATH=str(ROOT)),
  )
  try:
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(WorkdirLockedError, match=rf"pid {proc.pid} on host"):
      train_and_evaluate(config(), workdir)
    assert sorted(p.name for p in workdir.iterdir()) == [workdir_lib.LOCK_NAME]
  finally:
    proc.communicate("", timeout=60)
  assert proc.returncode == 0
  assert not (workdir / workdir_lib.LOCK_NAME).exists()


def test_a_stale_lock_is_taken_over(tmp_path, caplog):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  lock_path = tmp_path / workdir_lib.LOCK_NAME
  lock_path.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 0}))
  with caplog.at_level(logging.WARNING), workdir_lib.WorkdirLock(tmp_path):
    assert json.loads(lock_path.read_text())["pid"] == os.getpid()
    with pytest.raises(WorkdirLockedError, match=rf"pid {os.getpid()}"):
      workdir_lib.WorkdirLock(tmp_path).acquire()  # a second trainer, same process
  assert any(
      "left by a trainer that is gone" in r.getMessage() and str(dead.pid) in r.getMessage()
      for r in caplog.records
  )
  assert not lock_path.exists()


def test_workdir_that_is_a_file_or_read_only_stops_before_anything(tmp_path, monkeypatch):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  with pytest.raises(RunError, match=r"file is a file, not a directory"):
    train_and_evaluate(config(), a_file)
  with pytest.raises(RunError, match=r"lies under .*file, which is a file"):
    train_and_evaluate(config(), a_file / "sub")
  real_open = os.open

  def read_only_open(path, flags, *args):
    if ".fastpos-probe-" in str(path):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    return real_open(path, flags, *args)

  monkeypatch.setattr(workdir_lib.os, "open", read_only_open)
  with pytest.raises(RunError, match=r"cannot create files in .*Read-only file system"):
    train_and_evaluate(config(), tmp_path / "new" / "run")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_missing_validation_data_creates_nothing(tmp_path, monkeypatch):
  real = tasks.make_task

  def make_task(cfg):
    task = real(cfg)
    source = task.source

    def no_validation(split):
      if split == "validation":
        raise FileNotFoundError("no validation data in /nowhere")
      return source(split)

    task.source = no_validation
    return task

  monkeypatch.setattr(tasks, "make_task", make_task)
  with pytest.raises(FileNotFoundError, match="no validation data"):
    train_and_evaluate(config(), tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_disk_full_during_a_save_is_one_message(tmp_path, monkeypatch, caplog):
  # The meta item's file write, in orbax's background save thread, finds the disk full.
  async def full(self, x, directory):
    del self, x
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", full)
  with (
      caplog.at_level(logging.WARNING),
      pytest.raises(
          RunError,
          match=r"No space left on device in .*(checkpoints|best): "
          r"free space or use another --workdir",
      ),
  ):
    train_and_evaluate(config(num_train_steps=2), tmp_path / "run")
  assert not (tmp_path / "run" / workdir_lib.LOCK_NAME).exists()
  assert not [r for r in caplog.records if r.exc_info]  # no background tracebacks


def test_os_error_reason_reads_tensorstore_messages():
  err = ValueError(
      "RESOURCE_EXHAUSTED: Failed to write 166 bytes to file 7: No space left "
      "on device [os_error_code='28']"
  )
  assert workdir_lib.os_error_reason(err) == os.strerror(errno.ENOSPC)
  try:
    try:
      raise OSError(errno.EROFS, "x")
    except OSError as e:
      raise RuntimeError("wrapped") from e
  except RuntimeError as wrapped:
    assert workdir_lib.os_error_reason(wrapped) == os.strerror(errno.EROFS)
  assert workdir_lib.os_error_reason(ValueError("bad shape")) is None


# Slow; the default run keeps restores (test_damaged_newest_checkpoint_falls_back_...).
@pytest.mark.slow
def test_the_workdir_restores_without_a_trainer(runs, tmp_path, caplog):
  """The newest verified checkpoint (or a given step, or best/) of a workdir, as saved or
  into an abstract state; a damaged newest one is skipped, not moved (read-only)."""
  workdir = _copy(runs, tmp_path)  # the stopped run: checkpoints 3, 4 and 5
  newest = Workdir(workdir).restore(None, "latest")
  assert newest.step == 5 and newest.verified and newest.path == workdir / "checkpoints" / "5"
  assert int(newest.state["step"]) == 5 and "params" in newest.state
  assert newest.data_state is not None and newest.data_processes == 1
  run = run_lib.build_run(config(), workdir)
  at4 = Workdir(workdir).restore(run.checkpoint_abstract, 4)
  state, carry = from_checkpoint_tree(at4.state)
  assert at4.step == 4 and int(state.step) == 4 and carry == {}
  assert Workdir(workdir).restore(None, "best").meta["metrics"]["loss"] > 0
  _damage(workdir / "checkpoints" / "5", "weight_changed")
  with caplog.at_level(logging.WARNING):
    assert Workdir(workdir).restore(run.checkpoint_abstract, "latest").step == 4
  assert (workdir / "checkpoints" / "5").is_dir()
  assert any("checkpoints/5 does not load" in r.getMessage() for r in caplog.records)
  with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 7 in .*; its steps: .*5"):
    Workdir(workdir).restore(None, 7)
