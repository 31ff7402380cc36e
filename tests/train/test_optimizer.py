"""AdamW pieces: the learning-rate schedules and which parameters get weight decay."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fastpos.models import TaskInfo, build_model, model_config
from fastpos.train.config import base_config
from fastpos.train.state import decay_mask, make_optimizer, make_schedule


def _cfg(name, warmup=10, steps=110, end=0.1):
  c = base_config("synthetic")
  c.optimizer.learning_rate = 2.0
  c.num_train_steps = steps
  c.schedule.update(name=name, warmup_steps=warmup, end_factor=end)
  return c


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "rsqrt"])
def test_schedule(name):
  s = make_schedule(_cfg(name))
  assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(1.0)  # linear warmup
  assert float(s(10)) == pytest.approx(2.0)  # the peak
  end = {"cosine": 0.2, "linear": 0.2, "constant": 2.0, "rsqrt": 2.0 * (10 / 110) ** 0.5}[name]
  assert float(s(110)) == pytest.approx(end, rel=1e-5)
  mid = {
      "cosine": 0.2 + 1.8 * 0.5,
      "linear": 1.1,
      "constant": 2.0,
      "rsqrt": 2.0 * (10 / 60) ** 0.5,
  }[name]
  assert float(s(60)) == pytest.approx(mid, rel=1e-5)


def test_weight_decay_skips_biases_norms_and_positional_tables():
  c = model_config()
  c.update(
      num_layers=1,
      embed_dim=16,
      num_heads=2,
      mlp_dim=16,
      kernel="elu1",
      norm="pre",
      positional="absolute,fastrpb,kernelized_rpe",
  )
  c.positional_options.fastrpb = {"per_head": True}  # a 2-d table: skipped by its name
  model = build_model(c, TaskInfo("classify", 16, 4, 12))
  batch = {"inputs": jnp.ones((1, 12), jnp.int32), "mask": jnp.ones((1, 12), bool)}
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), batch))["params"]
  mask = {
      jax.tree_util.keystr(p): v
      for p, v in jax.tree_util.tree_leaves_with_path(
          decay_mask(params, base_config("synthetic").optimizer.no_decay)
      )
  }
  decayed = sorted(k for k, v in mask.items() if v)
  assert all(k.endswith("['kernel']") or k.endswith("['embedding']") for k in decayed)
  assert any("pos_fastrpb" in k for k in mask) and not any("pos_" in k for k in decayed)
  assert "['embed']['embedding']" in decayed and len(decayed) >= 7


def test_adamw_decays_only_masked_params_and_clips():
  c = _cfg("constant", warmup=0)
  c.optimizer.update(learning_rate=0.1, weight_decay=0.5, grad_clip_norm=1.0)
  tx = make_optimizer(c)
  params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, tx.init(params), params)
  np.testing.assert_allclose(updates["dense"]["kernel"], -0.1 * 0.5 * np.ones((2, 2)))
  np.testing.assert_array_equal(updates["dense"]["bias"], np.zeros(2))
  # Clipping comes first: Adam's first moment sees the clipped gradient (norm 1).
  big = jax.tree.map(lambda p: 1e6 * jnp.ones_like(p), params)
  _, state = tx.update(big, tx.init(params), params)
  mu = optax.tree_utils.tree_get(state, "mu")
  assert float(optax.tree.norm(mu)) == pytest.approx((1 - c.optimizer.b1) * 1.0, rel=1e-6)
