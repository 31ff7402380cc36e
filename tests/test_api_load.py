"""``fastpos.load`` on a tiny word-level LM trained 4 steps on the repository's text fixtures:
the restored parameters are the checkpoint's (read back independently through orbax), a step
can be named, damaged or foreign checkpoints are refused with their reason, a run saved on
one device loads on four, and the docstring examples that read a trained run run on it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import fastpos
from fastpos.train import cli, errors
from fastpos.train.checkpoint import CheckpointLoadError
from fastpos.train.digest import DigestMismatch
from tests.test_api_docs import example_scope, needs_a_run, package_examples, run_example
from tests.train.faults import rewrite_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "text_lm.py") + ":tiny,level=word,kernel=elu1,pos=rope"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """Checkpoints at steps 2 and 4 (and the best of them in best/)."""
  root = tmp_path_factory.mktemp("load")
  cfg = cli.load_config(CONFIG)
  cfg.task.cache_dir = str(root / "cache")
  cfg.num_train_steps = 4
  cfg.log_every_steps = cfg.eval_every_steps = cfg.checkpoint_every_steps = 2
  cfg.num_eval_batches = 1
  cfg.data.num_threads = 1
  fastpos.train_and_evaluate(cfg, root / "run")
  return root / "run"


def _saved_params(step_dir):
  with ocp.StandardCheckpointer() as c:
    return c.restore(step_dir / "state")["params"]


def _params_sum(params) -> float:
  return float(sum(np.sum(np.asarray(x, np.float64)) for x in jax.tree.leaves(params)))


def test_load_gives_the_checkpoints_model_and_parameters(workdir):
  loaded = fastpos.load(workdir)
  model, params, config, task = loaded
  assert isinstance(model, fastpos.DecoderLM) and config.task.name == "text_lm"
  assert config.model.kernel == "elu1" and task.info.kind == "lm"
  (best,) = os.listdir(workdir / "best")
  assert loaded.step == int(best) and loaded.checkpoint == str(workdir / "best" / best)
  jax.tree.map(np.testing.assert_array_equal, params, _saved_params(workdir / "best" / best))
  assert loaded.variables == {"params": params}
  logits = jax.jit(model.apply)({"params": params}, {"inputs": jnp.ones((2, 8), jnp.int32)})
  assert logits.shape == (2, 8, task.info.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))


def test_load_a_named_step_and_the_latest(workdir):
  two = fastpos.load(workdir, step=2)
  assert two.step == 2 and two.checkpoint.endswith(os.path.join("checkpoints", "2"))
  jax.tree.map(np.testing.assert_array_equal, two.params, _saved_params(workdir / "checkpoints/2"))
  latest = fastpos.load(workdir, checkpoint="latest")
  assert latest.step == 4 and _params_sum(latest.params) != _params_sum(two.params)
  with pytest.raises(errors.RunError, match=r"no checkpoint at step 3 in .*; its steps: 2, 4\."):
    fastpos.load(workdir, step=3)


def test_load_refuses_damaged_checkpoints_and_falls_back_to_intact_ones(workdir, tmp_path):
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy)

  def flip(tree):
    tree["params"]["embed"]["embedding"].view(np.uint32)[3, 1] ^= np.uint32(1 << 29)

  rewrite_state(copy / "checkpoints" / "4", flip)
  for best in (copy / "best").iterdir():
    rewrite_state(best, flip)
  with pytest.raises(DigestMismatch, match=r"checkpoints/4 is damaged: .*params/embed/embedding"):
    fastpos.load(copy, step=4)
  with pytest.raises(CheckpointLoadError, match=r"params/embed/embedding.*checkpoint='latest'"):
    fastpos.load(copy)
  older = fastpos.load(copy, checkpoint="latest")  # reported, skipped, not moved (read-only)
  assert older.step == 2 and (copy / "checkpoints" / "4").is_dir()


def test_load_refuses_a_config_of_another_model(workdir):
  cfg = cli.load_config(str(workdir / "config.json"))
  cfg.model.embed_dim = 32
  with pytest.raises(ValueError, match="of a different model .*embed_dim: 16 -> 32"):
    fastpos.load(workdir, config=cfg)


def test_load_bad_arguments(workdir, tmp_path):
  with pytest.raises(errors.RunError, match=r"workdir .*nowhere does not exist"):
    fastpos.load(tmp_path / "nowhere")
  with pytest.raises(errors.RunError, match="has no config.json"):
    fastpos.load(tmp_path)
  with pytest.raises(ValueError, match="checkpoint must be one of best, latest; got 'newest'"):
    fastpos.load(workdir, checkpoint="newest")
  for step in (-1, True, 2.0):
    with pytest.raises(ValueError, match="step must be None"):
      fastpos.load(workdir, step=step)


@pytest.mark.slow
def test_a_one_device_run_loads_on_four_devices(workdir):
  code = (
      "import sys, jax, numpy as np, fastpos\n"
      "l = fastpos.load(sys.argv[1])\n"
      "leaf = jax.tree.leaves(l.params)[0]\n"
      "print(jax.device_count(), len(leaf.sharding.device_set),"
      " sum(float(np.sum(np.asarray(x, np.float64))) for x in jax.tree.leaves(l.params)))\n"
  )
  env = {
      **os.environ,
      "PYTHONPATH": ROOT,
      "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
  }
  out = subprocess.run(
      [sys.executable, "-c", code, str(workdir)],
      capture_output=True,
      text=True,
      env=env,
      cwd=ROOT,
      timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  devices, spread, total = out.stdout.split()
  assert devices == "4" and spread == "4"  # replicated over the four devices
  assert float(total) == _params_sum(fastpos.load(workdir).params)


_RUN_EXAMPLES = [e for e in package_examples() if needs_a_run(e)]
_ON_THE_RUN = [e for e in _RUN_EXAMPLES if "train_and_evaluate" not in e.where]


def test_the_examples_that_read_a_run_are_these():
  names = sorted(e.where.split(" ", 1)[1] for e in _RUN_EXAMPLES)
  assert names == ["(module)", "Loaded", "Workdir", "evaluate", "load", "train_and_evaluate"], names


@pytest.mark.parametrize("example", _ON_THE_RUN, ids=str)
def test_docstring_examples_run_on_a_trained_run(example, workdir, tmp_path, monkeypatch):
  """``fastpos.load``'s, ``Loaded``'s, ``evaluate``'s, ``Workdir``'s and the package's examples,
  as written, on a copy of this module's run (evaluate writes its results there)."""
  run = shutil.copytree(workdir, tmp_path / "run")
  monkeypatch.chdir(ROOT)
  run_example(example, example_scope(workdir=run))


@pytest.mark.slow  # a fresh 2-step run (compiles a train and an eval step)
def test_train_and_evaluates_example_runs(tmp_path, monkeypatch):
  (example,) = [e for e in _RUN_EXAMPLES if "train_and_evaluate" in e.where]
  monkeypatch.chdir(ROOT)  # the example names configs/ from the repository root
  scope = example_scope(workdir=tmp_path / "run")
  run_example(example, scope)
  assert (tmp_path / "run" / "config.json").is_file() and scope["result"]["step"] == 2
