"""Every config file loads (default and ":tiny"), builds its model and traces it with
``jax.eval_shape`` (shapes only); the config files import no jax, flax or numpy and their
``get_config`` returns a complete config (nothing completes it later); the loader works from
any folder; a scheme switched on the command line leaves the row's other schemes' options."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from configs import common
from fastpos import config_schema, tasks
from fastpos.models import build_model
from fastpos.train import cli, config_files, errors
from fastpos.train import config as config_lib

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs"
CONFIGS = sorted(
    p for p in CONFIG_DIR.glob("*.py") if not p.name.startswith("_") and p.stem != "common"
)


def test_the_required_configs_exist():
  names = {p.stem for p in CONFIGS}
  assert {"listops_generated", "lra_text_fastrpb", "synthetic", "fastrpb_table1"} <= names


@pytest.mark.parametrize("task", tasks.task_names())
def test_the_base_config_is_complete_and_one(task):
  c = common.base_config(task)
  assert common.base_config is config_lib.base_config is config_schema.base_config
  assert set(c.task.keys()) == {"name", *config_schema.task_fields(task)}
  assert c.task.to_dict() == tasks.get_task_class(task).default_config().to_dict()
  config_lib.validate(c)


def test_an_incomplete_task_block_is_refused_naming_the_missing_fields():
  c = common.base_config("listops")
  del c.task["num_train"], c.task["parens"]
  with pytest.raises(errors.RunError, match=r"^config.task lacks field\(s\) num_train, parens "):
    config_lib.validate(c)
  with pytest.raises(cli.ConfigError, match="no field 'max_lenght'. Did you mean task.max_length"):
    cli.load_config(str(CONFIG_DIR / "synthetic.py"), [("task.max_lenght", "3")])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_and_builds_its_model(path):
  module = config_files.load_module(str(path))
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


_NO_JAX = """
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("jax", "jaxlib", "flax", "orbax", "grain"):
      raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Blocked())
sys.path.insert(0, sys.argv[1])
import importlib, pathlib
for p in sorted(pathlib.Path(sys.argv[1], "configs").glob("*.py")):
  m = importlib.import_module("configs." + p.stem)
  if hasattr(m, "get_config"):
    print(p.stem, m.get_config("tiny").task.name)
print(sorted(m for m in sys.modules if m.split(".")[0] == "fastpos"))
"""


def test_configs_import_without_jax_and_load_from_any_folder(tmp_path):
  out = subprocess.run(
      [sys.executable, "-c", _NO_JAX, str(ROOT)],
      cwd=tmp_path,
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  assert "listops_generated listops" in lines and len(lines) == len(CONFIGS) + 1
  # The schema, and the owners of the fields it reads: the tasks' modules (numpy) and the
  # kernels' options; neither the models, the schemes nor the trainer.
  loaded = eval(lines[-1])  # pylint: disable=eval-used
  owners = ("fastpos.tasks", "fastpos.ops.kernel_options")
  assert {"fastpos.config_schema", "fastpos.fields", *owners} <= set(loaded)
  assert [m for m in loaded if not m.startswith(owners)] == [
      "fastpos",
      "fastpos.config_schema",
      "fastpos.fields",
      "fastpos.ops",
  ]
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
  out = config_files.list_configs(CONFIG_DIR)
  listed = [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")]
  assert [Path(p).name for p in listed] == [p.name for p in CONFIGS]  # not common.py
  assert "first command" in out  # listops_generated.py's first docstring sentence
  assert "    task=text             one of: listops text retrieval image\n" in out
  assert "    tiny=false\n" in out


def test_a_config_built_in_python_is_the_loaded_one_and_the_trainer_takes_it(tmp_path):
  from configs import listops_generated  # pylint: disable=import-outside-toplevel
  from fastpos.train import run as run_lib  # pylint: disable=import-outside-toplevel

  cfg = listops_generated.get_config("tiny")  # complete: every field of the task's block
  assert cfg.to_dict() == cli.load_config(f"{CONFIG_DIR / 'listops_generated.py'}:tiny").to_dict()
  run = run_lib.build_run(cfg, tmp_path)
  assert run.cfg.to_dict() == cfg.to_dict()


def test_table_files_share_a_cell_through_the_typed_builder():
  from configs import fastrpb_table1, lra_text_fastrpb  # pylint: disable=import-outside-toplevel

  cell = fastrpb_table1.build(task="text", kernel="dpfp", pos="sinspe", tiny=True)
  text = lra_text_fastrpb.get_config("kernel=dpfp,pos=sinspe,tiny")
  assert text.model.remat == "block" and text.model.scan_layers
  with text.unlocked():
    text.model.update(remat="none", scan_layers=False, mlp_chunk=0)
  assert text.to_dict() == cell.to_dict()
  assert cell.experiment.to_dict() == {"row": "Linear, DPFP", "col": "sinSPE"}


def test_switching_the_scheme_on_the_command_line_just_works():
  """The WikiText Performer row sets sinusoidal options for "absolute"; a command line that
  lists other schemes leaves them behind, unless it sets them itself."""
  spec = f"{CONFIG_DIR / 'wikitext103_permuteformer_table4.py'}:tiny,model=performer"
  row = cli.load_config(spec)
  assert row.model.positional_options.to_dict() == {"absolute": {"kind": "sinusoidal"}}
  cfg = cli.load_config(spec, [("model.positional", "fastrpb")])
  assert cfg.model.positional == "fastrpb" and cfg.model.positional_options.to_dict() == {}
  info = tasks.task_info(cfg.task)
  model = build_model(cfg.model, info)
  batch = {"inputs": jnp.ones((2, 8), jnp.int32), "mask": jnp.ones((2, 8), bool)}
  rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
  variables = jax.eval_shape(lambda: model.init(rngs, batch, train=False))
  logits = jax.eval_shape(lambda v: model.apply(v, batch, train=False), variables)
  assert logits.shape == (2, 8, info.vocab_size)
  both = cli.load_config(
      spec,
      [("model.positional", "fastrpb"), ("model.positional_options.fastrpb.per_head", "true")],
  )
  assert both.model.positional_options.to_dict() == {"fastrpb": {"per_head": True}}
  kept = cli.load_config(spec, [("model.positional", "absolute+fastrpb")])  # still listed
  assert kept.model.positional_options.to_dict() == {"absolute": {"kind": "sinusoidal"}}
  cfg = cli.load_config(
      spec, [("model.positional", "fastrpb"), ("model.positional_options.absolute.kind", "learned")]
  )
  with pytest.raises(ValueError, match="options for 'absolute', which is not in"):
    build_model(cfg.model, info)  # set on the command line for an unlisted scheme: refused


def test_scheme_options_keep_their_declared_type(tmp_path):
  """Through the real flag parser: a "number" option keeps the int or float it was given (in
  the file or on the command line), an "int" option stays an int, and a config.json's too."""
  path = tmp_path / "typed.py"
  path.write_text(
      "from configs import synthetic\n\n\n"
      "def get_config(arg=None):\n"
      "  cfg = synthetic.get_config('tiny')\n"
      "  cfg.model.positional = 'rope+t5_bias'\n"
      "  cfg.model.positional_options = {'rope': {'base': 500}, 't5_bias': {'num_buckets': 8}}\n"
      "  return cfg\n"
  )

  def options(*overrides):
    cfg = cli.load_config(str(path), [("seed", "1"), *overrides])
    return cfg, cfg.model.positional_options.rope.base, cfg.model.positional_options.t5_bias

  cfg, base, t5 = options()
  assert type(base) is int and base == 500 and type(t5.num_buckets) is int
  for given, want in (("300", 300), ("0.5", 0.5), ("1e3", 1000.0), ("300.0", 300.0)):
    _, base, _ = options(("model.positional_options.rope.base", given))
    assert type(base) is type(want) and base == want, (given, base)
  _, _, t5 = options(("model.positional_options.t5_bias.num_buckets", "16"))
  assert type(t5.num_buckets) is int and t5.num_buckets == 16
  for option, bad in (("rope.base", "ten"), ("t5_bias.num_buckets", "16.5")):
    with pytest.raises(cli.ConfigError, match=bad):
      options((f"model.positional_options.{option}", bad))
  with pytest.raises(cli.ConfigError, match=r"rope.base is a field \(number\)"):
    options(("model.positional_options.rope.base.x", "1"))
  saved = tmp_path / "config.json"
  saved.write_text(cfg.to_json())  # a run's saved config: JSON keeps the int
  base = cli.load_config(str(saved), [("seed", "2")]).model.positional_options.rope.base
  assert type(base) is int and base == 500


def test_the_config_is_validated_once_on_the_way_in(tmp_path, monkeypatch):
  # train.py's path: config_of validates; build_run (what train_and_evaluate and evaluate
  # start with) takes that config as it is. A config changed since, or a library caller's
  # own, is validated there.
  from fastpos.train import run as run_lib  # pylint: disable=import-outside-toplevel

  calls = []
  real = config_schema.check
  monkeypatch.setattr(config_schema, "check", lambda cfg: calls.append(1) or real(cfg))
  cfg = cli.load_config(f"{CONFIG_DIR / 'synthetic.py'}:tiny", lock=False)
  assert len(calls) == 1
  run = run_lib.build_run(cfg, tmp_path / "run")
  assert len(calls) == 1 and run.cfg.to_dict() == cfg.to_dict()
  cfg.model.dropout_rate = 1.5  # changed after config_of: validated again, and refused
  with pytest.raises(config_lib.InvalidConfigError, match=r"dropout_rate must be .*; got 1.5"):
    run_lib.build_run(cfg, tmp_path / "run")
  assert len(calls) == 2
  run_lib.build_run(config_lib.base_config("synthetic"), tmp_path / "run")  # a caller's own
  assert len(calls) == 3
