"""Every config file loads (default and ":tiny"), builds its model and traces it with
``jax.eval_shape`` (shapes only); configs/common.py restates the base config without importing
fastpos and cannot drift from it; the loader works from any folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from configs import common
from fastpos import tasks
from fastpos.models import build_model
from fastpos.train import cli
from fastpos.train.config import base_config, complete_task

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs"
CONFIGS = sorted(
    p for p in CONFIG_DIR.glob("*.py") if not p.name.startswith("_") and p.stem != "common"
)


def test_the_required_configs_exist():
  names = {p.stem for p in CONFIGS}
  assert {"listops_generated", "lra_text_fastrpb", "synthetic", "fastrpb_table1"} <= names


@pytest.mark.parametrize("task", tasks.task_names())
def test_common_base_equals_fastpos_base(task):
  ours = common.base_config(task)
  assert list(ours.task.keys()) == ["name"]  # the rest comes from the task's class
  assert complete_task(ours).to_dict() == base_config(task).to_dict()
  assert list(ours.keys()) == list(base_config(task).keys())


def test_complete_task_keeps_set_fields_and_names_unknown_ones():
  c = common.base_config("listops")
  c.task.max_length = 77
  assert complete_task(c).task.max_length == 77 and "num_train" in c.task
  assert complete_task(c).to_dict() == c.to_dict()  # idempotent
  c = common.base_config("listops")
  c.task.max_lenght = 77
  with pytest.raises(ValueError, match=r"\['max_lenght'\].*valid fields: .*max_length"):
    complete_task(c)
  with pytest.raises(cli.ConfigError, match="max_lenght"):
    cli.load_config(str(CONFIG_DIR / "synthetic.py"), [("task.max_lenght", "3")])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_and_builds_its_model(path):
  module = cli.load_module(str(path))
  doc = module.__doc__ or ""
  assert f"python train.py --config=configs/{path.name}" in doc, "docstring gives the command"
  assert "Hardware:" in doc
  assert "tiny" in module.ARGS and all(k in module.ARGS for k in getattr(module, "CHOICES", {}))
  full = cli.load_config(str(path))
  tiny = cli.load_config(f"{path}:tiny")
  assert tiny.num_train_steps < full.num_train_steps
  for cfg in (full, tiny):
    build_model(cfg.model, tasks.task_info(cfg.task))  # names, options, compatibility
  info = tasks.task_info(tiny.task)
  model = build_model(tiny.model, info)
  n = info.max_length
  batch = {"inputs": jnp.ones((2, n), jnp.int32), "mask": jnp.ones((2, n), bool)}
  if info.kind == "retrieval":
    batch.update(inputs2=batch["inputs"], mask2=batch["mask"])
  variables = jax.eval_shape(
      lambda: model.init(
          {
              "params": jax.random.PRNGKey(0),
              "dropout": jax.random.PRNGKey(1),
              "features": jax.random.PRNGKey(2),
          },
          batch,
          train=False,
      )
  )
  logits = jax.eval_shape(lambda v: model.apply(v, batch, train=False), variables)
  want = (2, n, info.vocab_size) if info.kind == "lm" else (2, info.num_classes)
  assert logits.shape == want
  params = sum(x.size for x in jax.tree.leaves(variables["params"]))
  assert 0 < params < 200_000, "':tiny' must stay tiny"


def test_command_line_overrides_reach_any_field():
  cfg = cli.load_config(
      f"{CONFIG_DIR / 'synthetic.py'}:tiny",
      [("model.kernel", "sikf"), ("optimizer.learning_rate", "0.5"), ("task.num_train", "77")],
  )
  assert cfg.model.kernel == "sikf" and cfg.optimizer.learning_rate == 0.5
  assert cfg.task.num_train == 77 and cfg.model.embed_dim == 16  # the tiny variant
  with pytest.raises(cli.ConfigError, match="nonexistent_field"):
    cli.load_config(str(CONFIG_DIR / "synthetic.py"), [("nonexistent_field", "1")])


def test_parse_arg():
  a = common.parse_arg("tiny,steps=7", tiny=False, steps=100)
  assert a.tiny is True and a.steps == 7
  assert common.parse_arg(None, tiny=False).tiny is False
  assert common.parse_arg("tiny=false", tiny=True).tiny is False
  with pytest.raises(ValueError, match="unknown config argument 'small'; valid: tiny"):
    common.parse_arg("small", tiny=False)
  with pytest.raises(ValueError, match=r"steps='many' is not a int \(default 100\)"):
    common.parse_arg("steps=many", steps=100)
  with pytest.raises(ValueError, match=r"tiny='maybe' is not a boolean"):
    common.parse_arg("tiny=maybe", tiny=False)
  with pytest.raises(ValueError, match=r"config argument 'steps' needs a value"):
    common.parse_arg("steps", steps=100)
  with pytest.raises(ValueError, match=r"unknown kernel='nope'; valid: sikf, elu1"):
    common.parse_arg("kernel=nope", choices={"kernel": ("sikf", "elu1")}, kernel="sikf")


def test_a_bad_argument_names_the_choices():
  spec = f"{CONFIG_DIR / 'fastrpb_table1.py'}:task=text,kernel=nope"
  with pytest.raises(cli.ConfigError, match=r"kernel='nope'; valid: softmax, dpfp, sikf"):
    cli.load_config(spec)
  with pytest.raises(cli.ConfigError, match=r"unknown config argument 'kernal'"):
    cli.load_config(f"{CONFIG_DIR / 'lra_text_fastrpb.py'}:kernal=sikf")
  with pytest.raises(cli.ConfigError, match=r"unknown config argument 'task'"):
    cli.load_config(f"{CONFIG_DIR / 'lra_text_fastrpb.py'}:task=image")  # this file is Text's


def test_configs_import_no_fastpos_and_load_from_any_folder(tmp_path):
  code = (
      "import sys; sys.path.insert(0, sys.argv[1]); "
      "from configs import fastrpb_table1, listops_generated, wikitext103_nprf_table2; "
      "c = listops_generated.get_config('tiny'); "
      "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
      "('fastpos', 'jax', 'orbax', 'grain', 'flax', 'numpy')); "
      "print(c.model.kernel, heavy)"
  )
  out = subprocess.run(
      [sys.executable, "-c", code, str(ROOT)],
      cwd=tmp_path,
      capture_output=True,
      text=True,
      timeout=60,
      check=True,
  ).stdout
  assert out.strip() == "sikf []"
  env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
  )
  proc = subprocess.run(
      [
          sys.executable,
          str(ROOT / "train.py"),
          f"--config={CONFIG_DIR / 'lra_text_fastrpb.py'}:tiny",
          "--print_config",
      ],
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert proc.returncode == 0, proc.stderr
  assert "positional: absolute+fastrpb" in proc.stdout and "max_length: 128" in proc.stdout
  assert "on_overflow: truncate" in proc.stdout  # a field of the task class, filled in
  proc = subprocess.run(
      [sys.executable, str(ROOT / "train.py"), "--list_configs"],
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert proc.returncode == 0, proc.stderr
  assert f"{CONFIG_DIR / 'fastrpb_table1.py'}: FastRPB Table 1" in proc.stdout


def test_list_configs_shows_every_file_and_its_arguments():
  out = cli.list_configs(CONFIG_DIR)
  listed = [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")]
  assert [Path(p).name for p in listed] == [p.name for p in CONFIGS]  # not common.py
  assert "first command" in out  # listops_generated.py's first docstring sentence
  assert "    task=text             one of: listops text retrieval image\n" in out
  assert "    tiny=false\n" in out


def test_the_trainer_completes_a_config_built_in_python(tmp_path):
  from configs import listops_generated  # pylint: disable=import-outside-toplevel
  from fastpos.train import run as run_lib  # pylint: disable=import-outside-toplevel

  cfg = listops_generated.get_config("tiny")  # config.task: the fields the file sets
  assert "num_train" in cfg.task and "seed" not in cfg.task
  run = run_lib.build_run(cfg, tmp_path)
  assert (
      run.cfg.task.to_dict()
      == cli.load_config(f"{CONFIG_DIR / 'listops_generated.py'}:tiny").task.to_dict()
  )
