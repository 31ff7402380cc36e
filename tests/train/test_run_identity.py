"""A run is one thing (fastpos.train.identity): every checkpoint carries its run's identity; a
checkpoint of another run (another seed, learning rate or data seed) is refused at resume, by
evaluate / eval.py and by fastpos.load with one line naming it, the workdir left as it was; a
config.json edited by hand is refused; an accepted change joins the history (earlier
checkpoints still load); checkpoints written before identities resume with a notice; the model
format comes from the checkpoint when launches.jsonl is gone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fastpos
from fastpos.train import config_record, digest, evaluate, identity, launches, train_and_evaluate
from fastpos.train import workdir as workdir_lib
from fastpos.train.errors import EXIT_BAD_INPUT, RunError
from tests.train.common import tiny_config
from tests.train.faults import edit_json

ROOT = Path(__file__).resolve().parents[2]
# One trajectory field each: a run that differs from the base run in it alone.
FOREIGN = {"seed": 1, "optimizer.learning_rate": 0.02, "task.seed": 3}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The base run and one run per FOREIGN field, 2 steps each (checkpoints/2 and best/2)."""
  root = tmp_path_factory.mktemp("identity")
  out = {"base": root / "base"}
  train_and_evaluate(tiny_config(num_train_steps=2), out["base"])
  for field, value in FOREIGN.items():
    out[field] = root / field
    train_and_evaluate(tiny_config(num_train_steps=2, **{field: value}), out[field])
  return out


def _copy(src: Path, tmp_path: Path) -> Path:
  out = tmp_path / "run"
  shutil.copytree(src, out)
  return out


def _listing(path: Path):
  return sorted(
      (str(p.relative_to(path)), p.stat().st_mtime_ns, p.stat().st_size if p.is_file() else -1)
      for p in path.rglob("*")
      if p.name != "train.lock"
  )


def _meta(step_dir: Path) -> dict:
  return json.loads((step_dir / "meta" / "metadata").read_text())


def _one_line(info) -> str:
  line = str(info.value)
  assert "\n" not in line
  return line


def test_every_checkpoint_carries_the_run_identity(runs):
  base = runs["base"]
  start = json.loads((base / workdir_lib.RUN_NAME).read_text())
  assert len(start["id"]) == 32 and start["data"]["task"] == "synthetic"
  for step_dir in (base / "checkpoints" / "2", base / "best" / "2"):
    ident = _meta(step_dir)["run"]
    assert ident["id"] == start["id"]
    assert ident["trajectory"]["seed"] == 0 and ident["trajectory"]["task.seed"] == 0
    assert ident["trajectory"]["optimizer.learning_rate"] == 0.01
    assert "log_every_steps" not in ident["trajectory"]  # not a trajectory field
    assert ident["model_format"] == launches.MODEL_FORMAT
    assert ident["data"] == identity.data_digest(start["data"])
    assert (ident["changes"], ident["launches"]) == (0, 1)
  # The identity is under the meta digest: an edit of it is damage.
  meta = _meta(base / "checkpoints" / "2")
  meta["run"]["id"] = "0" * 32
  with pytest.raises(digest.DigestMismatch):
    digest.check_meta(meta)


@pytest.mark.parametrize("field", list(FOREIGN))
def test_a_foreign_checkpoint_is_refused_at_resume_eval_and_load(runs, tmp_path, field):
  workdir = _copy(runs["base"], tmp_path)
  for kind in ("checkpoints", "best"):
    shutil.rmtree(workdir / kind / "2")
    shutil.copytree(runs[field] / kind / "2", workdir / kind / "2")
  before = _listing(workdir)
  value = FOREIGN[field]
  for which, call in [
      ("checkpoints", lambda: train_and_evaluate(tiny_config(num_train_steps=4), workdir)),
      ("best", lambda: evaluate(tiny_config(), workdir, "validation")),
      ("checkpoints", lambda: evaluate(tiny_config(), workdir, "validation", checkpoint="latest")),
      ("best", lambda: fastpos.load(workdir)),
      ("checkpoints", lambda: fastpos.load(workdir, step=2)),
  ]:
    with pytest.raises(RunError) as info:
      call()
    line = _one_line(info)
    assert line.startswith(f"checkpoint {workdir / which / '2'} belongs to another run"), line
    assert f"differs from this run's in {field} " in line and f"-> {value}" in line, line
    assert f"move it out of {workdir}" in line
  assert _listing(workdir) == before
  assert not (workdir / "results_validation.json").exists()


@pytest.mark.slow
def test_eval_py_refuses_a_foreign_best(runs, tmp_path):
  workdir = _copy(runs["base"], tmp_path)
  shutil.rmtree(workdir / "best" / "2")
  shutil.copytree(runs["seed"] / "best" / "2", workdir / "best" / "2")
  before = _listing(workdir)
  proc = subprocess.run(
      [sys.executable, "eval.py", f"--workdir={workdir}", "--split=test"],
      cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == EXIT_BAD_INPUT and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith(f"eval.py: checkpoint {workdir / 'best' / '2'} belongs to another run")
  assert not (workdir / "results_test.json").exists()
  assert _listing(workdir) == before


@pytest.mark.parametrize("field,value", [("optimizer.learning_rate", 0.5), ("seed", 7)])
def test_a_config_json_edited_by_hand_is_refused(runs, tmp_path, field, value):
  workdir = _copy(runs["base"], tmp_path)

  def change(cfg):
    *parents, last = field.split(".")
    node = cfg
    for p in parents:
      node = node[p]
    node[last] = value

  edit_json(workdir / "config.json", change)
  before = _listing(workdir)
  edited = fastpos.train.cli.load_config(str(workdir / "config.json"))  # what the refusal offers
  with edited.unlocked():
    edited.num_train_steps = 4
  for call in (
      lambda: train_and_evaluate(edited, workdir),
      lambda: train_and_evaluate(edited, workdir, allow_config_change=True),
      lambda: evaluate(edited, workdir, "validation"),
      lambda: fastpos.load(workdir),
  ):
    with pytest.raises(RunError) as info:
      call()
    line = _one_line(info)
    assert f"was trained with {field} " in line and "the record was edited or replaced" in line
  assert _listing(workdir) == before
  assert not (workdir / workdir_lib.CHANGES_NAME).exists()


# Slow; the default run keeps the refusals
# (test_a_foreign_checkpoint_is_refused_at_resume_eval_and_load).
@pytest.mark.slow
def test_an_accepted_change_joins_the_history(runs, tmp_path):
  workdir = _copy(runs["base"], tmp_path)
  train_and_evaluate(
      tiny_config(num_train_steps=4, **{"optimizer.learning_rate": 0.02}),
      workdir,
      allow_config_change=True,
  )
  ident = _meta(workdir / "checkpoints" / "4")["run"]
  assert ident["trajectory"]["optimizer.learning_rate"] == 0.02
  assert (ident["changes"], ident["launches"]) == (1, 2)
  assert fastpos.load(workdir, step=2).step == 2  # the earlier trajectory is in the history
  assert fastpos.load(workdir, step=4).config.optimizer.learning_rate == 0.02
  # A further resume with the changed config changes nothing that affects results.
  train_and_evaluate(tiny_config(num_train_steps=6, **{"optimizer.learning_rate": 0.02}), workdir)
  last = config_record.read_changes(workdir)[-1]
  assert [c["field"] for c in last["changes"]] == ["num_train_steps"] and "data" not in last


def _strip_identity(workdir: Path) -> None:
  """Makes the checkpoints what an earlier fastpos wrote: no meta["run"] (the meta digest
  redone), no run.json."""
  for step_dir in [*(workdir / "checkpoints").iterdir(), *(workdir / "best").iterdir()]:

    def strip(meta):
      del meta["run"]
      meta["digests"]["meta"] = digest.meta_digest(meta)

    edit_json(step_dir / "meta" / "metadata", strip)
  (workdir / workdir_lib.RUN_NAME).unlink()


def test_checkpoints_without_identity_resume_as_legacy(runs, tmp_path, caplog):
  workdir = _copy(runs["base"], tmp_path)
  _strip_identity(workdir)
  assert fastpos.load(workdir).step == 2  # accepted
  with caplog.at_level("WARNING", logger="absl"):
    result = train_and_evaluate(tiny_config(num_train_steps=4), workdir)
  assert result["step"] == 4
  notices = [r.getMessage() for r in caplog.records if "without a run identity" in r.getMessage()]
  assert any(str(workdir / "checkpoints" / "2") in n for n in notices)
  start = json.loads((workdir / workdir_lib.RUN_NAME).read_text())  # the run got one now
  assert _meta(workdir / "checkpoints" / "4")["run"]["id"] == start["id"]


def test_the_model_format_comes_from_the_checkpoint(runs, tmp_path, monkeypatch):
  workdir = _copy(runs["base"], tmp_path)
  (workdir / workdir_lib.LAUNCHES_NAME).unlink()
  monkeypatch.setitem(launches.FORMAT_CHANGES, 2, ("every model changed", lambda model: True))
  # The checkpoint says format 2: evaluating and loading it are not refused as "format 1".
  assert fastpos.load(workdir).step == 2
  evaluate(tiny_config(), workdir, "validation")
  # A resume names the lost record instead of recreating it.
  with pytest.raises(RunError, match=r"launches.jsonl is missing, but checkpoint .* was saved"):
    train_and_evaluate(tiny_config(num_train_steps=4), workdir)
