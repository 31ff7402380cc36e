"""Packed classification: several examples per row, one logit vector per segment.

* the pipeline: every example once per window and once per evaluation, targets and weights
  per slot, the CLS slot, an exact restore;
* the model (float64, softmax kernel): each segment's logits equal the example's logits run
  alone, and the gradient of a packed batch's loss equals the sum of the examples' own;
* the cells that cannot pack (the main job's SIKF + FastRPB, retrieval) stop before
  compiling, naming the reason and bucketing;
* a short run of the main job's softmax cell, packed, and its exact resume.
"""

from __future__ import annotations

from collections import Counter

import grain
import jax
import numpy as np
import pytest

from fastpos.models import TaskInfo, build_model, model_config
from fastpos.tasks.base import ArraySource
from fastpos.train import data, packing
from fastpos.train.run import build_run
from fastpos.train.steps import loss_and_metrics, model_inputs, real_tokens
from fastpos.train.trainer import train_and_evaluate
from tests.helpers import rel_err
from tests.train.common import assert_trees_equal, tiny_config

V, N, C = 13, 16, 3
LENGTHS = (5, 9, 3, 12, 7, 4, 16, 2, 6, 8, 1, 11)


def _source(seed=0):
  rng = np.random.default_rng(seed)
  inputs = np.zeros((len(LENGTHS), N), np.int32)
  for i, n in enumerate(LENGTHS):
    inputs[i, :n] = rng.integers(1, V, n)
  targets = rng.integers(0, C, len(LENGTHS)).astype(np.int32)
  return ArraySource({"inputs": inputs, "mask": inputs != 0, "targets": targets})


def _cfg(pooling="mean", **overrides):
  cfg = tiny_config(**{"data.pack": True, "data.pack_segments": 3, "data.bucket_window": 2})
  cfg.model.pooling = pooling
  cfg.batch_size = cfg.eval_batch_size = 2
  for k, v in overrides.items():
    cfg.data[k] = v
  return cfg


def _examples(batch, src):
  """(example index, row, slot) of each weighted segment of a packed batch, checking the
  segment's tokens, positions, target and CLS slot against the source."""
  out = []
  cls = int(batch["inputs"].shape[1] == N + 1)
  for r, s in zip(*np.nonzero(batch["weight"])):
    where = np.flatnonzero(batch["segment_ids"][r] == s + 1)
    assert np.all(np.diff(where) == 1)  # contiguous
    np.testing.assert_array_equal(batch["positions"][r, where], np.arange(len(where)))
    tokens = batch["inputs"][r, where[cls:]]
    assert not cls or (batch["inputs"][r, where[0]] == 0 and not batch["mask"][r, where[0]])
    assert batch["mask"][r, where[cls:]].all()
    i = next(
        i
        for i, n in enumerate(LENGTHS)
        if n == len(tokens) and np.array_equal(src.arrays["inputs"][i, :n], tokens)
    )
    assert batch["targets"][r, s] == src.arrays["targets"][i]
    out.append((i, r, s))
  return out


def check_stream(seen: list[int], cfg, n: int, carry: int) -> None:
  """``seen`` (the examples of the first batches) holds the shuffled stream's examples once
  each: every example of the stream's first ``len(seen) - slack`` is in it, and nothing
  beyond its first ``len(seen) + slack``; slack: a window's examples (the current window's
  unread rows) plus ``carry``, the most examples a window can leave to the next."""
  slack = cfg.data.bucket_window * cfg.batch_size + carry
  order = grain.MapDataset.range(n).seed(cfg.seed).shuffle().repeat()
  stream = [order[i] for i in range(len(seen) + slack)]
  assert not Counter(seen) - Counter(stream)
  assert not Counter(stream[: len(seen) - slack]) - Counter(seen)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_packed_batches_hold_each_example_once_and_restore(pooling):
  src, cfg = _source(), _cfg(pooling)
  width = N + (pooling == "cls")
  it = data.train_iterator(src, cfg)
  seen = []
  for _ in range(16):
    batch = next(it)
    assert batch["inputs"].shape == batch["segment_ids"].shape == (2, width)
    assert batch["targets"].shape == batch["weight"].shape == batch["segment_mask"].shape == (2, 3)
    np.testing.assert_array_equal(batch["weight"], batch["segment_mask"])  # no filler rows
    assert batch["segment_mask"][:, 0].all()
    assert float(real_tokens(batch)) == sum(LENGTHS[i] for i, _, _ in _examples(batch, src))
    seen += [i for i, _, _ in _examples(batch, src)]
  check_stream(seen, cfg, len(src), carry=3)  # a window leaves at most one row to the next
  state = it.get_state()
  rest = [next(it) for _ in range(3)]
  again = data.train_iterator(src, cfg)
  again.set_state(state)
  for a, b in zip(rest, [next(again) for _ in range(3)]):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("limit", [0, 2])
def test_packed_evaluation_scores_each_example_once(limit):
  src, cfg = _source(), _cfg()
  batches = list(data.eval_iterator(src, cfg, limit))
  scored = [i for b in batches for i, _, _ in _examples(b, src)]
  covered = 4 if limit else len(src)  # the examples `limit` unpacked batches of 2 score
  assert sorted(scored) == list(range(covered))
  assert sum(float(b["weight"].sum()) for b in batches) == covered
  plain = 2 * data.num_eval_batches(len(src), 2, limit) * N
  packed = sum(b["inputs"].size for b in batches)
  assert packed < plain  # fewer token slots than one example per row


def test_pack_rows_keeps_the_segment_limit():
  rows = packing.pack_rows(np.array([1, 1, 1, 1, 1, 9]), 16, limit=3)
  assert rows == [[5, 0, 1], [2, 3, 4]]


def _model(pooling, scheme="absolute+t5_bias", **extra):
  c = model_config()
  c.update(num_layers=1, embed_dim=16, num_heads=2, mlp_dim=16, dropout_rate=0.0, kernel="softmax")
  c.update(positional=scheme, dtype="float64", pooling=pooling, **extra)
  return build_model(c, TaskInfo("classify", V, C, N))


def _random_params(model, batch):
  """Random float64 parameters (the gradients are those of float64 leaves)."""
  variables = model.init(jax.random.key(0), batch)
  leaves, tree = jax.tree.flatten(variables)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  return jax.tree.unflatten(
      tree,
      [
          (x + 0.2 * jax.random.normal(k, x.shape, x.dtype)).astype(np.float64)
          for k, x in zip(keys, leaves)
      ],
  )


def _flat(tree):
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


# Slow; the default run keeps packing against each segment alone (tests/ops/test_segments.py).
@pytest.mark.slow
@pytest.mark.parametrize(
    "pooling, scheme, extra",
    [
        ("mean", "absolute+t5_bias", {}),
        pytest.param("cls", "absolute+t5_bias", {}, marks=pytest.mark.slow),
        # The segments reach the layers and the pooling through nn.scan and remat, too.
        pytest.param(
            "cls",
            "rope",
            dict(num_layers=2, scan_layers=True, remat="block"),
            marks=pytest.mark.slow,
        ),
        pytest.param("mean", "absolute+kernelized_rpe", {}, marks=pytest.mark.slow),
    ],
)
def test_packed_logits_and_gradients_equal_each_example_alone(pooling, scheme, extra):
  src, cfg = _source(), _cfg(pooling)
  packed = next(data.eval_iterator(src, cfg))  # 2 rows of up to 3 examples
  model = _model(pooling, scheme, **extra)
  alone = {"inputs": src.arrays["inputs"][:1], "mask": src.arrays["mask"][:1]}
  params = _random_params(model, alone)

  def loss(p, batch):
    logits = model.apply(p, model_inputs(batch))
    return loss_and_metrics(logits, batch, "classify")[0], logits

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (total, logits), g_packed = grad(params, packed)
  assert logits.dtype == np.float64 and logits.shape == (2, 3, C)
  g_sum, loss_sum, worst = None, 0.0, 0.0
  for i, r, s in _examples(packed, src):
    one = {k: src.arrays[k][i : i + 1] for k in ("inputs", "mask", "targets")}
    (value, own), g = grad(params, {**one, "weight": np.ones(1)})
    worst = max(worst, rel_err(logits[r, s], own[0]))
    loss_sum += float(value)
    g_sum = g if g_sum is None else jax.tree.map(np.add, g_sum, g)
  g_err = rel_err(_flat(g_packed), _flat(g_sum))  # relative to the largest entry of any leaf
  print(f"packed vs alone ({pooling}, {scheme}): logits {worst:.1e}, gradients {g_err:.1e}")
  assert worst < 1e-9 and g_err < 1e-9, (worst, g_err)
  assert abs(float(total) - loss_sum) < 1e-9 * abs(loss_sum)


def test_cells_that_cannot_pack_stop_before_compiling(tmp_path):
  from configs import listops_generated

  cfg = listops_generated.get_config(
      "tiny"
  )  # the main job's cell: SIKF + absolute + FastRPB (FastRPB spans the row)
  cfg.data.pack = True
  with pytest.raises(ValueError, match=r"scheme 'fastrpb'.*config\.data\.bucket_lengths"):
    build_run(cfg, tmp_path)
  cfg = tiny_config(**{"data.pack": True})
  with pytest.raises(ValueError, match="'retrieval' task: a retrieval example is two documents"):
    packing.check_config(cfg, "retrieval", N, _model("mean"))


def _job(**overrides):
  """The main job's packable cell (softmax + absolute positions), tiny, packed."""
  from configs import listops_generated

  cfg = listops_generated.get_config("tiny,kernel=softmax,pos=none")
  cfg.data.pack = True
  cfg.update(num_train_steps=4, eval_every_steps=2, checkpoint_every_steps=2, log_every_steps=1)
  cfg.num_eval_batches = 2
  cfg.schedule.name = "constant"
  cfg.update(overrides)
  return cfg


def _covered(cfg) -> int:
  """The validation examples that ``num_eval_batches`` unpacked batches would score."""
  return min(
      cfg.task.num_validation, cfg.num_eval_batches * (cfg.eval_batch_size or cfg.batch_size)
  )


@pytest.mark.slow  # three short trainer runs (~40 s)
def test_packed_main_job_trains_and_resumes_exactly(tmp_path):
  full = train_and_evaluate(_job(), tmp_path / "full")
  assert np.isfinite(full["validation"]["loss"])
  assert full["validation"]["num_examples"] == _covered(_job())
  train_and_evaluate(_job(num_train_steps=2), tmp_path / "split")
  second = train_and_evaluate(_job(), tmp_path / "split")
  assert_trees_equal(full["state"], second["state"])
  assert full["validation"] == second["validation"]


@pytest.mark.slow  # a trainer run (~25 s)
def test_packed_main_job_runs(tmp_path):
  """Two steps of the main job's packable cell, packed, on the generated ListOps data: the
  rows hold several examples and the loss counts each one once."""
  cfg = _job(num_train_steps=2, eval_every_steps=2, checkpoint_every_steps=2)
  out = train_and_evaluate(cfg, tmp_path / "run")
  assert np.isfinite(out["validation"]["loss"])
  assert out["validation"]["num_examples"] == _covered(cfg)  # each scored once
  src = build_run(cfg, tmp_path / "unused").task.source("train")
  it = data.train_iterator(src, cfg)
  batches = [next(it) for _ in range(10)]
  seen = sum(float(b["weight"].sum()) for b in batches)
  assert seen > 1.5 * 10 * cfg.batch_size  # examples per row
  assert batches[0]["inputs"].shape[1] == cfg.task.max_length  # mean pooling: no CLS slot
