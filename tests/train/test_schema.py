"""The value schema (fastpos.config_schema): every field of every config is declared with a
range or choices and classified (changes results or not); every value outside a declaration,
generated from the schema, is refused with one line naming the field, the value and the valid
values; a few of them through train.py itself (exit 2, one line, no traceback)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import ml_collections
import pytest

from configs import common
from fastpos import config_schema, models, positional, tasks
from fastpos.ops import features, kernel_options
from fastpos.train import cli, config_files, errors
from fastpos.train import config as config_lib

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(
    p for p in (ROOT / "configs").glob("*.py") if not p.name.startswith("_") and p.stem != "common"
)


def _variants(path: Path) -> list[str]:
  """The file's default, ``tiny``, and each value of each argument with choices (tiny)."""
  module = config_files.load_module(str(path))
  out = [str(path), f"{path}:tiny"]
  for name, values in getattr(module, "CHOICES", {}).items():
    out += [f"{path}:tiny,{name}={v}" for v in values]
  return out


VARIANTS = [v for p in CONFIGS for v in _variants(p)]


def _declared_with_range(decl: config_schema.Field) -> bool:
  if decl.type in ("int", "float"):
    return decl.choices is not None or decl.low is not None
  if decl.type in ("str", "tuple"):
    return decl.choices is not None or bool(decl.valid)
  return True  # bool, block


def test_every_field_of_every_config_is_declared_and_classified():
  assert len(VARIANTS) > 50
  seen = set()
  for spec in VARIANTS:
    cfg = cli.load_config(spec)  # validates: every default of every config is in range
    task = cfg.task.name
    for path, value in config_schema.leaves(cfg):
      if path == "model.positional_options":
        for scheme, options in value.items():
          assert set(options) <= set(positional.get_class(scheme).option_spec), (spec, scheme)
        continue
      decl = config_schema.field(path, task)
      assert decl is not None, f"{spec}: config.{path} is not declared in fastpos.config_schema"
      assert _declared_with_range(decl), f"config.{path} has no range, choices or valid words"
      assert isinstance(config_schema.is_trajectory(path, cfg.to_dict()), bool)
      seen.add(path if not path.startswith("task.") else f"{task}:{path}")
  assert "model.kernel_options.seed" in seen and "listops:task.parens" in seen


def test_declarations_match_the_package():
  for task in tasks.task_names():
    block = tasks.task_config(task)
    assert set(block.keys()) - {"name"} == set(tasks.get_task_class(task).config_fields), task
    base = config_lib.base_config(task)
    for path, _ in config_schema.leaves(base):
      assert config_schema.field(path, task) is not None, path
  assert config_schema.FIELDS["model.remat"].choices == models.REMAT_POLICIES
  undeclared_blocks = {"experiment", "paper"}  # set by configs/common.set_paper only
  base_paths = {p for p, _ in config_schema.leaves(config_lib.base_config("synthetic"))}
  for path, decl in config_schema.FIELDS.items():
    if decl.type != "block" and path.split(".")[0] not in undeclared_blocks:
      assert path in base_paths, f"config.{path} is declared but not in the base config"
    assert _declared_with_range(decl), path
  assert common.base_config("listops").keys() == config_lib.base_config("listops").keys()


def test_the_schema_reads_kernels_and_task_fields_from_their_owners(monkeypatch):
  # A kernel or option registered in fastpos.ops.features, or a field declared on a task's
  # class, is in the schema with nothing else edited: no second list to keep in step.
  monkeypatch.setattr(features, "KERNELS", (*features.KERNELS, "fake_kernel"))
  options = {**kernel_options.OPTIONS, "fake_option": config_schema.fields.integer(3, 1)}
  monkeypatch.setattr(kernel_options, "OPTIONS", options)
  task_cls = tasks.get_task_class("synthetic")
  own = {**task_cls.config_fields, "fake_field": config_schema.fields.boolean(False)}
  monkeypatch.setattr(task_cls, "config_fields", own)
  assert config_schema.field("model.kernel").choices == features.KERNELS
  cfg = config_lib.base_config("synthetic")
  assert cfg.model.kernel_options.fake_option == 3 and cfg.task.fake_field is False
  cfg.model.kernel = "fake_kernel"
  config_schema.check(cfg)  # the new kernel, option and task field are valid values
  cfg.model.kernel_options.fake_option = 0
  with pytest.raises(config_schema.ConfigValueError, match="fake_option must be an integer >= 1"):
    config_schema.check(cfg)
  cfg.model.kernel_options.fake_option = 3
  cfg.model.kernel = "elu2"
  with pytest.raises(config_schema.ConfigValueError, match="softmax, elu1, .*fake_kernel; got"):
    config_schema.check(cfg)


# ---------------------------------------------------------------------------------------------
# Values outside each declaration
# ---------------------------------------------------------------------------------------------
def _bad_values(decl: config_schema.Field) -> list:
  """Values the declaration refuses: past each end of the range, another type, not a choice,
  not finite."""
  t = decl.type
  if decl.choices is not None:
    return ["bogus", 12345] if t == "str" else [33, "32", 1.5]
  out = {
      "bool": [1, "true", None],
      "str": [3, None, True],
      "tuple": ["x", 3],
      "block": [3, "x"],
  }.get(t)
  if out is not None:
    return out
  out = ["7", True, None]
  if t == "int":
    out.append(1.5)
  else:
    out += [math.nan, math.inf, -math.inf]
  step = 1 if t == "int" else 0.5
  if decl.low is not None:
    out.append(decl.low if decl.low_open else decl.low - step)
  if decl.high is not None:
    out.append(decl.high if decl.high_open else decl.high + step)
  return out


def _base_for(path: str) -> tuple[ml_collections.ConfigDict, str]:
  task = "synthetic"
  if path.startswith("task.") and path != "task.name":
    task = next(t for t in tasks.task_names() if path[5:] in config_schema.task_fields(t))
  cfg = config_lib.base_config(task)
  common.set_paper(cfg, row="r", col="c", table="t", results={"r|c": 1.0})
  return cfg, task


def _with(cfg: ml_collections.ConfigDict, path: str, value) -> ml_collections.ConfigDict:
  """A copy of ``cfg`` with ``value`` at ``path``, type checks of ConfigDict bypassed."""
  values = cfg.to_dict()
  node = values
  *parents, last = path.split(".")
  for part in parents:
    node = node[part]
  node[last] = value
  return ml_collections.ConfigDict(values)


def _declared_paths() -> list[str]:
  paths = [
      p
      for p in config_schema.FIELDS
      if p not in config_schema.OPEN_BLOCKS and p not in ("model.positional_options",)
  ]
  paths += ["task.name"] + [f"model.kernel_options.{k}" for k in features.OPTIONS]
  paths += sorted({f"task.{k}" for t in tasks.task_names() for k in config_schema.task_fields(t)})
  return paths


TALLY = {"tried": 0, "one_line": 0}


def _assert_refused(cfg, path: str, value) -> str:
  TALLY["tried"] += 1
  with pytest.raises(errors.RunError) as info:
    config_lib.validate(cfg)
  text = str(info.value)
  assert "\n" not in text and text.startswith(f"config.{path}"), (path, value, text)
  shown = repr(value) if isinstance(value, str) else str(value)
  assert shown in text, (path, value, text)
  TALLY["one_line"] += 1
  return text


@pytest.mark.parametrize("path", _declared_paths())
def test_values_outside_the_declaration_are_refused_naming_the_field(path):
  cfg, task = _base_for(path)
  decl = config_schema.field(path, task)
  config_lib.validate(cfg)  # the base itself passes
  for value in _bad_values(decl):
    text = _assert_refused(_with(cfg, path, value), path, value)
    assert decl.describe() in text


def _bad_options(option: positional.Option) -> list:
  out = []
  if option.choices is not None:
    out.append("bogus" if option.type == "str" else 12345)
  if option.type == "bool":
    out.append(3)
  if option.type in ("int", "number"):
    out += ["7", math.nan] if option.type == "number" else ["7", 1.5]
    if option.low is not None:
      out.append(option.low if option.low_open else option.low - 1)
  return out


@pytest.mark.parametrize("scheme", [s for s in positional.SCHEMES if s != "none"])
def test_bad_positional_options_are_refused_naming_the_option(scheme):
  cfg = config_lib.base_config("synthetic")
  tried = 0
  for name, option in positional.get_class(scheme).option_spec.items():
    for value in _bad_options(option):
      bad = _with(cfg, "model.positional_options", {scheme: {name: value}})
      _assert_refused(bad, f"model.positional_options.{scheme}.{name}", value)
      tried += 1
  assert tried or not positional.get_class(scheme).option_spec


def test_unknown_fields_are_refused_naming_the_valid_ones():
  cfg = config_lib.base_config("synthetic")
  for path, needle in [
      ("model.num_layer", "num_layers"),
      ("task.max_lenght", "max_length"),
      ("model.kernel_options.m", "num_features"),
      ("sead", "seed"),
  ]:
    with pytest.raises(errors.RunError, match=rf"^config\.{path} is not a .*{needle}"):
      config_lib.validate(_with(cfg, path, 1))
  with pytest.raises(errors.RunError, match=r"config.task: synthetic task: need 1 <= min_len"):
    config_lib.validate(_with(cfg, "task.min_length", 99))  # a rule between two fields
  with pytest.raises(errors.RunError, match=r"config.model.positional='bogus': unknown pos"):
    config_lib.validate(_with(cfg, "model.positional", "bogus"))


def test_a_new_field_is_one_declaration():
  """How another field is declared (the module docstring's example) and what it does."""
  decl = config_schema.Field("str", choices=("none", "block"), trajectory=False)
  assert not decl.is_valid("full") and decl.is_valid("block") and not decl.affects({})
  assert config_schema.error("model.remat", decl, "full") == (
      "config.model.remat must be one of none, block; got 'full'."
  )


# ---------------------------------------------------------------------------------------------
# Through train.py
# ---------------------------------------------------------------------------------------------
def _train(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
      [sys.executable, "train.py", "--config=configs/synthetic.py:tiny", *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )


@pytest.mark.parametrize(
    "override, needle",
    [
        pytest.param(
            "batch_size=-8",
            "config.batch_size must be an integer >= 1; got -8.",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "seed=-1",
            "config.seed must be an integer >= 0 and <= 4294967295; got -1.",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "precision=bogus",
            "config.precision must be one of default, high, highest",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "optimizer.learning_rate=nan",
            "learning_rate must be a finite number > 0",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_train_py_refuses_in_one_line(tmp_path, override, needle):
  proc = _train(f"--config.{override}", f"--workdir={tmp_path / 'run'}")
  assert "Traceback" not in proc.stderr and proc.returncode == errors.EXIT_BAD_INPUT, proc.stderr
  assert proc.stderr.strip().splitlines() == [f"train.py: {needle}"] or needle in proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
  assert not (tmp_path / "run").exists()


def test_load_config_validates():
  """What train.py / eval.py / --print_config load is checked before anything else happens."""
  with pytest.raises(
      errors.RunError,
      match=r"^config.model.dropout_rate must be a finite " r"number in \[0, 1\); got 1.5\.$",
  ):
    cli.load_config(
        str(ROOT / "configs" / "synthetic.py") + ":tiny", [("model.dropout_rate", "1.5")]
    )


@pytest.mark.slow
def test_print_config_validates():
  proc = _train("--config.model.dropout_rate=1.5", "--print_config")
  assert proc.returncode == errors.EXIT_BAD_INPUT and not proc.stdout, proc.stdout
  assert proc.stderr.strip() == (
      "train.py: config.model.dropout_rate must be a finite number " "in [0, 1); got 1.5."
  )
