"""The workdir's one owner, ``fastpos.train.workdir.Workdir``: its layout, the effective config
(config.json with the recorded changes) that every reader sees, the one message for a folder
that is not a run's (from ``fastpos.load``, ``eval.py`` and ``generate.py`` alike), a public
API that imports nothing of the trainer, and record file names written in the owner only."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fastpos
from fastpos.train import cli, config_record, errors, train_and_evaluate
from fastpos.train import workdir as workdir_lib
from fastpos.train.checkpoint import Checkpoints
from fastpos.train.workdir import Workdir
from tests.train.common import tiny_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import plot_positional  # noqa: E402


def test_the_layout_is_the_owners(tmp_path):
  run = Workdir(tmp_path)
  assert os.fspath(run) == str(tmp_path)
  assert {
      "config": run.config_file,
      "changes": run.changes_file,
      "run": run.run_file,
      "launches": run.launches_file,
      "metrics": run.metrics_file,
      "tensorboard": run.tensorboard_dir,
      "checkpoints": run.checkpoints_dir,
      "best": run.best_dir,
      "log": run.log_file,
      "lock": run.lock_file,
      "previous": run.previous_dir,
      "results": run.results_file("test"),
  } == {
      "config": tmp_path / "config.json",
      "changes": tmp_path / "config_changes.jsonl",
      "run": tmp_path / "run.json",
      "launches": tmp_path / "launches.jsonl",
      "metrics": tmp_path / "metrics.jsonl",
      "tensorboard": tmp_path / "tensorboard",
      "checkpoints": tmp_path / "checkpoints",
      "best": tmp_path / "best",
      "log": tmp_path / "train.log",
      "lock": tmp_path / "train.lock",
      "previous": tmp_path / "previous",
      "results": tmp_path / "results_test.json",
  }
  # The record modules write where the owner says.
  ckpts = Checkpoints(tmp_path, read_only=True)
  assert (ckpts.latest_dir, ckpts.best_dir) == (run.checkpoints_dir, run.best_dir)
  assert run.lock().path == run.lock_file
  for name in ("run.json", "results_validation.json", "notes.txt"):
    (tmp_path / name).write_text("{}")
  assert workdir_lib.leftover_records(tmp_path) == ["run.json", "results_validation.json"]


def _recorded_run(workdir: Path):
  """config.json of the tiny config and one recorded resume that changed the seed."""
  start, resumed = tiny_config(), tiny_config(seed=1)
  workdir.mkdir()
  run = Workdir(workdir)
  run.config_file.write_text(start.to_json_best_effort(indent=2))
  config_record.record(workdir, 2, config_record.check_resume(workdir, resumed, allow=True))
  return start, resumed


def test_the_effective_config_holds_the_recorded_changes(tmp_path):
  start, resumed = _recorded_run(tmp_path / "run")
  run = Workdir(tmp_path / "run")
  assert json.loads(run.config_file.read_text())["seed"] == 0  # config.json: the start's
  config = run.config()
  assert config.seed == 1 and config_record.as_json(config) == config_record.as_json(resumed)
  assert config.to_dict() == resumed.to_dict()  # lists back as tuples (data.bucket_lengths)
  # eval.py and generate.py read the same through --config=<workdir>/config.json.
  assert cli.load_config(str(run.config_file)).seed == 1
  assert config_record.as_json(start) != config_record.as_json(config)


@pytest.mark.slow  # trains 2 steps, resumes 2 more with a changed seed
def test_a_run_with_a_recorded_change_loads_with_it(tmp_path):
  workdir = tmp_path / "run"
  train_and_evaluate(tiny_config(num_train_steps=2), workdir)
  train_and_evaluate(tiny_config(num_train_steps=4, seed=1), workdir, allow_config_change=True)
  assert json.loads((workdir / "config.json").read_text())["seed"] == 0  # what a raw read saw
  loaded = fastpos.load(workdir, checkpoint="latest")
  assert loaded.step == 4 and loaded.config.seed == 1
  params, meta = plot_positional.load_checkpoint(workdir, "latest")
  assert meta["step"] == 4 and meta["which"] == "latest" and meta["run"]["trajectory"]["seed"] == 1
  assert set(params) == set(loaded.params)


def _message(path: Path) -> str:
  with pytest.raises(errors.RunError) as e:
    Workdir(path).require_run()
  return str(e.value)


@pytest.mark.parametrize("case", ["missing", "no-config"])
def test_load_says_what_the_owner_says(tmp_path, case):
  path = tmp_path / "nowhere" if case == "missing" else tmp_path
  expected = _message(path)
  assert ("does not exist" if case == "missing" else "has no config.json") in expected
  with pytest.raises(errors.RunError) as e:
    fastpos.load(path)
  assert str(e.value) == expected


@pytest.mark.parametrize("case", ["missing", "no-config"])
def test_plot_positional_says_what_the_owner_says(tmp_path, case, capsys, monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))  # main sets it
  path = tmp_path / "nowhere" if case == "missing" else tmp_path
  assert plot_positional.main([str(path)]) == errors.EXIT_BAD_INPUT
  assert capsys.readouterr().err.strip() == f"plot_positional: {_message(path)}"


@pytest.mark.parametrize("case", ["missing", "no-config"])
@pytest.mark.parametrize("program", ["eval.py", "scripts/generate.py"])
def test_the_programs_say_what_the_owner_says(tmp_path, program, case):
  path = tmp_path / "nowhere" if case == "missing" else tmp_path
  flags = [f"--workdir={path}"] + (["--prompt=5"] if program.endswith("generate.py") else [])
  proc = subprocess.run(
      [sys.executable, program, *flags],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  name = Path(program).name
  assert proc.returncode == errors.EXIT_BAD_INPUT, proc.stderr[-2000:]
  assert proc.stderr.strip() == f"{name}: {_message(path)}" and not proc.stdout


def test_the_api_imports_nothing_of_the_trainer():
  code = (
      "import importlib, json, pkgutil, sys, fastpos.api\n"
      "for m in pkgutil.iter_modules(fastpos.api.__path__):\n"
      "  importlib.import_module('fastpos.api.' + m.name)\n"
      "fastpos.load\n"
      "print(json.dumps(sorted(m for m in sys.modules if m.startswith('fastpos.train'))))\n"
  )
  proc = subprocess.run(
      [sys.executable, "-c", code],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  loaded = json.loads(proc.stdout)
  assert "fastpos.train.workdir" in loaded
  internals = ("trainer", "loop", "cli", "config_files", "resume", "run", "steps", "feed")
  assert [m for m in loaded if m.rsplit(".", 1)[-1] in internals] == []


# The names of the workdir's records, as literals: written in the owner and nowhere else in
# the code that reads or writes workdirs ("best" is also the name of a checkpoint choice).
RECORD_LITERALS = {
    "config.json",
    "config_changes.jsonl",
    "run.json",
    "launches.jsonl",
    "metrics.jsonl",
    "checkpoints",
    "tensorboard",
    "train.log",
    "train.lock",
}


def _literals(path: Path) -> list[tuple[int, str]]:
  tree = ast.parse(path.read_text(encoding="utf-8"))
  return [
      (node.lineno, node.value)
      for node in ast.walk(tree)
      if isinstance(node, ast.Constant) and node.value in RECORD_LITERALS
  ]


def test_record_names_are_written_in_the_owner_only():
  sources = [*ROOT.glob("*.py"), *ROOT.glob("scripts/*.py"), *ROOT.glob("fastpos/**/*.py")]
  found = {}
  for path in sources:
    rel = path.relative_to(ROOT).as_posix()
    hits = _literals(path)
    if hits:
      found[rel] = hits
  owner = found.pop("fastpos/train/workdir.py")
  assert {name for _, name in owner} == RECORD_LITERALS
  assert found == {}, f"record file names outside fastpos/train/workdir.py: {found}"
