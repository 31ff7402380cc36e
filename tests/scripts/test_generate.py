"""scripts/generate.py on a tiny LM trained for a few steps on the WikiText-103 sample
(fastpos/tasks/samples/wikitext): a sample from a word prompt with --check, and the one-line
errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.tasks.paths import SAMPLES
from fastpos.train import cli, errors, train_and_evaluate
from fastpos.train.checkpoint import CheckpointLoadError
from fastpos.train.config import base_config
from tests.helpers import FAST_COMPILE_FLAGS
from tests.train.faults import rewrite_state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "generate.py")
DATA = os.path.join(SAMPLES, "wikitext")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import generate  # noqa: E402


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A 1-layer ELU+1 + RoPE decoder trained 3 steps (a checkpoint and config.json)."""
  root = tmp_path_factory.mktemp("generate")
  c = base_config("wikitext103")
  c.task.update(data_dir=DATA, cache_dir=str(root / "cache"), segment_length=16, vocab_size=143)
  c.model.update(
      num_layers=1,
      embed_dim=16,
      num_heads=2,
      mlp_dim=16,
      dropout_rate=0.0,
      kernel="elu1",
      positional="rope",
  )
  c.batch_size, c.num_train_steps, c.num_eval_batches = 4, 3, 1
  c.log_every_steps = c.eval_every_steps = c.checkpoint_every_steps = 3
  c.data.num_threads = 1
  train_and_evaluate(c, root / "run")
  return root / "run"


def _run(*args):
  # generate.py's --check compares two programs it compiles itself: the fast compile flags.
  return subprocess.run(
      [sys.executable, SCRIPT, *args],
      capture_output=True,
      text=True,
      cwd=ROOT,
      timeout=300,
      env={**os.environ, "XLA_FLAGS": FAST_COMPILE_FLAGS},
  )


def test_generate_samples_and_checks(workdir):
  out = _run(
      f"--workdir={workdir}",
      "--prompt=the",
      "--num_tokens=6",
      "--top_k=20",
      "--top_p=0.9",
      "--seed=1",
      "--check",
      "--tolerance=1e-5",
  )
  assert out.returncode == 0, out.stderr[-2000:]
  lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
  assert len(lines["sample"].split()) == 6
  assert "tokens/s" in lines["decoding"]
  err = float(lines["check"].split("full forward ")[1].split()[0])
  assert err < 1e-5


def test_generate_bad_prompt_is_one_line(workdir):
  out = _run(f"--workdir={workdir}", "--prompt=zzqx-not-a-word", "--num_tokens=2")
  assert out.returncode == errors.EXIT_BAD_INPUT
  assert out.stderr.strip().count("\n") == 0 and "zzqx-not-a-word" in out.stderr


def test_prompt_encoding_and_flags():
  vocab = ["<pad>", "<eos>", "<unk>", "the", "game"]
  np.testing.assert_array_equal(generate.encode_prompt("the game", vocab, 5), [3, 4])
  np.testing.assert_array_equal(generate.encode_prompt("4 1", None, 5), [4, 1])
  for text, vocab_, msg in (
      ("0 2", None, "out of range"),
      ("the", None, "integer token ids"),
      ("99999999999", None, "token id 99999999999 is out of range"),
      ("Game", vocab, "not in the task's vocabulary"),
      ("  ", vocab, "empty"),
  ):
    with pytest.raises(errors.RunError, match=msg):
      generate.encode_prompt(text, vocab_, 5)
  for bad in (
      dict(num_tokens=0),
      dict(temperature=-1.0),
      dict(top_k=-1),
      dict(top_p=0.0),
      dict(tolerance=0.0),
      dict(temperature=float("nan")),
      dict(top_p=float("inf")),
      dict(tolerance=float("nan")),
      dict(seed=-1),
  ):
    kw = {**dict(num_tokens=1, temperature=1.0, top_k=0, top_p=1.0, tolerance=1e-4), **bad}
    with pytest.raises(errors.RunError, match=f"--{next(iter(bad))}"):
      generate.check_flags(**kw)


def test_sampling_cuts():
  logits = jnp.log(jnp.asarray([[0.0, 0.5, 0.3, 0.15, 0.05]]))
  keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(0), jnp.arange(200))

  def draws(**kw):  # 200 draws in one compiled call (op by op, 200 calls took seconds)
    sample = jax.jit(jax.vmap(lambda k: generate.sample_logits(logits, k, **kw)[0]))
    return {int(t) for t in np.asarray(sample(keys))}

  assert draws(temperature=0.0, top_k=0, top_p=1.0) == {1}
  assert draws(temperature=1.0, top_k=2, top_p=1.0) == {1, 2}
  assert draws(temperature=1.0, top_k=0, top_p=0.7) == {1, 2}  # 0.5 + 0.3 reaches 0.7
  assert draws(temperature=1.0, top_k=0, top_p=1.0) == {1, 2, 3, 4}  # never 0 (padding)


def test_generate_refuses_a_best_checkpoint_whose_weights_changed(workdir, tmp_path):
  """A weight that differs from its digest (as a flipped bit in an array chunk makes it):
  --checkpoint=best stops with the array named; --checkpoint=latest (intact) samples."""
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy)
  (best,) = (copy / "best").iterdir()

  def change(tree):
    tree["params"]["embed"]["embedding"].view(np.uint32)[5, 1] ^= np.uint32(1 << 30)

  rewrite_state(best, change)
  cfg = cli.load_config(str(copy / "config.json"))
  with pytest.raises(
      CheckpointLoadError,
      match=r"best/3 \(DigestMismatch: 1 of \d+ arrays "
      r"differ from their digests: params/embed/embedding\).*--checkpoint=latest",
  ):
    generate.restore(str(copy), cfg, "best")
  assert "params" in generate.restore(str(copy), cfg, "latest").variables
