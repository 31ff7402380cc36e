"""The run's record of its config (fastpos.train.config_record): a resume that changes any field
that changes results is refused naming it (every such field, in process); free fields change
silently but are recorded; an accepted change is recorded in config_changes.jsonl, the summary
line and TensorBoard; config.json stays byte for byte what the run started with (end to end on
the tiny trainer config, and once through train.py)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_collections
import pytest

from configs import common
from fastpos import config_schema, positional
from fastpos.train import cli, config_record, errors, launches, train_and_evaluate
from fastpos.train import config as config_lib
from fastpos.train import workdir as workdir_lib
from fastpos.train.tensorboard import read_text
from tests.train.common import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _other(decl: config_schema.Field, value):
  """A valid value of ``decl`` other than ``value``."""
  if decl.choices is not None:
    return next(c for c in decl.choices if c != value)
  if decl.type == "bool":
    return not value
  if decl.type == "str":
    return "rope" if value == "none" else value + "x"  # model.positional: a scheme
  if decl.type == "tuple":  # bucket lengths or sharding rules
    return next(t for t in ((8,), ((r"mlp/.*kernel", (None, "model")),)) if decl.is_valid(t))
  if decl.type == "int":
    return value + 1 if decl.high is None or value + 1 <= decl.high else value - 1
  if decl.type == "float":
    new = value * 0.5 if value else 0.5
    return new if decl.is_valid(new) else value + 0.25 * ((decl.high or value + 1) - value)
  raise AssertionError(decl)


def _fields(cfg: ml_collections.ConfigDict):
  """(path, declaration, value) of every declared leaf of ``cfg``."""
  for path, value in config_schema.leaves(cfg):
    decl = config_schema.field(path, cfg.task.name)
    if decl is not None and decl.type != "block" and path != "task.name":
      yield path, decl, value


def _config(task: str) -> ml_collections.ConfigDict:
  cfg = config_lib.base_config(task)
  common.set_paper(cfg, row="r", col="c", table="t", results={"r|c": 1.0})
  cfg.model.positional_options.fastrpb = {"per_head": False}
  return cfg


def _write_run(workdir: Path, cfg) -> bytes:
  workdir.mkdir(parents=True, exist_ok=True)
  text = cfg.to_json_best_effort(indent=2)
  (workdir / "config.json").write_text(text)
  return text.encode()


def _changed(cfg, path: str, value) -> ml_collections.ConfigDict:
  values = cfg.to_dict()
  node = values
  *parents, last = path.split(".")
  for part in parents:
    node = node[part]
  node[last] = value
  return ml_collections.ConfigDict(values)


@pytest.mark.parametrize(
    "task",
    ["synthetic", "listops", "lra_text", "pathfinder", "mqar", "wikitext103", "lra_retrieval"],
)
def test_every_results_field_is_refused_and_every_free_one_passes(tmp_path, task):
  cfg = _config(task)
  _write_run(tmp_path, cfg)
  refused = passed = 0
  for path, decl, value in _fields(cfg):
    new = _changed(cfg, path, _other(decl, value))
    config_lib.validate(new)  # the other value is valid: only the change is at stake
    changes = config_record.compare(config_record.as_json(cfg), config_record.as_json(new))
    assert [c.field for c in changes] == [path], (path, changes)
    if decl.affects(cfg.to_dict()) or decl.affects(new.to_dict()):
      with pytest.raises(errors.RunError) as info:
        config_record.check_resume(tmp_path, new, allow=False)
      line = str(info.value)
      assert "\n" not in line and f"results: {changes[0]}." in line, line
      assert "--allow_config_change" in line
      refused += 1
    else:
      assert config_record.check_resume(tmp_path, new, allow=False) == changes
      passed += 1
    assert config_record.check_resume(tmp_path, new, allow=True) == changes
  assert refused > 20 and passed >= 8


def test_scheme_options_and_schedule_dependent_fields(tmp_path):
  cfg = _config("synthetic")
  _write_run(tmp_path, cfg)
  for scheme, cls in positional.SCHEMES.items():  # a scheme's options change the model
    for name, option in cls.option_spec.items():
      new = _changed(cfg, f"model.positional_options.{scheme}", {name: option.default})
      if scheme == "fastrpb" and name == "per_head":
        continue  # the same value as the run's
      with pytest.raises(errors.RunError, match=rf"{scheme}\.{name} \(unset\) -> "):
        config_record.check_resume(tmp_path, new, allow=False)
  # num_train_steps moves a decaying schedule only.
  assert config_schema.is_trajectory("num_train_steps", cfg.to_dict())  # cosine
  constant = _changed(cfg, "schedule.name", "constant")
  assert not config_schema.is_trajectory("num_train_steps", constant.to_dict())


def test_changes_accumulate_and_eval_reads_the_effective_config(tmp_path):
  cfg = _config("synthetic")
  saved = _write_run(tmp_path, cfg)
  first = _changed(cfg, "seed", 5)
  config_record.record(tmp_path, 4, config_record.check_resume(tmp_path, first, allow=True))
  second = _changed(first, "log_every_steps", 7)
  # Against config.json with the first change applied: only log_every_steps differs now.
  changes = config_record.check_resume(tmp_path, second, allow=False)
  assert [str(c) for c in changes] == ["log_every_steps 50 -> 7"]
  config_record.record(tmp_path, 8, changes)
  entries = config_record.read_changes(tmp_path)
  assert [e["step"] for e in entries] == [5, 9] and [e["checkpoint"] for e in entries] == [4, 8]
  assert entries[0]["changes"] == [{"field": "seed", "old": 0, "new": 5, "affects_results": True}]
  assert config_record.describe(entries) == (
      "config changed at step 5: seed 0 -> 5 (config_changes.jsonl)"
  )
  loaded = cli.load_config(str(tmp_path / "config.json"))  # what eval.py reads
  assert loaded.seed == 5 and loaded.log_every_steps == 7
  assert (tmp_path / "config.json").read_bytes() == saved
  # Going back to the start's seed is a change again.
  with pytest.raises(errors.RunError, match=r"seed 5 -> 0"):
    config_record.check_resume(tmp_path, cfg, allow=False)
  (tmp_path / "config_changes.jsonl").write_text("{not json\n")
  with pytest.raises(errors.RunError, match=r"config_changes.jsonl:1 is not a config change"):
    config_record.read_changes(tmp_path)


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
  """A 2-step run of the tiny trainer config (resumed by the tests in copies)."""
  workdir = tmp_path_factory.mktemp("record") / "run"
  train_and_evaluate(tiny_config(num_train_steps=2), workdir)
  return workdir


def _copy(workdir: Path, tmp_path: Path) -> Path:
  out = tmp_path / "run"
  shutil.copytree(workdir, out)
  return out


def test_resume_with_a_changed_seed_is_refused_then_recorded(two_steps, tmp_path, caplog):
  workdir = _copy(two_steps, tmp_path)
  saved = (workdir / "config.json").read_bytes()
  listing = sorted(
      (str(p.relative_to(workdir)), p.stat().st_mtime_ns)
      for p in workdir.rglob("*")
      if p.name != "train.lock"
  )
  changed = tiny_config(num_train_steps=4, seed=1, **{"task.seed": 2})
  with pytest.raises(errors.RunError, match=r"results: seed 0 -> 1; task.seed 0 -> 2\. Res"):
    train_and_evaluate(changed, workdir)
  assert (
      sorted(
          (str(p.relative_to(workdir)), p.stat().st_mtime_ns)
          for p in workdir.rglob("*")
          if p.name != "train.lock"
      )
      == listing
  )
  # The trainer logs through absl's logger, whose own level an earlier flag parse may have
  # raised to WARNING: set it here too.
  with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger="absl"):
    result = train_and_evaluate(changed, workdir, allow_config_change=True)
  assert result["step"] == 4
  assert (workdir / "config.json").read_bytes() == saved  # never rewritten by a resume
  (entry,) = config_record.read_changes(workdir)
  assert entry["step"] == 3 and entry["checkpoint"] == 2
  assert [(c["field"], c["affects_results"]) for c in entry["changes"]] == [
      ("num_train_steps", False),
      ("seed", True),
      ("task.seed", True),
  ]  # constant schedule
  assert read_text(workdir / "tensorboard", "config_changes") == [
      (3, "num_train_steps 2 -> 4 (no effect on results)\nseed 0 -> 1\ntask.seed 0 -> 2")
  ]
  (summary,) = [
      r.getMessage()
      for r in caplog.records  # the run's last line
      if "metrics.jsonl, tensorboard/, config.json" in r.getMessage()
  ]
  assert "; config changed at step 3: seed 0 -> 1, task.seed 0 -> 2 (config_changes.jsonl)" in (
      summary
  ), summary
  # The same config again: nothing new to record; config.json still the start's.
  before = (workdir / workdir_lib.LAUNCHES_NAME).read_bytes()
  train_and_evaluate(tiny_config(num_train_steps=4, seed=1, **{"task.seed": 2}), workdir)
  assert len(config_record.read_changes(workdir)) == 1
  assert (workdir / "config.json").read_bytes() == saved
  # Every start appended one launch (the refused one none); earlier lines are kept as written.
  assert (workdir / workdir_lib.LAUNCHES_NAME).read_bytes().startswith(before)
  starts = launches.read(workdir)
  assert [(e["first_step"], e["resumed_from"]) for e in starts] == [
      (1, None),
      (3, str(workdir / "checkpoints" / "2")),
      (5, str(workdir / "checkpoints" / "4")),
  ]


def test_free_fields_change_silently_and_are_recorded(two_steps, tmp_path):
  workdir = _copy(two_steps, tmp_path)
  saved = (workdir / "config.json").read_bytes()
  train_and_evaluate(
      tiny_config(num_train_steps=3, log_every_steps=3, **{"data.num_threads": 2}), workdir
  )
  assert (workdir / "config.json").read_bytes() == saved
  (entry,) = config_record.read_changes(workdir)
  assert {c["field"]: c["affects_results"] for c in entry["changes"]} == {
      "data.num_threads": False,
      "log_every_steps": False,
      "num_train_steps": False,
  }


@pytest.mark.slow
def test_train_py_refuses_a_changed_learning_rate(two_steps, tmp_path):
  workdir = _copy(two_steps, tmp_path)
  saved = (workdir / "config.json").read_bytes()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [
          sys.executable,
          "train.py",
          f"--config={workdir}/config.json",
          f"--workdir={workdir}",
          "--config.optimizer.learning_rate=0.5",
          "--config.num_train_steps=3",
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == errors.EXIT_BAD_INPUT and "Traceback" not in proc.stderr
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith("train.py: the run in ") and (
      "results: optimizer.learning_rate 0.01 -> 0.5. Resume" in line
  ), line
  assert (workdir / "config.json").read_bytes() == saved
  assert not (workdir / "config_changes.jsonl").exists()
