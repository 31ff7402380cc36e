"""The run's record of its launches (fastpos.train.launches): what each start ran with (the
command, versions, source commit, devices, model format), the commit and dirty flag of a git
checkout, and the refusal to resume, evaluate or load a run trained under an older model format
whose later changes touch its config."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import ml_collections
import pytest

import fastpos
from fastpos.train import evaluate, launches, train_and_evaluate
from fastpos.train import workdir as workdir_lib
from fastpos.train.errors import RunError
from tests.train.common import tiny_config


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
  """A 1-step run of the tiny trainer config, checkpointed (copied by tests that change it)."""
  workdir = tmp_path_factory.mktemp("launches") / "run"
  train_and_evaluate(tiny_config(num_train_steps=1, checkpoint_every_steps=1), workdir)
  return workdir


def test_a_run_records_what_it_ran_with(one_step):
  (line,) = launches.read(one_step)
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
  assert line["model_format"] == launches.MODEL_FORMAT


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
  # A folder inside the checkout is not its top: fastpos installed into a virtualenv that
  # lies in another project's checkout records no commit of that project.
  (tmp_path / "venv" / "site-packages").mkdir(parents=True)
  assert launches.source(tmp_path / "venv" / "site-packages") is None


def _model(**fields) -> ml_collections.ConfigDict:
  return tiny_config(**{f"model.{k}": v for k, v in fields.items()})


def _lines(workdir: Path, *entries: dict) -> None:
  (workdir / workdir_lib.LAUNCHES_NAME).write_text("".join(json.dumps(e) + "\n" for e in entries))


def test_a_run_of_an_older_model_format_is_refused_where_the_change_touches_it(tmp_path):
  (tmp_path / "checkpoints").mkdir()
  scanned_spe = _model(scan_layers=True, positional="spe")
  # No record: trained before it existed (format 1), and format 2 changed scanned SPE.
  with pytest.raises(RunError, match=r"cannot evaluate the run in .*model format 1; this one is 2"):
    launches.check_format(tmp_path, scanned_spe, "evaluate")
  launches.check_format(tmp_path, _model(scan_layers=False, positional="spe"), "evaluate")
  launches.check_format(tmp_path, _model(scan_layers=True, positional="rope"), "evaluate")
  _lines(tmp_path, {"first_step": 1, "model_format": 2})
  launches.check_format(tmp_path, scanned_spe, "resume")
  # A record that begins with a resume: the run's first steps predate the record.
  _lines(tmp_path, {"first_step": 3, "model_format": 2})
  with pytest.raises(RunError, match=r"cannot resume .*SPE draws each layer's noise"):
    launches.check_format(tmp_path, scanned_spe, "resume")
  (tmp_path / "checkpoints").rmdir()  # nothing trained: nothing to refuse
  launches.check_format(tmp_path, scanned_spe, "load")


def test_resume_evaluate_and_load_refuse_a_run_a_later_format_changed(
    one_step, tmp_path, monkeypatch
):
  workdir = tmp_path / "run"
  shutil.copytree(one_step, workdir)
  listing = sorted((str(p), p.stat().st_mtime_ns) for p in workdir.rglob("*"))
  monkeypatch.setattr(launches, "MODEL_FORMAT", 3)
  monkeypatch.setitem(launches.FORMAT_CHANGES, 3, ("every model changed", lambda model: True))
  for doing, call in [
      ("resume", lambda: train_and_evaluate(tiny_config(num_train_steps=2), workdir)),
      ("evaluate", lambda: evaluate(tiny_config(), workdir, "validation")),
      ("load", lambda: fastpos.load(workdir)),
  ]:
    with pytest.raises(RunError) as info:
      call()
    assert str(info.value) == (
        f"cannot {doing} the run in {workdir}: it was trained by an older fastpos (model "
        "format 2; this one is 3) and since then every model changed, so its checkpoints "
        "would compute another function here. Use the fastpos version that trained it, or "
        "train the run again."
    )
  assert sorted((str(p), p.stat().st_mtime_ns) for p in workdir.rglob("*")) == listing
