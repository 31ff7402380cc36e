"""Every experiment config loads (default and ":tiny"), builds its model and traces it with
``jax.eval_shape`` (shapes only); command-line overrides reach any field."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from absl import flags
from ml_collections import config_flags

from fastpos import tasks
from fastpos.models import build_model
from fastpos.train.config import parse_arg

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
CONFIGS = sorted(p for p in CONFIG_DIR.glob("*.py") if not p.name.startswith("_"))


def _load(path: Path):
  spec = importlib.util.spec_from_file_location(f"configs_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_required_configs_exist():
  names = {p.stem for p in CONFIGS}
  assert {"listops_generated", "lra_text_fastrpb", "synthetic"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_and_builds_its_model(path):
  module = _load(path)
  doc = module.__doc__ or ""
  assert f"python train.py --config=configs/{path.name}" in doc, "docstring gives the command"
  assert "Hardware:" in doc
  full = module.get_config()
  tiny = module.get_config("tiny")
  assert tiny.num_train_steps < full.num_train_steps
  for cfg in (full, tiny):
    build_model(cfg.model, tasks.task_info(cfg.task))  # names, options, compatibility
  info = tasks.task_info(tiny.task)
  model = build_model(tiny.model, info)
  n = info.max_length
  batch = {"inputs": jnp.ones((2, n), jnp.int32), "mask": jnp.ones((2, n), bool)}
  if info.kind == "retrieval":
    batch.update(inputs2=batch["inputs"], mask2=batch["mask"])
  variables = jax.eval_shape(lambda: model.init(
      {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1),
       "features": jax.random.PRNGKey(2)}, batch, train=False))
  logits = jax.eval_shape(lambda v: model.apply(v, batch, train=False), variables)
  want = (2, n, info.vocab_size) if info.kind == "lm" else (2, info.num_classes)
  assert logits.shape == want
  params = sum(x.size for x in jax.tree.leaves(variables["params"]))
  assert 0 < params < 200_000, "':tiny' must stay tiny"


def _parse(argv):
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv)
  fv(argv)
  return fv.config


def test_command_line_overrides_reach_any_field():
  cfg = _parse(["train.py", f"--config={CONFIG_DIR / 'synthetic.py'}:tiny",
                "--config.model.kernel=sikf", "--config.optimizer.learning_rate=0.5",
                "--config.task.num_train=77"])
  assert cfg.model.kernel == "sikf" and cfg.optimizer.learning_rate == 0.5
  assert cfg.task.num_train == 77 and cfg.model.embed_dim == 16  # the tiny variant
  with pytest.raises(Exception, match="nonexistent_field"):
    _parse(["train.py", f"--config={CONFIG_DIR / 'synthetic.py'}",
            "--config.nonexistent_field=1"])


def test_parse_arg():
  a = parse_arg("tiny,steps=7", tiny=False, steps=100)
  assert a.tiny is True and a.steps == 7
  assert parse_arg(None, tiny=False).tiny is False
  with pytest.raises(ValueError, match="unknown config argument 'small'; valid: tiny"):
    parse_arg("small", tiny=False)
