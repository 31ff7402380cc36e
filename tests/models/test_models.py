"""The models built from configs: validation, fast vs dense, padding, causality, precision."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.models import TaskInfo, build_model, model_config
from tests.helpers import rel_err

V = 13


def _cfg(**kw):
  c = model_config()
  c.num_layers, c.embed_dim, c.num_heads, c.mlp_dim, c.dropout_rate = 2, 16, 2, 32, 0.0
  c.kernel_options.num_features = 8
  c.chunk_size = 4
  for k, v in kw.items():
    if isinstance(v, dict):
      for kk, vv in v.items():
        c[k][kk] = vv
    else:
      c[k] = v
  return c


def _batch(b, n, seed=0, pad=0, pair=False):
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, V, (b, n)).astype(np.int32)
  if pad:
    ids[:, n - pad :] = 0
  out = {"inputs": jnp.asarray(ids), "mask": jnp.asarray(ids != 0)}
  if pair:
    ids2 = rng.integers(1, V, (b, n)).astype(np.int32)
    out.update(inputs2=jnp.asarray(ids2), mask2=jnp.asarray(ids2 != 0))
  return out


def _init(model, batch, seed=0):
  variables = jax.jit(model.init)(jax.random.key(seed), batch)  # one compile, not one per op
  params = variables["params"]
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [l + 0.2 * jax.random.normal(k, l.shape, l.dtype) for k, l in zip(keys, leaves)]
  return {**variables, "params": jax.tree.unflatten(tree, leaves)}


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(kernel="elu2"), "unknown kernel 'elu2'; valid choices: softmax, elu1"),
        (dict(positional="fastrbp"), "unknown positional scheme 'fastrbp'; valid choices"),
        (
            dict(positional="fastrpb", positional_options={"fastrpb": {"per_haed": True}}),
            "unknown option 'per_haed' for positional scheme 'fastrpb'; valid options",
        ),
        (
            dict(positional="none", positional_options={"fastrpb": {"per_head": True}}),
            "not in model.positional",
        ),
        (dict(norm="mid"), "unknown norm 'mid'; valid choices"),
        (dict(pooling="max"), "unknown pooling 'max'"),
        (dict(dtype="float16"), "unknown dtype 'float16'"),
        (dict(kernel_options={"num_feature": 3}), "unknown kernel option 'num_feature'"),
        (dict(chunk_size=-1), r"model\.chunk_size must be an int >= 0 .*got -1"),
    ],
)
def test_bad_config_names_the_value_and_choices(bad, match):
  c = _cfg()
  for k, v in bad.items():
    if isinstance(v, dict):
      c[k].update(v) if k != "positional_options" else c.__setattr__(k, v)
    else:
      c[k] = v
  with pytest.raises(ValueError, match=match):
    build_model(c, TaskInfo("classify", V, 3, 16))


def test_cls_pooling_with_a_grid_is_rejected():
  with pytest.raises(ValueError, match="cls"):
    build_model(_cfg(pooling="cls"), TaskInfo("classify", V, 3, 16, grid=(4, 4)))


# The default run: the LM with ELU+1 + kernelized RPE through its whole stack; the classifier
# with a grid, the dual encoder, the softmax models and ELU+1 + FastRPB in a classifier run with
# `-m slow` (tests/models/test_cells.py holds every kernel x scheme layer,
# softmax ones included, to its dense reference).
@pytest.mark.parametrize(
    "kind, kernel, scheme, grid",
    [
        pytest.param("classify", "elu1", "fastrpb", None, marks=pytest.mark.slow),
        pytest.param("classify", "sikf", "kernelized_rpe", (3, 4), marks=pytest.mark.slow),
        pytest.param("classify", "softmax", "fastrpb", (3, 4), marks=pytest.mark.slow),
        pytest.param("retrieval", "favor", "fastrpb", None, marks=pytest.mark.slow),
        ("lm", "elu1", "kernelized_rpe", None),
        pytest.param("lm", "softmax", "fastrpb", None, marks=pytest.mark.slow),
    ],
)
def test_model_fast_equals_dense(kind, kernel, scheme, grid):
  n = 12
  task = TaskInfo(kind, V, 3, n, grid=grid)
  model = build_model(_cfg(kernel=kernel, positional=scheme, dtype="float64"), task)
  batch = _batch(2, n, pad=0 if grid else 3, pair=kind == "retrieval")
  v = _init(model, batch)
  fast = jax.jit(model.apply)(v, batch)
  dense = jax.jit(functools.partial(model.apply, reference=True))(v, batch)
  if kind == "lm":
    m = np.asarray(batch["mask"])
    fast, dense = np.asarray(fast)[m], np.asarray(dense)[m]
  assert rel_err(fast, dense) < 1e-9


# Slow; the default run keeps padding invariance in test_model_fast_equals_dense (padded
# batches) and tests/ops/test_masks.py (a boolean mask equals the unpadded sequence).
@pytest.mark.slow
@pytest.mark.parametrize(
    "kernel, scheme", [("elu1", "fastrpb"), ("softmax", "absolute"), ("favor", "kernelized_rpe")]
)
def test_trailing_padding_changes_nothing(kernel, scheme):
  """Classifier logits with 8 real tokens are the same padded to 8 or to 14 tokens."""
  task = TaskInfo("classify", V, 3, 16)
  model = build_model(_cfg(kernel=kernel, positional=scheme, dtype="float64"), task)
  short = _batch(2, 8)
  long = {
      "inputs": jnp.pad(short["inputs"], ((0, 0), (0, 6))),
      "mask": jnp.pad(short["mask"], ((0, 0), (0, 6))),
  }
  v = _init(model, long)
  apply = jax.jit(model.apply)
  assert rel_err(apply(v, long), apply(v, short)) < 1e-9


# Slow; the default run keeps an LM with the causal FFT output hooks held to causality in
# tests/models/test_refusals.py::test_the_lm_never_sees_a_later_token[elu1-schemes1].
@pytest.mark.slow
@pytest.mark.parametrize(
    "kernel, scheme", [("elu1", "fastrpb"), ("softmax", "kernelized_rpe"), ("sikf", "none")]
)
def test_lm_never_sees_future_tokens(kernel, scheme):
  n = 10
  model = build_model(
      _cfg(kernel=kernel, positional=scheme, dtype="float64"), TaskInfo("lm", V, 0, n)
  )
  batch = _batch(1, n)
  v = _init(model, batch)
  apply = jax.jit(model.apply)  # one compile for the n calls (eager dispatch is the cost)
  base = np.asarray(apply(v, batch))
  for i in range(n - 1):
    changed = dict(
        batch,
        inputs=batch["inputs"].at[:, i + 1 :].set((batch["inputs"][:, i + 1 :] % (V - 1)) + 1),
    )
    out = np.asarray(apply(v, changed))
    # FFT round-off only (1e-13 relative); a leak would be of order 1.
    assert rel_err(out[:, : i + 1], base[:, : i + 1]) < 1e-12, i
    assert not np.allclose(out[:, i + 1 :], base[:, i + 1 :])


# Slow; the default run keeps each model kind's build in tests/test_api_docs.py (its examples).
@pytest.mark.slow
def test_dual_encoder_shares_one_tower_and_combines_both_orders():
  task = TaskInfo("retrieval", V, 2, 8)
  model = build_model(_cfg(kernel="elu1", positional="fastrpb"), task)
  batch = _batch(2, 8, pair=True)
  v = _init(model, batch)
  assert "encoder" in v["params"] and "encoder_1" not in v["params"]
  assert v["params"]["head_hidden"]["kernel"].shape[0] == 4 * 16  # [u, v, u*v, u-v]
  swapped = dict(
      batch,
      inputs=batch["inputs2"],
      mask=batch["mask2"],
      inputs2=batch["inputs"],
      mask2=batch["mask"],
  )
  apply = jax.jit(model.apply)
  assert not np.allclose(apply(v, batch), apply(v, swapped))


# Slow; the default run keeps each model kind's build in tests/test_api_docs.py (its examples).
@pytest.mark.slow
def test_shared_kernelized_rpe_is_one_table_for_all_layers():
  cfg = _cfg(
      kernel="elu1",
      positional="kernelized_rpe",
      positional_options={"kernelized_rpe": {"share_across_layers": True}},
  )
  model = build_model(cfg, TaskInfo("classify", V, 3, 8))
  v = model.init(jax.random.key(0), _batch(1, 8))
  enc = v["params"]["encoder"]
  assert "pos_kernelized_rpe_shared" in enc
  assert all("pos_kernelized_rpe" not in enc[f"block_{i}"]["attention"] for i in range(2))


# Slow; the default run keeps each model kind's build in tests/test_api_docs.py (its examples).
@pytest.mark.slow
def test_batchnorm_variant_keeps_running_stats_of_real_tokens_only():
  model = build_model(
      _cfg(norm="batch", positional="fastrpb", kernel="elu1"), TaskInfo("classify", V, 3, 10)
  )
  batch = _batch(2, 10, pad=4)
  v = model.init(jax.random.key(0), batch)
  assert "batch_stats" in v
  _, upd = model.apply(
      v, batch, train=True, rngs={"dropout": jax.random.key(1)}, mutable=["batch_stats"]
  )
  garbage = dict(batch, inputs=batch["inputs"].at[:, -4:].set(5))  # padded ids change
  _, upd2 = model.apply(
      v, garbage, train=True, rngs={"dropout": jax.random.key(1)}, mutable=["batch_stats"]
  )
  for a, b in zip(jax.tree.leaves(upd), jax.tree.leaves(upd2)):
    np.testing.assert_array_equal(a, b)


# Slow; the default run keeps bfloat16 inputs on the fused op
# (tests/ops/test_fused_linear_attention.py::test_bf16_inputs_give_float32_sums).
@pytest.mark.slow
@pytest.mark.parametrize(
    "kernel, scheme", [("elu1", "fastrpb"), ("favor", "kernelized_rpe"), ("softmax", "fastrpb")]
)
def test_bfloat16_tracks_float32(kernel, scheme):
  task = TaskInfo("classify", V, 3, 64)
  batch = _batch(2, 64, pad=5)
  f32 = build_model(_cfg(kernel=kernel, positional=scheme), task)
  bf16 = build_model(_cfg(kernel=kernel, positional=scheme, dtype="bfloat16"), task)
  v = _init(f32, batch)
  a = jax.jit(f32.apply)(v, batch)
  b = jax.jit(bf16.apply)(v, batch)
  assert b.dtype == jnp.float32  # logits are float32
  assert np.all(np.isfinite(np.asarray(b)))
  assert rel_err(b, a) < 0.1


# Slow; the default run keeps per-layer feature draws in tests/models/test_scan_keys.py
# (test_each_layer_draws_the_unrolled_layers_projection[True]).
@pytest.mark.slow
def test_redrawn_features_need_an_rng_and_change_per_key():
  cfg = _cfg(kernel="favor", kernel_options={"redraw": True})
  model = build_model(cfg, TaskInfo("classify", V, 3, 8))
  batch = _batch(2, 8)
  v = _init(model, batch)
  fixed = model.apply(v, batch)  # evaluation: the fixed draw
  np.testing.assert_array_equal(fixed, model.apply(v, batch))
  outs = [
      model.apply(
          v, batch, train=True, rngs={"features": jax.random.key(s), "dropout": jax.random.key(0)}
      )
      for s in (1, 2)
  ]
  assert not np.allclose(outs[0], outs[1])


def test_nprf_kernel_with_shared_kernelized_rpe():
  # Luo et al.'s recipe is a kernel x scheme cell (a config row), not a scheme of its own.
  cfg = _cfg(
      kernel="nprf",
      positional="kernelized_rpe",
      positional_options={"kernelized_rpe": {"share_across_layers": True}},
  )
  model = build_model(cfg, TaskInfo("lm", V, 0, 8))
  batch = _batch(1, 8)
  v = jax.jit(model.init)(jax.random.key(0), batch)  # one program each, not op by op
  assert "pos_kernelized_rpe_shared" in v["params"]["encoder"]
  assert np.all(np.isfinite(np.asarray(jax.jit(model.apply)(v, batch))))


# The default run: pre-norm; post-norm (the same memory path) runs with `-m slow`.
@pytest.mark.parametrize("norm", [pytest.param("post", marks=pytest.mark.slow), "pre"])
def test_transformer_xl_memory_reproduces_the_full_sequence(norm):
  """Segment 2 with the memory of segment 1 (M = L) gives the logits of the last L positions
  of one causal run over both segments: the memory holds each layer's inputs and the
  relative positions continue across the boundary."""
  seg = 6
  cfg = _cfg(kernel="softmax", positional="transformer_xl", dtype="float64", norm=norm)
  full_model = build_model(cfg, TaskInfo("lm", V, 0, 2 * seg))
  cfg.memory_length = seg
  mem_model = build_model(cfg, TaskInfo("lm", V, 0, 2 * seg))
  batch = _batch(2, 2 * seg)
  v = _init(full_model, batch)
  full = np.asarray(jax.jit(full_model.apply)(v, batch))
  first = {k: a[:, :seg] for k, a in batch.items()}
  second = {k: a[:, seg:] for k, a in batch.items()}
  mem_apply = jax.jit(mem_model.apply)
  out1, memory = mem_apply(v, first)
  out2, _ = mem_apply(v, second, memory=memory)
  assert rel_err(np.asarray(out1), full[:, :seg]) < 1e-9
  assert rel_err(np.asarray(out2), full[:, seg:]) < 1e-9
