"""Readers of a workdir beside the trainer that writes it (``Checkpoints.restore_newest``).

A trainer with ``keep_checkpoints=1`` deletes each checkpoint once the next one is saved: a
reader (``eval.py``, ``fastpos.load``, ``Workdir.restore``) can see the step it chose
vanish while it reads. That step is not damaged: the reader lists the folder again and reads
its newest step; only a step that fails while the folder stays as it was is reported damaged.

* A step deleted during its read (and a newer one in its place): the newer one is read, no
  damage reported; a step deleted with nothing left: one error saying so, not "damaged".
* A writer thread saving with keep 1 (latest and best) while the reader restores "latest"
  and "best" over and over: every read returns a complete, verified checkpoint.
* ``fastpos.load`` on a damaged workdir, as a program of its own: one exception with one
  message, and nothing of orbax's on stderr.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.train import checkpoint as checkpoint_lib
from fastpos.train import resume as resume_lib
from fastpos.train import run as run_lib
from fastpos.train.checkpoint import (
    CheckpointLoadError,
    Checkpoints,
    config_meta,
)
from fastpos.train.state import checkpoint_tree
from fastpos.train.workdir import Workdir
from tests.train.common import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _save(ckpts: Checkpoints, run, it, state, carry, step: int) -> None:
  """One checkpoint (and best) of ``state`` at ``step``, as the trainer writes them."""
  state = state.replace(step=jnp.int32(step))
  next(it)
  meta = {
      "rng": [1, step],
      "config": config_meta(run.cfg, run.info),
      "step": step,
      "data": resume_lib.DataPosition().meta(run.cfg, 12, step),
      "log_window": None,
  }
  ckpts.save(step, checkpoint_tree(state, carry), it, meta)
  ckpts.save_best(step, checkpoint_tree(state, carry), {**meta, "metrics": {"loss": 1.0}})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """A run of the tiny config with keep_checkpoints=1 (nothing compiled: random states), and
  a workdir holding checkpoints/2, /4 and /6 (written with keep 3)."""
  root = tmp_path_factory.mktemp("readers")
  run = run_lib.build_run(tiny_config(keep_checkpoints=1), root / "run")
  src = run.task.source("train")
  state, carry = run.init_state()
  rng = np.random.default_rng(0)
  state = jax.tree.map(
      lambda x: jax.device_put(rng.normal(size=x.shape).astype(x.dtype), x.sharding)
      if jnp.issubdtype(x.dtype, jnp.floating)
      else x,
      state,
  )
  three = root / "three"
  keep3 = run_lib.build_run(tiny_config(keep_checkpoints=3), three)
  ckpts = Checkpoints(three, keep3.cfg)
  ckpts.open_for_writing()
  it = run.feed.train(src, 0)
  try:
    for step in (2, 4, 6):
      _save(ckpts, run, it, state, carry, step)
    ckpts.wait()
  finally:
    ckpts.close()
  return {"run": run, "src": src, "state": state, "carry": carry, "three": three}


def _copy(setup, tmp_path: Path, steps=(2, 4)) -> Path:
  """A copy of the setup's workdir with only ``steps`` in checkpoints/ (the others moved to
  ``<copy>/later/``)."""
  workdir = tmp_path / "w"
  shutil.copytree(setup["three"], workdir)
  (workdir / "later").mkdir()
  for step_dir in (workdir / "checkpoints").iterdir():
    if int(step_dir.name) not in steps:
      step_dir.rename(workdir / "later" / step_dir.name)
  return workdir


def _vanish_during_read(monkeypatch, step_dir: Path, newer: Path | None = None):
  """The first read of ``step_dir``'s state deletes the folder first (a trainer's rotation);
  with ``newer``, that folder (a newer step) moves in beside it first."""
  restore = Checkpoints._restore_state
  done = []

  def restore_after_rotation(self, manager, path, step, abstract_state, meta):
    if Path(path) == step_dir and not done:
      done.append(step)
      if newer is not None:
        newer.rename(step_dir.with_name(newer.name))
      shutil.rmtree(step_dir)
    return restore(self, manager, path, step, abstract_state, meta)

  monkeypatch.setattr(Checkpoints, "_restore_state", restore_after_rotation)
  return done


def test_a_step_deleted_while_read_is_not_damaged(setup, tmp_path, monkeypatch, caplog):
  workdir = _copy(setup, tmp_path)
  latest = workdir / "checkpoints"
  done = _vanish_during_read(monkeypatch, latest / "4", newer=workdir / "later" / "6")
  abstract = setup["run"].checkpoint_abstract
  with caplog.at_level(logging.WARNING):
    found = Workdir(workdir).restore(abstract, "latest")
  assert done == [4]
  assert found.path == latest / "6" and found.verified  # the newer step, read whole
  assert not [r for r in caplog.records if "does not load" in r.getMessage()]
  assert not list(latest.glob("*.corrupt*"))


def test_the_older_step_is_read_when_the_newest_vanishes(setup, tmp_path, monkeypatch, caplog):
  workdir = _copy(setup, tmp_path)
  _vanish_during_read(monkeypatch, workdir / "checkpoints" / "4")
  with caplog.at_level(logging.WARNING):
    found = Workdir(workdir).restore(setup["run"].checkpoint_abstract, "latest")
  assert found.step == 2 and found.verified
  assert not [r for r in caplog.records if "does not load" in r.getMessage()]


def test_every_step_deleted_while_read_says_so(setup, tmp_path, monkeypatch):
  workdir = _copy(setup, tmp_path, steps=(4,))
  _vanish_during_read(monkeypatch, workdir / "checkpoints" / "4")
  with pytest.raises(CheckpointLoadError, match="were deleted while being read") as e:
    Workdir(workdir).restore(setup["run"].checkpoint_abstract, "latest")
  assert "Restore them from a copy" not in str(e.value)


# Slow; the default run keeps a damaged workdir's load (test_load_of_a_damaged_workdir_...).
@pytest.mark.slow
def test_readers_beside_a_writer_that_keeps_one(setup, tmp_path, caplog):
  """A writer thread saves steps 1, 2, ... (latest and best, keep 1, asynchronously) while
  this thread restores the newest of each, 12 times: every read succeeds, verified, at a step
  that only grows, and no damage is reported."""
  run, workdir = setup["run"], tmp_path / "w"
  stop, errors = threading.Event(), []

  def write():
    ckpts = Checkpoints(workdir, run.cfg)
    ckpts.open_for_writing()
    it = run.feed.train(setup["src"], 0)
    try:
      step = 0
      while not stop.is_set() and step < 2000:
        step += 1
        _save(ckpts, run, it, setup["state"], setup["carry"], step)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)
    finally:
      ckpts.wait()
      ckpts.close()

  writer = threading.Thread(target=write)
  writer.start()
  steps = {"latest": [], "best": []}
  try:
    while not all(
        d.is_dir() and any(p.name.isdigit() for p in d.iterdir())
        for d in (workdir / "checkpoints", workdir / "best")
    ):
      assert writer.is_alive(), errors
      stop.wait(0.05)
    with caplog.at_level(logging.WARNING):
      for i in range(12):
        which = ("latest", "best")[i % 2]
        found = Workdir(workdir).restore(run.checkpoint_abstract, which)
        assert found.verified
        steps[which].append(found.step)
  finally:
    stop.set()
    writer.join(timeout=120)
  assert not errors, errors
  assert not [r for r in caplog.records if "does not load" in r.getMessage()]
  for which, got in steps.items():
    assert got == sorted(got), (which, got)
  assert steps["latest"][-1] > steps["latest"][0], steps  # the writer was writing meanwhile


def test_load_of_a_damaged_workdir_is_one_exception_and_a_quiet_stderr(setup, tmp_path):
  """``fastpos.load`` in a program of its own, every checkpoint damaged: one CheckpointLoadError
  naming both, and stderr holds nothing (no orbax log, no abandoned read)."""
  workdir = _copy(setup, tmp_path)
  for step_dir in (workdir / "checkpoints").iterdir():
    # The array chunks (orbax's larger data files; the B-tree nodes are the small ones).
    for f in (f for f in (step_dir / "state").rglob("*") if f.parent.name == "d"):
      if f.stat().st_size < 4096:
        continue
      data = bytearray(f.read_bytes())
      data[40::97] = bytes(b ^ 0x5A for b in data[40::97])
      f.write_bytes(bytes(data))
  config = tmp_path / "config.json"
  config.write_text(setup["run"].cfg.to_json_best_effort())
  script = textwrap.dedent(f"""
      import fastpos, gc, time
      from fastpos.train import cli
      from fastpos.train.checkpoint import CheckpointLoadError
      cfg = cli.load_config({str(config)!r})
      try:
        fastpos.load({str(workdir)!r}, checkpoint="latest", config=cfg)
      except CheckpointLoadError as e:
        print("CAUGHT", e)
      else:
        print("LOADED")
      # Abandoned sibling reads are collected later, from orbax's loop thread: wait for them.
      for _ in range(3):
        time.sleep(1)
        gc.collect()
      """)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run(
      [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = proc.stdout.strip().splitlines()
  assert line.startswith("CAUGHT no checkpoint in ") and "/checkpoints/4 (" in line, line
  assert "/checkpoints/2 (" in line and "TensorStore details" not in line, line
  # The fixture writes checkpoints as the trainer did before runs had an identity: the one
  # notice per checkpoint that says so is the only line allowed.
  noise = [
      l
      for l in proc.stderr.strip().splitlines()
      if "was written by an earlier fastpos, without a run identity" not in l
  ]
  assert not noise, proc.stderr[-3000:]


def test_the_listing_of_a_folder_that_cannot_be_listed_is_one_error(setup, tmp_path, monkeypatch):
  """Orbax's listing keeps failing (not a damaged step): one CheckpointLoadError naming the
  folder, after a few tries, never orbax's raw exception."""
  workdir = _copy(setup, tmp_path)
  calls = []

  def failing_manager(directory, **kw):
    calls.append(directory)
    raise FileNotFoundError(f"{directory}/4/_CHECKPOINT_METADATA")

  monkeypatch.setattr(checkpoint_lib, "_manager", failing_manager)
  monkeypatch.setattr(checkpoint_lib, "_RELIST_PAUSE_S", 0.0)
  with pytest.raises(CheckpointLoadError, match="cannot list the checkpoints in .*checkpoints"):
    Checkpoints(workdir, read_only=True)
  assert len(calls) == checkpoint_lib._LIST_ATTEMPTS
