"""The causal algorithm keyword through the layer and the model config: ``fastpos.attention(...,
mode=...)`` gives the same layer in every mode; bad values are refused naming the choices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastpos
from fastpos import config_schema
from fastpos.models import AttentionConfig, TaskInfo, model_config
from tests.helpers import rel_err

# Causal linear cells by the op's path: plain (relu), decay (permuteformer), the running
# maximum of the keys' scale (sikf), separate denominator features (elu1 x rope).
# The op's own tests hold every path to the dense reference; the layer's default run keeps one.
_SLOW = pytest.mark.slow
CELLS = [
    pytest.param("relu", (), marks=_SLOW),
    ("elu1", ("permuteformer",)),
    pytest.param("sikf", (), marks=_SLOW),  # the default run keeps elu1 + permuteformer
    pytest.param("elu1", ("rope",), marks=_SLOW),
]


def _cell_id(value) -> str:
  return "-".join(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("kernel, schemes", CELLS, ids=_cell_id)
def test_layer_in_chunk_mode_equals_recurrent_mode(kernel, schemes):
  n = 21
  x = jax.random.normal(jax.random.key(0), (2, n, 16), jnp.float64)
  mask = jnp.arange(n)[None] < jnp.array([[n], [15]])
  outs = {}
  for mode in ("chunk", "recurrent"):
    layer = fastpos.attention(
        16,
        2,
        kernel=kernel,
        positional=schemes,
        causal=True,
        max_length=32,
        chunk_size=4,
        mode=mode,
        dtype=jnp.float64,
    )
    # Jitted: one compile per function, not one per operation.
    params = jax.jit(layer.init)(jax.random.key(1), x)
    grad = jax.grad(lambda p, f=layer.apply: jnp.sum(jnp.sin(f(p, x, mask=mask)) * mask[..., None]))
    outs[mode] = (jax.jit(layer.apply)(params, x, mask=mask), jax.jit(grad)(params))
  got, want = outs["chunk"], outs["recurrent"]
  keep = np.asarray(mask)[..., None]
  assert rel_err(np.asarray(got[0]) * keep, np.asarray(want[0]) * keep) < 1e-9
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    assert rel_err(a, b) < 1e-9


def test_layer_refuses_a_bad_mode_naming_the_choices():
  with pytest.raises(
      ValueError, match=r"mode must be one of auto, chunk, recurrent, fused; got 'fast'"
  ):
    fastpos.attention_config(16, 2, kernel="elu1", causal=True, mode="fast")
  with pytest.raises(ValueError, match="mode='fused' is built for causal"):
    fastpos.attention_config(16, 2, kernel="elu1", causal=False, mode="fused")


def test_model_config_attention_mode_reaches_the_layer():
  c = model_config()
  assert c.attention_mode == "auto"
  c.kernel, c.attention_mode = "elu1", "chunk"
  cfg = AttentionConfig.from_model_config(c, TaskInfo(kind="lm", vocab_size=7, max_length=8))
  assert cfg.mode == "chunk"
  field = config_schema.FIELDS["model.attention_mode"]
  assert set(field.choices) == {"auto", "chunk", "recurrent", "fused"}
  assert not field.trajectory  # the same function to rounding: not part of a run's trajectory
