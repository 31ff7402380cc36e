"""The run's record of its launches (fastpos.train.launches): what each start ran with (the
command, versions, source commit, devices), and the commit and dirty flag of a git checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys

import jax
import pytest

import fastpos
from fastpos.train import launches, train_and_evaluate
from tests.train.common import tiny_config


def test_a_run_records_what_it_ran_with(tmp_path):
  workdir = tmp_path / "run"
  train_and_evaluate(tiny_config(num_train_steps=1, checkpoint_every_steps=1), workdir)
  (line,) = launches.read(workdir)
  assert line["first_step"] == 1 and line["resumed_from"] is None
  assert line["command"] == sys.argv
  assert line["processes"] == jax.process_count()
  assert line["devices"] == {
      "count": jax.device_count(),
      "platform": jax.devices()[0].platform,
      "kind": jax.devices()[0].device_kind,
  }
  assert line["versions"]["jax"] == jax.__version__
  assert line["versions"]["fastpos"] == fastpos.__version__
  assert set(line["versions"]) == {"python", *launches.DISTRIBUTIONS}
  assert line["source"] == launches.source()


def _git(where, *args) -> str:
  command = ["git", "-C", str(where), "-c", "user.email=t@t", "-c", "user.name=t", *args]
  return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_source_is_the_checkouts_commit_and_whether_tracked_files_differ(tmp_path):
  assert launches.source(tmp_path) is None  # not a checkout
  _git(tmp_path, "init", "-q")
  (tmp_path / "a.py").write_text("x = 1\n")
  _git(tmp_path, "add", "a.py")
  _git(tmp_path, "commit", "-q", "-m", "one")
  commit = _git(tmp_path, "rev-parse", "HEAD")
  (tmp_path / "untracked.txt").write_text("not part of the source\n")
  assert launches.source(tmp_path) == {"commit": commit, "dirty": False}
  (tmp_path / "a.py").write_text("x = 2\n")
  assert launches.source(tmp_path) == {"commit": commit, "dirty": True}
