"""Transformer-XL memory in the trainer, on the WikiText-103 sample
(fastpos/tasks/samples/wikitext).

The memory is the steps' carry (checkpointed: exact resume), is carried across training steps over
stream batches and reset where a stream starts, starts empty at each evaluation and is carried
across its batches in order. The references here run the model WITHOUT memory over whole
streams: with a memory at least as long as the history, a memory model's per-segment results
must equal the full causal run's (the model test pins that property for the model itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from fastpos import tasks
from fastpos.models import TaskInfo, build_model
from fastpos.tasks.paths import SAMPLES
from fastpos.train import data as data_lib
from fastpos.train import evaluate, train_and_evaluate
from fastpos.train import steps as steps_lib
from fastpos.train.config import base_config
from fastpos.train.state import TrainState
from fastpos.train.steps import loss_and_metrics, make_train_step, model_inputs
from tests.helpers import rel_err
from tests.train.common import assert_trees_equal

ROOT = os.path.join(SAMPLES, "wikitext")
V = 143  # the fixture's vocabulary
L = 24  # train: 288 tokens -> 12 segments -> 4 streams of 3; validation: 3 segments


def memory_config(cache_dir, **overrides) -> ml_collections.ConfigDict:
  """A 1-layer width-16 Transformer-XL decoder (memory M = L) with dropout, 4 steps: the
  stream epoch is 3 steps, so step 4 starts the streams again (a memory reset)."""
  c = base_config("wikitext103")
  c.task.update(data_dir=ROOT, cache_dir=str(cache_dir), segment_length=L, vocab_size=V)
  c.model.update(
      num_layers=1,
      embed_dim=16,
      num_heads=2,
      mlp_dim=16,
      dropout_rate=0.1,
      kernel="softmax",
      positional="transformer_xl",
      memory_length=L,
  )
  c.batch_size = 4
  c.eval_batch_size = 2  # validation: 2 streams of 2 segments
  c.num_train_steps = 4
  c.optimizer.learning_rate = 1e-2
  c.schedule.update(name="constant", warmup_steps=2)
  c.log_every_steps = 1
  c.eval_every_steps = 2
  c.checkpoint_every_steps = 2
  c.data.num_threads = 1
  for key, value in overrides.items():
    node = c
    *path, last = key.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  return c


def _ce(logits, targets):
  """Cross-entropy per position, float64: logits ``[..., V]``, targets ``[...]``."""
  logits = np.asarray(logits, np.float64)
  top = logits.max(-1, keepdims=True)
  log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  return log_z - np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]


def _full_model(cfg, length):
  """The same model without memory (same parameters), for whole streams of ``length``."""
  model_cfg = cfg.model.copy_and_resolve_references()
  model_cfg.memory_length = 0
  return build_model(model_cfg, TaskInfo("lm", V, 0, length))


def _stream_losses(model, params, src, num_streams):
  """CE ``[streams, T * L]`` of the full causal model over each stream (segments r*T ..
  r*T + T - 1 concatenated), NaN where nothing is scored; T = ceil(S / streams)."""
  s = len(src)
  steps = data_lib.num_stream_steps(s, num_streams)
  index = np.arange(num_streams * steps)
  real = index < s
  x, y, m = (
      np.where(real.reshape(-1, 1), src.arrays[k][index % s], 0).reshape(num_streams, steps * L)
      for k in ("inputs", "targets", "mask")
  )
  m = m.astype(bool)  # slots past the last segment are all padding (causal: no effect)
  logits = jax.jit(model.apply)(
      {"params": params}, {"inputs": jnp.asarray(x), "mask": jnp.asarray(m)}
  )
  scored = np.where(real.reshape(-1, 1), src.arrays["mask"][index % s], False).reshape(
      num_streams, steps * L
  )
  return np.where(scored, _ce(logits, y), np.nan)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """An uninterrupted 4-step run, and a 2-step run resumed to 4 in its own workdir."""
  root = tmp_path_factory.mktemp("memory")
  cache = root / "cache"
  full = train_and_evaluate(memory_config(cache), root / "full")
  first = train_and_evaluate(memory_config(cache, num_train_steps=2), root / "split")
  second = train_and_evaluate(memory_config(cache), root / "split")
  return {"root": root, "cache": cache, "full": full, "first": first, "second": second}


# Slow; the default run keeps the memory across segments in tests/models/test_models.py
# (test_transformer_xl_memory_reproduces_the_full_sequence[pre]) and exact resume in test_trainer.
@pytest.mark.slow
def test_resume_with_memory_is_bitwise_exact(runs):
  assert runs["first"]["step"] == 2 and runs["second"]["step"] == 4
  full = (runs["full"]["state"], runs["full"]["carry"])
  resumed = (runs["second"]["state"], runs["second"]["carry"])
  states, mask = runs["full"]["carry"]
  assert len(states) == 1 and states[0].shape == (4, L, 16) and mask.shape == (4, L)
  # After step 4 (the first segment of each stream again) the memory holds that segment.
  assert np.all(np.asarray(mask)) and np.any(np.asarray(states[0]) != 0)
  assert states[0].sharding.spec == jax.sharding.PartitionSpec("data")
  assert_trees_equal(full, resumed)  # params, Adam moments, step and the memory

  def records(name):
    return [json.loads(l) for l in open(runs["root"] / name / "metrics.jsonl")]

  def train_losses(name):
    return {r["step"]: r["loss"] for r in records(name) if r["split"] == "train"}

  assert train_losses("split") == train_losses("full") and len(train_losses("full")) == 4
  # Checkpoint 2 of the uninterrupted run holds the memory the stopped run ended with.
  saved = ocp.StandardCheckpointer().restore(runs["root"] / "full" / "checkpoints" / "2" / "state")
  want = jax.tree.leaves(jax.device_get(runs["first"]["carry"]))
  got = jax.tree.leaves(saved["memory"])
  assert len(got) == len(want) == 2
  for x, y in zip(got, want):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # Perplexity is reported, and the best checkpoint is the lowest validation perplexity.
  val = {r["step"]: r for r in records("full") if r["split"] == "validation"}
  assert sorted(val) == [2, 4]
  for r in val.values():
    assert r["perplexity"] == pytest.approx(np.exp(r["loss"])) and r["num_examples"] == 54
  best = min(val, key=lambda s: val[s]["perplexity"])
  assert runs["full"]["best"] == {"step": best, "perplexity": val[best]["perplexity"]}


# Slow; the default run keeps the memory across segments in tests/models/test_models.py
# (test_transformer_xl_memory_reproduces_the_full_sequence[pre]).
@pytest.mark.slow
def test_evaluation_carries_the_memory_across_batches_in_order(runs):
  """Validation: 3 segments in 2 streams ([0, 1] and [2, pad]); M = L covers stream 0's
  history, so the evaluation equals the full causal model over each stream."""
  cfg = memory_config(runs["cache"])
  res = evaluate(cfg, runs["root"] / "full", "validation", checkpoint="latest")
  src = tasks.make_task(cfg.task).source("validation")
  params = runs["full"]["state"].params
  ce = _stream_losses(_full_model(cfg, 2 * L), params, src, 2)
  assert np.sum(~np.isnan(ce)) == res["num_examples"] == 54
  assert rel_err(res["loss"], np.nanmean(ce)) < 1e-5
  # Without the memory, the second segment of stream 0 would see no history: a different
  # loss, so the test above can tell.
  alone = _stream_losses(_full_model(cfg, L), params, src, 3)
  assert abs(np.nanmean(alone) - np.nanmean(ce)) > 1e-3


@pytest.fixture(scope="module")
def constant_params_steps(runs):
  """Training steps with a zero learning rate (constant parameters) and no dropout, over
  one stream epoch plus one step, with M = 2L (the whole history of a 3-segment stream)."""
  cfg = memory_config(runs["cache"], **{"model.dropout_rate": 0.0, "model.memory_length": 2 * L})
  task = tasks.make_task(cfg.task)
  src = task.source("train")
  model = build_model(cfg.model, task.info)
  params = runs["full"]["state"].params
  it = data_lib.stream_train_iterator(src, cfg)
  batches = [next(it) for _ in range(4)]
  out = {"cfg": cfg, "src": src, "model": model, "params": params, "batches": batches}
  out[1] = _run_steps(model, params, batches, 1)
  return out


def _run_steps(model, params, batches, grad_accum_steps):
  tx = optax.sgd(0.0)
  state = TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), collections={}
  )
  carry = model.init_memory(4)
  step = jax.jit(make_train_step(model, tx, "lm", grad_accum_steps))
  history = []
  for b in batches:
    state, metrics, carry = step(state, jax.tree.map(jnp.asarray, b), carry, jax.random.PRNGKey(0))
    history.append(jax.device_get(metrics))
  return {"metrics": history, "state": state, "carry": carry}


# Slow; the default run keeps the memory across segments in tests/models/test_models.py
# (test_transformer_xl_memory_reproduces_the_full_sequence[pre]).
@pytest.mark.slow
def test_training_carries_the_memory_and_resets_it_per_epoch(constant_params_steps):
  run = constant_params_steps
  src, cfg = run["src"], run["cfg"]
  ce = _stream_losses(_full_model(cfg, 3 * L), run["params"], src, 4)  # [4 streams, 3L]
  history = run[1]["metrics"]
  for t in range(3):  # step t scores positions [tL, (t+1)L) of every stream
    want = np.nansum(ce[:, t * L : (t + 1) * L])
    count = np.sum(~np.isnan(ce[:, t * L : (t + 1) * L]))
    loss_sum, loss_count = history[t]["loss"]
    assert loss_count == count and rel_err(loss_sum, want) < 1e-5, t
  # Step 4 starts the streams again: reset memory, so the loss of step 1 exactly.
  assert history[3]["loss"][0] == history[0]["loss"][0]
  np.testing.assert_array_equal(
      np.asarray(run[1]["state"].params["embed"]["embedding"]),
      np.asarray(run["params"]["embed"]["embedding"]),
  )


@pytest.mark.slow
def test_gradient_does_not_flow_into_the_memory(constant_params_steps):
  """Step 2's gradient is that of its segment's loss with step 1's memory held constant (an
  input, not a function of the parameters); with an empty memory it would differ."""
  run = constant_params_steps
  model, params, batches = run["model"], run["params"], run["batches"]
  b0, b1 = (jax.tree.map(jnp.asarray, b) for b in batches[:2])
  _, memory = jax.jit(model.apply)({"params": params}, model_inputs(b0))

  def segment_loss(p, mem):
    logits, _ = model.apply({"params": p}, model_inputs(b1), train=False, memory=mem)
    return loss_and_metrics(logits, b1, "lm")[0]

  grad = jax.jit(jax.grad(segment_loss))
  count = run[1]["metrics"][1]["loss"][1]
  norm_const = float(optax.tree.norm(grad(params, memory))) / count
  norm_empty = float(optax.tree.norm(grad(params, model.init_memory(4)))) / count
  got = float(run[1]["metrics"][1]["grad_norm"][0])
  assert rel_err(got, norm_const) < 1e-4
  assert abs(norm_empty - norm_const) > 1e-3 * norm_const


def test_micro_batches_take_memory_rows_like_batch_rows():
  # pylint: disable=protected-access
  x = jnp.arange(4 * 3 * 2).reshape(4, 3, 2)
  micro = steps_lib._split_micro(x, 2)
  assert micro.shape == (2, 2, 3, 2)
  np.testing.assert_array_equal(micro[1], x[jnp.array([1, 3])])  # row r -> micro-batch r % 2
  np.testing.assert_array_equal(steps_lib._merge_micro(micro), x)


@pytest.mark.slow
def test_gradient_accumulation_splits_and_merges_the_memory(constant_params_steps):
  """2 micro-batches of 2 streams give the losses and the memory of one batch of 4."""
  run = constant_params_steps
  run[2] = _run_steps(run["model"], run["params"], run["batches"], 2)
  for a, b in zip(run[1]["metrics"], run[2]["metrics"]):
    assert rel_err(b["loss"][0], a["loss"][0]) < 1e-5 and b["loss"][1] == a["loss"][1]
  for a, b in zip(jax.tree.leaves(run[1]["carry"]), jax.tree.leaves(run[2]["carry"])):
    if a.dtype == bool:
      np.testing.assert_array_equal(a, b)
    else:
      assert rel_err(b, a) < 1e-5


_FOUR_DEVICES = """
import json, sys
import jax
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
from fastpos.train import train_and_evaluate
from tests.train.test_memory import memory_config
assert jax.device_count() == 4, jax.devices()
r = train_and_evaluate(memory_config(sys.argv[1] + "/cache", **json.loads(sys.argv[2])),
                       sys.argv[1] + "/run")
spec = str(jax.tree.leaves(r["carry"])[0].sharding.spec)
print("RESULT" + json.dumps({"train": r["train"], "validation": r["validation"], "spec": spec}))
"""


@pytest.mark.slow
def test_four_devices_match_one_with_memory(tmp_path):
  """The memory is split over 4 simulated devices like the batch; losses match 1 device."""
  overrides = {"eval_batch_size": 4, "optimizer.eps": 1e-4, "model.dropout_rate": 0.0}
  one = train_and_evaluate(memory_config(tmp_path / "cache", **overrides), tmp_path / "one")
  root = Path(__file__).resolve().parents[2]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", PYTHONPATH=str(root))
  env.pop("JAX_PLATFORMS", None)
  proc = subprocess.run(
      [sys.executable, "-c", _FOUR_DEVICES, str(tmp_path / "four"), json.dumps(overrides)],
      cwd=root,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
  four = json.loads(line[len("RESULT") :])
  assert four["spec"] == "P('data',)"
  for split in ("train", "validation"):
    assert rel_err(four[split]["loss"], one[split]["loss"]) < 1e-5, split
