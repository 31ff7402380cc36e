"""Exact evaluation of a text task scores every token once, whatever the evaluation batch.

``Run.evaluate_split`` on ``configs/text_lm.py:tiny`` with several ``eval_batch_size``s (the
last batch padded with weight-0 copies of real segments, or not) gives the metrics of a
reference that applies the model to one segment at a time and sums over the scored tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import text_lm
from fastpos.train import run as run_lib


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(run, state) of the tiny text config: the model as initialised."""
  run = run_lib.build_run(text_lm.get_config("tiny"), tmp_path_factory.mktemp("eval"))
  return run, run.init_state()[0]


def _reference(run: run_lib.Run, state) -> dict[str, float]:
  """Loss, accuracy and token count over the validation split, one segment per model call
  (no batch, no padding), summed in float64 on the host."""
  source = run.task.source("validation")
  variables = {"params": state.params, **state.collections}
  apply = jax.jit(lambda v, b: run.model.apply(v, b, train=False))  # one program, every call
  loss = correct = count = 0.0
  for i in range(len(source)):
    ex = source[i]
    batch = {"inputs": jnp.asarray(ex["inputs"])[None], "mask": jnp.asarray(ex["mask"])[None]}
    logits = np.asarray(apply(variables, batch), np.float64)[0]  # [N, V]
    scored = np.asarray(ex["mask"], bool)
    targets = np.asarray(ex["targets"])
    log_z = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    ce = log_z - np.take_along_axis(logits, targets[:, None], -1)[:, 0]
    loss += float(np.sum(ce[scored]))
    correct += float(np.sum((np.argmax(logits, -1) == targets)[scored]))
    count += float(np.sum(scored))
  return {"loss": loss / count, "accuracy": correct / count, "num_examples": count}


# 0: batch 8, 6 rows of padding; 1 (a call per segment) runs with `-m slow`, the default run
# keeps the padded batch.
@pytest.mark.parametrize("eval_batch_size", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_every_token_scored_once_whatever_the_eval_batch(tiny, eval_batch_size):
  run, state = tiny
  n = len(run.task.source("validation"))
  assert 1 < n < 8, f"the fixture should pad the batch of 8; {n} segments"
  cfg = run.cfg.copy_and_resolve_references()
  cfg.eval_batch_size = eval_batch_size
  got = run_lib.build_run(cfg, run.workdir, run.model).evaluate_split(state, "validation")
  want = _reference(run, state)
  assert got["num_examples"] == want["num_examples"]  # every scored token once, padding none
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
  np.testing.assert_allclose(got["accuracy"], want["accuracy"], rtol=1e-6)
  np.testing.assert_allclose(got["perplexity"], np.exp(want["loss"]), rtol=1e-5)
